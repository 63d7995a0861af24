"""A node fault log onto slices of K hosts, with or without hot spares: each slice's down time."""
# A slice is down while any of its hosts is (a TPU slice, a multi-host replica): the union of its
# hosts' outages as the log has them, so correlated faults count once. Hot spares: idle healthy
# servers; a slice that loses a host takes a free spare, which joins it `swap_days` later (the slice
# is down meanwhile); a repaired host becomes a spare. Used by plan/runs.py.
from __future__ import annotations

import dataclasses
import heapq
import math

from mecefo_jax.config import ConfigError
from mecefo_jax.core import fault_log
from mecefo_jax.core.timed import TimedEvent


@dataclasses.dataclass(frozen=True)
class Fleet:
  """`slices` slices of `hosts` servers each, and `spares` hot spares swapped in after
  `swap_days`; drawn from a log's cluster of `nodes` servers."""
  slices: int
  hosts: int = 1
  spares: int = 0
  swap_days: float = 0.0

  @property
  def servers(self) -> int:
    return self.slices * self.hosts + self.spares

  @classmethod
  def of(cls, nodes: int, hosts: int, spares: int = 0, swap_days: float = 0.0) -> 'Fleet':
    """The fleet of `nodes` servers: `spares` of them spares, the rest in slices of `hosts`."""
    if hosts < 1 or spares < 0 or (nodes - spares) % hosts or nodes - spares < hosts:
      raise ConfigError(f'{nodes} servers less {spares} spares do not make slices of {hosts} '
                        'hosts: the rest must be a positive multiple of --slice-hosts')
    return cls((nodes - spares) // hosts, hosts, spares, swap_days)


def slice_events(faults: list, fleet: Fleet, nodes: int, classes: str, window: tuple[float, float],
                 seed: int, where: str) -> tuple[list[TimedEvent], list[list[str | None]]]:
  """(the slices' events in seconds from the window's start, each slice's drawn hosts): servers
  drawn as fault_log.slice_events draws them (at one host a slice and no spares, the same
  events), the first `fleet.spares` of the draw the spares."""
  down = fault_log.down_intervals(fault_log.counted(faults, classes, where), where)
  drawn = fault_log.draw_nodes(sorted({f.node for f in faults}), fleet.servers, nodes, seed, where)
  spares, rest = drawn[:fleet.spares], drawn[fleet.spares:]
  members = [rest[s * fleet.hosts:(s + 1) * fleet.hosts] for s in range(fleet.slices)]
  by_slice = (_union(down, members) if not fleet.spares
              else _swapped(down, members, spares, fleet.swap_days))
  first, last = window
  return fault_log.timed_events(by_slice, list(range(fleet.slices)), first, last, 1.0), members


def _union(down: dict, members: list[list]) -> dict[int, list[tuple[float, float]]]:
  """Each slice down while any of its hosts is."""
  return {s: fault_log.merged([span for h in hosts for span in down.get(h, ())])
          for s, hosts in enumerate(members)}


def _host_events(down: dict, hosts: list) -> list[tuple[float, int, str]]:
  """(day, host index, 'fail' | 'repair') of every host's outages, repairs first at one day."""
  events = [(t, h, kind) for h, node in enumerate(hosts) if node is not None
            for a, b in down.get(node, ()) for t, kind in ((a, 'fail'), (b, 'repair'))
            if t < math.inf]
  return sorted(events, key=lambda e: (e[0], e[2] != 'repair', e[1]))


class _Swaps:
  """The hot-spare bookkeeping: which hosts each slice holds, the free spares, the slices
  waiting for one, the swaps under way, and each slice's down spans."""

  def __init__(self, members: list[list[int]], spares: list[int], swap_days: float):
    self.slice_of = {h: s for s, hosts in enumerate(members) for h in hosts}
    self.members = [set(hosts) for hosts in members]
    self.free, self.swap_days = set(spares), swap_days
    self.down_hosts: set[int] = set()
    self.waiting: list[tuple[int, int]] = []  # (slice, host to replace), first come first served
    self.under_way: list[tuple[float, int, int, int]] = []  # (ready day, slice, old, spare)
    self.down_since: dict[int, float] = {}
    self.spans: dict[int, list[tuple[float, float]]] = {}

  def _check(self, s: int, day: float) -> None:
    down = bool(self.members[s] & self.down_hosts)
    if down and s not in self.down_since:
      self.down_since[s] = day
    elif not down and s in self.down_since:
      self.spans.setdefault(s, []).append((self.down_since.pop(s), day))

  def _assign(self, day: float) -> None:
    while self.waiting and self.free:
      s, old = self.waiting.pop(0)
      spare = min(self.free)
      self.free.discard(spare)
      heapq.heappush(self.under_way, (day + self.swap_days, s, old, spare))

  def swaps_until(self, day: float) -> None:
    """Completes the swaps ready by `day`: the spare joins, the old host leaves the slice."""
    while self.under_way and self.under_way[0][0] <= day:
      ready, s, old, spare = heapq.heappop(self.under_way)
      self.members[s] = (self.members[s] - {old}) | {spare}
      self.slice_of.pop(old, None)
      self.slice_of[spare] = s
      self._check(s, ready)

  def fail(self, h: int, day: float) -> None:
    self.down_hosts.add(h)
    self.free.discard(h)
    for i, (ready, s, old, spare) in enumerate(self.under_way):
      if spare == h:  # the spare on its way failed: its slice waits for another
        self.under_way.pop(i)
        heapq.heapify(self.under_way)
        self.waiting.insert(0, (s, old))
        break
    if h in self.slice_of:
      s = self.slice_of[h]
      self.waiting.append((s, h))
      self._check(s, day)
    self._assign(day)

  def repair(self, h: int, day: float) -> None:
    self.down_hosts.discard(h)
    s = self.slice_of.get(h)
    if s is None:  # swapped out (or a spare): back to the pool
      self.free.add(h)
    else:  # still its slice's: any swap for it is called off, the spare freed
      self.waiting = [w for w in self.waiting if w != (s, h)]
      kept = [w for w in self.under_way if (w[1], w[2]) != (s, h)]
      self.free |= {w[3] for w in self.under_way if (w[1], w[2]) == (s, h)}
      self.under_way = kept
      heapq.heapify(self.under_way)
      self._check(s, day)
    self._assign(day)


def _swapped(down: dict, members: list[list], spares: list, swap_days: float
             ) -> dict[int, list[tuple[float, float]]]:
  """Each slice's down spans with hot spares swapped in for its failed hosts."""
  hosts = [*(h for m in members for h in m), *spares]
  k = len(members[0])  # host indices: slice s holds [s k, (s + 1) k), the spares come last
  book = _Swaps([list(range(s * k, (s + 1) * k)) for s in range(len(members))],
                list(range(len(hosts) - len(spares), len(hosts))), swap_days)
  for day, h, kind in _host_events(down, hosts):
    book.swaps_until(day)
    (book.fail if kind == 'fail' else book.repair)(h, day)
  book.swaps_until(math.inf)
  for s, since in book.down_since.items():
    book.spans.setdefault(s, []).append((since, math.inf))
  return {s: fault_log.merged(spans) for s, spans in book.spans.items()}
