"""Step-time budget: how many rows each live slice runs exactly and how many degraded.

Units are granules of rows. A live slice's cost is `exact + cost * degraded` units; the budget is
a multiple of the fault-free slice's cost (its own micro-batch, all exact). Every row of the
step is processed by someone; among the assignments whose every slice stays within the budget,
the one with the fewest degraded rows is chosen. When no assignment fits, the budget is raised
to the smallest step time any assignment reaches (all rows degraded, spread evenly), and the
fewest degraded rows are chosen at that step time.
"""
from __future__ import annotations

import functools
import heapq
import math

import numpy as np

_EPS = 1e-9  # float slack: a cost equal to the budget fits


def balanced(total: int, parts: int) -> list[int]:
  """`total` split over `parts` as evenly as possible, larger parts first."""
  return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def counts(n_live: int, units: int, budget: float, cost: float) -> list[tuple[int, int]]:
  """[(exact, degraded) units] of `n_live` slices processing `units` units in all, each within
  `budget` units of cost when possible, with the fewest degraded units; larger loads first."""
  return list(_counts(n_live, units, budget, cost))


@functools.lru_cache(maxsize=1024)  # a failure replay asks for the same few live counts often
def _counts(n_live: int, units: int, budget: float, cost: float) -> tuple[tuple[int, int], ...]:
  if not 0.0 < cost < 1.0:
    raise ValueError(f'degraded cost must be in (0, 1), got {cost}')
  if n_live < 1 or units < 0 or budget <= 0:
    raise ValueError(f'need n_live >= 1, units >= 0, budget > 0; got {n_live}, {units}, {budget}')
  base = units if math.isinf(budget) else math.floor(budget + _EPS)  # exact, none degraded
  if n_live * base >= units:
    return tuple((r, 0) for r in balanced(units, n_live))
  most = math.floor(budget / cost + _EPS)  # degraded units one slice fits (then no exact)
  if n_live * most < units:  # cannot fit: the least step time reachable, cost * ceil(units / n)
    return _counts(n_live, units, cost * -(-units // n_live), cost)
  degraded = _fewest_degraded(n_live, units - n_live * base, budget, cost, base, most)
  return tuple(_fill(degraded, units, budget, cost))


def _fewest_degraded(n_live, deficit, budget, cost, base, most) -> list[int]:
  """Degraded units per slice covering `deficit` units beyond every slice's `base`, fewest in
  all: a min-plus dynamic programme over slices (capacity gained per degraded count is not
  linear, as exact rows come in whole units)."""
  gain = [math.floor(budget - cost * g + _EPS) + g - base for g in range(most + 1)]
  # Weight g * big + g^2: fewest degraded units first, then the most even split of them.
  big = (n_live * most) ** 2 + 1
  inf = np.iinfo(np.int64).max // 4
  best = np.full(deficit + 1, inf, np.int64)  # best[d]: least weight covering >= d so far
  best[0] = 0
  choices = []
  for _ in range(n_live):
    new, pick = best.copy(), np.zeros(deficit + 1, np.int64)
    for g in range(1, most + 1):
      shifted = best[np.maximum(np.arange(deficit + 1) - gain[g], 0)] + g * big + g * g
      better = shifted < new
      new[better], pick[better] = shifted[better], g
    best = new
    choices.append(pick)
  per_slice, d = [], deficit
  for pick in reversed(choices):
    g = int(pick[d])
    per_slice.append(g)
    d = max(d - gain[g], 0)
  return sorted(per_slice, reverse=True)


def _fill(degraded: list[int], units: int, budget: float, cost: float) -> list[tuple[int, int]]:
  """Exact units on top of each slice's degraded ones, as many as the budget allows, then taken
  one at a time from the most loaded slice until exactly `units` are processed."""
  exact = [math.floor(budget - cost * g + _EPS) for g in degraded]
  heap = [(-(e + g), -e, i) for i, (e, g) in enumerate(zip(exact, degraded))]
  heapq.heapify(heap)
  for _ in range(sum(exact) + sum(degraded) - units):
    _, _, i = heapq.heappop(heap)
    exact[i] -= 1
    heapq.heappush(heap, (-(exact[i] + degraded[i]), -exact[i], i))
  return sorted(zip(exact, degraded), key=lambda c: (-(c[0] + c[1]), -c[1]))
