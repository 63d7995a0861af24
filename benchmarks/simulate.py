"""Failure replay on a simulated cluster: step time per live set from per-role costs, no devices."""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Sequence

import numpy as np

from benchmarks.ledger import ProgramLedger, RunPrograms, program_requests
from mecefo_jax.fault.failures import FailureSchedule, TimedEvent as Event, apply_event
from mecefo_jax.plan.roles import Role
from mecefo_jax.plan.takeover import Planner

CHECKPOINT = 'checkpoint-restart'


# --- roles --------------------------------------------------------------------------------------

def live_sets(n_slices: int):
  """Every non-empty set of live slices."""
  for k in range(1, n_slices + 1):
    yield from itertools.combinations(range(n_slices), k)


def needed_roles(planners: Sequence[Planner]) -> set[Role]:
  """Every role any failure pattern can give a slice under `planners` (all 2^n - 1 live sets)."""
  return {r for p in planners for live in live_sets(p.n_slices) for r in p.plan(live).roles.values()}


# --- cost model ---------------------------------------------------------------------------------

def features(role: Role) -> list[float]:
  """Linear model: program overhead + exact rows + degraded passes + degraded rows."""
  degraded = role.degraded > 0
  return [1.0, role.exact, role.passes if degraded else 0.0, role.degraded]


def fit(costs: dict[Role, float]) -> np.ndarray:
  """Least-squares coefficients of `features` from measured role costs."""
  roles = sorted(costs)
  a = np.asarray([features(r) for r in roles])
  return np.linalg.lstsq(a, np.asarray([costs[r] for r in roles]), rcond=None)[0]


def predict(coef: np.ndarray, role: Role) -> float:
  return float(np.dot(coef, features(role)))


@dataclasses.dataclass
class ClusterCosts:
  """Seconds, measured on one slice. Group programs run per slice, then one update program."""
  normal_s: float  # fused normal step: fault-free, and any step where all live slices are normal
  update_s: float  # cross-slice update program (the §3 combine + optimizer) after the groups
  group_s: dict[Role, float]  # per-slice contribution program of each role
  group_compile_s: dict[Role, float]
  fused_compile_s: float  # also charged for the fused step of any other role
  update_compile_s: float
  refresh_s: float = 0.0  # svd bases refresh, run every tau steps while degraded work runs
  refresh_compile_s: float = 0.0  # the refresh repeated every tau steps (warm unless full)
  cold_refresh_compile_s: float = 0.0  # the first refresh of a run (from scratch)
  eval_compile_s: float = 0.0
  move_s: float = 0.0  # a compiled program moved onto other slices (step/retarget.py)
  tau: int = 10
  rejoin_s: float = 0.0  # state copy onto a repaired slice
  restore_s: float = 0.0  # checkpoint-restart: restore of a durable checkpoint on restart
  modelled: set = dataclasses.field(default_factory=set)  # roles whose cost is predicted

  def complete(self, roles: set[Role]) -> 'ClusterCosts':
    """Fills roles not measured from the linear fit (and mean compile time); marks them modelled."""
    missing = set(roles) - set(self.group_s)
    if not missing:
      return self
    if not hasattr(self, '_fit'):  # of the measured roles only, once
      measured = {r: s for r, s in self.group_s.items() if r not in self.modelled}
      self._fit = (fit(measured), float(np.mean([self.group_compile_s[r] for r in measured])))
    coef, compile_mean = self._fit
    for r in missing:
      self.group_s[r] = predict(coef, r)
      self.group_compile_s[r] = compile_mean
    self.modelled |= missing
    return self

  def group(self, role: Role) -> float:
    """Seconds of `role`'s group program: measured, else predicted (and then kept)."""
    return self.complete({role}).group_s[role]

  def group_compile(self, role: Role) -> float:
    return self.complete({role}).group_compile_s[role]

  def compile_of(self, key: tuple) -> float:
    """Compile seconds of the program `key` = (kind, slices, *args) (step/cache.py)."""
    kind, _, *args = key
    if kind == 'group':
      return self.group_compile(args[0])
    if kind == 'refresh':
      return self.refresh_compile_s if args[0] else self.cold_refresh_compile_s
    return {'fused': self.fused_compile_s, 'update': self.update_compile_s,
            'eval': self.eval_compile_s}[kind]

  def to_json(self) -> dict:
    roles = [{'exact': r.exact, 'degraded': r.degraded, 'passes': r.passes,
              'step_s': self.group_s[r], 'compile_s': self.group_compile_s[r],
              'modelled': r in self.modelled}
             for r in sorted(self.group_s)]
    scalars = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ('group_s', 'group_compile_s', 'modelled')}
    return {**scalars, 'roles': roles}


