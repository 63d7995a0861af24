"""The takeover planner: which live slice processes which rows of every micro-batch, and its role."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

from mecefo_jax.config import DEGRADED_COST, POLICIES, Config, check_setting
from mecefo_jax.core import budget
from mecefo_jax.core.roles import Role, split_passes


@dataclasses.dataclass(frozen=True)
class Rows:
  """Rows [start, stop) of slice `owner`'s micro-batch."""
  owner: int
  start: int
  stop: int

  @property
  def n(self) -> int:
    return self.stop - self.start


@dataclasses.dataclass
class SliceWork:
  exact: list[Rows] = dataclasses.field(default_factory=list)
  degraded: list[Rows] = dataclasses.field(default_factory=list)

  def counts(self) -> tuple[int, int]:
    return sum(r.n for r in self.exact), sum(r.n for r in self.degraded)


def ring_next(live: Sequence[int], failed_slice: int, n_slices: int) -> int:
  """The next live slice after `failed_slice` on the ring 0..n-1."""
  for k in range(1, n_slices + 1):
    if (failed_slice + k) % n_slices in live:
      return (failed_slice + k) % n_slices
  raise ValueError('no live slice')


def _split(n_rows: int, parts: int, granule: int) -> list[int]:
  """n_rows split over parts as evenly as possible in multiples of granule rows."""
  return [granule * units for units in budget.balanced(n_rows // granule, parts)]


def spread_shares(live: list[int], orphans: list[int], n_slices: int, micro_batch: int,
                  granule: int):
  """Policy spread's shares: (orphan, slice, first row, rows) for every non-empty share, each
  orphaned micro-batch split evenly over the live slices."""
  load = dict.fromkeys(live, 0)  # degraded rows so far
  for f in orphans:
    # Remainder granules go to the least-loaded slices first (ties: ring order after the
    # failed one), so that over several orphans no slice carries over a granule more than another.
    order = sorted(live, key=lambda s: (load[s], (s - f) % n_slices))
    start = 0
    for s, n in zip(order, _split(micro_batch, len(live), granule)):
      if n:
        yield f, s, start, n
        load[s] += n
      start += n


def plan(live: Sequence[int], n_slices: int, micro_batch: int, policy: str, granule: int = 1,
         degraded_cost: float = DEGRADED_COST, time_budget: float = 1.0
         ) -> tuple[dict[int, SliceWork], list[Rows]]:
  """(work of every live slice, rows dropped) for one step. docs/algorithm.md §1.

  neighbor: the next live slice on the ring does its own and the orphans, all degraded.
  naive: the same neighbour does both exactly (the baseline that runs out of memory).
  spread: each orphaned micro-batch is split evenly over all live slices (starting after the
    failed one); each runs its own rows exactly and only its share degraded.
  drop: orphans are skipped (smaller global batch), like torchft.
  exact: every row processed exactly, the orphans split evenly over the live slices (no
    approximation; the step costs n/(n-d) of a normal one): the quality reference.
  budget: every live slice stays within `time_budget` times the fault-free step's cost (exact
    row 1, degraded row `degraded_cost`) with the fewest degraded rows (core/budget.py).
  `granule` (dividing micro_batch) keeps spread shares shardable over a slice's fsdp devices.
  """
  check_setting('faults.degraded_cost', degraded_cost)
  if micro_batch % granule:
    raise ValueError(f'granule {granule} must divide micro_batch {micro_batch}')
  if policy not in POLICIES:
    raise ValueError(f'takeover policy must be one of {POLICIES}, got {policy!r}')
  live = sorted(live)
  if not live:
    raise ValueError('no live slice')
  if policy in ('exact', 'budget'):
    loads = budget_loads(live, n_slices, micro_batch, policy, granule, degraded_cost, time_budget)
    return _within_budget(loads, n_slices, micro_batch, granule), []
  work = {s: SliceWork(exact=[Rows(s, 0, micro_batch)]) for s in live}
  orphans = [s for s in range(n_slices) if s not in work]
  dropped: list[Rows] = []
  if policy == 'drop':
    dropped = [Rows(f, 0, micro_batch) for f in orphans]
  elif policy in ('neighbor', 'naive'):
    for f in orphans:
      carrier = work[ring_next(work, f, n_slices)]
      whole = Rows(f, 0, micro_batch)
      carrier.exact.append(whole) if policy == 'naive' else carrier.degraded.append(whole)
  else:  # spread
    for f, s, start, n in spread_shares(live, orphans, n_slices, micro_batch, granule):
      work[s].degraded.append(Rows(f, start, start + n))
  if policy == 'neighbor':
    # The paper's neighbour runs the degraded step on both of its micro-batches.
    for w in work.values():
      if w.degraded and w.exact:
        w.degraded = w.exact + w.degraded
        w.exact = []
  return work, dropped


@dataclasses.dataclass(frozen=True)
class Assignment:
  """A live set's takeover: the rows each live slice runs, and its role."""
  work: dict[int, SliceWork]  # rows every live slice processes, exact and degraded
  dropped: list[Rows]  # rows nobody processes (policy drop)
  roles: dict[int, Role]  # the program shape every live slice runs


@dataclasses.dataclass(frozen=True)
class Planner:
  """The one place that turns a live set into work and roles, with the run's defaults; the
  controller, the simulator and the benchmarks all plan through it."""
  n_slices: int
  micro_batch: int
  policy: str = 'neighbor'
  granule: int = 1  # spread shares are multiples of it (a slice's fsdp size keeps them shardable)
  max_rows: int = 0  # most rows of one degraded pass; 0: two micro-batches (faults.max_degraded_rows)
  degraded_cost: float = DEGRADED_COST
  time_budget: float = 1.0  # policy budget: a multiple of the fault-free step's cost

  def __post_init__(self):
    if not self.max_rows:
      object.__setattr__(self, 'max_rows', 2 * self.micro_batch)

  @classmethod
  def from_config(cls, cfg: Config, n_slices: int, granule: int = 1, policy: str | None = None,
                  time_budget: float | None = None) -> 'Planner':
    """The run's planner; `policy` and `time_budget` replace faults.takeover and
    faults.time_budget unless None."""
    f = cfg.faults
    return cls(n_slices, cfg.train.micro_batch, f.takeover if policy is None else policy, granule,
               f.max_degraded_rows, f.degraded_cost,
               f.time_budget if time_budget is None else time_budget)

  def plan(self, live: Sequence[int]) -> Assignment:
    work, dropped = plan(live, self.n_slices, self.micro_batch, self.policy, self.granule,
                         self.degraded_cost, self.time_budget)
    return Assignment(work, dropped, {s: self.role(w) for s, w in work.items()})

  def roles(self, live: Sequence[int]) -> dict[int, Role]:
    """plan(live).roles from row counts, without listing rows: a failure replay at scale plans
    thousands of live sets (tests/test_core.py checks both agree)."""
    if self.policy not in POLICIES or not live:
      return self.plan(live).roles  # its error
    live, b, role = sorted(live), self.micro_batch, self._role_of_rows
    if self.policy in ('exact', 'budget'):
      loads = budget_loads(live, self.n_slices, b, self.policy, self.granule,
                           self.degraded_cost, self.time_budget)
      g = self.granule
      return {s: role(g * e, g * d) for s, e, d in sorted(loads)}
    degraded = dict.fromkeys(live, 0)
    orphans = [s for s in range(self.n_slices) if s not in degraded]
    if self.policy == 'spread':
      for _, s, _, n in spread_shares(live, orphans, self.n_slices, b, self.granule):
        degraded[s] += n
      return {s: role(b, degraded[s]) for s in live}
    if self.policy != 'drop':  # neighbor, naive: the ring's next live slice carries each orphan
      for f in orphans:
        degraded[ring_next(degraded, f, self.n_slices)] += b
    if self.policy == 'naive':
      return {s: role(b + degraded[s], 0) for s in live}
    # neighbor: a carrier runs its own micro-batch degraded too (drop: none carries)
    return {s: role(0, b + d) if d else role(b, 0) for s, d in degraded.items()}

  def role(self, w: SliceWork) -> Role:
    return self._role_of_rows(*w.counts())

  @functools.lru_cache(maxsize=256)
  def _role_of_rows(self, exact: int, degraded: int) -> Role:
    """One Role object per load, built once (a replay at scale plans thousands of sets)."""
    return Role(exact, degraded, split_passes(degraded, self.max_rows))


def budget_loads(live, n_slices, micro_batch, policy, granule, cost, time_budget
                 ) -> list[tuple[int, int, int]]:
  """[(slice, exact, degraded granules)] of policy exact or budget: the budget's counts, the
  heavier loads on the failed slices' ring successors (ring order from the first failed one)."""
  limit = math.inf if policy == 'exact' else time_budget * micro_batch / granule
  loads = budget.counts(len(live), n_slices * (micro_batch // granule), limit, cost)
  first_down = min((s for s in range(n_slices) if s not in live), default=n_slices - 1)
  ring = sorted(live, key=lambda s: (s - first_down) % n_slices)
  return [(s, e, g) for s, (e, g) in zip(ring, loads)]


def _within_budget(loads, n_slices, micro_batch, granule) -> dict[int, SliceWork]:
  """Rows by budget_loads: each slice its own rows first (exact first), then the orphans in
  order."""
  per_slice = micro_batch // granule
  taken = {s: [Rows(s, 0, granule * min(e + g, per_slice))] for s, e, g in loads}
  queue = [Rows(o, taken[o][0].stop if o in taken else 0, micro_batch) for o in range(n_slices)]
  queue = [r for r in queue if r.n]
  work = {}
  for s, e, g in loads:
    rows = taken[s]
    rows += _pop_rows(queue, granule * (e + g) - rows[0].n)
    exact = _pop_rows(rows, granule * e)
    work[s] = SliceWork(exact=exact, degraded=rows)
  assert not queue, queue  # every row has a slice
  return work


def _pop_rows(rows: list[Rows], n: int) -> list[Rows]:
  """The first `n` rows of `rows` (removed from it), splitting a range where needed."""
  out = []
  while n > 0:
    r = rows.pop(0)
    if r.n > n:
      rows.insert(0, Rows(r.owner, r.start + n, r.stop))
      r = Rows(r.owner, r.start, r.start + n)
    out.append(r)
    n -= r.n
  return out
