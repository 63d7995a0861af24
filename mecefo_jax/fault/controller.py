"""Host controller: per step, the live slices, their roles, where every micro-batch goes."""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable

import jax
import numpy as np

from mecefo_jax import multihost, sharding
from mecefo_jax.config import Config
from mecefo_jax.data import order
from mecefo_jax.fault.failures import FailureEvent, FailureSchedule, apply_event
from mecefo_jax.fault.goodput import Goodput
from mecefo_jax.model.bases import kind as basis_kind
from mecefo_jax.model.train_state import params_sha256, state_shardings
from mecefo_jax.plan.roles import Role
from mecefo_jax.plan.takeover import Planner, SliceWork
from mecefo_jax.step import retarget, slice_steps, train_step
from mecefo_jax.step.cache import ProgramCache, step_keys
from mecefo_jax.step.precompile import Precompiler, next_live_sets
from mecefo_jax.step.store import ProgramStore

log = logging.getLogger('mecefo')

class SliceFailure(RuntimeError):
  """Raised (e.g. by an error hook) while dispatching or running one slice's work."""

  def __init__(self, slice_: int, message: str = ''):
    super().__init__(message or f'slice {slice_} failed')
    self.slice = slice_


class AllSlicesDown(RuntimeError):
  pass


class Controller:
  """Owns the train state and runs each step on the live slices with the takeover policy."""

  def __init__(self, cfg: Config, mesh, graphdef, corpus, schedule: FailureSchedule, state,
               n_slices: int | None = None, present: tuple[int, ...] | None = None,
               program_store: ProgramStore | None = None):
    """`n_slices`: the run's logical slice count N; `present`: the logical ids of `mesh`'s rows
    (default 0, 1, ...). The others are absent (no devices): failed until a later start.
    `program_store`: compiled programs kept across processes (step/store.py)."""
    self.cfg, self.mesh, self.graphdef, self.corpus = cfg, mesh, graphdef, corpus
    self.n_slices, self.micro_batch = n_slices or mesh.shape['slice'], cfg.train.micro_batch
    self.present = tuple(present or range(mesh.shape['slice']))
    slices = sharding.PresentSlices(mesh, self.present)
    self.submesh = slices.sub  # logical slice ids -> the mesh of their devices
    self.schedule, self.policy = schedule, cfg.faults.takeover
    self.planner = Planner.from_config(cfg, self.n_slices, granule=mesh.shape['fsdp'])
    self.state, self.state_slices = state, self.present
    self.failed: set[int] = set()
    self.error_hooks: list[Callable[[int, int], None]] = []  # (slice, step); may raise
    self.events: list[dict] = []
    self.ledger = Goodput()
    self.samples = collections.Counter()  # exact / degraded / dropped sample counts
    self.programs = ProgramCache(cfg, slices, graphdef, lambda s: self.ledger.book('compile', s),
                                 move=retarget.enabled(cfg.train.move_programs),
                                 program_store=program_store)
    self.precompiler: Precompiler | None = None
    self._hosts: list[tuple[int, ...]] | None = None  # start_precompile
    self._bases_step = _host_int(state.bases_step)
    self._refreshed = basis_kind(cfg).refresh is not None  # svd: bases kept, refreshed every tau
    self.devices_back_at: int | None = None  # resumed after every slice was down at this step

  # --- failure state -------------------------------------------------------------------------
  def live(self) -> tuple[int, ...]:
    return tuple(s for s in range(self.n_slices) if s not in self.failed)

  def _apply(self, event: FailureEvent, wall_s: float) -> None:
    if event.kind == 'repair' and event.slice in self.failed and event.slice not in self.present:
      log.warning('step %d: slice %d cannot be repaired here (%s): its devices are absent; '
                  'it rejoins at a start with them present', event.step, event.slice, event.source)
      return
    if not apply_event(self.failed, event.kind, event.slice):
      return  # no change (already failed / not failed)
    self.events.append({**event.to_dict(), 'wall_s': wall_s, 'live': len(self.live())})
    log.warning('step %d: slice %d %s (%s); live slices %s', event.step, event.slice,
                'FAILED' if event.kind == 'fail' else 'repaired, rejoining', event.source,
                list(self.live()))

  # --- programs ----------------------------------------------------------------------------
  @property
  def goodput(self) -> dict:
    return self.ledger.seconds

  def wants_precompile(self) -> bool:
    """faults.precompile: auto = on where the host CPU is idle during steps (GPU/TPU). With
    several processes it fills the program store for restarts: needs moves and a store."""
    mode = self.cfg.faults.precompile
    if multihost.is_multiprocess() and not (self.programs.move and self.programs.store):
      return False
    if mode == 'auto':
      return jax.devices()[0].platform != 'cpu'
    return mode == 'always'

  def start_precompile(self, hosts: list[tuple[int, ...]] | None = None) -> None:
    """Builds, in the background, the programs of every live set one event away. With several
    processes (`hosts`: the slices of each present host) a process cannot build programs in a
    thread of its own (they vote on each: step/cache.py); it compiles instead, into the program
    store only, the programs of the job that restarts with the survivors of each host's death,
    which that job then loads."""
    self._hosts = hosts
    self.precompiler = Precompiler(self.store_live_set if hosts else self.compile_live_set)
    self.precompiler.want(self._next_live_sets())

  def _next_live_sets(self) -> list[tuple[int, ...]]:
    if self._hosts:  # the survivors of a host's death
      live = self.live()
      return [s for s in (tuple(x for x in live if x not in h) for h in self._hosts) if s]
    return [s for s in next_live_sets(self.live(), self.n_slices) if set(s) <= set(self.present)]

  def store_live_set(self, live: tuple[int, ...]) -> None:
    """Compiles into the program store the programs of `live` of shapes it lacks."""
    for key in self._program_keys(live):
      self.programs.prepare(*key)

  def compile_live_set(self, live: tuple[int, ...]) -> None:
    """Builds (and caches) every program a step on `live` runs, and the eval program when evals
    run between steps (train.eval_every); where programs move, only those of shapes not built
    yet: the others are moved in a tenth of a second when `live` is met."""
    for key in self._program_keys(live):
      if not self.programs.has_shape(key):
        self.programs.program(*key)

  def _program_keys(self, live: tuple[int, ...]) -> list[tuple]:
    """In the order a failure needs them: the step's, the basis refreshes, the eval."""
    roles = self.planner.plan(live).roles
    keys = step_keys(live, roles, self.cfg.mesh.ordered_reduce)
    if self._refreshed and any(r.degraded for r in roles.values()):
      keys.append(('refresh', live, False))  # the first refresh, or mecefo.refresh=full
      if self.cfg.mecefo.refresh == 'warm':
        keys.append(('refresh', live, True))
    return keys + ([('eval', live)] if self.cfg.train.eval_every else [])

  def build_step_programs(self):
    """Builds the programs a step on the live slices runs (with the basis refreshes where it
    runs degraded work); returns the fused one, if it is."""
    live = self.live()
    if not live:
      return None
    keys = [key for key in self._program_keys(live) if key[0] != 'eval']  # the step's first
    programs = [self.programs.program(*key) for key in keys]
    return programs[0] if keys[0][0] == 'fused' else None

  def programs_report(self) -> dict:
    """report.json's `precompile` and `programs` sections."""
    return {'precompile': (self.precompiler.summary() if self.precompiler else
                           {'enabled': False, 'live_sets': 0, 'seconds': 0.0}),
            'programs': {'move': self.programs.move, **self.programs.stats,
                         'store': self.programs.store and str(self.programs.store.dir)}}

  def evaluator(self, live):
    """The forward-only `(params, tokens) -> mean loss` program on `live`."""
    return self.programs.program('eval', live)

  # --- state placement ---------------------------------------------------------------------
  def _place_state(self, live: tuple[int, ...]) -> None:
    """Move the state onto exactly the live slices: a view when shrinking, a copy on rejoin."""
    if live == self.state_slices:
      return
    keep = tuple(s for s in self.state_slices if s in live)
    if not keep:
      raise AllSlicesDown(
          f'no live slice holds the training state: slices {list(self.state_slices)} held it '
          f'and are all down')
    if keep != self.state_slices:
      self.state = slice_steps.state_view(self.cfg, self.state, self.submesh(keep))
    if keep != live:
      # Rejoin: the repaired slices receive the current state from live peers.
      t0 = time.perf_counter()
      target = state_shardings(self.cfg, self.submesh(live))
      if multihost.is_multiprocess():
        copy = self.programs.get(('rejoin', keep, live),
                                 lambda: multihost.compile_rejoin(target, live.index(keep[0])))
        self.state = copy(multihost.stack_for_rejoin(self.state, target))
      else:
        self.state = jax.device_put(self.state, target)
      self.state = jax.block_until_ready(self.state)
      self.ledger.book('rejoin', time.perf_counter() - t0)
    self.state_slices = live

  # --- one step ----------------------------------------------------------------------------
  def step(self, step: int, wall_s: float = 0.0) -> dict:
    """Runs training step `step`; returns its metrics (device scalars)."""
    events = self.schedule.events_at(step)  # repairs first
    for event in events:
      if event.kind == 'fail' and not set(self.live()) <= set(self.state_slices):
        # A step's repairs take effect before its failures: the repaired slices receive the
        # state now, so a peer failing in this same step can still hand it over.
        self._place_state(self.live())
      self._apply(event, wall_s)
    if step == self.devices_back_at:
      self._devices_back(step, wall_s)
    if self.precompiler and events and self.live():
      self.precompiler.want(self._next_live_sets())
    while True:
      live = self.live()
      if not live:
        raise AllSlicesDown(
            f'all {self.n_slices} slices are down at step {step}; nothing can run')
      try:
        self._run_hooks(step, live)
        return self._timed(step, live)
      except SliceFailure as err:
        if err.slice not in live:
          raise  # not a live slice: failing it again would change nothing and retry forever
        self._apply(FailureEvent(step, err.slice, 'fail', f'error: {err}'), wall_s)

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

  def _timed(self, step: int, live: tuple[int, ...]) -> dict:
    """Runs the step and books its wall time in the goodput ledger."""
    self.ledger.start_step()
    metrics, processed = self._run(step, live)
    if self.failed:
      jax.block_until_ready(metrics)  # a step under failure is booked by what it processed
    self.ledger.end_step(processed, self.n_slices * self.micro_batch, bool(self.failed))
    return metrics

  def _run(self, step: int, live: tuple[int, ...]) -> tuple[dict, int]:
    plan = self.planner.plan(live)
    ids_SxB = order.sample_ids(step, self.n_slices, self.micro_batch)
    processed = self._account(plan.work, plan.dropped)
    self._place_state(live)
    if any(r.degraded for r in plan.roles.values()):
      self._maybe_refresh_bases(step, live)
    programs = self.programs.step_programs(live, plan.roles)
    if programs.fused is None:
      return self._run_groups(live, programs, plan.work, ids_SxB), processed
    metrics = None  # where this process holds no live slice (multi-process): nothing to run
    if multihost.is_local(self.submesh(live)):
      role = plan.roles[live[0]]
      self.state, metrics = programs.fused(self.state, self._batch(ids_SxB, plan.work, live, role))
    return metrics, processed

  def _batch(self, ids_SxB, work, slices, role: Role) -> jax.Array:
    """Tokens of `slices` on their devices; each process makes only the rows it holds."""
    mesh = self.submesh(slices)
    return multihost.put_batch(lambda i: self._tokens(ids_SxB, work[slices[i]]),
                               train_step.batch_shape(self.cfg, len(slices), role),
                               sharding.batch_sharding(mesh))

  def _run_groups(self, live, programs, work, ids_SxB) -> dict:
    outputs = []
    for role, slices, program in programs.groups:
      if not multihost.is_local(self.submesh(slices)):
        continue  # multi-process: another process runs this group
      state_view = slice_steps.state_view(self.cfg, self.state, self.submesh(slices))
      outputs.append(program(state_view, self._batch(ids_SxB, work, slices, role)))
    if not outputs:
      return None
    # Each slice's sums stay on its devices; the stack over the live mesh places them by device.
    sums = slice_steps.stack_groups(outputs, self.cfg, self.submesh(live))
    self.state, metrics = programs.update(self.state, sums)
    return metrics

  def _tokens(self, ids_SxB, w: SliceWork) -> np.ndarray:
    ids = [ids_SxB[r.owner, r.start:r.stop] for r in (*w.exact, *w.degraded)]
    return self.corpus.sequences(np.concatenate(ids))

  def _account(self, work, dropped) -> int:
    """Counts samples by how they were processed; returns how many were processed."""
    processed = 0
    for w in work.values():
      exact, degraded = w.counts()
      self.samples['exact'] += exact
      self.samples['degraded'] += degraded
      processed += exact + degraded
    self.samples['dropped'] += sum(r.n for r in dropped)
    return processed

  def _maybe_refresh_bases(self, step: int, live) -> None:
    """svd bases are recomputed every tau steps, and only when degraded work runs: from scratch
    the first time, then warm-started from the last bases unless mecefo.refresh=full."""
    mc = self.cfg.mecefo
    if not self._refreshed:
      return
    if self._bases_step < 0 or step - self._bases_step >= mc.tau:
      warm = mc.refresh == 'warm' and self._bases_step >= 0
      refresh = self.programs.program('refresh', live, warm)
      if multihost.is_local(self.submesh(live)):
        self.state = refresh(self.state)
      self._bases_step = step

  # --- snapshot / resume ---------------------------------------------------------------------
  def dump_meta(self) -> dict:
    """The controller's host state as JSON-able data (saved with every snapshot)."""
    return {'failed': sorted(self.failed), 'events': self.events, 'goodput': self.ledger.seconds,
            'samples': dict(self.samples)}

  def load_meta(self, meta: dict) -> None:
    """Restores dump_meta() output; the state was just restored onto every slice."""
    self.failed = set(meta['failed'])
    self.events, self.ledger = list(meta['events']), Goodput(meta['goodput'])
    self.samples = collections.Counter(meta['samples'])
    self.state_slices = self.present
    self._bases_step = _host_int(self.state.bases_step)

  def apply_presence(self, step: int) -> None:
    """At a start: slices without devices fail ('absent') from `step` on; absent ones whose
    devices are back rejoin ('present'), as after a repair. The schedule cannot repair an
    absent slice (no devices): its repairs wait for a later start."""
    for s in range(self.n_slices):
      if s not in self.present:
        self._apply(FailureEvent(step, s, 'fail', 'absent'), 0.0)
      elif s in self.failed and self._last_source(s) == 'absent':
        self._apply(FailureEvent(step, s, 'repair', 'present'), 0.0)

  def _last_source(self, s: int) -> str | None:
    return next((e['source'] for e in reversed(self.events) if e['slice'] == s), None)

  def _devices_back(self, step: int, wall_s: float) -> None:
    """The run stopped at `step` with every slice down and was resumed: all are back now."""
    for s in sorted(self.failed):
      self._apply(FailureEvent(step, s, 'repair', 'resume'), wall_s)

  # --- checks ------------------------------------------------------------------------------
  def replica_hashes(self) -> dict[int, str]:
    """params_sha256 of the params held by each live slice (bit-identical replicas hash equal)."""
    view = lambda s: slice_steps.state_view(self.cfg, self.state, self.submesh((s,)))
    return {s: params_sha256(view(s).params) for s in self.state_slices}


def _host_int(x: jax.Array) -> int:
  """A replicated device scalar on the host (from a local shard: works in every process)."""
  return int(np.asarray(x.addressable_shards[0].data))
