"""snapshot.every: auto: the smallest snapshot interval whose measured cost fits a budget.

CheckFreq (FAST'21) tunes the interval from measured costs; BAFT and REFT aim at <= 1% overhead
at the highest frequency that allows. What a snapshot costs the loop is measured, not modelled:
over the k steps from one save to the next, wall = k * idle + cost, where idle is the wall of a
step that neither starts a save nor runs beside one, and cost is the save's wait plus whatever
its background work takes from the steps beside it. The interval is then the smallest k with
cost / (k * idle) <= budget, capped at max_every (the steps a crash may cost).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics

from mecefo_jax import multihost
from mecefo_jax.sections import entry

log = logging.getLogger('mecefo')

START = 8  # the interval auto starts from: room for idle steps between saves to compare with


@dataclasses.dataclass
class SnapshotInterval:
  """report.json's `snapshot_interval` section (the defaults: a fixed interval, `every`)."""
  auto: bool = entry('', 'snapshot.every=auto: the interval was chosen from measured costs '
                     '(snapshot/interval.py)', default=False)
  every: int = entry('steps', 'the in-memory snapshot interval at the end; 0 when disabled',
                     default=0)
  budget: float | None = entry('', 'snapshot.overhead_budget (auto); null otherwise', default=None)
  max_every: int | None = entry('steps', 'snapshot.max_every (auto); null otherwise', default=None)
  cost_s: float | None = entry('s', 'measured cost of one snapshot to the loop: its wait plus its '
                               "background work's slowdown of the steps beside it (auto)",
                               default=None)
  idle_step_s: float | None = entry('s', 'median wall of a step with no snapshot work (auto)',
                                    default=None)
  changes: list[list[int]] = entry('', '[step, every] at each re-measure of auto (every 4 '
                                   'save-to-save periods), the interval set from that step on',
                                   factory=list)


def smallest_interval(cost_s: float, step_s: float, budget: float, max_every: int) -> int:
  """The smallest k >= 1 with cost_s / (k * step_s) <= budget, at most max_every."""
  if cost_s <= 0 or step_s <= 0:
    return 1
  return max(1, min(max_every, math.ceil(cost_s / (budget * step_s) * (1 - 1e-9))))


class IntervalTuner:
  """Watches the loop's steps and proposes the interval every `periods` save-to-save periods
  (a fixed number of periods, so that every process of a job proposes at the same step)."""

  def __init__(self, budget: float, max_every: int, start: int = START, periods: int = 4):
    self.budget, self.max_every, self.periods = budget, max_every, periods
    self.every = min(start, max_every)
    self._idle = collections.deque(maxlen=64)  # walls of idle steps
    self._costs: list[float] = []  # cost of each complete period since the last proposal
    self._closed = 0  # periods completed since the last proposal (with a cost or not)
    self._period: list[float] | None = None  # walls of the period in progress
    self.idle_s: float | None = None
    self.cost_s: float | None = None
    self.changes: list[list[int]] = []  # [step, every] of each proposal

  def observe(self, wall_s: float, saved: bool, busy: bool) -> None:
    """One step: its wall time (iteration to iteration), whether a save was due after it (the
    same on every process, whether this host saved or not), whether background save work was
    running when it started."""
    if saved:
      self._close_period()
      self._period = []
    if self._period is not None:
      self._period.append(wall_s)
    if not saved and not busy:
      self._idle.append(wall_s)

  def _close_period(self) -> None:
    self._closed += self._period is not None
    if self._period and self._idle:
      self.idle_s = statistics.median(self._idle)
      self._costs.append(sum(self._period) - len(self._period) * self.idle_s)

  def due(self) -> bool:
    """Whether propose() has a new interval (the same step on every process of a job)."""
    return self._closed >= self.periods

  def propose(self) -> int:
    """The interval for the measurements since the last proposal; with no idle step seen yet
    (every step ran beside a save), twice the interval, to find some. It grows at once (the
    budget holds from the next period) but shrinks at most by half: a cost that noise hid (the
    idle steps' median above a period's, measured 0 on a loaded machine) walks it down one
    re-measure at a time instead of dropping it to every step."""
    if not self._costs:
      proposal = min(2 * self.every, self.max_every)
    else:
      self.cost_s = max(0.0, statistics.median(self._costs))
      proposal = max(smallest_interval(self.cost_s, self.idle_s, self.budget, self.max_every),
                     self.every // 2)
    self._costs, self._closed = [], 0
    self.every = proposal
    return proposal

  def after_step(self, interval: 'Interval', steps_done: int, wall_s: float, busy: bool) -> None:
    """Feeds a step of the loop; sets `interval.every` when a proposal is due (multi-process:
    the largest any process proposes, so that every process's cost fits the budget)."""
    self.observe(wall_s, interval.due(steps_done), busy)
    if not self.due():
      return
    every = self.propose()
    if multihost.is_multiprocess():
      every = self.every = max(multihost.allgather_json(every))
    if every != interval.every:
      log.info('snapshot.every=auto: every %d step(s) from step %d (a snapshot costs %s s beside '
               'a %s s step; budget %g)', every, steps_done, _rounded(self.cost_s),
               _rounded(self.idle_s), self.budget)
      interval.every = every
    self.changes.append([steps_done, every])

  def report(self, every: int) -> SnapshotInterval:
    """The section, with `every`: the interval at the end."""
    return SnapshotInterval(auto=True, every=every, budget=self.budget, max_every=self.max_every,
                            cost_s=self.cost_s, idle_step_s=self.idle_s, changes=self.changes)


class Interval:
  """The in-memory snapshot interval, its one owner: snapshot.every, or with `auto` the
  tuner's (which alone changes it). The snapshot tiers ask it what is due."""

  def __init__(self, every: int, tuner: IntervalTuner | None = None):
    self.every, self.tuner = every, tuner

  @classmethod
  def of(cls, every: int | str, overhead_budget: float, max_every: int) -> 'Interval':
    """snapshot.every resolved: the one place `auto` becomes a number (the tuner's start)."""
    if every != 'auto':
      return cls(every)
    tuner = IntervalTuner(overhead_budget, max_every)
    return cls(tuner.every, tuner)

  def due(self, steps_done: int) -> bool:
    return steps_done % self.every == 0

  def after_step(self, steps_done: int, wall_s: float, busy: bool) -> None:
    """A step of the loop, `wall_s` long (iteration to iteration), `busy` when it started
    beside background save work: measured where the interval is tuned."""
    if self.tuner:
      self.tuner.after_step(self, steps_done, wall_s, busy)

  def report(self) -> SnapshotInterval:
    """report.json's `snapshot_interval` section."""
    return self.tuner.report(self.every) if self.tuner else SnapshotInterval(every=self.every)


def _rounded(x: float | None) -> str:
  return 'n/a' if x is None else f'{x:.3g}'
