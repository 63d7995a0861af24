"""Progress counted in loss: a step's rows priced by a degraded row's worth v and the noise scale r.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training"): the steps to a given loss
grow as 1 + B_noise/B, so a step whose rows are worth x of a full batch (x = (exact + v·degraded)
/ rows; a dropped row is worth nothing) makes rho(x) = x(1 + r)/(x + r) of a full step's
progress, r = B_noise/B. At r -> inf every sample counts alike (rho = x, the headline); at r = 1
(the critical batch) a shrunk batch loses less than its share. A run's loss-equivalent progress:
the fault-free run's time to its target loss over the time with failures, i.e. its steps'
progress over the fault-free steps of the same time. v is measured by benchmarks/row_value.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Sequence

ROW_VALUE = 'docs/results/row_value_tiny.json'  # v of the default (full MeCeFO) mode, measured
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


def read_v(path: str = ROW_VALUE, mode: str = 'full') -> dict:
  """{'v', 'v_ci95', 'source'}: the degraded row's worth measured for `mode`."""
  measured = json.loads(Path(path).read_text())
  m = measured['modes'][mode]
  return {'v': m['v'], 'v_ci95': m['v_ci95'], 'source': (
      f"{path}: mode {mode}, {len(m['seeds'])} seeds x {m['steps']} steps on "
      f"{measured['config']} at {measured['commit'][:7]}")}
