"""The goodput ledger: a run's wall time by category, booked by the controller step by step."""
from __future__ import annotations

import dataclasses
import enum
import time

from mecefo_jax.sections import entry


class Bucket(str, enum.Enum):
  """The goodput's time categories (seconds); the values are report.json's keys."""
  NORMAL = 'normal_productive'  # fault-free steps
  DEGRADED = 'degraded_productive'  # the processed share of steps under failure
  COMPILE = 'compile'  # programs built (compiled, loaded, moved) while the step waited
  REJOIN = 'rejoin'  # state copied onto repaired slices
  LOST = 'lost'  # the share of steps under failure whose rows nobody processed (drop)
  RESTART = 'restart'  # from a process's death to the next start's first step


KEYS = tuple(b.value for b in Bucket)
DOCS = {
    Bucket.NORMAL: 'steps with every slice live',
    Bucket.DEGRADED: 'share of steps under failure spent on the samples processed',
    Bucket.COMPILE: 'building programs (compile, load, move) while the step waited: the first '
                    "step's at start-up, new live sets, evals; not the initializer (compile_s)",
    Bucket.REJOIN: 'copying the state to repaired slices',
    Bucket.LOST: 'share of steps under failure standing for samples dropped (`drop` policy)',
    Bucket.RESTART: "after a death (the supervisor's): from it to the restarted loop, less its "
                    'compiles',
}
# report.json's `goodput` section: a float of seconds per bucket (reports before schema 8 lack
# `restart`: they still plot).
Seconds = dataclasses.make_dataclass(
    'Seconds', [(b.value, float, entry('s', DOCS[b], optional=b is Bucket.RESTART))
                for b in Bucket])
Seconds.__module__ = __name__


class Goodput:
  """Seconds by category. A step's time runs from the end of the previous step (snapshots and
  logging in between included) to its own end, minus the compile and rejoin booked meanwhile."""

  def __init__(self, seconds: dict | None = None):
    self.seconds = {**dict.fromkeys(KEYS, 0.0), **(seconds or {})}
    self._last_end: float | None = None  # None: the next step's time starts when it starts
    self._start = self._overhead_at_start = 0.0

  def book(self, key: str, seconds: float) -> None:
    self.seconds[key] += seconds

  def start_step(self) -> None:
    self._start = self._last_end if self._last_end is not None else time.perf_counter()
    self._overhead_at_start = self._overhead()

  def end_step(self, processed_rows: int, total_rows: int, failed: bool) -> None:
    """Books the step: normal without failures; under failure the processed share is degraded
    productive and the share of rows that nobody processed (drop) is lost."""
    self._last_end = time.perf_counter()
    spent = self._last_end - self._start - (self._overhead() - self._overhead_at_start)
    if not failed:
      self.seconds[Bucket.NORMAL] += spent
    else:
      self.seconds[Bucket.DEGRADED] += spent * processed_rows / total_rows
      self.seconds[Bucket.LOST] += spent * (total_rows - processed_rows) / total_rows

  def exclude(self, seconds: float) -> None:
    """Time between two steps that is not step time (an eval): the next step does not pay it."""
    if self._last_end is not None:
      self._last_end += seconds

  def restart_clock(self) -> None:
    """After a resume: the next step's time starts when it starts."""
    self._last_end = None

  def report(self) -> Seconds:
    return Seconds(**self.seconds)

  def _overhead(self) -> float:
    return self.seconds[Bucket.COMPILE] + self.seconds[Bucket.REJOIN]
