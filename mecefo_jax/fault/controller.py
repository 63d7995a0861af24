"""Host controller: the decider's plan of each step (core/decider.py), run by the executor."""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import time
from typing import Callable

import jax
import numpy as np

from mecefo_jax import multihost, sharding
from mecefo_jax.config import Config
from mecefo_jax.core.decider import Decider, DeciderMeta, DeciderState, Plans, StepPlan
from mecefo_jax.core.failures import FailureEvent, FailureSchedule
from mecefo_jax.core.goodput import Goodput
from mecefo_jax.core.programs import EVAL, FUSED, ProgramKey, RunPrograms
from mecefo_jax.core.takeover import Planner
from mecefo_jax.fault import evaluation
from mecefo_jax.fault.executor import AllSlicesDown, Executor
from mecefo_jax.model import contract
from mecefo_jax.model.bases import kind as basis_kind
from mecefo_jax.step import retarget, train_step
from mecefo_jax.step.cache import ProgramCache, Programs
from mecefo_jax.step.precompile import Precompile, Precompiler
from mecefo_jax.step.program_store import ProgramStore

__all__ = ['AllSlicesDown', 'Controller', 'SliceFailure']
log = logging.getLogger('mecefo')


class SliceFailure(RuntimeError):
  """One slice's failure, raised on the host by a `Controller.error_hooks` check before its
  work is dispatched (a health check of the user's): that slice fails in place and is taken
  over. A runtime error of XLA or a device is not one: nothing attributes it to a slice, so it
  ends the process, which the supervisor treats as a death (docs/tpu.md)."""

  def __init__(self, slice_: int, message: str = ''):
    super().__init__(message or f'slice {slice_} failed')
    self.slice = slice_


