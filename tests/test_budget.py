"""The step-time budget planner against a brute force over every assignment (small cases)."""
import itertools
import math

import pytest

from mecefo_jax.core import budget

EPS = 1e-9


def _brute(n_live, units, budget_units, cost):
  """(fewest degraded units within the budget or None, least max cost, fewest degraded at it)."""
  per_slice = [(e, g) for e in range(units + 1) for g in range(units + 1 - e)]
  fewest, least_cost, fewest_at_least = None, math.inf, None
  for combo in itertools.product(per_slice, repeat=n_live):
    if sum(e + g for e, g in combo) != units:
      continue
    degraded = sum(g for _, g in combo)
    top = max(e + cost * g for e, g in combo)
    if top <= budget_units + EPS and (fewest is None or degraded < fewest):
      fewest = degraded
    if top < least_cost - EPS or (abs(top - least_cost) <= EPS and degraded < fewest_at_least):
      least_cost, fewest_at_least = top, degraded
  return fewest, least_cost, fewest_at_least


CASES = [(n, b, t, c) for n, b in ((2, 3), (3, 2), (3, 3), (4, 2)) for t in (1.0, 1.2, 1.5, 2.0)
         for c in (0.3, 0.5, 0.65, 0.9)]


@pytest.mark.parametrize('n_slices, micro_units, time_budget, cost', CASES)
def test_fewest_degraded_rows_within_budget_as_brute_force(n_slices, micro_units, time_budget,
                                                           cost):
  units = n_slices * micro_units  # every slice's rows, on one slice fewer
  for n_live in range(1, n_slices):
    got = budget.counts(n_live, units, time_budget * micro_units, cost)
    assert len(got) == n_live and sum(e + g for e, g in got) == units  # every row once
    fewest, least_cost, fewest_at_least = _brute(n_live, units, time_budget * micro_units, cost)
    top = max(e + cost * g for e, g in got)
    degraded = sum(g for _, g in got)
    if fewest is not None:  # the budget can be met: met, with the fewest degraded rows
      assert top <= time_budget * micro_units + EPS and degraded == fewest, (got, fewest)
    else:  # it cannot: the least step time, with the fewest degraded rows at it
      assert top == pytest.approx(least_cost) and degraded == fewest_at_least, got


def test_no_failure_and_ample_budget_degrade_nothing():
  assert budget.counts(4, 16, 4.0, 0.65) == [(4, 0)] * 4
  assert budget.counts(3, 16, math.inf, 0.65) == [(6, 0), (5, 0), (5, 0)]


def test_large_cluster_plan_covers_every_row_and_spreads_degraded_rows():
  got = budget.counts(255, 256 * 8, 8.0, 0.65)  # one of 256 down, budget 1.0
  assert sum(e + g for e, g in got) == 256 * 8
  assert max(g for _, g in got) <= 3  # spread thin, not piled on a neighbour


@pytest.mark.parametrize('bad', [(0, 4, 1.0, 0.5), (2, 4, 1.0, 1.0), (2, 4, 0.0, 0.5)])
def test_bad_arguments_are_refused(bad):
  with pytest.raises(ValueError):
    budget.counts(*bad)
