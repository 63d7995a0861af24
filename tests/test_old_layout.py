"""Runs written before the scanned model (per-block parameters): the durable checkpoint resumes
converted to stacked blocks; an old in-memory snapshot is kept and passed over, never a silent
step-0 start. The fixture (tests/fixtures/old_layout, README there) was written by train.py at
d33af66."""
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from mecefo_jax.config import load_config
from mecefo_jax.model import layout, train_state
from mecefo_jax.records.job import STOPPED
from mecefo_jax.records.run_dir import snapshot_dirs
from mecefo_jax.run import cli, rundir
from mecefo_jax.snapshot.manager import SnapshotManager
from procs import error_lines

FIXTURE = Path(__file__).parent / 'fixtures' / 'old_layout'
RUN_ID = json.loads((FIXTURE / 'run' / 'run_state.json').read_text())['run_id']
STEP = 3  # the fixture stopped after step 3 (--stop-after 3 of train.steps=6)


def _copy_run(tmp_path, *, durable=True, memory=False) -> Path:
  """The fixture's run in tmp_path/old, its placeholders (README there) replaced by this copy's
  paths: the run directory, its tmpfs folder and its failure trace (written beside it)."""
  out, trace = tmp_path / 'old', tmp_path / 'oldT'
  shm = snapshot_dirs(_cfg().snapshot, out, RUN_ID)[0]
  trace.write_text('1 1 fail\n')
  shutil.copytree(FIXTURE / 'run', out)
  for name in ('run_state.json', 'report.json', 'history.jsonl', 'failures.txt'):
    text = (out / name).read_text()
    for placeholder, path in (('@RUN@', out), ('@SHM@', shm.parent), ('@TRACE@', trace)):
      text = text.replace(placeholder, str(path))
    (out / name).write_text(text)
  if not durable:
    shutil.rmtree(out / 'checkpoints')
  if memory:  # the in-memory snapshot where this --out's tmpfs folder is
    shutil.copytree(next((FIXTURE / 'shm').iterdir()), shm)
  return out


def _cfg():
  state = json.loads((FIXTURE / 'run' / 'run_state.json').read_text())
  m, t = state['config']['model'], state['config']['train']
  return load_config(None, [f'model.{k}={v}' for k, v in m.items()] +
                     [f'train.{k}={t[k]}' for k in ('steps', 'micro_batch')] +
                     ['mesh.slice=2', 'snapshot.every=1', 'snapshot.durable_every=1'])


@pytest.fixture
def cleanup_shm(tmp_path):
  yield
  shutil.rmtree(snapshot_dirs(_cfg().snapshot, tmp_path / 'old', RUN_ID)[0].parent,
                ignore_errors=True)


def _old_arrays(out: Path) -> dict:
  """The fixture's durable checkpoint as saved (per-block), read without any target."""
  path = out / 'checkpoints' / RUN_ID / str(STEP) / 'state'
  return ocp.PyTreeCheckpointer().restore(path)


def test_old_durable_checkpoint_restores_as_the_old_params_stacked(tmp_path):
  out = _copy_run(tmp_path)
  cfg = _cfg()
  mesh = jax.make_mesh((2, 1, 1), ('slice', 'fsdp', 'tensor'))
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        train_state.abstract_state(cfg), train_state.state_shardings(cfg, mesh))
  with SnapshotManager(tmp_path / 'shm', durable_dir=out / 'checkpoints' / RUN_ID,
                       durable_every=1) as manager:
    step, state, meta, where = manager.restore_latest(target)
  assert step == STEP and 'durable checkpoint' in where and 'param_layout' not in meta
  old = _old_arrays(out)
  assert 'block0' in old['params'] and 'blocks' not in old['params']
  expected = layout.stacked(jax.tree.map(np.asarray, old['params']))
  got = jax.device_get(state.params)
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, b)
  # The AdamW moments and the bases convert with them (bases were computed at the failure).
  np.testing.assert_array_equal(jax.device_get(state.bases['blocks']['gate'][1]),
                                np.asarray(old['bases']['block1']['gate']))
  assert int(state.bases_step) >= 1


def test_old_run_resumes_from_its_durable_checkpoint_past_its_memory_snapshot(
    tmp_path, caplog, cleanup_shm):
  out = _copy_run(tmp_path, memory=True)
  code = cli.main(['--out', str(out), '--resume', 'mesh.slice=2', 'train.compile_cache=', '-q',
                   '--stop-after', '1'])
  err = caplog.text
  assert code == STOPPED, err[-3000:]
  assert 'per-block parameter layout' in err and 'it is kept, not restored' in err, err
  assert 'converted to stacked blocks' in err, err
  report = json.loads((out / 'report.json').read_text())
  assert report['resumed_from_step'] == STEP and report['steps'] >= STEP + 1
  # It read its trace where it was given (the copy came later); it carries one from now on.
  assert (out / rundir.TRACE).read_text() == '1 1 fail\n'


def test_old_memory_snapshot_alone_is_refused_in_one_line_and_kept(tmp_path, capsys,
                                                                   cleanup_shm):
  out = _copy_run(tmp_path, durable=False, memory=True)
  shm = snapshot_dirs(_cfg().snapshot, out, RUN_ID)[0] / str(STEP)
  before = sorted(p.relative_to(shm) for p in shm.rglob('*'))
  for args in (['--resume'], []):  # explicit and automatic resume alike: never a step-0 start
    code = cli.main(['--out', str(out), *args, 'mesh.slice=2', 'train.compile_cache=', '-q'])
    lines = error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1, lines
    assert 'per-block parameter layout' in lines[0] and '--fresh' in lines[0], lines
    assert sorted(p.relative_to(shm) for p in shm.rglob('*')) == before
    assert json.loads((out / 'run_state.json').read_text())['status'] == 'stopped'