class Controller:
  """Runs each step on the live slices: the decider plans it, the executor runs the plan. It
  owns both, the program cache and the background builder.

  What the run layer asks of it (run/; tests/test_layout.py keeps it to this): `start` (the
  first step's programs built: `first_programs_s`, `first_programs`), `step`, `last_plan` and
  `last_built`, `fetch`, `evaluate`, `wait_for_steps`, the state and where it lives (`state`,
  `state_mesh`, `live`), what happened (`events`, `samples`, `stream_position`, `goodput`,
  `tokens_trained`, `step_memory`, `programs_report`, `dump_meta`), bookings (`book`,
  `exclude_from_steps`) and `settle` / `close`.
  """

  def __init__(self, cfg: Config, mesh, graphdef, corpus, schedule: FailureSchedule, state,
               n_slices: int | None = None, present: tuple[int, ...] | None = None,
               program_store: ProgramStore | None = None):
    """`n_slices`: the run's logical slice count N; `present`: the logical ids of `mesh`'s rows
    (default 0, 1, ...). The others are absent (no devices): failed until a later start.
    `program_store`: compiled programs kept across processes (step/program_store.py)."""
    self.cfg, self.corpus, self.schedule = cfg, corpus, schedule
    self.n_slices, self.micro_batch = n_slices or mesh.shape['slice'], cfg.train.micro_batch
    present = tuple(present or range(mesh.shape['slice']))
    planner = Planner.from_config(cfg, self.n_slices, granule=mesh.shape['fsdp'])
    run = RunPrograms.of(cfg, basis_kind(cfg).refresh is not None)
    self.decider = Decider(planner, run, schedule, cfg.mecefo.tau, present)
    self.decider.bases_step = _host_int(state.bases_step)
    slices = sharding.PresentSlices(mesh, present)
    move = retarget.enabled(cfg.train.move_programs,
                            verdicts=program_store.dir if program_store else None)
    self.programs = ProgramCache(cfg, slices, graphdef, lambda s: self._ledger.book('compile', s),
                                 move=move, program_store=program_store)
    self.executor = Executor(cfg, slices, self.programs, corpus, self.n_slices, state,
                             lambda bucket, s: self._ledger.book(bucket, s))
    # Host-side checks (slice, step) before a step's dispatch; an exception fails that slice.
    self.error_hooks: list[Callable[[int, int], None]] = []
    self.precompiler: Precompiler | None = None
    self._hosts: list[tuple[int, ...]] | None = None  # start_precompile
    self._deferred: list[tuple[int, ...]] | None = None  # hosts: the store's fill, once a step ran
    self._steps_run = 0  # by this start
    self.plans = PlanChain()
    self.last_plan: StepPlan | None = None  # the plan of the last step run
    self.last_built: tuple = ()  # the programs it waited for: ((key, how), ...)
    self.first_programs_s: float | None = None  # Controller.start: the first step's programs
    self.first_programs: dict[str, int] = {}  # ... by how each was built: {'loaded': 3}
    self.step_memory: dict = {}  # Controller.start: the fused step's memory per device

  @classmethod
  def start(cls, cfg: Config, presence, graphdef, corpus, schedule: FailureSchedule, state, *,
            meta: DeciderMeta | None = None, step: int = 0, all_down_at: int | None = None,
            program_store: ProgramStore | None = None) -> 'Controller':
    """The controller of a start at `step` (`meta`: the restored snapshot's decider state;
    `all_down_at`: every slice was down at that step), its first step's programs built: the
    fault-free step's, or at a start with slices down, the takeover's. Then, where
    faults.precompile says so, the programs one event away are built in the background."""
    self = cls(cfg, presence.mesh, graphdef, corpus, schedule, state, presence.n_slices,
               presence.ids, program_store)
    if meta is not None:
      self.load_meta(meta)
      self.decider.check_stream(step)
      self.apply_presence(step)
      if all_down_at is not None and step <= all_down_at:
        self.decider.devices_back_at = all_down_at  # a resume means every slice is back
    t0, before = time.perf_counter(), len(self.programs.built)
    fused = self.build_step_programs()
    self.first_programs_s = time.perf_counter() - t0
    self.first_programs = dict(collections.Counter(
        how for _, how, _ in self.programs.built[before:]))
    self.step_memory = train_step.memory_summary(fused) if fused else {}
    if self.wants_precompile() and multihost.is_multiprocess():
      # Filling the store for restarts waits for this start's first step: it would take the
      # cores of the first programs and step (the cold start's, and a restart's).
      self._deferred = presence.host_slices()
    elif self.wants_precompile():
      self.start_precompile()
    return self

  # --- what the rest of the run reads ---------------------------------------------------------
  @property
  def state(self):
    return self.executor.state

  @property
  def state_slices(self) -> tuple[int, ...]:
    return self.executor.state_slices

  def submesh(self, slices):
    return self.executor.submesh(slices)

  @property
  def state_mesh(self):
    """The mesh of the slices that hold the state now."""
    return self.submesh(self.state_slices)

  @property
  def _ledger(self) -> Goodput:
    return self.decider.state.goodput

  @property
  def goodput(self) -> dict:
    return self._ledger.seconds

  @property
  def events(self) -> list[dict]:
    return self.decider.state.events

  @property
  def samples(self):
    return self.decider.state.samples

  @property
  def failed(self) -> set[int]:
    return self.decider.state.failed

  @failed.setter
  def failed(self, slices) -> None:
    self.decider.state.failed = set(slices)

  def live(self) -> tuple[int, ...]:
    return self.decider.live()

  def tokens_trained(self) -> int:
    """Tokens of every row processed so far, exact or degraded (resumed runs: all starts)."""
    return (self.samples.get('exact', 0) + self.samples.get('degraded', 0)) * self.cfg.model.seq_len

  def fetch(self, metrics, stop: bool | None = None) -> tuple[dict, bool]:
    """(a step's metrics on the host, whether the job voted to stop): waits for the step. With
    several processes a collective carrying `stop`, this process's vote."""
    values = multihost.fetch(metrics, self.state_mesh, stop=stop)
    return values, bool(values.pop('stop', 0.0))

  def book(self, bucket: str, seconds: float) -> None:
    """`seconds` into goodput's `bucket` (core/goodput.py), e.g. a restart's."""
    self._ledger.book(bucket, seconds)

  def wait_for_steps(self) -> None:
    """Waits for the steps dispatched so far: host work timed after it (an eval) is not
    charged their time."""
    jax.block_until_ready(self.state)

  def exclude_from_steps(self, seconds: float) -> None:
    """`seconds` spent outside steps (an eval): no step's time in the goodput ledger."""
    self._ledger.exclude(seconds)

  def settle(self) -> None:
    """Waits for the programs being built in the background (a test's death lands alike)."""
    if self.precompiler:
      self.precompiler.wait()

  def close(self) -> None:
    if self.precompiler:
      self.precompiler.stop()

  # --- one step ----------------------------------------------------------------------------
  def step(self, step: int, wall_s: float = 0.0) -> dict:
    """Runs training step `step`; returns its metrics (device scalars). `last_plan` is then its
    plan, `last_built` the programs it waited for: ((key, how), ...)."""
    before = len(self.programs.built)
    if self._deferred is not None and self._steps_run:
      hosts, self._deferred = self._deferred, None
      self.start_precompile(hosts)
    self._steps_run += 1
    try:
      return self._step(step, wall_s)
    finally:
      self.last_built = tuple((key, how) for key, how, ahead in self.programs.built[before:]
                              if not ahead)

  def _step(self, step: int, wall_s: float) -> dict:
    placements, changed = self.decider.advance(step, wall_s)
    for live in placements:
      self.executor.place(live)
    if self.precompiler and changed and self.live():
      self._want_ahead()
    while True:
      live = self.live()
      if not live:
        raise AllSlicesDown(
            f'all {self.n_slices} slices are down at step {step}; nothing can run')
      try:
        self._run_hooks(step, live)
        return self._timed(step)
      except SliceFailure as err:
        if err.slice not in live:
          raise  # not a live slice: failing it again would change nothing and retry forever
        self.decider.apply(FailureEvent(step, err.slice, 'fail', f'error: {err}'), wall_s)

  def _run_hooks(self, step: int, live: tuple[int, ...]) -> None:
    """Any error a hook raises while dispatching slice s's work is a failure of slice s."""
    for s in live:
      for hook in self.error_hooks:
        try:
          hook(s, step)
        except SliceFailure:
          raise
        except Exception as err:  # noqa: BLE001 -- attributed to the slice, not swallowed
          raise SliceFailure(s, f'slice {s}: {type(err).__name__}: {err}') from err

  def _timed(self, step: int) -> dict:
    """Decides, runs and books the step's wall time in the goodput ledger."""
    self._ledger.start_step()
    plan = self.last_plan = self.decider.decide(step)
    self.plans.add(plan)
    self.decider.commit(plan)
    metrics = self.executor.run(plan)
    if self.failed:
      jax.block_until_ready(metrics)  # a step under failure is booked by what it processed
    self._ledger.end_step(plan.processed, self.n_slices * self.micro_batch, bool(self.failed))
    return metrics

  # --- programs ----------------------------------------------------------------------------
  def build_step_programs(self):
    """Builds the programs a step on the live slices runs now (with its basis refresh where
    it runs degraded work); returns the fused one, if it is."""
    live = self.live()
    if not live:
      return None
    keys = [k for k in self.decider.programs_for(live) if k.kind.stage != 'eval']
    built = [self.programs.program(key) for key in keys]
    return built[0] if keys[0].kind is FUSED else None

  def evaluate(self, n_batches: int) -> float:
    """Mean token loss on `n_batches` batches of fixed held-out rows (fault/evaluation.py)."""
    return evaluation.held_out_loss(self, n_batches)

  def evaluator(self, live):
    """The forward-only `(params, tokens) -> mean loss` program on `live`."""
    return self.programs.program(ProgramKey(EVAL, live))

  def wants_precompile(self) -> bool:
    """faults.precompile: auto = on where the host CPU is idle during steps (GPU/TPU), and in
    a job of several processes: there it fills the program store for restarts, once per
    program shape (needs moves and a store)."""
    mode = self.cfg.faults.precompile
    if multihost.is_multiprocess() and not (self.programs.move and self.programs.store):
      return False
    if mode == 'auto':
      return jax.devices()[0].platform != 'cpu' or multihost.is_multiprocess()
    return mode == 'always'

  def start_precompile(self, hosts: list[tuple[int, ...]] | None = None) -> None:
    """Builds, in the background, the programs of every live set one event away, likeliest
    first: compiles of shapes not built yet, moves of the others (at most
    faults.precompile_max programs kept ahead of need). With several processes (`hosts`: the
    slices of each present host) a process cannot build programs in a thread of its own (they
    vote on each: step/cache.py); it compiles instead, into the program store only, the
    programs of the job that restarts with the survivors of each host's death."""
    self._hosts = hosts
    self.precompiler = Precompiler(self.store_live_set if hosts else self.build_live_set)
    self._want_ahead()

  def _want_ahead(self) -> None:
    """Queues the live sets one event away; drops the programs built ahead for sets that are
    no longer one event away."""
    live_sets = list(self.decider.next_live_sets(self._hosts))
    if not self._hosts:
      keep = {k for s in (self.live(), *live_sets) for k in self.decider.programs_for(s)}
      self.programs.evict_ahead(keep)
    self.precompiler.want(live_sets)

  def store_live_set(self, live: tuple[int, ...]) -> None:
    """Compiles into the program store the programs of `live` of shapes it lacks (until the
    run ends: a restart compiles what is left). The processes split them by claims: each
    first compiles those no peer claimed, then waits for its peers' (or takes over a dead
    one's), so that a process's 'background builds done' means the store holds them all."""
    stopping = lambda: bool(self.precompiler and self.precompiler.stopping)
    keys = self.decider.programs_for(live)
    claimed = [key for key in keys if not stopping() and not self.programs.prepare(key)]
    for key in claimed:
      if not stopping():
        self.programs.prepare(key, give_up=stopping)

  def build_live_set(self, live: tuple[int, ...]) -> None:
    """Builds every program steps on `live` request, while fewer than faults.precompile_max
    are kept ahead of need."""
    limit = self.cfg.faults.precompile_max
    for key in self.decider.programs_for(live):
      if key not in self.programs.keys():
        if limit and len(self.programs.ahead) >= limit:
          return
        self.programs.program(key, ahead=True)

  def programs_report(self, other_compiles: int,
                      other_compile_s: float) -> tuple[Precompile, Programs, Plans]:
    """report.json's `precompile`, `programs` and `plans` sections; `other_compiles` and their
    seconds: the XLA compiles of this process outside the programs (eager ops, conversions)."""
    cache = self.programs
    programs = Programs(**dataclasses.asdict(cache.stats), move=cache.move,
                        store=cache.store and str(cache.store.dir), scan_unroll=contract.SCAN_UNROLL,
                        other_compiles=other_compiles, other_compile_s=other_compile_s)
    precompile = self.precompiler.summary() if self.precompiler else Precompile()
    return precompile, programs, self.plans.summary()

  # --- snapshot / resume ---------------------------------------------------------------------
  def dump_meta(self) -> DeciderMeta:
    """The decider's state as a snapshot's meta carries it."""
    return self.decider.state.to_meta()

  def load_meta(self, meta: DeciderMeta) -> None:
    """Restores dump_meta() output; the state was just restored onto every slice."""
    self.decider.state = DeciderState.from_meta(meta)
    self.decider.held = self.executor.state_slices = self.decider.present
    self.decider.bases_step = _host_int(self.state.bases_step)

  def stream_position(self) -> int:
    """The samples of the stream trained (or, under a step-indexed policy, counted) so far."""
    return self.decider.stream_position()

  def apply_presence(self, step: int) -> None:
    self.decider.apply_presence(step)

  # --- checks ------------------------------------------------------------------------------
  def replica_hashes(self) -> dict[int, str]:
    return self.executor.replica_hashes()


class PlanChain:
  """A running hash of every step's plan; with several processes, each new kind of plan (its
  live set, programs, refresh or rejoin changed) is checked to be the same on every process."""

  def __init__(self):
    self.steps, self.digest, self._last = 0, '', None

  def add(self, plan: StepPlan) -> None:
    self.steps += 1
    self.digest = hashlib.sha256((self.digest + plan.digest()).encode()).hexdigest()[:16]
    shape = (plan.live, plan.programs, plan.refresh, plan.rejoins)
    if shape != self._last and multihost.is_multiprocess():
      mine = plan.digest()
      digests = multihost.allgather_json(mine)
      if any(d != mine for d in digests):
        raise RuntimeError(f'the processes planned step {plan.step} differently (plan digests '
                           f'{digests}): their failure schedules or configs differ')
    self._last = shape

  def summary(self) -> Plans:
    return Plans(steps=self.steps, digest=self.digest)


def _host_int(x: jax.Array) -> int:
  """A replicated device scalar on the host (from a local shard: works in every process)."""
  return int(np.asarray(x.addressable_shards[0].data))
