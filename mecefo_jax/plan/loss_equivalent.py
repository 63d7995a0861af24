"""Progress counted in loss: a step's rows priced by a degraded row's worth v and noise scale r."""
# McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training"): the steps to a given loss
# grow as 1 + B_noise/B, so a step whose rows are worth x of a full batch (x = (exact + v·degraded)
# / rows; a dropped row is worth nothing) makes rho(x) = x(1 + r)/(x + r) of a full step's progress,
# r = B_noise/B. At r -> inf every sample counts alike (rho = x, the headline); at r = 1 (the
# critical batch) a shrunk batch loses less than its share. A run's loss-equivalent progress: the
# fault-free run's time to its target loss over the time with failures, i.e. its steps' progress
# over the fault-free steps of the same time. v is measured by benchmarks/row_value.py.
from __future__ import annotations

import math
from typing import Mapping, Sequence

from mecefo_jax.plan import measured

R_SOURCE = ('r = B_noise/B (McCandlish et al. 2018, "An Empirical Model of Large-Batch '
            'Training"): r -> inf every sample counts alike; r = 1 the critical batch')


def progress(x: float, r: float) -> float:
  """A step's progress relative to a full batch's, its rows worth `x` of a full batch."""
  return x if math.isinf(r) else x * (1.0 + r) / (x + r)


def percent(mix: Mapping[tuple[float, float], float], rows: int, fault_free_steps: float,
            v: float, r: float, keep: float = 1.0) -> float:
  """100 x the progress of the steps in `mix` ({(exact rows, degraded rows): steps}) over the
  fault-free run's `fault_free_steps` of `rows` rows in the same time; `keep`: the share of
  step time the snapshot tax leaves."""
  done = sum(n * progress((exact + v * degraded) / rows, r) for (exact, degraded), n in mix.items())
  return 100.0 * keep * done / fault_free_steps


def mean_progress_of_live(events: Sequence, n: int, horizon_s: float, r: float) -> float:
  """The time-mean of progress(live share) over the window: every live slice training exact
  rows at full pace, nothing else lost (`events`: a draw's timed slice events)."""
  down, t0, area = set(), 0.0, 0.0
  for e in events:
    area += progress(1.0 - len(down) / n, r) * (min(e.time_s, horizon_s) - t0)
    t0 = min(e.time_s, horizon_s)
    (down.add if e.kind == 'fail' else down.discard)(e.slice)
  area += progress(1.0 - len(down) / n, r) * (horizon_s - t0)
  return area / horizon_s


def read_v() -> dict:
  """{'v', 'v_ci95', 'source'}: the degraded row's worth measured for the default (full MeCeFO)
  mode (package data row_value)."""
  m, where = measured.fields('row_value'), measured.provenance('row_value')
  full = m['modes']['full']
  return {'v': full['v'], 'v_ci95': full['v_ci95'], 'source': (
      f"{where['source']}: mode full, {len(full['seeds'])} seeds x {full['steps']} steps on "
      f"{m['config']} at {where['commit'][:7]}")}


def read_thresholds() -> dict:
  """{'d', 'budget', 'spread_r1'}: a degraded row's cost against an exact row's by FLOPs (d) and
  the v a takeover must beat: d where the step time is kept (budget), 2d where the step is
  lengthened, at r = 1 (spread); measured with v (package data row_value)."""
  full = measured.fields('row_value')['modes']['full']
  return {'d': full['d_flops'], **full['thresholds_flops']}
