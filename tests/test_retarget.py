"""Compiled programs moved onto other devices of the same shape: bit-identical, no compile."""
import os

import jax
import numpy as np
import pytest

from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.model import llama, train_state
from mecefo_jax.core.roles import Role
from mecefo_jax.step import retarget, slice_steps

pytestmark = pytest.mark.usefixtures('devices')
TINY = ['model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=48', 'model.seq_len=16',
        'model.n_layers=1', 'model.vocab_size=64', 'train.micro_batch=4', 'mesh.slice=4',
        'mesh.fsdp=2']


def test_the_probe_passes_on_cpu_and_auto_is_off_on_tpu():
  assert retarget.probe('cpu') is None
  assert retarget.enabled('auto', 'cpu') and not retarget.enabled('never', 'cpu')
  assert not retarget.enabled('auto', 'tpu')
  with pytest.raises(ValueError, match='move_programs must be one of'):
    retarget.enabled('sometimes', 'cpu')


def test_a_probes_pass_is_kept_for_this_runtime_and_probed_again_for_another(tmp_path,
                                                                             monkeypatch):
  """A process with a program store probes once per runtime: a later one reads the pass.
  A failure is not kept; another runtime (here: other XLA flags), or no store, probes again."""
  verdicts = [None]
  probed = []
  monkeypatch.setattr(retarget, 'probe', lambda platform: probed.append(platform) or verdicts[-1])
  assert retarget.enabled('auto', 'cpu', verdicts=tmp_path) and probed == ['cpu']
  [kept] = tmp_path.glob('move-probe-*.passed')
  assert retarget.enabled('auto', 'cpu', verdicts=tmp_path) and probed == ['cpu']
  assert retarget.enabled('auto', 'cpu') and probed == ['cpu'] * 2
  kept.unlink()
  verdicts.append('a moved program gave another output')
  assert not retarget.enabled('auto', 'cpu', verdicts=tmp_path) and probed == ['cpu'] * 3
  assert not retarget.enabled('auto', 'cpu', verdicts=tmp_path) and probed == ['cpu'] * 4
  assert list(tmp_path.iterdir()) == []
  verdicts.append(None)
  flags = os.environ.get('XLA_FLAGS', '')
  monkeypatch.setenv('XLA_FLAGS', f'{flags} --xla_cpu_enable_fast_math=false')
  assert retarget.enabled('auto', 'cpu', verdicts=tmp_path) and probed == ['cpu'] * 5
  assert retarget.enabled('auto', 'cpu', verdicts=tmp_path) and probed == ['cpu'] * 5
  monkeypatch.setenv('XLA_FLAGS', flags)
  assert retarget.enabled('auto', 'cpu', verdicts=tmp_path) and probed == ['cpu'] * 6
  assert len(list(tmp_path.glob('move-probe-*.passed'))) == 2


def test_a_moved_group_program_gives_the_direct_compiles_output_bit_for_bit():
  cfg = load_config(None, TINY)
  slices = sharding.PresentSlices(sharding.make_mesh(cfg.mesh), (0, 1, 2, 3))
  graphdef = llama.abstract(cfg.model)[0]
  role = Role(exact=2, degraded=4)
  a, b = slices.sub((0, 2)), slices.sub((1, 3))
  compiled = slice_steps.lower_group(cfg, a, role, graphdef).compile()
  moved = retarget.Serialized.of(compiled, a.devices.flat).load_onto(list(b.devices.flat))
  direct = slice_steps.lower_group(cfg, b, role, graphdef).compile()
  state = jax.jit(lambda: train_state.init_state(cfg),
                  out_shardings=train_state.state_shardings(cfg, slices.mesh))()
  view = slice_steps.state_view(cfg, state, b)
  tokens = np.random.default_rng(0).integers(0, 64, (2, 6, 17)).astype(np.int32)
  tokens = jax.device_put(tokens, sharding.batch_sharding(b))
  for got, want in zip(jax.tree.leaves(moved(view, tokens)), jax.tree.leaves(direct(view, tokens))):
    assert got.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match='a program of 4 devices cannot run on 2'):
    retarget.Serialized.of(compiled, a.devices.flat).load_onto(list(b.devices.flat)[:2])

