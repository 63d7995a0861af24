"""The run's compiled programs, each built once: moved from a program of the same shape
(step/retarget.py), else loaded from the program store (step/store.py), else compiled."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from mecefo_jax import multihost
from mecefo_jax.config import Config
from mecefo_jax.plan.roles import Role
from mecefo_jax.step import retarget, slice_steps, store, train_step

log = logging.getLogger('mecefo')

# kind -> lower(cfg, mesh of the program's slices, graphdef, *args)
_LOWER = {
    'fused': lambda cfg, mesh, graphdef, role: train_step.lower_step(cfg, mesh, role, graphdef),
    'group': lambda cfg, mesh, graphdef, role: slice_steps.lower_group(cfg, mesh, role, graphdef),
    'update': lambda cfg, mesh, graphdef: slice_steps.lower_update(cfg, mesh),
    'refresh': lambda cfg, mesh, graphdef, warm: train_step.lower_refresh(cfg, mesh, warm),
    'eval': lambda cfg, mesh, graphdef: train_step.lower_eval(cfg, mesh, cfg.train.micro_batch,
                                                               graphdef),
}


class ProgramCache:
  """Compiled programs shared by the training thread and the background precompiler.

  `on_compile(seconds)` is called for compiles (and waits for a precompile in flight) in the
  thread that created the cache, the training thread: the time the step could not run.
  """

  def __init__(self, cfg: Config, slices, graphdef, on_compile: Callable[[float], None],
               move: bool = False, program_store: store.ProgramStore | None = None):
    """`slices`: the run's sharding.PresentSlices (a program's slices are logical ids); `move`:
    programs move between sets of slices of one shape (retarget.enabled); `program_store`:
    where compiled programs are loaded from and written to (None: nowhere)."""
    self.cfg, self.slices, self.graphdef, self._on_compile = cfg, slices, graphdef, on_compile
    self.move, self.store = move, program_store
    self._programs: dict = {}
    self._by_shape: dict[tuple, retarget.Serialized] = {}  # shape_of(key) -> the first program
    self.stats = {'compiled': 0, 'compiled_s': 0.0, 'loaded': 0, 'loaded_s': 0.0, 'moved': 0,
                  'moved_s': 0.0}
    self._lock = threading.Lock()
    self._stats_lock = threading.Lock()  # prepare() books outside _lock
    self._owner = threading.get_ident()

  def get(self, key, build: Callable):
    """The program cached under `key`, built once (the loser of a race reuses the result)."""
    program = self._programs.get(key)
    if program is None:
      if self._in_owner() and self._lock.locked():
        log.info('waiting for the background compile of the %s program for slices %s', key[0],
                 list(key[1]))
      t0 = time.perf_counter()
      with self._lock:  # one compile at a time
        program = self._programs.get(key)
        if program is None:
          program = self._programs[key] = build()
      if self._in_owner():
        self._on_compile(time.perf_counter() - t0)
    return program

  def keys(self) -> set:
    return set(self._programs)

  def program(self, kind: str, slices: tuple[int, ...], *args):
    """The `kind` program (see _LOWER) on the devices of `slices`."""
    return self.get((kind, slices, *args), lambda: self._build(kind, slices, args))

  def _build(self, kind: str, slices: tuple[int, ...], args: tuple):
    """Moved from a program of the same shape where there is one (and moving is on), else
    loaded from the store, else compiled. Runs under the lock."""
    mesh, shape = self.slices.sub(slices), shape_of((kind, slices, *args))
    devices = list(mesh.devices.flat)
    where = f'{kind} program {"onto" if self.move else "for"} slices {list(slices)}' + (
        '' if self._in_owner() else ' (background)')
    if self.move and shape in self._by_shape:
      program = self._moved(self._by_shape[shape], devices, where)
      if program is not None:
        return program
    t0 = time.perf_counter()
    lowered = _LOWER[kind](self.cfg, mesh, self.graphdef, *args)
    key = self.store and store.fingerprint(lowered, None if self.move else devices)
    serialized = self._agreed_entry(key)
    if serialized is not None:
      program = self._moved(serialized, devices, where, loading=t0)
      if program is not None:
        if self.move:
          self._by_shape.setdefault(shape, serialized)
        return program
    log.info('compiling the %s', where)
    program, serialized = self._compiled(lowered, devices, t0, self.move or self.store)
    if serialized is not None:
      if self.move:
        self._by_shape.setdefault(shape, serialized)
      if self.store:
        self.store.write(key, serialized)
    return program

  def prepare(self, kind: str, slices: tuple[int, ...], *args) -> None:
    """Compiles the `kind` program into the store only, unless the store or this cache has one
    of its shape: for a later process (a restart), not this one, so no process vote; and
    outside the lock, so that the training thread never waits for it."""
    shape = shape_of((kind, slices, *args))
    if self.store is None or not self.move or shape in self._by_shape:
      return
    t0 = time.perf_counter()
    mesh = self.slices.sub(slices)
    lowered = _LOWER[kind](self.cfg, mesh, self.graphdef, *args)
    key = store.fingerprint(lowered, None)
    if self.store.path(key).exists():
      return
    log.info('compiling the %s program %sfor slices %s into the program store (background)',
             kind, ''.join(f'{a} ' for a in args if not isinstance(a, Role)), list(slices))
    serialized = self._compiled(lowered, list(mesh.devices.flat), t0, serialize=True)[1]
    if serialized is not None:
      self.store.write(key, serialized)

  def _compiled(self, lowered, devices, t0: float, serialize: bool):
    """(`lowered` compiled, booked from `t0`; its serialized copy if `serialize`). No copy of a
    program JAX's persistent cache loaded (booked as a load): on CPU such an executable is
    serialized again without its functions (jax 0.10.2: `NOT_FOUND: Function ... not found`
    where the copy runs), so it is neither moved nor stored. (train.py turns that cache off.)"""
    hits = store.cache_hits()
    with store.booking():
      program = lowered.compile(store.compiler_options(self.store, devices) or None)
    from_jax_cache = store.cache_hits() > hits
    self._book('loaded' if from_jax_cache else 'compiled', time.perf_counter() - t0)
    copy = serialize and not from_jax_cache
    return program, retarget.Serialized.of(program, devices) if copy else None

  def _moved(self, serialized, devices, where: str, loading: float | None = None):
    """`serialized` loaded onto `devices` (booked as a move, or as a load from the store when
    `loading` is its start time); None where that fails (then moving is off from now on)."""
    t0 = time.perf_counter() if loading is None else loading
    try:
      program = serialized.load_onto(devices)
    except Exception as err:  # noqa: BLE001 -- private APIs: compile instead, from now on
      log.warning('loading the %s failed (%s: %s): programs are compiled for each set of slices '
                  'from now on', where, type(err).__name__, err)
      self.move = False
      return None
    self._book('moved' if loading is None else 'loaded', time.perf_counter() - t0)
    log.info('%s the %s', 'moved' if loading is None else 'loaded from the store', where)
    return program

  def _agreed_entry(self, key: str | None) -> retarget.Serialized | None:
    """The store's entry for `key`, where every process has one (multi-process: all load or
    none does, so that no process reaches a collective a compile ahead of the others)."""
    entry = self.store.read(key) if key else None
    if multihost.is_multiprocess() and key:
      if not self._in_owner():
        return None  # no votes off the training thread (processes vote in step)
      if not all(multihost.allgather_json(entry is not None)):
        return None
    return entry

  def _in_owner(self) -> bool:
    return threading.get_ident() == self._owner

  def _book(self, what: str, seconds: float) -> None:
    with self._stats_lock:
      self.stats[what] += 1
      self.stats[f'{what}_s'] += seconds

  def has_shape(self, key) -> bool:
    """Whether the program `key` = (kind, slices, *args) would be moved, not compiled: one of
    its shape is built already (and moving is on)."""
    return self.move and shape_of(key) in self._by_shape

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
