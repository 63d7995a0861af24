"""The run's compiled programs, each built once, keyed by kind, slices and shape."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from mecefo_jax.config import Config
from mecefo_jax.plan.roles import Role
from mecefo_jax.step import slice_steps, train_step

log = logging.getLogger('mecefo')

# kind -> build(cfg, mesh of the program's slices, graphdef, *args)
_BUILDERS = {
    'fused': lambda cfg, mesh, graphdef, role: train_step.compile_step(cfg, mesh, role, graphdef),
    'group': lambda cfg, mesh, graphdef, role: slice_steps.compile_group(cfg, mesh, role, graphdef),
    'update': lambda cfg, mesh, graphdef: slice_steps.compile_update(cfg, mesh),
    'refresh': lambda cfg, mesh, graphdef, warm: train_step.compile_refresh(cfg, mesh, warm),
    'eval': lambda cfg, mesh, graphdef: train_step.compile_eval(cfg, mesh, cfg.train.micro_batch,
                                                                 graphdef),
}


class ProgramCache:
  """Compiled programs shared by the training thread and the background precompiler.

  `on_compile(seconds)` is called for compiles (and waits for a precompile in flight) in the
  thread that created the cache, the training thread: the time the step could not run.
  """

  def __init__(self, cfg: Config, slices, graphdef, on_compile: Callable[[float], None]):
    """`slices`: the run's sharding.PresentSlices (a program's slices are logical ids)."""
    self.cfg, self.slices, self.graphdef, self._on_compile = cfg, slices, graphdef, on_compile
    self._programs: dict = {}
    self._lock = threading.Lock()
    self._owner = threading.get_ident()

  def get(self, key, build: Callable):
    """The program cached under `key`, built once (the loser of a race reuses the result)."""
    program = self._programs.get(key)
    if program is None:
      if threading.get_ident() == self._owner:  # the step waits: say why (seconds on CPU)
        log.info('compiling the %s program for slices %s (%s)', key[0], list(key[1]),
                 'waiting for the background compile' if self._lock.locked() else 'first use')
      t0 = time.perf_counter()
      with self._lock:  # one compile at a time
        program = self._programs.get(key)
        if program is None:
          program = self._programs[key] = build()
      if threading.get_ident() == self._owner:
        self._on_compile(time.perf_counter() - t0)
    return program

  def keys(self) -> set:
    return set(self._programs)

  def program(self, kind: str, slices: tuple[int, ...], *args):
    """The `kind` program (see _BUILDERS) on the devices of `slices`."""
    mesh = self.slices.sub(slices)
    return self.get((kind, slices, *args),
                    lambda: _BUILDERS[kind](self.cfg, mesh, self.graphdef, *args))

  def step_programs(self, live: tuple[int, ...], roles: dict[int, Role]) -> 'StepPrograms':
    """The programs one step on `live` runs: one fused SPMD program when every slice plays one
    single-pass role (mesh.ordered_reduce aside), else one per role group and the update."""
    first = roles[live[0]]
    if len(set(roles.values())) == 1 and first.passes == 1 and not self.cfg.mesh.ordered_reduce:
      return StepPrograms(fused=self.program('fused', live, first))
    groups = {}
    for s in live:
      groups.setdefault(roles[s], []).append(s)
    return StepPrograms(groups=[(role, tuple(slices), self.program('group', tuple(slices), role))
                                for role, slices in groups.items()],
                        update=self.program('update', live))


@dataclasses.dataclass
class StepPrograms:
  """Either `fused` or (`groups`: [(role, slices, program)], `update`)."""
  fused: Callable | None = None
  groups: list = dataclasses.field(default_factory=list)
  update: Callable | None = None
