"""The decider-driven replay: the steps between failure events in bulk, programs and clock."""
# The plans of those steps, the programs they build (plan/ledger.py), the clock they advance.
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Callable, Sequence

from mecefo_jax.core import goodput, programs
from mecefo_jax.core.decider import Decider, StepPlan
from mecefo_jax.core.goodput import Bucket
from mecefo_jax.core.programs import ProgramKey
from mecefo_jax.core.roles import Role
from mecefo_jax.plan.cost_model import ClusterCosts
from mecefo_jax.plan.ledger import PREMOVED, BuildStats, Premover, ProgramLedger


@dataclasses.dataclass
class Tally:
  """One replay's totals."""
  samples: float = 0.0
  steps: int = 0  # steps run (checkpoint-restart: including steps later lost)
  refreshes: int = 0  # steps that ran the svd basis refresh first
  live_slice_s: float = 0.0  # integral over time of the number of live slices
  failed_s: float = 0.0  # time with at least one slice down
  all_down_s: float = 0.0  # time with no live slice: no progress
  goodput: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(goodput.KEYS, 0.0))
  builds: BuildStats = dataclasses.field(default_factory=BuildStats)
  restarts: int = 0
  lost_steps: int = 0  # checkpoint-restart: steps redone after a failure
  # {(exact rows, degraded rows) of a step: steps run so}: progress counted in loss from it
  # (plan/loss_equivalent.py)
  mix: dict = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def quiet():
  """The decider logs a warning per event: a replay applies thousands."""
  log = logging.getLogger('mecefo')
  level = log.level
  log.setLevel(logging.ERROR)
  try:
    yield
  finally:
    log.setLevel(level)


@dataclasses.dataclass(frozen=True)
class _Refreshes:
  """The steps `first`, `first + every`, ... that run the basis refresh (none: first None)."""
  first: int | None
  every: int

  def before(self, b: int) -> int:
    """How many come before step `b`."""
    return 0 if self.first is None or b <= self.first else (b - 1 - self.first) // self.every + 1

  def last_before(self, b: int) -> int | None:
    n = self.before(b)
    return self.first + (n - 1) * self.every if n else None


