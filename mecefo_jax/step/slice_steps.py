"""Per-slice programs for steps where slices play different roles, and the cross-slice update.

Slices with different roles cannot share one SPMD program without per-slice branches, and a
collective inside such a branch deadlocks (docs/algorithm.md §8). So each group of slices with the
same role runs its own program on its own devices (in-slice sharding intact), producing
per-slice gradient sums; one update program over the live slices then reduces them across
slices (outside any branch), applies the §3 rule and the optimizer, identically everywhere.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mecefo_jax import sharding
from mecefo_jax.config import Config
from mecefo_jax.model import models
from mecefo_jax.model.train_state import TrainState, abstract_state, make_optimizer, state_shardings
from mecefo_jax.core.roles import Role
from mecefo_jax.ops.schedule import Schedule, abstract_schedule
from mecefo_jax.sharding import batch_sharding, replicated
from mecefo_jax.step import train_step


def state_view(cfg: Config, state, sub: Mesh):
  """View of the (replicated-over-slice) train state on only the slices of `sub`, a submesh of
  the state's mesh."""
  return sharding.view(state, sub, state_shardings(cfg, sub))


def _stacked(sh: NamedSharding, mesh: Mesh) -> NamedSharding:
  """Sharding of a per-slice stack [n_slices, *x]: dim 0 over 'slice', the rest as x."""
  return NamedSharding(mesh, P('slice', *sh.spec))


@functools.lru_cache(maxsize=256)
def sums_shardings(cfg: Config, mesh: Mesh):
  param_sh = state_shardings(cfg, mesh).params
  per_slice = NamedSharding(mesh, P('slice'))
  return (jax.tree.map(lambda s: _stacked(s, mesh), param_sh), per_slice, per_slice, per_slice)


def stack_groups(outputs, cfg: Config, mesh: Mesh):
  """Assemble per-group per-slice sums into arrays over `mesh` (zero-copy, by device)."""
  target = sums_shardings(cfg, mesh)
  n = mesh.shape['slice']

  def one(sh, *group_leaves):
    shards = [s.data for leaf in group_leaves for s in leaf.addressable_shards]
    shape = (n, *group_leaves[0].shape[1:])
    return jax.make_array_from_single_device_arrays(shape, sh, shards,
                                                    dtype=group_leaves[0].dtype)
  return jax.tree.map(one, target, *outputs)


def lower_group(cfg: Config, mesh: Mesh, role: Role, graphdef) -> jax.stages.Lowered:
  """`(state, tokens_GxRxL1) -> per-slice (grads, loss, exact_tokens, degraded_tokens)` on `mesh`."""
  def group(state: TrainState, tokens_GxRxL1):
    key = jax.random.fold_in(state.rng, state.step)
    one = functools.partial(train_step.contribution, state.params, state.bases, key=key, role=role,
                            graphdef=graphdef, cfg=cfg)
    # vmap over the group's slices: each slice's sums stay on its own devices, unreduced.
    return jax.vmap(one)(tokens_GxRxL1)

  state_sh = state_shardings(cfg, mesh)
  jitted = jax.jit(group, in_shardings=(state_sh, batch_sharding(mesh)),
                   out_shardings=sums_shardings(cfg, mesh))
  tokens = jax.ShapeDtypeStruct(train_step.batch_shape(cfg, mesh.shape['slice'], role), jnp.int32)
  return jitted.lower(abstract_state(cfg), tokens)


def lower_update(cfg: Config, mesh: Mesh) -> jax.stages.Lowered:
  """`(state, stacked sums, schedule) -> (state, metrics)`: reduce across slices, §3 rule,
  optimizer (`schedule`: train_state.schedule_numbers)."""
  sums_sh = sums_shardings(cfg, mesh)

  def update(state: TrainState, sums, schedule: Schedule):
    if cfg.mesh.ordered_reduce:  # every device gets all slices' sums, adds them in slice order
      sums = jax.tree.map(lambda x, sh: jax.lax.with_sharding_constraint(
          x, NamedSharding(mesh, P(None, *sh.spec[1:]))), sums, sums_sh)
    return train_step.finish_step(state, jax.tree.map(lambda x: x.sum(0), sums),
                                  make_optimizer(cfg, schedule), models.spec(cfg.model))

  jitted = jax.jit(update, donate_argnums=0,
                   in_shardings=(state_shardings(cfg, mesh), sums_sh, replicated(mesh)),
                   out_shardings=(state_shardings(cfg, mesh), replicated(mesh)))
  return jitted.lower(abstract_state(cfg), _abstract_sums(cfg, mesh.shape['slice']),
                      abstract_schedule())


def _abstract_sums(cfg: Config, n_slices: int):
  """Shapes of per-slice sums stacked over n_slices: (grads, loss, exact, degraded)."""
  stacked = lambda shape, dtype: jax.ShapeDtypeStruct((n_slices, *shape), dtype)
  params = abstract_state(cfg).params
  scalar = stacked((), jnp.float32)
  return (jax.tree.map(lambda p: stacked(p.shape, p.dtype), params), scalar, scalar, scalar)
