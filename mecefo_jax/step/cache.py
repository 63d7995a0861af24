"""The run's compiled programs, each built once by the first source that has it: moved from a
program of the same shape (step/retarget.py), loaded from the program store (step/store.py),
or compiled."""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Callable

from mecefo_jax import multihost
from mecefo_jax.config import Config
from mecefo_jax.core import programs
from mecefo_jax.core.programs import ProgramKey
from mecefo_jax.step import lowering, retarget, store

log = logging.getLogger('mecefo')


@dataclasses.dataclass
class BuildStats:
  """Programs built by each source, and their seconds (report.json's `programs`)."""
  compiled: int = 0
  compiled_s: float = 0.0
  loaded: int = 0
  loaded_s: float = 0.0
  moved: int = 0
  moved_s: float = 0.0
  moved_ahead: int = 0  # of the moves, those made in the background before their set was live
  moved_ahead_s: float = 0.0

  def book(self, how: str, seconds: float) -> None:
    setattr(self, how, getattr(self, how) + 1)
    setattr(self, f'{how}_s', getattr(self, f'{how}_s') + seconds)


@dataclasses.dataclass
class Request:
  """One program to build: its key, the mesh of its slices, whether off the training thread."""
  key: ProgramKey
  mesh: object
  background: bool
  lower: Callable
  store_devices: bool  # the store's key names the devices (programs do not move)
  how: str | None = None  # set by a source that builds it other than its name says

  @property
  def devices(self) -> list:
    return list(self.mesh.devices.flat)

  @functools.cached_property
  def lowered(self):
    return self.lower()

  @functools.cached_property
  def store_key(self) -> str:
    return store.fingerprint(self.lowered, self.devices if self.store_devices else None)

  def __str__(self) -> str:
    """E.g. 'group program onto slices [0, 2]': onto where programs move, else for."""
    where = 'for' if self.store_devices else 'onto'
    return (f'{self.key.kind.name} program {where} slices {list(self.key.slices)}' +
            (' (background)' if self.background else ''))


class Moved:
  """Programs of a shape built before (`keep`), loaded onto the devices of other slices."""
  how = 'moved'

  def __init__(self, enabled: bool):
    self.enabled = enabled
    self._by_shape: dict[tuple, retarget.Serialized] = {}  # key.shape -> the first program

  def has(self, key: ProgramKey) -> bool:
    return programs.how_built(key, self._by_shape, self.enabled) == programs.MOVED

  def keep(self, key: ProgramKey, serialized: retarget.Serialized) -> None:
    if self.enabled:
      self._by_shape.setdefault(key.shape, serialized)

  def build(self, request: Request):
    return self.load(self._by_shape[request.key.shape], request) if self.has(request.key) else None

  def load(self, serialized: retarget.Serialized, request: Request):
    """`serialized` loaded onto the request's devices; None where that fails, and then
    programs are compiled for each set of slices from then on (private APIs: step/retarget.py)."""
    try:
      return serialized.load_onto(request.devices)
    except Exception as err:  # noqa: BLE001 -- private APIs: compile instead, from now on
      log.warning('loading the %s failed (%s: %s): programs are compiled for each set of slices '
                  'from now on', request, type(err).__name__, err)
      self.enabled = False
      return None


class _WithStore:
  """A source that reads or writes the program store (None: no store) and keeps what it builds
  for moves."""

  def __init__(self, program_store: store.ProgramStore | None, moved: Moved):
    self.store, self.moved = program_store, moved


class Stored(_WithStore):
  """Programs in the program store, loaded where every process has one."""
  how = 'loaded'

  def build(self, request: Request):
    if self.store is None:
      return None
    entry = self.store.read(request.store_key)
    if multihost.is_multiprocess():
      # All processes load or none does, so that no process reaches a collective a compile
      # ahead of the others; no vote off the training thread (processes vote in step).
      if request.background or not all(multihost.allgather_json(entry is not None)):
        return None
    program = entry and self.moved.load(entry, request)
    if program is not None:
      self.moved.keep(request.key, entry)
    return program


class Compiled(_WithStore):
  """Programs compiled now; kept serialized for moves and written to the store."""
  how = 'compiled'

  def build(self, request: Request):
    log.info('compiling the %s', request)
    program, serialized, from_jax_cache = compile_lowered(
        request.lowered, request.devices, self.store,
        serialize=self.moved.enabled or bool(self.store))
    if from_jax_cache:
      request.how = 'loaded'
    if serialized is not None:
      self.moved.keep(request.key, serialized)
      if self.store:
        self.store.write(request.store_key, serialized)
    return program


def compile_lowered(lowered, devices, program_store, serialize: bool):
  """(`lowered` compiled, its serialized copy if `serialize`, whether JAX's persistent cache
  had it). No copy of a program that cache loaded: on CPU such an executable is serialized
  again without its functions (jax 0.10.2: `NOT_FOUND: Function ... not found` where the copy
  runs), so it is neither moved nor stored (train.py turns that cache off)."""
  hits = store.cache_hits()
  with store.booking():
    program = lowered.compile(store.compiler_options(program_store, devices) or None)
  from_jax_cache = store.cache_hits() > hits
  copy = serialize and not from_jax_cache
  return program, retarget.Serialized.of(program, devices) if copy else None, from_jax_cache


