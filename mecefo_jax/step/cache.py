"""The run's compiled programs, each built once: compiled for its first set of slices, then
moved onto any other set of the same shape (step/retarget.py) instead of compiled again."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from mecefo_jax.config import Config
from mecefo_jax.plan.roles import Role
from mecefo_jax.step import retarget, slice_steps, train_step

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

  def __init__(self, cfg: Config, slices, graphdef, on_compile: Callable[[float], None],
               move: bool = False):
    """`slices`: the run's sharding.PresentSlices (a program's slices are logical ids); `move`:
    programs move between sets of slices of one shape (retarget.enabled)."""
    self.cfg, self.slices, self.graphdef, self._on_compile = cfg, slices, graphdef, on_compile
    self.move = move
    self._programs: dict = {}
    self._by_shape: dict = {}  # shape_of(key) -> (the first program of that shape, its devices)
    self._serialized: dict = {}
    self.stats = {'compiled': 0, 'compiled_s': 0.0, 'moved': 0, 'moved_s': 0.0}
    self._lock = threading.Lock()
    self._owner = threading.get_ident()

  def get(self, key, build: Callable):
    """The program cached under `key`, built once (the loser of a race reuses the result)."""
    program = self._programs.get(key)
    if program is None:
      if threading.get_ident() == self._owner and self._lock.locked():
        log.info('waiting for the background compile of the %s program for slices %s', key[0],
                 list(key[1]))
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
    return self.get((kind, slices, *args), lambda: self._build(kind, slices, args))

  def _build(self, kind: str, slices: tuple[int, ...], args: tuple):
    """Moved from a program of the same shape where there is one (and moving is on), else
    compiled. Runs under the lock."""
    mesh, shape = self.slices.sub(slices), shape_of((kind, slices, *args))
    devices = list(mesh.devices.flat)
    background = '' if threading.get_ident() == self._owner else ' (background)'
    if self.move and shape in self._by_shape:
      t0 = time.perf_counter()
      try:
        program = self._source(shape).load_onto(devices)
      except Exception as err:  # noqa: BLE001 -- private APIs: compile instead, from now on
        log.warning('moving the %s program failed (%s: %s): programs are compiled for each set '
                    'of slices from now on', kind, type(err).__name__, err)
        self.move = False
      else:
        self._book('moved', time.perf_counter() - t0)
        log.info('moved the %s program onto slices %s%s', kind, list(slices), background)
        return program
    log.info('compiling the %s program for slices %s%s', kind, list(slices), background)
    t0 = time.perf_counter()
    program = _BUILDERS[kind](self.cfg, mesh, self.graphdef, *args)
    self._book('compiled', time.perf_counter() - t0)
    if self.move:
      self._by_shape.setdefault(shape, (program, devices))
    return program

  def _source(self, shape) -> retarget.Serialized:
    """The serialized first program of `shape` (serialized once, at its first move)."""
    if shape not in self._serialized:
      self._serialized[shape] = retarget.Serialized(*self._by_shape[shape])
    return self._serialized[shape]

  def _book(self, what: str, seconds: float) -> None:
    self.stats[what] += 1
    self.stats[f'{what}_s'] += seconds

  def step_programs(self, live: tuple[int, ...], roles: dict[int, Role]) -> 'StepPrograms':
    """The programs one step on `live` runs (step_keys)."""
    keys = step_keys(live, roles, self.cfg.mesh.ordered_reduce)
    if keys[0][0] == 'fused':
      return StepPrograms(fused=self.program(*keys[0]))
    return StepPrograms(groups=[(role, slices, self.program(kind, slices, role))
                                for kind, slices, role in keys[:-1]],
                        update=self.program(*keys[-1]))


def step_keys(live: tuple[int, ...], roles: dict[int, Role], ordered_reduce: bool) -> list[tuple]:
  """The (kind, slices, *args) of the programs one step on `live` runs: one fused SPMD program
  when every slice plays one single-pass role (and not mesh.ordered_reduce), else one group
  program per role (its slices in live order) and the update.

  A group of one role is one program over its slices, not a program of one slice run on each:
  where a slice is one device, XLA compiles a one-device program differently from a program
  partitioned over several (sums differ in the last bits), and results must not depend on
  how many slices share a role."""
  first = roles[live[0]]
  if len(set(roles.values())) == 1 and first.passes == 1 and not ordered_reduce:
    return [('fused', live, first)]
  groups = {}
  for s in live:
    groups.setdefault(roles[s], []).append(s)
  return [*(('group', tuple(slices), role) for role, slices in groups.items()), ('update', live)]


def shape_of(key: tuple) -> tuple:
  """(kind, number of slices, *args): what a program's HLO depends on, as the in-slice mesh,
  the config and the graph are the run's; programs of one shape move between sets of slices."""
  kind, slices, *args = key
  return (kind, len(slices), *args)


@dataclasses.dataclass
class StepPrograms:
  """Either `fused` or (`groups`: [(role, slices, program)], `update`)."""
  fused: Callable | None = None
  groups: list = dataclasses.field(default_factory=list)
  update: Callable | None = None
