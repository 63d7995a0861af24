"""A pytree of arrays as one flat byte image: the format of in-memory snapshots (one Orbax array).

Saving one array instead of one per leaf makes an every-step snapshot cheap: Orbax's per-leaf
cost (~1.2 ms of CPU each, 254 leaves for llama_60m) vanishes, and the image is packed into a
host buffer that is reused from save to save, so its pages are never faulted in again. The
layout (path, shape, dtype of every leaf, in flatten order) travels with the image; unpacking
needs a target of the same layout, so an image is tied to its model, not to its mesh.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from mecefo_jax import multihost

Layout = list[list]  # [[path, shape, dtype], ...], JSON-friendly


def layout(tree: Any) -> Layout:
  """Path, shape and dtype of every leaf of `tree` (arrays or abstract leaves)."""
  # str(dtype), not dtype.name: .name is ~50x slower, and this runs at every snapshot.
  return [[jax.tree_util.keystr(path), list(leaf.shape), str(np.dtype(leaf.dtype))]
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def nbytes(lay: Layout) -> int:
  return sum(math.prod(shape) * np.dtype(dtype).itemsize for _, shape, dtype in lay)


def views(image: np.ndarray, lay: Layout):
  """The leaves' places in `image`, as arrays of their shape and dtype (no copy)."""
  pos = 0
  for _, shape, dtype in lay:
    size = math.prod(shape) * np.dtype(dtype).itemsize
    yield image[pos:pos + size].view(dtype).reshape(shape)
    pos += size


def split_sources(tree: Any) -> list:
  """For each leaf of `tree` (replicated over its mesh's slices), where its bytes are copied
  from: the image's bytes cut into one contiguous share per slice, so that every slice copies
  about 1/n of them over its own host link, all at once (REFT's sharded copy).

  A leaf whose leading axis is whole on every device (the stacked blocks' layer axis among
  them) is cut along it: its rows go to the slice whose share holds each row's middle byte, so
  no slice copies more than its share plus one row (one layer). Each entry is the devices of
  the one slice a leaf comes from, a list [(first row, stop row, devices), ...] for a leaf cut
  between slices, or None for a leaf on no multi-slice mesh (copied from its replica 0)."""
  lay = layout(tree)
  sizes = [math.prod(shape) * np.dtype(dtype).itemsize for _, shape, dtype in lay]
  total, start, sources = max(sum(sizes), 1), 0, []
  for leaf, (_, shape, _), size in zip(jax.tree.leaves(tree), lay, sizes):
    mesh = getattr(getattr(leaf, 'sharding', None), 'mesh', None)
    n = mesh.shape.get('slice', 1) if mesh is not None and hasattr(mesh, 'shape') else 1
    sources.append(_leaf_sources(leaf, shape, size, start, total, mesh, n) if n > 1 else None)
    start += size
  return sources


def _leaf_sources(leaf, shape, size: int, start: int, total: int, mesh, n: int):
  """split_sources' entry of one leaf whose bytes start at `start` in the image."""
  spec = tuple(getattr(leaf.sharding, 'spec', ()))
  rows = shape[0] if shape and (not spec or spec[0] is None) else 1
  middles = start + (np.arange(rows) + 0.5) * (size / max(rows, 1))
  owners = np.minimum(n - 1, (middles * n / total).astype(np.int64))
  devices = lambda k: frozenset(mesh.devices[k].flat)
  if owners[0] == owners[-1]:
    return devices(int(owners[0]))
  cuts = [0, *np.flatnonzero(np.diff(owners)) + 1, rows]
  return [(int(a), int(b), devices(int(owners[a]))) for a, b in zip(cuts[:-1], cuts[1:])]


def pack(tree: Any, out: np.ndarray | None = None, devices=None) -> tuple[np.ndarray, Layout]:
  """(image, layout): the bytes of every leaf of `tree`, in flatten order, copied into `out`
  (reused when it has the right size, else a new buffer). A sharded jax.Array is copied shard
  by shard straight into its place: its replica-0 shards, or its shards on `devices` if given
  (one set for all leaves, or split_sources' list of one entry per leaf; None: replica 0)."""
  lay = layout(tree)
  if out is None or out.shape != (nbytes(lay),):
    out = np.empty(nbytes(lay), np.uint8)
  leaves = jax.tree.leaves(tree)
  per_leaf = devices if isinstance(devices, list) else [devices] * len(leaves)
  copies = []  # (destination, source) pairs
  for leaf, view, source in zip(leaves, views(out, lay), per_leaf):
    if not isinstance(leaf, jax.Array):
      copies.append((view, leaf))
    elif isinstance(source, list):  # rows from several slices (split_sources)
      copies += [(view[(slice(a, b), *shard.index[1:], ...)], _rows(shard.data, a, b))
                 for a, b, devices in source for shard in leaf.addressable_shards
                 if shard.device in devices]
    else:
      # view[(*index, ...)]: a view even for 0-d leaves, where view[()] would be a scalar copy
      copies += [(view[(*shard.index, ...)], shard.data) for shard in leaf.addressable_shards
                 if ((shard.device in source) if source is not None else shard.replica_id == 0)]
  # Every device-to-host transfer started before the first wait; but not on CPU, where nothing
  # crosses and jax 0.11 keeps the host value this makes, a zero-copy view of the buffer that
  # the next train step then cannot donate.
  for _, source in copies:
    if isinstance(source, jax.Array) and next(iter(source.devices())).platform != 'cpu':
      source.copy_to_host_async()
  for view, source in copies:
    view[...] = np.asarray(source)
  return out, lay


def _rows(x: jax.Array, start: int, stop: int) -> jax.Array | np.ndarray:
  """Rows start:stop of a one-device array: on the CPU sliced on the host (a view; a jax slice
  compiled a program per leaf shape, ~0.2 CPU s a run), elsewhere on the device (only those
  rows cross)."""
  if next(iter(x.devices())).platform == 'cpu':
    return np.asarray(x)[start:stop]
  return x[start:stop]


def unpack(image: np.ndarray, target: Any) -> Any:
  """The pytree of `target`'s structure from `image`, each leaf a jax.Array on the sharding
  of its target leaf (jax.ShapeDtypeStruct with .sharding, or an array)."""
  leaves, treedef = jax.tree.flatten(target)
  out = [jax.make_array_from_callback(x.shape, x.sharding, lambda index, v=view: v[index],
                                      dtype=x.dtype)
         for x, view in zip(leaves, views(image, layout(target)))]
  return jax.tree.unflatten(treedef, out)


def local_replica(tree) -> list[np.ndarray] | None:
  """Host copies of the leaves of `tree` as held by local_replica_devices, or None."""
  devices = multihost.local_replica_devices(tree)
  if devices is None:
    return None
  return list(views(*pack(tree, devices=devices)))  # views of one fresh copy
