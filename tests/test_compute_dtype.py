"""model.compute_dtype: `auto` resolved per backend, the resolved value in a run's log,
report.json and run_state.json, and a resume in another dtype says what changed."""
import dataclasses
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from mecefo_jax.config import (ConfigError, ModelConfig, load_config, resolve_compute_dtype,
                               to_dict)
from mecefo_jax.model import llama
from mecefo_jax.run import rundir
from mecefo_jax.run.trainer import Trainer
from mecefo_jax.records.run_state import RunState, read_run_state, write_run_state
from mecefo_jax.run.parts import StartMode
from procs import TINY, suite_store

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize('platform, auto', [('cpu', 'float32'), ('gpu', 'bfloat16'),
                                            ('tpu', 'bfloat16')])
def test_auto_is_bfloat16_on_accelerators_and_float32_on_cpu(platform, auto):
  assert resolve_compute_dtype('auto', platform) == auto
  for named in ('float32', 'bfloat16', 'float16'):  # a named dtype is kept on every backend
    assert resolve_compute_dtype(named, platform) == named


def test_auto_is_the_default_and_no_config_overrides_it():
  for path in [None, *sorted((ROOT / 'configs').glob('*.yaml'))]:
    assert load_config(path).model.compute_dtype == 'auto', path


def test_the_model_computes_in_the_dtype_resolved_for_the_backend(monkeypatch):
  cfg = ModelConfig(d_model=16, n_heads=2, ffn_dim=32, seq_len=8, n_layers=1)
  tokens = jnp.zeros((1, 8), jnp.int32)
  for platform, dtype in (('cpu', jnp.float32), ('tpu', jnp.bfloat16)):
    monkeypatch.setattr(jax, 'default_backend', lambda p=platform: p)
    graphdef, params = llama.create(cfg)
    assert llama.forward(graphdef, params, tokens).dtype == dtype, platform
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}  # param_dtype


def _train(out: Path, steps: int, resume: bool = False) -> Trainer:
  cfg = load_config(None, [*TINY, 'mesh.slice=1', f'train.steps={steps}',
                           'train.eval_every=0', 'train.eval_batches=1',
                           f'snapshot.dir={out.parent}/shm'])
  run = Trainer(cfg, out, progress='quiet', start=StartMode(
      resume=resume, explicit_resume=resume, program_store=suite_store()))
  try:
    run.run()
  finally:
    run.close()
  return run


def _dtype_warnings(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records
          if r.levelno == logging.WARNING and 'model.compute_dtype' in r.getMessage()]


def test_runs_record_the_resolved_dtype_and_a_resume_in_another_one_warns(tmp_path, caplog):
  out = tmp_path / 'run'
  caplog.set_level(logging.INFO, logger='mecefo')
  first = _train(out, 2)
  state, report = read_run_state(out), json.loads((out / rundir.REPORT).read_text())
  assert (state.compute_dtype, state.platform, report['compute_dtype']) == (
      'float32', 'cpu', 'float32')
  assert state.config['model']['compute_dtype'] == 'auto'  # resolved again by a resume
  assert ', compute float32 |' in first.describe()  # the line train.py logs at the start
  _train(out, 3, resume=True)  # the same backend: nothing to say
  assert _dtype_warnings(caplog) == []
  # As if the run so far had been made on a GPU.
  write_run_state(out, dataclasses.replace(read_run_state(out), compute_dtype='bfloat16',
                                            platform='gpu'))
  _train(out, 4, resume=True)
  [line] = _dtype_warnings(caplog)
  assert 'resumed on cpu computing in float32 (model.compute_dtype=auto)' in line
  assert 'computed in bfloat16 on gpu' in line and '\n' not in line
  state = read_run_state(out)
  assert (state.status, state.compute_dtype, state.platform) == ('finished', 'float32', 'cpu')


def test_a_resume_may_name_another_compute_dtype(tmp_path):
  cfg = lambda *o: load_config(None, ['train.steps=4', *o])
  write_run_state(tmp_path, RunState('stopped', run_id='abc', config=to_dict(cfg())))
  checked = rundir.check_start(tmp_path, cfg('model.compute_dtype=bfloat16'), resume=True,
                               replace=False)
  assert checked.run_id == 'abc'
  with pytest.raises(ConfigError, match=r'model\.param_dtype'):  # the state's dtype may not
    rundir.check_start(tmp_path, cfg('model.param_dtype=bfloat16'), resume=True, replace=False)
