"""The run's compiled programs, each built once by the first source that has it: moved from a
program of the same shape (step/retarget.py), loaded from the program store (step/program_store.py),
or compiled."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Callable

from mecefo_jax import multihost
from mecefo_jax.config import Config
from mecefo_jax.core import programs
from mecefo_jax.core.programs import ProgramKey
from mecefo_jax.core.roles import slice_list
from mecefo_jax.records import progress_marks
from mecefo_jax.sections import entry
from mecefo_jax.step import lowering, retarget
from mecefo_jax.step.program_store import (booking, cache_hits, compiler_options, covers_code,
                                           fingerprint, ProgramStore, recipe)

log = logging.getLogger('mecefo')


@dataclasses.dataclass
class BuildStats:
  """Programs built by each source, and their seconds (report.json's `programs` counters)."""
  compiled: int = entry('', 'programs compiled by this process (background compiles included)',
                        default=0)
  compiled_s: float = entry('s', 'their lowering and compile time', default=0.0)
  loaded: int = entry('', "programs loaded instead of compiled: from the program store, or hits "
                      "of JAX's persistent compilation cache", default=0)
  loaded_s: float = entry('s', 'their lowering and load time', default=0.0)
  moved: int = entry('', 'programs moved onto another set of slices instead of compiled', default=0)
  moved_s: float = entry('s', 'time spent moving them', default=0.0)
  moved_ahead: int = entry('', 'of the moves, those made in the background before their set of '
                           'slices was live (faults.precompile)', default=0)
  moved_ahead_s: float = entry('s', 'their time, off the critical path', default=0.0)

  def book(self, how: str, seconds: float) -> None:
    """One program built `how`: 'compiled', 'loaded', 'moved' (a source's `how`) or
    'moved_ahead' (a move in the background, booked besides as moved)."""
    match how:
      case 'compiled':
        self.compiled, self.compiled_s = self.compiled + 1, self.compiled_s + seconds
      case 'loaded':
        self.loaded, self.loaded_s = self.loaded + 1, self.loaded_s + seconds
      case 'moved':
        self.moved, self.moved_s = self.moved + 1, self.moved_s + seconds
      case 'moved_ahead':
        self.moved_ahead, self.moved_ahead_s = self.moved_ahead + 1, self.moved_ahead_s + seconds
      case _:
        raise ValueError(f'no program is built {how!r}')


@dataclasses.dataclass(kw_only=True)
class Programs(BuildStats):
  """report.json's `programs` section: the counters, and how this process built its programs."""
  move: bool = entry('', 'train.move_programs resolved: programs moved between sets of slices of '
                     'one shape (step/retarget.py)')
  store: str | None = entry('', 'the program store directory (step/program_store.py), null if none')
  scan_unroll: int = entry('', "lax.scan's unroll over the stacked blocks in every program (the "
                           'same at every depth)')
  other_compiles: int = entry('', 'XLA compiles of this process besides the programs above and the '
                              'initializer (eager ops, layout conversions; jax.monitoring)')
  other_compile_s: float = entry('s', 'their XLA compile time')


@dataclasses.dataclass
class Request:
  """One program to build: its key, the mesh of its slices, and who asks: the step that needs
  it now, or (`ahead`) the background builder before its set of slices is live."""
  key: ProgramKey
  mesh: object
  ahead: bool
  lower: Callable
  store_devices: bool  # the store's key names the devices (programs do not move)
  model: str = ''  # model.kind: in the store's key
  recipe: Callable[[], str] | None = None  # its alias's key (program_store.recipe), where a store
  by_recipe: bool = False  # the recipe covers its code: found by its alias (ProgramStore.lookup)

  @property
  def devices(self) -> list:
    return list(self.mesh.devices.flat)

  @functools.cached_property
  def lowered(self):
    return self.lower()

  @functools.cached_property
  def store_key(self) -> str:
    return fingerprint(self.lowered, self.devices if self.store_devices else None, self.model)

  def __str__(self) -> str:
    """E.g. 'group program onto slices [0, 2]': onto where programs move, else for."""
    where = 'for' if self.store_devices else 'onto'
    return (f'{self.key.kind.name} program {where} slices {slice_list(self.key.slices)}' +
            (' (background)' if self.ahead else ''))


@dataclasses.dataclass(frozen=True)
class Built:
  """A program a source built, and how: 'moved', 'loaded' (the program store or JAX's
  persistent cache) or 'compiled'."""
  program: Callable
  how: str


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

  def build(self, request: Request) -> Built | None:
    program = self.has(request.key) and self.load(self._by_shape[request.key.shape], request)
    return Built(program, self.how) if program else None

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

  def __init__(self, program_store: ProgramStore | None, moved: Moved):
    self.store, self.moved = program_store, moved

  def load(self, entry: retarget.Serialized | None, request: Request) -> Built | None:
    """`entry` loaded onto the request's devices (kept for moves); None: no entry, or it
    does not load."""
    program = entry and self.moved.load(entry, request)
    if program is None:
      return None
    self.moved.keep(request.key, entry)
    return Built(program, 'loaded')


class Stored(_WithStore):
  """Programs in the program store, loaded where every process has one."""

  def __init__(self, program_store: ProgramStore | None, moved: Moved,
               shared: Callable[[], bool]):
    super().__init__(program_store, moved)
    self.shared = shared  # whether the job's processes share this store (shares_store)

  def build(self, request: Request) -> Built | None:
    if self.store is None:
      return None
    recipe_key = request.recipe() if request.by_recipe else None  # (lookup takes str | None)
    if not multihost.is_multiprocess():
      return self.load(self.store.lookup(recipe_key, lambda: request.store_key), request)
    if request.ahead:  # no vote off the training thread (processes vote in step)
      return None
    # A program no alias names is left to Shared where the processes share the store: one of
    # them lowers it, not each.
    by_key = None if recipe_key and self.shared() else lambda: request.store_key
    entry = self.store.lookup(recipe_key, by_key)
    # All processes load or none does, so that no process reaches a collective a compile
    # ahead of the others.
    return self.load(entry, request) if all(multihost.allgather_json(entry is not None)) else None


class Shared(_WithStore):
  """A program none of a job's processes has, where they share one program store (a local
  job's do): the process that takes its recipe's claim lowers and compiles it into the store
  and the others load it once its alias is there, instead of each lowering and compiling the
  same program at the same time. They wait on the claim, not in a collective: a long compile
  is no collective's timeout, and a claimer that fails leaves the claim to the next."""

  def __init__(self, stored: Stored, compiled: 'Compiled'):
    super().__init__(stored.store, stored.moved)
    self.shared, self.compiled = stored.shared, compiled

  def build(self, request: Request) -> Built | None:
    if not (self.store and multihost.is_multiprocess() and request.by_recipe and not request.ahead
            and self.shared()):
      return None
    recipe_key, built = request.recipe(), None

    def build_into() -> None:  # under the recipe's claim
      nonlocal built
      entry = self.store.read(request.store_key)  # lowered: another recipe's may be it
      built = (self.load(entry, request) if entry else None) or self.compiled.build(request)
      self.store.set_alias(recipe_key, request.store_key)
    self.store.fill(recipe_key, build_into, give_up=lambda: False,
                    present=lambda: self.store.alias_of(recipe_key) is not None)
    built = built or self.load(self.store.lookup(recipe_key, None), request)
    if not all(multihost.allgather_json(built is not None)):
      log.warning('the %s was not in the program store for every process: those without it '
                  'compile it', request)
    return built


def shares_store(program_store: ProgramStore) -> bool:
  """Whether every process of the job sees one program store (all processes call it): process
  0 leaves a mark in its directory, the others look for it."""
  mark = program_store.dir / f'.job-{os.getpid()}-{time.time_ns()}'
  if multihost.is_chief():
    with contextlib.suppress(OSError):  # a store it cannot write: not shared
      mark.touch()
  name = multihost.allgather_json(mark.name)[0]
  seen = multihost.allgather_json((program_store.dir / name).exists())
  if multihost.is_chief():
    mark.unlink(missing_ok=True)
  return all(seen)


class Compiled(_WithStore):
  """Programs compiled now; kept serialized for moves and written to the store."""
  how = 'compiled'

  def build(self, request: Request, keep: bool = True) -> Built:
    """`keep=False`: into the program store only (not kept for moves)."""
    log.info('compiling the %s%s', request, '' if keep else ' into the program store')
    program, serialized, from_jax_cache = compile_lowered(
        request.lowered, request.devices, self.store,
        serialize=self.moved.enabled or bool(self.store))
    if serialized is not None:
      if keep:
        self.moved.keep(request.key, serialized)
      if self.store:
        self.store.write(request.store_key, serialized)
    return Built(program, 'loaded' if from_jax_cache else self.how)


def compile_lowered(lowered, devices, program_store, serialize: bool):
  """(`lowered` compiled, its serialized copy if `serialize`, whether JAX's persistent cache
  had it). No copy of a program that cache loaded: on CPU such an executable is serialized
  again without its functions (jax 0.10.2: `NOT_FOUND: Function ... not found` where the copy
  runs), so it is neither moved nor stored (train.py turns that cache off)."""
  hits = cache_hits()
  with booking():
    program = lowered.compile(compiler_options(program_store, devices) or None)
  from_jax_cache = cache_hits() > hits
  copy = serialize and not from_jax_cache
  return program, retarget.Serialized.of(program, devices) if copy else None, from_jax_cache


class ProgramCache:
  """Compiled programs shared by the training thread and the background builder; each is built
  once, through the sources, by the request that first asks for it.

  `on_compile(seconds)` is called for the builds (and waits for a build in flight) of the
  requests that are not `ahead`: the time the step could not run.
  """

  def __init__(self, cfg: Config, slices, graphdef, on_compile: Callable[[float], None],
               move: bool = False, program_store: ProgramStore | None = None):
    """`slices`: the run's sharding.PresentSlices (a program's slices are logical ids); `move`:
    programs move between sets of slices of one shape (retarget.enabled); `program_store`:
    where compiled programs are loaded from and written to (None: nowhere)."""
    self.cfg, self.slices, self.graphdef, self._on_compile = cfg, slices, graphdef, on_compile
    self.store = program_store
    self.moved = Moved(move)
    self.compiled = Compiled(program_store, self.moved)
    stored = Stored(program_store, self.moved, functools.cache(lambda: shares_store(self.store)))
    self.sources = (self.moved, stored, Shared(stored, self.compiled), self.compiled)
    self.stats = BuildStats()
    self._programs: dict = {}
    self.ahead: set[ProgramKey] = set()  # built ahead of need, not yet asked for by a step
    self.built: list[tuple[ProgramKey, str, bool]] = []  # (key, how, ahead)
    self._lock = threading.Lock()
    self._stats_lock = threading.Lock()  # prepare() books outside _lock

  @property
  def move(self) -> bool:
    return self.moved.enabled

  def keys(self) -> set:
    return set(self._programs)

  def program(self, key: ProgramKey, ahead: bool = False):
    """The program `key` on the devices of its slices, built once (a request that finds it
    being built waits for it). `ahead`: asked for by the background builder, before its set
    of slices is live: kept in `ahead` until a step asks for it, and not the step's wait."""
    program = self._programs.get(key)
    if program is None:
      if not ahead and self._lock.locked():
        log.info('waiting for the background build of the %s', key)
      t0 = time.perf_counter()
      with self._lock, progress_marks.during('compiling', str(key)):  # one build at a time
        program = self._programs.get(key)
        if program is None:
          program = self._programs[key] = self._build(self._request(key, ahead))
          if ahead:
            self.ahead.add(key)
      if not ahead:
        self._on_compile(time.perf_counter() - t0)
    if not ahead:
      self.ahead.discard(key)
    return program

  def _request(self, key: ProgramKey, ahead: bool) -> Request:
    mesh = self.slices.sub(key.slices)
    program = key.shape if self.move else (key, [d.id for d in mesh.devices.flat])
    return Request(key, mesh, ahead, lambda: lowering.lower(key, self.cfg, mesh, self.graphdef),
                   store_devices=not self.move, model=self.cfg.model.kind,
                   recipe=lambda: recipe(self.cfg, program, dict(mesh.shape),
                                         key.kind.optimizer),
                   by_recipe=covers_code(self.cfg.model.kind))

  def _build(self, request: Request):
    """From the first source that has it. Runs under the lock."""
    t0 = time.perf_counter()
    for source in self.sources:
      built = source.build(request)
      if built is not None:
        self._book(built.how, time.perf_counter() - t0, request.ahead)
        if built.how != 'compiled':
          log.info('%s the %s', 'moved' if built.how == 'moved' else 'loaded from the store',
                   request)
        self.built.append((request.key, built.how, request.ahead))
        if self.store and 'store_key' in request.__dict__:  # lowered: the alias is known
          self.store.set_alias(request.recipe(), request.store_key)
        return built.program
    raise AssertionError('the compiled source always builds')

  def prepare(self, key: ProgramKey, give_up=None) -> bool:
    """Compiles `key` into the program store only, unless the store or this cache has one of
    its shape: for a later process (a restart), not this one, so no process vote; and outside
    the lock, so that the training thread never waits for it. The claim is its recipe's, taken
    before lowering: a job's processes want the same programs at the same time, and only the
    one that claims a program lowers it (the others found it by the alias it leaves). One that
    a peer process claimed is left to it: False, unless `give_up` is given (ProgramStore.fill
    waits for the peer)."""
    if self.store is None or not self.move or self.moved.has(key):
      return True
    t0 = time.perf_counter()
    request = self._request(key, ahead=True)
    recipe_key = request.recipe()

    def build_into() -> None:  # under the recipe's claim
      if not self.store.path(request.store_key).exists():  # another recipe's entry may be it
        built = self.compiled.build(request, keep=False)  # logs 'compiling the ... (background)'
        self._book(built.how, time.perf_counter() - t0, True)
      self.store.set_alias(recipe_key, request.store_key)
    return self.store.fill(recipe_key, build_into, give_up,
                           present=lambda: self.store.alias_of(recipe_key) is not None)

  def evict_ahead(self, keep: set[ProgramKey]) -> int:
    """Drops the programs built ahead of need that are not in `keep`; how many."""
    with self._lock:
      gone = self.ahead - keep
      for key in gone:
        self._programs.pop(key, None)
      self.ahead -= gone
    return len(gone)

  def _book(self, how: str, seconds: float, ahead: bool) -> None:
    with self._stats_lock:
      self.stats.book(how, seconds)
      if ahead and how == 'moved':
        self.stats.book('moved_ahead', seconds)

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
