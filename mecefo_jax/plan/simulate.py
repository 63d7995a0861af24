"""Failure replay on a simulated cluster: the real decider's plans, costed per role, no devices."""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np

from mecefo_jax.core import goodput, programs
from mecefo_jax.core.decider import Decider
from mecefo_jax.core.failures import FailureEvent, FailureSchedule, TimedEvent as Event, apply_event
from mecefo_jax.core.goodput import Bucket
from mecefo_jax.core.programs import ProgramKey, RunPrograms
from mecefo_jax.core.roles import Role
from mecefo_jax.core.takeover import Planner
from mecefo_jax.plan.cost_model import ClusterCosts, features, fit, predict
from mecefo_jax.plan.ledger import ProgramLedger
from mecefo_jax.plan.replay import Replay, Tally, quiet, replay_trace, step_seconds

CHECKPOINT = 'checkpoint-restart'
__all__ = ['CHECKPOINT', 'ClusterCosts', 'Event', 'PolicyModel', 'Tally', 'features', 'fit',
           'predict', 'quiet', 'replay', 'replay_trace', 'step_seconds']


# --- roles --------------------------------------------------------------------------------------

def live_sets(n_slices: int):
  """Every non-empty set of live slices."""
  for k in range(1, n_slices + 1):
    yield from itertools.combinations(range(n_slices), k)


def needed_roles(planners: Sequence[Planner]) -> set[Role]:
  """Every role any failure pattern can give a slice under `planners` (all 2^n - 1 live sets)."""
  return {r for p in planners for live in live_sets(p.n_slices) for r in p.plan(live).roles.values()}


@dataclasses.dataclass
class PolicyModel:
  """One policy's replay settings: its planner (the decider's), costs and the run's programs.
  `planner.policy` may be CHECKPOINT: a spare replaces the failed slice (no decider)."""
  planner: Planner
  costs: ClusterCosts
  run: RunPrograms = RunPrograms()
  tau: int = 10  # mecefo.tau: steps between svd basis refreshes
  move: bool = True  # programs move between sets of slices of one shape (train.move_programs)
  premove_cap: int = 0  # programs moved in the background after each change of live set; 0: off

  @property
  def policy(self) -> str:
    return self.planner.policy

  @property
  def n(self) -> int:
    return self.planner.n_slices

  @property
  def b(self) -> int:
    return self.planner.micro_batch

  def decider(self) -> Decider:
    """A fresh decider: no event scheduled (a replay applies them), every slice present."""
    return Decider(self.planner, self.run, FailureSchedule(self.n), self.tau)

  def fault_free(self) -> list[ProgramKey]:
    """The programs of the fault-free run (every slice normal), built before a replay."""
    live = tuple(range(self.n))
    return programs.programs_for(programs.Need(live, dict.fromkeys(live, Role(self.b)), self.run))

  def ledger(self) -> ProgramLedger:
    """The stand-in program cache with the fault-free run's programs built."""
    return ProgramLedger(self.costs.compile_of, self.costs.move_s, self.move, self.fault_free())


# --- the replay ---------------------------------------------------------------------------------

def replay(events: Sequence[Event], n_slices: int, horizon_s: float, model: PolicyModel,
           checkpoint_every: int = 500) -> Tally:
  """Back-to-back steps over `horizon_s`; due events take effect at the next step boundary.

  MeCeFO policies: the real decider plans each step (core/decider.py); a step pays for the
  programs it needs that are not built yet (ProgramLedger: compiles and moves, less what the
  background worker moved), a plan with rejoins one rejoin. checkpoint-restart: see
  `checkpoint_restart`."""
  if model.policy == CHECKPOINT:
    return checkpoint_restart(events, n_slices, horizon_s, model, checkpoint_every)
  r = Replay(model.decider(), model.costs, model.move, model.premove_cap, model.fault_free())
  i = 0
  with quiet():
    while r.now < horizon_s:
      while i < len(events) and events[i].time_s <= r.now:
        r.decider.apply(FailureEvent(r.step, events[i].slice, events[i].kind, 'replay'))
        i += 1
      start, live = r.now, r.decider.live()
      t_next = min(events[i].time_s if i < len(events) else horizon_s, horizon_s)
      if live:
        r.window(t_next, horizon_s)
      else:  # every slice is down: no step until a repair
        r.begin()
        r.now = max(r.now, t_next)
        r.tally.all_down_s += r.now - start
      span = min(r.now, horizon_s) - start
      r.tally.live_slice_s += len(live) * span
      r.tally.failed_s += span if len(live) < n_slices else 0.0
  return r.tally


