"""Each kind of program (core/programs.py) lowered for the devices of its slices."""
from __future__ import annotations

from typing import Callable

import jax

from jax.sharding import NamedSharding, PartitionSpec as P

from mecefo_jax import multihost
from mecefo_jax.config import Config
from mecefo_jax.core.programs import ProgramKey
from mecefo_jax.model.train_state import abstract_state, state_shardings
from mecefo_jax.step import slice_steps, train_step

# kind name -> lower(cfg, mesh of the program's slices, graphdef, variant)
LOWER: dict[str, Callable[..., jax.stages.Lowered]] = {
    'fused': lambda cfg, mesh, graphdef, role: train_step.lower_step(cfg, mesh, role, graphdef),
    'group': lambda cfg, mesh, graphdef, role: slice_steps.lower_group(cfg, mesh, role, graphdef),
    'update': lambda cfg, mesh, graphdef, _: slice_steps.lower_update(cfg, mesh),
    'refresh_cold': lambda cfg, mesh, graphdef, _: train_step.lower_refresh(cfg, mesh, False),
    'refresh_warm': lambda cfg, mesh, graphdef, _: train_step.lower_refresh(cfg, mesh, True),
    'eval': lambda cfg, mesh, graphdef, _: train_step.lower_eval(cfg, mesh, cfg.train.micro_batch,
                                                                 graphdef),
    'rejoin': lambda cfg, mesh, graphdef, source: lower_rejoin(cfg, mesh, source),
}


def lower_rejoin(cfg: Config, mesh, source: int) -> jax.stages.Lowered:
  """The copy of the state from the slice at row `source` of `mesh` onto all of its slices
  (multihost.rejoin_copy: a collective, the one way across processes on CPU)."""
  target = state_shardings(cfg, mesh)
  stacked = jax.tree.map(
      lambda a, sh: jax.ShapeDtypeStruct((mesh.shape['slice'], *a.shape), a.dtype,
                                         sharding=NamedSharding(sh.mesh, P('slice', *sh.spec))),
      abstract_state(cfg), target)
  return multihost.rejoin_copy(target, source).lower(stacked)


def lower(key: ProgramKey, cfg: Config, mesh, graphdef) -> jax.stages.Lowered:
  """The program `key` lowered onto `mesh` (the devices of `key.slices`)."""
  try:
    lower_kind = LOWER[key.kind.name]
  except KeyError:
    raise ValueError(f'no lowering for program kind {key.kind.name!r} (step/lowering.py)') from None
  return lower_kind(cfg, mesh, graphdef, key.variant)
