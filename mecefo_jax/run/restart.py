"""The restart after a death: its seconds in the goodput (`restart`) and on the plot's time axis."""
from __future__ import annotations

import time

from mecefo_jax.records import history
from mecefo_jax.records.history import HistoryLine, Kind
from mecefo_jax.records.snapshot_meta import SnapshotMeta


def deaths(lines: list[HistoryLine]) -> list[float]:
  """The times of the deaths and stalls the supervisor recorded in history.jsonl (launch-death
  and launch-stall lines: a stall's restart is a death's)."""
  return [line.t for line in lines if line.kind in (Kind.LAUNCH_DEATH, Kind.LAUNCH_STALL)]


def death_before_start(lines: list[HistoryLine]) -> float | None:
  """When the death that this start restarts after happened: the first launch-death line since
  the run's last start line; None where none is (a first start, a stop, a resume by hand)."""
  starts = [i for i, line in enumerate(lines) if line.kind is Kind.START]
  return next(iter(deaths(lines[starts[-1] + 1:] if starts else lines)), None)


def book(out_dir, controller, meta: SnapshotMeta | None) -> None:
  """Books in the `controller`'s goodput ledger (core/goodput.py) the restart that this start of the run in `out_dir`
  ends, its loop about to start, restored with snapshot `meta` (None: a start from step 0):
  from the death to now, less the compiles the start booked already (in `compile`)."""
  from mecefo_jax import multihost
  # Read quietly: the report's read of the file (steps_lost_total) warns of a damaged line.
  death = multihost.on_chief(lambda: death_before_start(history.read(out_dir, warn=False)))
  if death is None or meta is None:
    return
  compiled = controller.goodput['compile'] - meta.controller.goodput.get('compile', 0.0)
  controller.book('restart', max(0.0, time.time() - death - compiled))