class ProgramCache:
  """Compiled programs shared by the training thread and the background builder.

  `on_compile(seconds)` is called for builds (and waits for a build in flight) in the thread
  that created the cache, the training thread: the time the step could not run.
  """

  def __init__(self, cfg: Config, slices, graphdef, on_compile: Callable[[float], None],
               move: bool = False, program_store: store.ProgramStore | None = None):
    """`slices`: the run's sharding.PresentSlices (a program's slices are logical ids); `move`:
    programs move between sets of slices of one shape (retarget.enabled); `program_store`:
    where compiled programs are loaded from and written to (None: nowhere)."""
    self.cfg, self.slices, self.graphdef, self._on_compile = cfg, slices, graphdef, on_compile
    self.store = program_store
    self.moved = Moved(move)
    self.sources = (self.moved, Stored(program_store, self.moved),
                    Compiled(program_store, self.moved))
    self.stats = BuildStats()
    self._programs: dict = {}
    self.ahead: set[ProgramKey] = set()  # built in the background, not yet needed
    self.built: list[tuple[ProgramKey, str, bool]] = []  # (key, how, in the background)
    self._lock = threading.Lock()
    self._stats_lock = threading.Lock()  # prepare() books outside _lock
    self._owner = threading.get_ident()

  @property
  def move(self) -> bool:
    return self.moved.enabled

  def get(self, key: ProgramKey, build: Callable):
    """The program cached under `key`, built once (the loser of a race reuses the result)."""
    program = self._programs.get(key)
    owner = self._in_owner()
    if program is None:
      if owner and self._lock.locked():
        log.info('waiting for the background build of the %s', key)
      t0 = time.perf_counter()
      with self._lock:  # one build at a time
        program = self._programs.get(key)
        if program is None:
          program = self._programs[key] = build()
          if not owner:
            self.ahead.add(key)
      if owner:
        self._on_compile(time.perf_counter() - t0)
    if owner:
      self.ahead.discard(key)
    return program

  def keys(self) -> set:
    return set(self._programs)

  def program(self, key: ProgramKey):
    """The program `key` on the devices of its slices."""
    return self.get(key, lambda: self._build(key))

  def _build(self, key: ProgramKey):
    """From the first source that has it. Runs under the lock."""
    mesh = self.slices.sub(key.slices)
    request = Request(key, mesh, not self._in_owner(),
                      lambda: lowering.lower(key, self.cfg, mesh, self.graphdef),
                      store_devices=not self.move)
    t0 = time.perf_counter()
    for source in self.sources:
      program = source.build(request)
      if program is not None:
        how = request.how or source.how
        self._book(how, time.perf_counter() - t0, request.background)
        if source.how != 'compiled':
          log.info('%s the %s', 'moved' if how == 'moved' else 'loaded from the store', request)
        self.built.append((key, how, request.background))
        return program
    raise AssertionError('the compiled source always builds')

  def prepare(self, key: ProgramKey) -> None:
    """Compiles `key` into the store only, unless the store or this cache has one of its shape:
    for a later process (a restart), not this one, so no process vote; and outside the lock,
    so that the training thread never waits for it."""
    if self.store is None or not self.move or self.moved.has(key):
      return
    t0 = time.perf_counter()
    mesh = self.slices.sub(key.slices)
    lowered = lowering.lower(key, self.cfg, mesh, self.graphdef)
    store_key = store.fingerprint(lowered, None)
    if self.store.path(store_key).exists():
      return
    log.info('compiling the %s program for slices %s into the program store (background)',
             key.kind.name, list(key.slices))
    _, serialized, from_jax_cache = compile_lowered(lowered, list(mesh.devices.flat), self.store,
                                                    serialize=True)
    self._book('loaded' if from_jax_cache else 'compiled', time.perf_counter() - t0, True)
    if serialized is not None:
      self.store.write(store_key, serialized)

  def evict_ahead(self, keep: set[ProgramKey]) -> int:
    """Drops the programs built ahead of need that are not in `keep`; how many."""
    with self._lock:
      gone = self.ahead - keep
      for key in gone:
        self._programs.pop(key, None)
      self.ahead -= gone
    return len(gone)

  def _in_owner(self) -> bool:
    return threading.get_ident() == self._owner

  def _book(self, how: str, seconds: float, background: bool) -> None:
    with self._stats_lock:
      self.stats.book(how, seconds)
      if background and how == 'moved':
        self.stats.book('moved_ahead', seconds)

  def has_shape(self, key: ProgramKey) -> bool:
    """Whether the program `key` would be moved, not compiled: one of its shape is built
    already (and moving is on)."""
    return self.moved.has(key)

  def step_programs(self, keys: tuple[ProgramKey, ...]) -> 'StepPrograms':
    """The programs of a step's keys (StepPlan.programs): the fused one, or the groups and
    the update."""
    if keys[0].kind is programs.FUSED:
      return StepPrograms(fused=self.program(keys[0]))
    return StepPrograms(groups=[(key.variant, key.slices, self.program(key)) for key in keys[:-1]],
                        update=self.program(keys[-1]))


@dataclasses.dataclass
class StepPrograms:
  """Either `fused` or (`groups`: [(role, slices, program)], `update`)."""
  fused: Callable | None = None
  groups: list = dataclasses.field(default_factory=list)
  update: Callable | None = None
