"""The two parameter layouts: stacked blocks (`blocks`, one leading layer axis) and per-block
(`block0`, `block1`, ...: mecefo-jax before the scanned model), and the conversion between them.

Every tree that mirrors the params (params, gradients, AdamW moments, bases, their shardings or
abstract leaves) converts the same way: a dict holding `blocks` becomes one holding `block{i}`
for each layer, and back. Used to resume durable checkpoints written before the scan and by the
tests' per-block reference.
"""
from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from mecefo_jax.model.llama import BLOCKS

_BLOCK = re.compile(r'block(\d+)$')
# Written into every snapshot's meta since the scanned model; a snapshot without it has the
# per-block layout.
STACKED = 'stacked-v1'


def _layer_leaf(x, i: int):
  """Layer i of a stacked leaf: an array's row, or an abstract leaf without its layer axis."""
  if isinstance(x, jax.ShapeDtypeStruct):
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
      sharding = NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)
  return x[i]


def per_block(tree: Any, n_layers: int) -> Any:
  """`tree` with every `blocks` subtree cut into `block0` .. `block{n_layers-1}`."""
  if not isinstance(tree, dict):
    return _map_children(tree, lambda t: per_block(t, n_layers))
  out = {k: per_block(v, n_layers) for k, v in tree.items() if k != BLOCKS}
  if BLOCKS in tree:
    for i in range(n_layers):
      out[f'block{i}'] = jax.tree.map(lambda x, i=i: _layer_leaf(x, i), tree[BLOCKS])
  return out


def stacked(tree: Any) -> Any:
  """`tree` with its `block{i}` subtrees stacked into one `blocks` subtree (inverse of
  per_block)."""
  if not isinstance(tree, dict):
    return _map_children(tree, stacked)
  blocks = sorted((int(m.group(1)), k) for k in tree if (m := _BLOCK.match(str(k))))
  out = {k: stacked(v) for k, v in tree.items() if not _BLOCK.match(str(k))}
  if blocks:
    out[BLOCKS] = jax.tree.map(lambda *xs: jnp.stack(xs), *[tree[k] for _, k in blocks])
  return out


def n_layers(tree: Any) -> int:
  """The layer count of the stacked blocks in `tree` (the leading dim of their leaves)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if any(getattr(k, 'key', None) == BLOCKS for k in path):
      return leaf.shape[0]
  raise ValueError('no stacked blocks in this tree')


def _map_children(tree, fn):
  """`tree` with `fn` applied to each child of a tuple/list/NamedTuple node; leaves as they are."""
  if isinstance(tree, tuple) and hasattr(tree, '_fields'):
    return type(tree)(*[fn(c) for c in tree])
  if isinstance(tree, (list, tuple)):
    return type(tree)(fn(c) for c in tree)
  return tree
