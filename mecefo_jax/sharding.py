"""Mesh construction and the one logical-axis rules table that maps parameter axes to mesh axes."""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mecefo_jax.config import ConfigError, MeshConfig

MESH_AXES = ('slice', 'fsdp', 'tensor')

# Logical axis name -> mesh axes. Slices hold full replicas, so no parameter axis maps to
# 'slice'; only the batch is split across slices.
LOGICAL_RULES: dict[str, tuple[str, ...] | None] = {
    'batch': ('slice', 'fsdp'),
    'vocab': ('tensor',),
    'embed': ('fsdp',),
    'heads': ('tensor',),
    'mlp': ('tensor',),
    'norm': None,
    'rank': None,
    'layers': None,  # the stacked blocks' layer axis: every device holds every layer's share
    'position': None,  # learned position embeddings' rows (model.kind=gpt2)
}


def mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int, int]:
  """(slice, fsdp, tensor) for `cfg` on `n_devices`, or a ConfigError suggesting one that fits."""
  in_slice = cfg.fsdp * cfg.tensor
  n_slices = cfg.slice if cfg.slice != -1 else n_devices // in_slice
  if n_slices < 1 or n_slices * in_slice > n_devices:
    raise ConfigError(
        f'mesh.slice*mesh.fsdp*mesh.tensor = {max(n_slices, 1) * in_slice} exceeds the {n_devices} '
        f'available device(s); try mesh.slice={n_devices} mesh.fsdp=1 mesh.tensor=1 '
        f'(or any product <= {n_devices})')
  return n_slices, cfg.fsdp, cfg.tensor


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (slice, fsdp, tensor) mesh over the first devices that fit `cfg`."""
  devices = list(devices if devices is not None else jax.devices())
  shape = mesh_shape(cfg, len(devices))
  used = devices[:math.prod(shape)]
  return Mesh(np.asarray(used).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def present_mesh(cfg: MeshConfig, n_slices: int) -> Mesh:
  """The mesh of the first of a run's `n_slices` slices that this machine's devices hold."""
  in_slice, devices = cfg.fsdp * cfg.tensor, jax.devices()
  present = min(n_slices, len(devices) // in_slice)
  if present < 1:
    raise ConfigError(f'this run has {n_slices} slices of {in_slice} device(s); '
                      f'{len(devices)} device(s) present: not one slice')
  return make_mesh(dataclasses.replace(cfg, slice=present), devices)


def submesh(mesh: Mesh, slices: Sequence[int]) -> Mesh:
  """The mesh made of only the given slices of `mesh` (e.g. the live ones)."""
  return Mesh(mesh.devices[list(slices)], mesh.axis_names,
              axis_types=(AxisType.Auto,) * len(mesh.axis_names))


@dataclasses.dataclass(frozen=True)
class PresentSlices:
  """A run's slices that have devices: row i of `mesh` holds logical slice `ids[i]`. Logical ids
  (data order, failures, snapshots) stay fixed when slices are absent, e.g. a dead host's."""
  mesh: Mesh
  ids: tuple[int, ...]

  def sub(self, slices: Sequence[int]) -> Mesh:
    """The mesh of the given logical slices (all present)."""
    return submesh(self.mesh, [self.ids.index(s) for s in slices])


def logical_to_spec(logical: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh) -> P:
  """PartitionSpec for an array with these logical axes; a dim the mesh does not divide stays whole."""
  if logical is None:
    return P()
  out = []
  for name, dim in zip(logical, shape):
    axes = LOGICAL_RULES.get(name) if name is not None else None
    if axes is not None:
      axes = tuple(a for a in axes if mesh.shape[a] > 1)
    size = math.prod(mesh.shape[a] for a in axes) if axes else 1
    out.append(axes if axes and dim % size == 0 else None)
  return P(*out)


def tree_shardings(logical_tree, shape_tree, mesh: Mesh):
  """NamedShardings for a pytree of arrays given a matching pytree of logical-axis tuples."""
  is_axes = lambda x: x is None or (isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x))
  return jax.tree.map(lambda axes, x: NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh)),
                      logical_tree, shape_tree, is_leaf=is_axes)


def view(tree, mesh: Mesh, shardings):
  """Zero-copy view of replicated-over-slice arrays restricted to the devices of `mesh`."""
  devices = set(mesh.devices.flat)

  def one(x, sh):
    shards = [s.data for s in x.addressable_shards if s.device in devices]
    # dtype: a process holding none of the mesh's devices (multi-process) gets an empty view.
    return jax.make_array_from_single_device_arrays(x.shape, sh, shards, dtype=x.dtype)
  return jax.tree.map(one, tree, shardings)


def first_replica(tree):
  """Zero-copy view, on its first slice's devices, of a tree replicated over its mesh's slices;
  leaves on no multi-slice mesh (host arrays, other meshes) are returned as they are."""
  subs = {}

  def one(x):
    mesh = getattr(getattr(x, 'sharding', None), 'mesh', None)
    if not isinstance(x, jax.Array) or mesh is None or mesh.shape.get('slice', 1) == 1:
      return x
    if id(mesh) not in subs:
      subs[id(mesh)] = submesh(mesh, (0,))
    sub = subs[id(mesh)]
    return view(x, sub, NamedSharding(sub, x.sharding.spec))
  return jax.tree.map(one, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Tokens [slice, rows, seq]: dim 0 across slices, rows across fsdp."""
  fsdp = 'fsdp' if mesh.shape['fsdp'] > 1 else None
  return NamedSharding(mesh, P('slice', fsdp, None))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