def checkpoint_restart(events: Sequence[Event], n_slices: int, horizon_s: float,
                       model: PolicyModel, checkpoint_every: int) -> Tally:
  """A spare takes each failed slice's place, so steps always run on all n slices and a repair
  changes nothing; each failure restarts the job: the steps since the last checkpoint (taken
  every `checkpoint_every`) are lost, then a restore and the compile of the fault-free programs
  in a fresh process."""
  c, tally, failed, i, now, progress = model.costs, Tally(), set(), 0, 0.0, 0
  ledger, per_step = model.ledger(), n_slices * model.b
  tally.builds = ledger.stats
  while now < horizon_s:
    i, fails = _apply_due(events, i, now, failed)
    start, next_t = now, events[i].time_s if i < len(events) else horizon_s
    if fails:
      lost = progress % checkpoint_every  # redone, their samples not counted
      progress -= lost
      tally.lost_steps, tally.samples, tally.restarts = (
          tally.lost_steps + lost, tally.samples - lost * per_step, tally.restarts + 1)
      tally.goodput[Bucket.NORMAL] -= lost * c.normal_s
      tally.goodput[Bucket.LOST] += lost * c.normal_s
      ledger.forget()
      compile_s = sum(ledger.build(key)[1] for key in model.fault_free())
      tally.goodput[Bucket.COMPILE] += compile_s
      tally.goodput[Bucket.RESTART] += c.restore_s
      now += compile_s + c.restore_s
    run = min(max(1, math.ceil((next_t - now) / c.normal_s)), (horizon_s - now) / c.normal_s)
    if run > 0:
      tally.samples += run * per_step
      tally.steps += math.ceil(run)
      tally.goodput[Bucket.NORMAL] += run * c.normal_s
      progress += int(run)
      now += run * c.normal_s
    span = min(now, horizon_s) - start
    tally.live_slice_s += n_slices * span
    tally.failed_s += span if failed else 0.0
  return tally


def _apply_due(events, i, now, failed) -> tuple[int, bool]:
  """Applies the events due by `now`: (the next one's index, whether a slice failed)."""
  fails = False
  while i < len(events) and events[i].time_s <= now:
    fails |= apply_event(failed, events[i].kind, events[i].slice) and events[i].kind == 'fail'
    i += 1
  return i, fails


# --- failures -----------------------------------------------------------------------------------

def stall_all_down(schedule: FailureSchedule, n_slices: int, steps: int) -> FailureSchedule | None:
  """`schedule` as a cluster that waits out all-down periods trains it: a step with no live
  slice is not trained but waited through, and the next trained step sees the net change of
  the failed set since the last one (labelled with the schedule's source). None if `schedule`
  runs out before `steps` trained steps."""
  events = schedule.all_events()
  source = events[0].source if events else 'api'
  out, applied, trained = FailureSchedule(n_slices), frozenset(), 0
  for failed in schedule.failed_sets((events[-1].step if events else 0) + steps + 1):
    if trained == steps:
      break
    if len(failed) == n_slices:
      continue  # every slice is down: no step runs until one is repaired
    for s in sorted(failed - applied):
      out.fail_at(s, trained, source)
    for s in sorted(applied - failed):
      out.repair_at(s, trained, source)
    applied, trained = failed, trained + 1
  return out if trained == steps else None


def preset_schedule(name: str, n_slices: int, steps: int, cluster_step_s: float, seed: int,
                    interval_scale: float = 1.0, stall: bool = False) -> FailureSchedule:
  """FailureSchedule.preset; `stall`: the cluster waits out all-down periods (stall_all_down)
  instead of stopping there, so every step is trained; the process is drawn over as many more
  steps as the waits take."""
  drawn = steps
  while True:
    sched = FailureSchedule.preset(name, n_slices, drawn, cluster_step_s, seed, interval_scale)
    stalled = stall_all_down(sched, n_slices, steps) if stall else sched
    if stalled is not None:
      return stalled
    drawn *= 2


def summarize(tallies: Sequence[Tally], horizon_s: float, fault_free_throughput: float) -> dict:
  """Seed-averaged drop in throughput and failure statistics of one policy under one preset."""
  drops = [100.0 * (1.0 - t.samples / horizon_s / fault_free_throughput) for t in tallies]
  mean = lambda f: float(np.mean([f(t) for t in tallies]))
  frac = lambda f: mean(f) / horizon_s
  built = lambda key: lambda t: vars(t.builds)[key]
  booked = lambda key: lambda t: t.goodput[key]
  restarts = mean(lambda t: t.restarts)
  return {'drop_pct': float(np.mean(drops)), 'drop_pct_std': float(np.std(drops)),
          'drop_pct_per_seed': drops, 'mean_live_slices': frac(lambda t: t.live_slice_s),
          'failure_time_frac': frac(lambda t: t.failed_s),
          'all_down_time_frac': frac(lambda t: t.all_down_s), 'steps': mean(lambda t: t.steps),
          'refreshes': mean(lambda t: t.refreshes),
          'compiled': mean(built('compiled')), 'moved': mean(built('moved')),
          'premoved': mean(built('premoved')), 'compile_time_frac': frac(built('compile_s')),
          'move_time_frac': frac(built('move_s')),
          'premove_wait_time_frac': frac(built('premove_wait_s')),
          'rejoin_time_frac': frac(booked(Bucket.REJOIN)),
          'restart_time_frac': frac(booked(Bucket.RESTART)), 'restarts': restarts,
          'lost_steps': mean(lambda t: t.lost_steps),
          'lost_steps_per_restart': mean(lambda t: t.lost_steps) / max(restarts, 1e-9),
          'goodput_frac': {key: frac(booked(key)) for key in goodput.KEYS}}
