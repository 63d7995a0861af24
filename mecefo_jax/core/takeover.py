"""The takeover planner: which live slice processes which rows of every micro-batch, and its role."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, ClassVar, Mapping, Sequence

from mecefo_jax.config import DEGRADED_COST, Config, check_setting
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
Piece = tuple[int | None, int, int]  # (live slice, or None: dropped; owner; rows)


class Handout:
  """What a policy decides for a live set: how many rows each live slice runs (`totals`, in
  the order its work is listed), how many of them exactly, its first ones (`exact`; None:
  all), and the pieces of the micro-batches handed out, in order: (live slice, or None:
  dropped; owner; rows), each owner's rows handed out from row 0 up. The roles come from the
  counts, the rows from the pieces, listed only when asked for (`lay_out`): a failure replay
  needs the roles of ~10^5 live sets, the rows of none."""

  def __init__(self, totals: dict[int, int], exact: Mapping[int, int] | None,
               pieces: Callable[[], list[Piece]]):
    self.totals, self.exact, self.pieces = totals, exact, pieces

  @classmethod
  def of(cls, pieces: list[Piece], exact: Mapping[int, int] | None = None) -> 'Handout':
    """The handout of `pieces` (totals in order of each slice's first piece)."""
    totals: dict[int, int] = {}
    for s, _, n in pieces:
      if s is not None:
        totals[s] = totals.get(s, 0) + n
    return cls(totals, exact, lambda: pieces)

  @classmethod
  def filled(cls, p: Planner, totals: dict[int, int], exact: Mapping[int, int] | None,
             order: Sequence[int]) -> 'Handout':
    """The handout of `totals`: each live slice its own rows first, then, slice by slice in
    `order`, what it lacks from the rows left, by owner; the rows nobody takes are dropped."""
    return cls(totals, exact, lambda: _fill(p, totals, order))

  def lay_out(self) -> tuple[Work, list[Rows]]:
    """(rows of every live slice, exact first, rows dropped)."""
    first_free: dict[int, int] = {}  # owner -> its first row not handed out yet
    rows_of: dict[int, list[Rows]] = {s: [] for s in self.totals}
    dropped: list[Rows] = []
    for s, owner, n in self.pieces():
      start = first_free.get(owner, 0)
      first_free[owner] = start + n
      (dropped if s is None else rows_of[s]).append(Rows(owner, start, start + n))
    exact = self.exact
    return {s: SliceWork(exact=rows if exact is None else _pop_rows(rows, exact[s]),
                         degraded=[] if exact is None else rows)
            for s, rows in rows_of.items()}, dropped


def _fill(p: Planner, totals: dict[int, int], order: Sequence[int]) -> list[Piece]:
  """Handout.filled's pieces."""
  b = p.micro_batch
  pieces: list[Piece] = [(s, s, min(totals[s], b)) for s in order]
  left = [[o, b - min(totals.get(o, 0), b)] for o in range(p.n_slices)]
  left = [q for q in left if q[1]]  # [owner, rows not handed out yet], by owner
  for s in order:
    lacking = totals[s] - b
    while lacking > 0:
      owner, rows = left[0]
      n = min(rows, lacking)
      pieces.append((s, owner, n))
      lacking -= n
      if n == rows:
        left.pop(0)
      else:
        left[0][1] = rows - n
  return pieces + [(None, owner, rows) for owner, rows in left]


def _ring_from_first_down(p: Planner, live: Sequence[int]) -> list[int]:
  """The live slices in ring order from the first failed one (slice order if none failed)."""
  members = set(live)
  first_down = min((s for s in range(p.n_slices) if s not in members), default=p.n_slices - 1)
  return sorted(live, key=lambda s: (s - first_down) % p.n_slices)


class Policy:
  """A takeover policy: for a live set (sorted, not empty) and the planner's settings, the
  `Handout` of every micro-batch; the planner derives rows and roles from it. A new policy is
  one subclass here, registered with `@register`."""
  name: ClassVar[str]
  # The rows nobody takes are not dropped but deferred: the stream of sample ids goes on from
  # the first one not trained (data/order.py's stream_ids), each sample trained once, in order.
  defers: ClassVar[bool] = False

  def handout(self, p: Planner, live: list[int]) -> Handout:
    raise NotImplementedError


REGISTRY: dict[str, Policy] = {}  # name -> policy; config.POLICIES names them (a test checks)


def register(cls: type[Policy]) -> type[Policy]:
  if cls.name in REGISTRY:
    raise ValueError(f'takeover policy {cls.name!r} is registered already')
  REGISTRY[cls.name] = cls()
  return cls


def own_pieces(p: Planner, live: Sequence[int]) -> list[Piece]:
  """Every live slice its own micro-batch."""
  return [(s, s, p.micro_batch) for s in live]


def orphans(p: Planner, live: Sequence[int]) -> list[int]:
  """The failed slices, whose micro-batches the live ones take over, in slice order."""
  members = set(live)
  return [s for s in range(p.n_slices) if s not in members]


def _carried(p: Planner, live: list[int], exact: Callable[[int], int] | None) -> Handout:
  """Each orphaned micro-batch whole on the next live slice of the ring; `exact(rows)`: the
  exact rows of a slice running `rows` (None: all)."""
  b, members = p.micro_batch, set(live)
  carrier = {f: ring_next(members, f, p.n_slices) for f in orphans(p, live)}
  totals = dict.fromkeys(live, b)
  for s in carrier.values():
    totals[s] += b
  return Handout(totals, None if exact is None else {s: exact(n) for s, n in totals.items()},
                 lambda: own_pieces(p, live) + [(s, f, b) for f, s in carrier.items()])


@register
class Neighbor(Policy):
  """The next live slice on the ring does its own micro-batch and the orphans, all degraded
  (the paper's neighbour runs the degraded step on both of its micro-batches)."""
  name = 'neighbor'

  def handout(self, p, live):
    return _carried(p, live, lambda rows: 0 if rows > p.micro_batch else rows)


@register
class Spread(Policy):
  """Each orphaned micro-batch split evenly over all live slices (in multiples of the granule,
  which keeps shares shardable over a slice's fsdp devices); each runs its own rows exactly and
  only its share degraded."""
  name = 'spread'

  def handout(self, p, live):
    shares = spread_shares(live, orphans(p, live), p.n_slices, p.micro_batch, p.granule)
    return Handout.of(own_pieces(p, live) + [(s, f, n) for f, s, _, n in shares],
                      dict.fromkeys(live, p.micro_batch))


class _WithinBudget(Policy):
  """Every live slice within `limit` granules of cost (exact row 1, degraded row
  `degraded_cost`) with the fewest degraded rows (core/budget.py)."""

  def limit(self, p: Planner) -> float:
    raise NotImplementedError

  def handout(self, p, live):
    return _within_budget(budget_loads(p, live, self.limit(p)), p)


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

  def handout(self, p, live):
    totals = dict.fromkeys(live, p.micro_batch)
    return Handout.filled(p, totals, totals, live)  # nobody lacks rows: the orphans' dropped


@register
class Requeue(Drop):
  """Every live slice its own micro-batch, exact; a failed slice's samples are neither degraded
  nor dropped but trained in later steps (the ids follow the samples trained, not the step)."""
  name = 'requeue'
  defers = True


@register
class Naive(Policy):
  """The next live slice on the ring does its own micro-batch and the orphans exactly (the
  baseline that runs out of memory)."""
  name = 'naive'

  def handout(self, p, live):
    return _carried(p, live, None)


def plan(live: Sequence[int], n_slices: int, micro_batch: int, policy: str, granule: int = 1,
         degraded_cost: float = DEGRADED_COST, time_budget: float = 1.0
         ) -> tuple[Work, list[Rows]]:
  """(work of every live slice, rows dropped) for one step: `Planner.plan` without roles."""
  a = Planner(n_slices, micro_batch, policy, granule, degraded_cost=degraded_cost,
              time_budget=time_budget).plan(live)
  return a.work, a.dropped


@dataclasses.dataclass(frozen=True)
class Assignment:
  """A live set's takeover: the role of every live slice, and the rows each runs (laid out
  when first asked for: a failure replay needs the roles of thousands of live sets only)."""
  roles: dict[int, Role]  # the program shape every live slice runs
  handout: Handout

  @functools.cached_property
  def _rows(self) -> tuple[Work, list[Rows]]:
    return self.handout.lay_out()

  @property
  def work(self) -> Work:
    """Rows every live slice processes, exact and degraded."""
    return self._rows[0]

  @property
  def dropped(self) -> list[Rows]:
    """Rows nobody processes (policy drop)."""
    return self._rows[1]


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
    object.__setattr__(self, '_roles_made', {})

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
    """The roles and rows of `live` under the policy, both from its handout."""
    policy = self.checked_policy()
    live = sorted(live)
    if not live:
      raise ValueError('no live slice')
    handout = policy.handout(self, live)
    totals, exact = handout.totals, handout.exact
    return Assignment({s: self._role(n if exact is None else exact[s], n)
                       for s, n in totals.items()}, handout)

  def roles(self, live: Sequence[int]) -> dict[int, Role]:
    return self.plan(live).roles

  def role(self, w: SliceWork) -> Role:
    exact, degraded = w.counts()
    return self._role(exact, exact + degraded)

  def _role(self, exact: int, rows: int) -> Role:
    """The role of `rows` rows, `exact` of them exact; one object per load, built once (a plan
    at scale has hundreds of slices, most of them in a few roles)."""
    role = self._roles_made.get((exact, rows))
    if role is None:
      degraded = rows - exact
      role = self._roles_made[exact, rows] = Role(exact, degraded,
                                                  split_passes(degraded, self.max_rows))
    return role

  def checked_policy(self) -> Policy:
    """The registered policy of this planner, its settings checked."""
    check_setting('faults.degraded_cost', self.degraded_cost)
    if self.micro_batch % self.granule:
      raise ValueError(f'granule {self.granule} must divide micro_batch {self.micro_batch}')
    if self.policy not in REGISTRY:
      raise ValueError(f'takeover policy must be one of {tuple(REGISTRY)}, got {self.policy!r}')
    return REGISTRY[self.policy]


def budget_loads(p: Planner, live: list[int], limit: float) -> list[tuple[int, int, int]]:
  """[(slice, exact, degraded granules)] within `limit` granules of cost each: the budget's
  counts, the heavier loads on the failed slices' ring successors (ring order from the first
  failed one)."""
  loads = budget.counts(len(live), p.n_slices * (p.micro_batch // p.granule), limit,
                        p.degraded_cost)
  return [(s, e, g) for s, (e, g) in zip(_ring_from_first_down(p, live), loads)]


def _within_budget(loads, p: Planner) -> Handout:
  """The handout of budget_loads: each slice its own rows first (exact first), then the rest
  of the micro-batches filled in the loads' order."""
  g = p.granule
  return Handout.filled(p, {s: g * (e + d) for s, e, d in loads}, {s: g * e for s, e, _ in loads},
                        [s for s, _, _ in loads])


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