class PolicyModel:
  """Step time, samples per step and program requests of a live set under one takeover policy."""

  def __init__(self, planner: Planner, costs: ClusterCosts, run: RunPrograms = RunPrograms(),
               move: bool = True):
    """`planner.policy` may be CHECKPOINT: a spare replaces the failed slice (no takeover);
    `move`: programs move between sets of slices of one shape (train.move_programs)."""
    self.planner, self.costs, self.run, self.move = planner, costs, run, move
    self.policy, self.n, self.b = planner.policy, planner.n_slices, planner.micro_batch
    self._cache: dict = {}
    self._by_place: dict = {}

  def _roles(self, live) -> set[Role]:
    """The roles a step on `live` runs, planned once per shape of live set (_shape)."""
    key = self._shape(live)
    if key not in self._cache:
      self._cache[key] = set(self.planner.plan(live).roles.values())
    return self._cache[key]

  def _shape(self, live) -> tuple[int, ...]:
    """What the set of roles of a live set depends on: for neighbor and naive the runs of
    failed slices before each carrier; for the other policies, which balance the orphaned
    rows over all live slices, only how many are live (tests/test_simulate.py checks both)."""
    if self.policy not in ('neighbor', 'naive'):
      return (len(live),)
    return tuple(sorted(self._places(live)))

  def roles(self, live: tuple[int, ...]) -> dict[int, Role]:
    """Every live slice's role, as planner.plan(live).roles, planned once per place (_places)
    where a slice's role depends on its place alone: a replay meets thousands of live sets."""
    if self.policy == CHECKPOINT:
      return dict.fromkeys(live, Role(self.b))
    if len(kinds := self._roles(live)) == 1:
      return dict.fromkeys(live, next(iter(kinds)))
    places = self._places(live)
    if places is None:
      return self.planner.plan(live).roles
    if not all(p in self._by_place for p in places):
      plan = self.planner.plan(live).roles
      self._by_place.update((p, plan[s]) for s, p in zip(live, places))
    return {s: self._by_place[p] for s, p in zip(live, places)}

  def _places(self, live) -> list | None:
    """What each live slice's role depends on, in live order: for neighbor and naive the run of
    failed slices before it (it carries them); for exact and budget the live count and its
    place on the ring from the first failed slice (the order the planner hands out its loads
    in); None for spread, where it depends on every orphan (tests/test_simulate.py checks)."""
    if self.policy in ('neighbor', 'naive'):
      return [(s - p - 1) % self.n for p, s in zip(live[-1:] + live[:-1], live)]
    if self.policy not in ('exact', 'budget'):
      return None
    first_down = min(set(range(self.n)) - set(live), default=self.n - 1)
    ring = {s: i for i, s in enumerate(sorted(live, key=lambda s: (s - first_down) % self.n))}
    return [(len(live), ring[s]) for s in live]

  def requests(self, live: tuple[int, ...], refreshed: bool) -> list[tuple]:
    """program_requests of `live` under this policy."""
    return program_requests(live, self.roles(live), self.run, refreshed)

  def ledger(self) -> ProgramLedger:
    """A replay's ledger: the fault-free step's programs are built before its window."""
    c = self.costs
    return ProgramLedger(c.compile_of, c.move_s, self.move,
                         built=self.requests(tuple(range(self.n)), False))

  def step(self, live: tuple[int, ...]) -> tuple[float, int]:
    """(seconds, samples) of one step on `live`; the slowest live slice sets the pace."""
    c = self.costs
    if self.policy == CHECKPOINT:
      return c.normal_s, self.n * self.b  # a spare stands in for the failed slice
    samples = (len(live) if self.policy == 'drop' else self.n) * self.b
    roles = self._roles(live)
    if roles == {Role(self.b)}:
      return c.normal_s, samples  # uniform normal role: the fused step (Controller._run)
    refresh = c.refresh_s / c.tau if any(r.degraded for r in roles) else 0.0
    return max(c.group(r) for r in roles) + c.update_s + refresh, samples


# --- failures and replay ------------------------------------------------------------------------

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


@dataclasses.dataclass
class Tally:
  samples: float = 0.0
  steps: int = 0  # steps run (checkpoint-restart: including steps later lost)
  live_slice_s: float = 0.0  # integral over time of the number of live slices
  failed_s: float = 0.0  # time with at least one slice down
  all_down_s: float = 0.0  # time with no live slice: no progress
  compile_s: float = 0.0
  move_s: float = 0.0
  compiled: int = 0  # programs compiled
  moved: int = 0  # programs moved onto other slices
  rejoin_s: float = 0.0  # checkpoint-restart: restore time of its restarts
  restarts: int = 0
  lost_steps: int = 0  # checkpoint-restart: steps redone after a failure


