"""The scanned model: one block body in every program at any depth, stacked leaves sharded and
decayed as their per-layer slices, and a stack never gathered whole."""
import math

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.model import layout, llama, train_state
from mecefo_jax.core.roles import Role
from mecefo_jax.step import train_step

pytestmark = pytest.mark.usefixtures('devices')
TINY = ['model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=48', 'model.seq_len=16',
        'model.vocab_size=64', 'train.micro_batch=2', 'mesh.slice=1']


def _cfg(*extra):
  return load_config(None, [*TINY, *extra])


def _programs(cfg, mesh):
  graphdef = llama.abstract(cfg.model)[0]
  b = cfg.train.micro_batch
  return {'normal': train_step.lower_step(cfg, mesh, Role(exact=b), graphdef),
          'degraded': train_step.lower_step(cfg, mesh, Role(degraded=2 * b), graphdef),
          'eval': train_step.lower_eval(cfg, mesh, b, graphdef),
          'refresh': train_step.lower_refresh(cfg, mesh),
          'refresh_warm': train_step.lower_refresh(cfg, mesh, warm=True),
          'init': train_state.lower_init(cfg, mesh)}


def test_every_program_holds_one_block_body_whatever_the_depth(devices):
  mesh = sharding.make_mesh(_cfg().mesh, devices[:1])
  two = {k: len(v.as_text()) for k, v in _programs(_cfg('model.n_layers=2'), mesh).items()}
  twelve = {k: len(v.as_text()) for k, v in _programs(_cfg('model.n_layers=12'), mesh).items()}
  # An unrolled model grows by ~5x here; a scanned one only by the digits of the shapes.
  for name in two:
    assert twelve[name] <= 1.02 * two[name], (name, two[name], twelve[name])


def test_weight_decay_applies_to_the_leaves_it_did_per_block():
  """One AdamW step on zero gradients moves exactly the decayed leaves (by lr * wd * p): per
  layer slice, the matrices of the per-block rule of before the scan, never a norm scale."""
  cfg = _cfg('model.n_layers=3', 'optimizer.warmup_steps=0')
  _, params = llama.create(cfg.model)
  tx = train_state.make_optimizer(cfg)
  zeros = jax.tree.map(jax.numpy.zeros_like, params)
  updates, _ = tx.update(zeros, tx.init(params), params)
  moved = jax.tree.map(lambda u: np.asarray(u != 0).reshape(u.shape[:1] + (-1,)).any(-1)
                       if u.ndim else bool(u != 0), updates)
  old_rule = jax.tree.map(lambda x: x.ndim >= 2, layout.per_block(params, 3))
  for i in range(3):
    assert jax.tree.map(lambda m, i=i: bool(m[i]), moved['blocks']) == old_rule[f'block{i}']
  rest = {k: v for k, v in old_rule.items() if not k.startswith('block')}
  assert jax.tree.map(lambda m: bool(np.all(m)), {k: moved[k] for k in rest}) == rest
  assert not old_rule['block0']['attn_norm']['scale'] and old_rule['block0']['ffn']['up']['kernel']


def _per_device_bytes(shapes, shardings) -> int:
  return sum(math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
             for x, sh in zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings)))


def test_stacked_leaves_shard_as_their_layers_did(devices):
  cfg = _cfg('model.n_layers=3', 'mesh.fsdp=2', 'mesh.tensor=2')
  mesh = sharding.make_mesh(cfg.mesh, devices[:4])
  state, shardings = train_state.abstract_state(cfg), train_state.state_shardings(cfg, mesh)
  spec = lambda *path: jax.tree_util.keystr(path) and _at(shardings.params, path).spec
  assert spec('blocks', 'attn', 'q', 'kernel') == P(None, 'fsdp', 'tensor')
  assert spec('blocks', 'attn', 'o', 'kernel') == P(None, 'tensor', 'fsdp')
  assert spec('blocks', 'ffn', 'down', 'kernel') == P(None, 'tensor', 'fsdp')
  assert tuple(spec('blocks', 'ffn_norm', 'scale')) in ((), (None, None))
  assert shardings.bases['blocks']['gate'].spec == P(None, 'fsdp', None)
  # Per-device bytes: the stack holds n_layers times one block's share, as the blocks did.
  block = nnx.eval_shape(lambda: llama.Block(cfg.model, nnx.Rngs(params=0)))
  block_state = nnx.state(block)
  block_axes = nnx.to_pure_dict(jax.tree.map(
      lambda v: v.get_metadata()['logical_axes'], block_state,
      is_leaf=lambda x: isinstance(x, nnx.Variable)))
  block_shapes = nnx.to_pure_dict(jax.tree.map(
      lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), block_state,
      is_leaf=lambda x: isinstance(x, nnx.Variable)))
  one_block = _per_device_bytes(block_shapes,
                                sharding.tree_shardings(block_axes, block_shapes, mesh))
  stack = _per_device_bytes(state.params['blocks'], shardings.params['blocks'])
  assert stack == 3 * one_block > 0


def _at(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def test_the_step_gathers_one_layer_at_a_time(devices):
  """fsdp=2 holds half the weights; gathering the whole stack at once would need more temp
  memory than fsdp=1, where nothing is gathered."""
  temp = {}
  for fsdp in (1, 2):
    cfg = _cfg('model.n_layers=6', 'model.d_model=64', 'model.ffn_dim=256', f'mesh.fsdp={fsdp}',
               'train.micro_batch=2')
    mesh = sharding.make_mesh(cfg.mesh, devices[:fsdp])
    lowered = train_step.lower_step(cfg, mesh, Role(exact=2), llama.abstract(cfg.model)[0])
    temp[fsdp] = train_step.memory_summary(lowered.compile())['temp_bytes']
  assert temp[2] <= temp[1], temp
