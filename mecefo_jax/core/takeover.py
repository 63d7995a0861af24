"""The takeover planner: which live slice processes which rows of every micro-batch, and its role."""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Sequence

from mecefo_jax.config import DEGRADED_COST, Config
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


# --- policies (docs/algorithm.md §1) ---------------------------------------------------------
Work = dict[int, SliceWork]


class Policy:
  """A takeover policy: for a live set (sorted, not empty) and the planner's settings, the rows
  each live slice runs, exact and degraded, and the rows nobody runs. The planner derives the
  roles from the rows, so a new policy is one subclass here, registered with `@register`."""
  name: ClassVar[str]

  def work(self, p: Planner, live: list[int]) -> tuple[Work, list[Rows]]:
    raise NotImplementedError


REGISTRY: dict[str, Policy] = {}  # name -> policy; config.POLICIES names them (a test checks)


def register(cls: type[Policy]) -> type[Policy]:
  if cls.name in REGISTRY:
    raise ValueError(f'takeover policy {cls.name!r} is registered already')
  REGISTRY[cls.name] = cls()
  return cls


def own_rows(p: Planner, live: Sequence[int]) -> Work:
  """Every live slice its own micro-batch, exactly."""
  return {s: SliceWork(exact=[Rows(s, 0, p.micro_batch)]) for s in live}


def orphans(p: Planner, live: Sequence[int]) -> list[int]:
  """The failed slices, whose micro-batches the live ones take over, in slice order."""
  members = set(live)
  return [s for s in range(p.n_slices) if s not in members]


def _carried(p: Planner, live: list[int], kind: str) -> Work:
  """Each orphaned micro-batch whole on the next live slice of the ring, as `kind` rows."""
  work = own_rows(p, live)
  for f in orphans(p, live):
    getattr(work[ring_next(work, f, p.n_slices)], kind).append(Rows(f, 0, p.micro_batch))
  return work


@register
class Neighbor(Policy):
  """The next live slice on the ring does its own micro-batch and the orphans, all degraded
  (the paper's neighbour runs the degraded step on both of its micro-batches)."""
  name = 'neighbor'

  def work(self, p, live):
    work = _carried(p, live, 'degraded')
    for w in work.values():
      if w.degraded:
        w.degraded, w.exact = w.exact + w.degraded, []
    return work, []


@register
class Spread(Policy):
  """Each orphaned micro-batch split evenly over all live slices (in multiples of the granule,
  which keeps shares shardable over a slice's fsdp devices); each runs its own rows exactly and
  only its share degraded."""
  name = 'spread'

  def work(self, p, live):
    work = own_rows(p, live)
    for f, s, start, n in spread_shares(live, orphans(p, live), p.n_slices, p.micro_batch,
                                        p.granule):
      work[s].degraded.append(Rows(f, start, start + n))
    return work, []


class _WithinBudget(Policy):
  """Every live slice within `limit` granules of cost (exact row 1, degraded row
  `degraded_cost`) with the fewest degraded rows (core/budget.py)."""

  def limit(self, p: Planner) -> float:
    raise NotImplementedError

  def work(self, p, live):
    return _within_budget(budget_loads(p, live, self.limit(p)), p), []


@register
class Exact(_WithinBudget):
  """Every row processed exactly, the orphans split evenly over the live slices (no
  approximation; the step costs n/(n-d) of a normal one): the quality reference."""
  name = 'exact'

  def limit(self, p):
    return math.inf


@register
class Budget(_WithinBudget):
  """Every live slice within `time_budget` times the fault-free step's cost, with the fewest
  degraded rows."""
  name = 'budget'

  def limit(self, p):
    return p.time_budget * p.micro_batch / p.granule


@register
class Drop(Policy):
  """Orphans are skipped (a smaller global batch), like torchft."""
  name = 'drop'

  def work(self, p, live):
    return own_rows(p, live), [Rows(f, 0, p.micro_batch) for f in orphans(p, live)]


@register
class Naive(Policy):
  """The next live slice on the ring does its own micro-batch and the orphans exactly (the
  baseline that runs out of memory)."""
  name = 'naive'

  def work(self, p, live):
    return _carried(p, live, 'exact'), []


def plan(live: Sequence[int], n_slices: int, micro_batch: int, policy: str, granule: int = 1,
         degraded_cost: float = DEGRADED_COST, time_budget: float = 1.0
         ) -> tuple[Work, list[Rows]]:
  """(work of every live slice, rows dropped) for one step: `Planner.plan` without roles."""
  a = Planner(n_slices, micro_batch, policy, granule, degraded_cost=degraded_cost,
              time_budget=time_budget).plan(live)
  return a.work, a.dropped


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
    """The rows and roles of `live` under the policy (its roles derived from its rows)."""
    policy = self.checked_policy()
    live = sorted(live)
    if not live:
      raise ValueError('no live slice')
    work, dropped = policy.work(self, live)
    return Assignment(work, dropped, {s: self.role(w) for s, w in work.items()})

  def roles(self, live: Sequence[int]) -> dict[int, Role]:
    return self.plan(live).roles

  def role(self, w: SliceWork) -> Role:
    exact, degraded = w.counts()
    return Role(exact, degraded, split_passes(degraded, self.max_rows))

  def checked_policy(self) -> Policy:
    """The registered policy of this planner, its settings checked."""
    if not 0.0 < self.degraded_cost < 1.0:
      raise ValueError(f'degraded_cost must be in (0, 1), got {self.degraded_cost}')
    if self.micro_batch % self.granule:
      raise ValueError(f'granule {self.granule} must divide micro_batch {self.micro_batch}')
    if self.policy not in REGISTRY:
      raise ValueError(f'takeover policy must be one of {tuple(REGISTRY)}, got {self.policy!r}')
    return REGISTRY[self.policy]


def budget_loads(p: Planner, live: list[int], limit: float) -> list[tuple[int, int, int]]:
  """[(slice, exact, degraded granules)] within `limit` granules of cost each: the budget's
  counts, the heavier loads on the failed slices' ring successors (ring order from the first
  failed one)."""
  n_slices = p.n_slices
  loads = budget.counts(len(live), n_slices * (p.micro_batch // p.granule), limit,
                        p.degraded_cost)
  first_down = min((s for s in range(n_slices) if s not in live), default=n_slices - 1)
  ring = sorted(live, key=lambda s: (s - first_down) % n_slices)
  return [(s, e, g) for s, (e, g) in zip(ring, loads)]


def _within_budget(loads, p: Planner) -> Work:
  """Rows by budget_loads: each slice its own rows first (exact first), then the orphans in
  order."""
  n_slices, micro_batch, granule = p.n_slices, p.micro_batch, p.granule
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