def _apply_due(events, i, now, failed):
  """Applies events due by `now`; returns (next index, any fail, any repair) that changed state."""
  fails = repairs = False
  while i < len(events) and events[i].time_s <= now:
    e = events[i]
    changed = apply_event(failed, e.kind, e.slice)
    fails |= changed and e.kind == 'fail'
    repairs |= changed and e.kind == 'repair'
    i += 1
  return i, fails, repairs


def replay(events: Sequence[Event], n_slices: int, horizon_s: float, model: PolicyModel,
           checkpoint_every: int = 500) -> Tally:
  """Back-to-back steps over `horizon_s`; due events take effect at the next step boundary.

  MeCeFO policies: a new live set pays for the programs it requests that are not built yet
  (ProgramLedger: compiles and moves), a repair pays one rejoin.
  checkpoint-restart: each failure restarts the job (restore + compile) and loses the steps
  since the last checkpoint (taken every `checkpoint_every`); a spare takes the failed
  slice's place, so it always runs on all n slices and a repair changes nothing.
  """
  tally, failed, seen, i, now = Tally(), set(), {tuple(range(n_slices))}, 0, 0.0
  ledger = model.ledger()
  progress, restart_due, ckpt = 0, False, model.policy == CHECKPOINT
  while now < horizon_s:
    i, fails, repairs = _apply_due(events, i, now, failed)
    live = tuple(s for s in range(n_slices) if ckpt or s not in failed)
    start, next_t = now, events[i].time_s if i < len(events) else horizon_s
    step_s, samples = model.step(live) if live else (0.0, 0)
    if ckpt and fails:
      # Rewind to the last checkpoint: the steps since then are redone, their samples not counted.
      lost = progress % checkpoint_every
      progress -= lost
      tally.lost_steps += lost
      tally.samples -= lost * model.n * model.b
    restart_due |= ckpt and fails
    if not live:
      now = min(next_t, horizon_s)
      tally.all_down_s += now - start
    else:
      now += _overheads(tally, model, ledger, live, seen, repairs, restart_due, ckpt)
      restart_due = False
      n_steps = max(1, math.ceil((next_t - now) / step_s))
      room = (horizon_s - now) / step_s
      run = min(n_steps, room)  # the window may end inside the last step: credit the fraction
      if run > 0:
        tally.samples += run * samples
        tally.steps += math.ceil(run)
        progress += int(run)
      now += max(run, 0) * step_s
    span = min(now, horizon_s) - start
    tally.live_slice_s += len(live) * span
    tally.failed_s += span if failed else 0.0
  s = ledger.stats
  tally.compile_s, tally.move_s, tally.compiled, tally.moved = (
      s['compiled_s'], s['moved_s'], s['compiled'], s['moved'])
  return tally


def _overheads(tally, model, ledger, live, seen, repairs, restart_due, ckpt) -> float:
  """Seconds before the next step can run: programs of a new live set, rejoin or restart."""
  c, spent = model.costs, 0.0
  if ckpt:
    if restart_due:
      ledger.forget()  # a fresh process: nothing compiled is cached
      tally.rejoin_s, tally.restarts = tally.rejoin_s + c.restore_s, tally.restarts + 1
      spent = ledger.charge(model.requests(live, False)) + c.restore_s
    return spent
  if repairs:
    tally.rejoin_s += c.rejoin_s
    spent += c.rejoin_s
  if live not in seen:
    seen.add(live)
    spent += ledger.charge(model.requests(live, ledger.refreshed))
  return spent


def summarize(tallies: Sequence[Tally], horizon_s: float, fault_free_throughput: float) -> dict:
  """Seed-averaged drop in throughput and failure statistics of one policy under one preset."""
  drops = [100.0 * (1.0 - t.samples / horizon_s / fault_free_throughput) for t in tallies]
  mean = lambda key: float(np.mean([getattr(t, key) for t in tallies]))
  return {'drop_pct': float(np.mean(drops)), 'drop_pct_std': float(np.std(drops)),
          'drop_pct_per_seed': drops, 'mean_live_slices': mean('live_slice_s') / horizon_s,
          'failure_time_frac': mean('failed_s') / horizon_s,
          'all_down_time_frac': mean('all_down_s') / horizon_s, 'steps': mean('steps'),
          'compile_time_frac': mean('compile_s') / horizon_s,
          'move_time_frac': mean('move_s') / horizon_s, 'compiled': mean('compiled'),
          'moved': mean('moved'),
          'rejoin_time_frac': mean('rejoin_s') / horizon_s, 'restarts': mean('restarts'),
          'lost_steps': mean('lost_steps'),
          'lost_steps_per_restart': mean('lost_steps') / max(mean('restarts'), 1e-9)}