class Replay:
  """A replay's state: the decider, the stand-in program cache and its background worker, the
  clock (seconds) at the boundary before step `step`, and the tally."""

  def __init__(self, decider: Decider, costs: ClusterCosts, move: bool, premove_cap: int,
               built: Sequence[ProgramKey] = ()):
    self.decider, self.costs = decider, costs
    self.ledger = ProgramLedger(costs.compile_of, costs.move_s, move, built)
    self.premover = Premover(self.ledger, premove_cap if move else 0)  # it only moves
    self.tally = Tally(builds=self.ledger.stats)
    self.now, self.step, self.live = 0.0, 0, decider.live()
    self.normal, self.rows = Role(decider.planner.micro_batch), (
        decider.n_slices * decider.planner.micro_batch)

  def begin(self) -> tuple[StepPlan | None, list[ProgramKey], list[ProgramKey]]:
    """Decides the step at the clock and builds what it needs (programs, rejoin): (the plan,
    None with no live slice; the programs it built; those it waited for). After a change of
    live set, once those are built, the background worker takes the next live sets."""
    d = self.decider
    live = d.live()
    plan = d.decide(self.step) if live else None
    keys = [k for k in plan.built() if not self.ledger.has(k)] if plan else []
    changed = live != self.live
    ready = self.premover.arrive(self.now, live, keys) if changed else {}
    blocked = [k for k in keys if self._build(k, ready.get(k))]
    if plan:
      if plan.rejoins:
        self._spend(Bucket.REJOIN, self.costs.rejoin_s)
      d.commit(plan)
    if changed:
      self.live = live
      self.premover.queue(self.now, d.next_live_sets() if self.premover.cap else (),
                          d.programs_for)
    return plan, keys, blocked

  def window(self, t_next: float, horizon_s: float) -> None:
    """The steps on the live set from the clock's until the first step boundary at or after
    `t_next` (at least one; the horizon may end inside a step), in bulk: one plan, its basis
    refreshes every tau steps, the refresh and eval programs built where first run."""
    d, s = self.decider, self.step
    clock = _Refreshes(*d.refreshes_from(s))  # before `begin` commits step s
    plan, _, _ = self.begin()
    # The live set's refresh and eval programs (the step's are built).
    step_s = step_seconds(plan, self.costs, self.normal)
    listed = [k for k in d.programs_for(plan.live) if k.kind.stage != 'step']
    refresh_s = self.costs.refresh_s
    spent = lambda a, b: (b - a) * step_s + refresh_s * (clock.before(b) - clock.before(a))
    a, t = s, self.now
    for q, keys in self._later(plan, listed, clock):
      if a + _steps_until(t_next - t, lambda n: spent(a, a + n), step_s) <= q:
        break  # the event comes first
      self.now, a = t + spent(a, q), q
      for key in keys:
        self._build(key)
      t = self.now
    end = a + _steps_until(t_next - t, lambda n: spent(a, a + n), step_s)
    run, work, self.now = end - s, spent(s, end), t + spent(a, end)
    if self.now > horizon_s:  # the horizon ends inside a step: credit its fraction
      end = a + _steps_until(horizon_s - t, lambda n: spent(a, a + n), step_s)
      last = spent(end - 1, end)
      part = max(0.0, horizon_s - t - spent(a, end - 1)) / last
      run, work, self.now = end - s - 1 + part, spent(s, end - 1) + part * last, horizon_s
    self._account(plan, run, work, clock.before(end) - clock.before(s))
    self._commit(plan, end, clock, next((k for k in listed if k.kind.stage == 'refresh'), None))

  def _later(self, plan: StepPlan, listed: list[ProgramKey], clock: _Refreshes):
    """[(step, programs)]: the refresh and eval programs of the live set not built yet, at the
    first step after the plan's that runs them."""
    d, s, at = self.decider, plan.step, {}
    for key in listed:
      if self.ledger.has(key):
        continue
      if key.kind.stage == 'refresh':
        q = clock.first if clock.first > s else clock.first + clock.every
      else:
        q = d.next_eval(s)
      at.setdefault(q, []).append(key)
    return sorted(at.items())

  def _account(self, plan: StepPlan, run: float, work: float, refreshes: int) -> None:
    """`run` steps of `plan` took `work` seconds (refreshes included)."""
    t = self.tally
    t.samples += run * plan.processed
    rows = (plan.samples['exact'], plan.samples['degraded'])
    t.mix[rows] = t.mix.get(rows, 0.0) + run
    t.steps += math.ceil(run)
    t.refreshes += refreshes
    if len(plan.live) == self.decider.n_slices:
      t.goodput[Bucket.NORMAL] += work
    else:
      share = plan.processed / self.rows
      t.goodput[Bucket.DEGRADED] += work * share
      t.goodput[Bucket.LOST] += work * (1.0 - share)

  def _commit(self, plan: StepPlan, end: int, clock: _Refreshes, refresh: ProgramKey | None
              ) -> None:
    """Steps up to `end` ran (the plan's first is committed): the decider commits the plan it
    makes at the window's last refresh step, without planning it again (the same live set and
    assignment, its refresh due), and counts the other steps' samples in bulk, as a commit of
    each would."""
    d, bulk = self.decider, end - plan.step - 1
    last = clock.last_before(end)
    if last is not None and last > plan.step:
      d.commit(dataclasses.replace(plan, step=last, refresh=refresh, eval=None))
      bulk -= 1
    for key, n in plan.samples.items():
      d.state.samples[key] += n * bulk
    self.step = end

  def _build(self, key: ProgramKey, ready_at: float | None = None) -> bool:
    """Builds `key` at the clock (or takes it from the background worker); whether the step
    waited for it."""
    how, seconds = self.ledger.build(key, ready_at, self.now)
    self._spend(Bucket.COMPILE, seconds)
    return how != PREMOVED or seconds > 0

  def _spend(self, bucket: Bucket, seconds: float) -> None:
    self.now += seconds
    self.tally.goodput[bucket] += seconds


def step_seconds(plan: StepPlan, costs: ClusterCosts, normal: Role) -> float:
  """Seconds of one step of `plan` (its refresh not counted): the fused `normal` step, else the
  slowest role's group program and the update (a fused step of another role is costed so)."""
  first = plan.programs[0]
  if plan.fused and first.variant == normal:
    return costs.normal_s
  return max(costs.group(k.variant) for k in plan.programs
             if k.kind is not programs.UPDATE) + costs.update_s


def _steps_until(span: float, spent: Callable[[int], float], step_s: float) -> int:
  """The fewest steps n >= 1 whose seconds `spent(n)` (increasing, at least n * step_s) reach
  `span`."""
  hi = max(1, math.ceil(span / step_s))
  while spent(hi) < span:  # float rounding of the bound
    hi += 1
  lo = 1
  while lo < hi:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if spent(mid) >= span else (mid + 1, hi)
  return lo


def replay_trace(decider: Decider, steps: int, costs: ClusterCosts, move: bool = True,
                 premove_cap: int = 0, built: Sequence[ProgramKey] = ()) -> list[dict]:
  """Steps 0..steps-1 under the decider's own (step-indexed) schedule, one at a time, with
  `built` built before: per step {step, live, roles, samples, programs (the plan's, in run
  order), built (new to the cache: compiled, moved, or taken from the background worker),
  blocked (those of `built` the step waited for)}. The reference `replay` agrees with, and the
  record to compare the executor's steps with."""
  r, records = Replay(decider, costs, move, premove_cap, built), []
  with quiet():
    for step in range(steps):
      r.step = step
      decider.advance(step)
      plan, new, blocked = r.begin()
      if plan:
        r.now += step_seconds(plan, costs, r.normal) + (costs.refresh_s if plan.refresh else 0.0)
      records.append({'step': step, 'live': decider.live(),
                      'roles': dict(plan.roles) if plan else {},
                      'samples': dict(plan.samples) if plan else {},
                      'programs': list(plan.built()) if plan else [], 'built': new,
                      'blocked': blocked})
  return records
