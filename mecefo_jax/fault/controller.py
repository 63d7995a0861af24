"""Host controller: per step, the live slices, their roles, where every micro-batch goes."""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import jax
import numpy as np

from mecefo_jax import multihost, sharding
from mecefo_jax.config import Config
from mecefo_jax.data import order
from mecefo_jax.fault import takeover
from mecefo_jax.fault.failures import FailureEvent, FailureSchedule
from mecefo_jax.model.train_state import params_sha256, state_shardings
from mecefo_jax.step import slice_steps, train_step
from mecefo_jax.step.precompile import Precompiler, next_live_sets

log = logging.getLogger('mecefo')

# Time categories of the goodput breakdown (seconds).
GOODPUT_KEYS = ('normal_productive', 'degraded_productive', 'compile', 'rejoin', 'lost')


class SliceFailure(RuntimeError):
  """Raised (e.g. by an error hook) while dispatching or running one slice's work."""

  def __init__(self, slice_: int, message: str = ''):
    super().__init__(message or f'slice {slice_} failed')
    self.slice = slice_


class AllSlicesDown(RuntimeError):
  pass


class Controller:
  """Owns the train state and runs each step on the live slices with the takeover policy."""

  def __init__(self, cfg: Config, mesh, graphdef, corpus, schedule: FailureSchedule, state):
    self.cfg, self.mesh, self.graphdef, self.corpus = cfg, mesh, graphdef, corpus
    self.n_slices, self.micro_batch = mesh.shape['slice'], cfg.train.micro_batch
    self.schedule, self.policy = schedule, cfg.faults.takeover
    self.max_rows = cfg.faults.max_degraded_rows or 2 * self.micro_batch
    self.state, self.state_slices = state, tuple(range(self.n_slices))
    self.failed: set[int] = set()
    self.error_hooks: list[Callable[[int, int], None]] = []  # (slice, step); may raise
    self.events: list[dict] = []
    self.goodput = dict.fromkeys(GOODPUT_KEYS, 0.0)
    self.samples = collections.Counter()  # exact / degraded / dropped sample counts
    self._programs: dict = {}
    self._compile_lock = threading.Lock()
    self._training_thread = threading.get_ident()
    self.precompiler: Precompiler | None = None
    self._bases_step = _host_int(state.bases_step)
    self._last_end: float | None = None
    self.devices_back_at: int | None = None  # resumed after every slice was down at this step

  # --- failure state -------------------------------------------------------------------------
  def live(self) -> tuple[int, ...]:
    return tuple(s for s in range(self.n_slices) if s not in self.failed)

  def _apply(self, event: FailureEvent, wall_s: float) -> None:
    if event.kind == 'fail' and event.slice not in self.failed:
      self.failed.add(event.slice)
    elif event.kind == 'repair' and event.slice in self.failed:
      self.failed.discard(event.slice)
    else:
      return  # no change (already failed / not failed)
    self.events.append({**event.to_dict(), 'wall_s': wall_s, 'live': len(self.live())})
    log.warning('step %d: slice %d %s (%s); live slices %s', event.step, event.slice,
                'FAILED' if event.kind == 'fail' else 'repaired, rejoining', event.source,
                list(self.live()))

  # --- programs ----------------------------------------------------------------------------
  def program(self, key, build):
    """The compiled program cached under `key`, built once. The training thread's compile
    time (waits for a background precompile included) is booked; the precompiler's is not."""
    program = self._programs.get(key)
    if program is None:
      t0 = time.perf_counter()
      with self._compile_lock:  # one compile at a time; the loser of a race reuses the result
        program = self._programs.get(key)
        if program is None:
          program = self._programs[key] = build()
      if threading.get_ident() == self._training_thread:
        self.goodput['compile'] += time.perf_counter() - t0
    return program

  def start_precompile(self) -> None:
    """Compiles, in the background, the programs of every live set one event away."""
    self.precompiler = Precompiler(self.compile_live_set)
    self.precompiler.want(next_live_sets(self.live(), self.n_slices))

  def compile_live_set(self, live: tuple[int, ...]) -> None:
    """Compiles (and caches) every program a step on `live` runs, as `_run` would ask, and
    the eval program when evals run between steps (train.eval_every)."""
    if self.cfg.train.eval_every:
      self.evaluator(live)
    _, _, roles = self._plan(live)
    if self.cfg.mecefo.basis == 'svd' and any(r.degraded for r in roles.values()):
      self._refresh(live, warm=False)  # the first refresh of a run, or mecefo.refresh=full
      if self.cfg.mecefo.refresh == 'warm':
        self._refresh(live, warm=True)
    if self._fused_path(roles):
      self.fused(live, roles[live[0]])
      return
    for role, slices in _role_groups(live, roles).items():
      self._group(slices, role)
    self._update(live)

  def fused(self, live, role):
    """The one-program SPMD step for slices that all play `role` (the fault-free path)."""
    mesh = sharding.submesh(self.mesh, live)
    return self.program(('fused', live, role),
                         lambda: train_step.compile_step(self.cfg, mesh, role, self.graphdef))

  def evaluator(self, live):
    """The forward-only `(params, tokens) -> mean loss` program on `live`."""
    mesh = sharding.submesh(self.mesh, live)
    return self.program(('eval', live), lambda: train_step.compile_eval(
        self.cfg, mesh, self.micro_batch, self.graphdef))

  def _group(self, slices, role):
    mesh = sharding.submesh(self.mesh, slices)
    return self.program(('group', slices, role),
                         lambda: slice_steps.compile_group(self.cfg, mesh, role, self.graphdef))

  def _update(self, live):
    mesh = sharding.submesh(self.mesh, live)
    return self.program(('update', live), lambda: slice_steps.compile_update(self.cfg, mesh))

  def _refresh(self, live, warm: bool):
    mesh = sharding.submesh(self.mesh, live)
    return self.program(('refresh', live, warm),
                        lambda: train_step.compile_refresh(self.cfg, mesh, warm))

  # --- state placement ---------------------------------------------------------------------
  def _place_state(self, live: tuple[int, ...]) -> None:
    """Move the state onto exactly the live slices: a view when shrinking, a copy on rejoin."""
    if live == self.state_slices:
      return
    keep = tuple(s for s in self.state_slices if s in live)
    if not keep:
      raise AllSlicesDown(
          f'no live slice holds the training state: slices {list(self.state_slices)} held it '
          f'and are all down. Resume from the newest snapshot with `python train.py --resume`.')
    if keep != self.state_slices:
      self.state = slice_steps.state_view(self.cfg, self.state, self.mesh, keep)
    if keep != live:
      # Rejoin: the repaired slices receive the current state from live peers.
      t0 = time.perf_counter()
      target = state_shardings(self.cfg, sharding.submesh(self.mesh, live))
      if multihost.is_multiprocess():
        copy = self.program(('rejoin', keep, live),
                            lambda: multihost.compile_rejoin(target, live.index(keep[0])))
        self.state = copy(multihost.stack_for_rejoin(self.state, target))
      else:
        self.state = jax.device_put(self.state, target)
      self.state = jax.block_until_ready(self.state)
      self.goodput['rejoin'] += time.perf_counter() - t0
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
      self.precompiler.want(next_live_sets(self.live(), self.n_slices))
    while True:
      live = self.live()
      if not live:
        raise AllSlicesDown(
            f'all {self.n_slices} slices are down at step {step}; nothing can run. The state of '
            f'step {step} is the last one trained; resume with `python train.py --resume` '
            'when devices return.')
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
    """Runs the step and books its wall time (minus compile and rejoin) by category."""
    start = self._last_end if self._last_end is not None else time.perf_counter()
    overhead = self.goodput['compile'] + self.goodput['rejoin']
    metrics, processed = self._run(step, live)
    if self.failed:
      # Steps under failure keep training: degraded-productive, except what `drop` skips.
      jax.block_until_ready(metrics)
    self._last_end = time.perf_counter()
    spent = self._last_end - start - (self.goodput['compile'] + self.goodput['rejoin'] - overhead)
    total_rows = self.n_slices * self.micro_batch
    if not self.failed:
      self.goodput['normal_productive'] += spent
    else:
      self.goodput['degraded_productive'] += spent * processed / total_rows
      self.goodput['lost'] += spent * (total_rows - processed) / total_rows
    return metrics

  def _run(self, step: int, live: tuple[int, ...]) -> tuple[dict, int]:
    work, dropped, roles = self._plan(live)
    ids_SxB = order.sample_ids(step, self.n_slices, self.micro_batch)
    processed = self._account(work, dropped)
    self._place_state(live)
    if any(r.degraded for r in roles.values()):
      self._maybe_refresh_bases(step, live)
    if self._fused_path(roles):
      role = roles[live[0]]
      program = self.fused(live, role)
      metrics = None  # where this process holds no live slice (multi-process): nothing to run
      if multihost.is_local(sharding.submesh(self.mesh, live)):
        self.state, metrics = program(self.state, self._batch(ids_SxB, work, live, role))
    else:
      metrics = self._run_groups(live, roles, work, ids_SxB)
    return metrics, processed

  def _batch(self, ids_SxB, work, slices, role: train_step.Role) -> jax.Array:
    """Tokens of `slices` on their devices; each process makes only the rows it holds."""
    mesh = sharding.submesh(self.mesh, slices)
    return multihost.put_batch(lambda i: self._tokens(ids_SxB, work[slices[i]]),
                               train_step.batch_shape(self.cfg, len(slices), role),
                               sharding.batch_sharding(mesh))

  def _plan(self, live):
    """(work, dropped rows, role of every live slice) of a step on `live`."""
    work, dropped = takeover.plan(live, self.n_slices, self.micro_batch, self.policy,
                                  self.mesh.shape['fsdp'], self.cfg.faults.degraded_cost)
    return work, dropped, {s: self._role(w) for s, w in work.items()}

  def _fused_path(self, roles) -> bool:
    """All live slices play one single-pass role: one SPMD program (no failure: the normal step)."""
    uniform = len(set(roles.values())) == 1 and next(iter(roles.values())).passes == 1
    return uniform and not self.cfg.mesh.ordered_reduce

  def _run_groups(self, live, roles, work, ids_SxB) -> dict:
    outputs = []
    for role, slices in _role_groups(live, roles).items():
      program = self._group(slices, role)
      if not multihost.is_local(sharding.submesh(self.mesh, slices)):
        continue  # multi-process: another process runs this group
      state_view = slice_steps.state_view(self.cfg, self.state, self.mesh, slices)
      outputs.append(program(state_view, self._batch(ids_SxB, work, slices, role)))
    # Each slice's sums stay on its devices; the stack over the live mesh places them by device.
    live_mesh = sharding.submesh(self.mesh, live)
    update = self._update(live)
    if not outputs:
      return None
    sums = slice_steps.stack_groups(outputs, self.cfg, live_mesh)
    self.state, metrics = update(self.state, sums)
    return metrics

  def _role(self, w: takeover.SliceWork) -> train_step.Role:
    exact, degraded = w.counts()
    return train_step.Role(exact, degraded, train_step.split_passes(degraded, self.max_rows))

  def _tokens(self, ids_SxB, w: takeover.SliceWork) -> np.ndarray:
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
    if mc.basis != 'svd':
      return
    if self._bases_step < 0 or step - self._bases_step >= mc.tau:
      refresh = self._refresh(live, warm=mc.refresh == 'warm' and self._bases_step >= 0)
      if multihost.is_local(sharding.submesh(self.mesh, live)):
        self.state = refresh(self.state)
      self._bases_step = step

  # --- snapshot / resume ---------------------------------------------------------------------
  def dump_meta(self) -> dict:
    """The controller's host state as JSON-able data (saved with every snapshot)."""
    return {'failed': sorted(self.failed), 'events': self.events, 'goodput': self.goodput,
            'samples': dict(self.samples)}

  def load_meta(self, meta: dict) -> None:
    """Restores dump_meta() output; the state was just restored onto every slice."""
    self.failed = set(meta['failed'])
    self.events, self.goodput = list(meta['events']), dict(meta['goodput'])
    self.samples = collections.Counter(meta['samples'])
    self.state_slices = tuple(range(self.n_slices))
    self._bases_step, self._last_end = _host_int(self.state.bases_step), None

  def _devices_back(self, step: int, wall_s: float) -> None:
    """The run stopped at `step` with every slice down and was resumed: all are back now."""
    for s in sorted(self.failed):
      self._apply(FailureEvent(step, s, 'repair', 'resume'), wall_s)

  # --- checks ------------------------------------------------------------------------------
  def replica_hashes(self) -> dict[int, str]:
    """params_sha256 of the params held by each live slice (bit-identical replicas hash equal)."""
    return {s: params_sha256(slice_steps.state_view(self.cfg, self.state, self.mesh, (s,)).params)
            for s in self.state_slices}


def _role_groups(live, roles) -> dict[train_step.Role, tuple[int, ...]]:
  """Live slices grouped by role (each group runs one program on its own devices)."""
  groups = collections.defaultdict(list)
  for s in live:
    groups[roles[s]].append(s)
  return {role: tuple(slices) for role, slices in groups.items()}


def _host_int(x: jax.Array) -> int:
  """A replicated device scalar on the host (from a local shard: works in every process)."""
  return int(np.asarray(x.addressable_shards[0].data))
