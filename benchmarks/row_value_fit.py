"""What a degraded row is worth, from eval curves: make-up steps to the fault-free loss, and v
fitted as a slope over the shares taken over, with a bootstrap interval over seeds.

Pure numpy: benchmarks/row_value.py trains the arms; tests check the arithmetic here.
"""
from __future__ import annotations

import numpy as np


def crossing_step(evals: list[tuple[int, float]], target: float) -> float | None:
  """The first step at which the eval curve reaches `target`, linear between evals (None: it
  never does)."""
  prev = None
  for step, loss in evals:
    if loss <= target:
      if prev is None or prev[1] == loss:
        return float(step)
      s0, l0 = prev
      return s0 + (step - s0) * (l0 - target) / (l0 - loss)
    prev = (step, loss)
  return None


def make_up_steps(evals: list[tuple[int, float]], target: float, steps: int) -> float | None:
  """Steps beyond the fault-free run's `steps` an arm needs to reach its final eval loss
  `target` (negative: it got there sooner; None: not within the steps it ran)."""
  t = crossing_step(evals, target)
  return None if t is None else t - steps


def slope(p, m) -> float:
  """Least squares of m = a p through the origin (no faults, no make-up steps)."""
  p, m = np.asarray(p, float), np.asarray(m, float)
  return float(np.sum(p * m) / np.sum(p * p))


def row_value(points: dict[int, dict[str, list[tuple[float, float]]]]) -> float:
  """v = 1 - a_degraded / a_dropped from seed -> arm ('degraded' | 'dropped') -> [(p, m)]."""
  fit = lambda arm: slope(*zip(*(pm for s in points.values() for pm in s[arm])))
  return 1.0 - fit('degraded') / fit('dropped')


def bootstrap(points: dict, resamples: int = 2000, seed: int = 0) -> list[float]:
  """The 95% percentile interval of v over seeds resampled with replacement (a resample whose
  dropped slope is 0 is left out)."""
  rng, seeds, vs = np.random.default_rng(seed), list(points), []
  for _ in range(resamples):
    pick = rng.choice(len(seeds), len(seeds))
    sample = {i: points[seeds[j]] for i, j in enumerate(pick)}
    try:
      with np.errstate(divide='raise', invalid='raise'):
        vs.append(row_value(sample))
    except FloatingPointError:
      continue
  return [float(np.percentile(vs, 2.5)), float(np.percentile(vs, 97.5))]


def thresholds(d: float, r: float = 1.0) -> dict[str, float]:
  """The v a takeover must beat: `budget` (the step time kept) d; `spread` (the step lengthened)
  d (1 + r) / r, r = B_noise / B (McCandlish et al. 2018)."""
  return {'budget': d, f'spread_r{r:g}': d * (1.0 + r) / r}
