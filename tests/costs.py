"""What each test pays for, where $MECEFO_TEST_COSTS names a file: one JSON line per test with its
wall (setup, call and teardown), the processes it started (procs.Launcher) and the XLA compiles
it ran in this process (count, seconds). benchmarks/suite_table.py makes docs/development.md's
table of the slowest tests from these lines and pytest's own durations (--junitxml)."""
from __future__ import annotations

import json
import os
import time

import jax

from procs import Launcher

COSTS_ENV = 'MECEFO_TEST_COSTS'
# jax's event for one backend compile (jax/_src/dispatch.py BACKEND_COMPILE_EVENT); a program
# loaded from a store or cache does not record it.
COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'


class Costs:
  """Running totals of this pytest process: compiles (count, seconds), processes started."""

  def __init__(self):
    self.compiles, self.compile_s = 0, 0.0
    jax.monitoring.register_event_duration_secs_listener(self._event)

  def _event(self, event: str, seconds: float, **_) -> None:
    if event == COMPILE_EVENT:
      self.compiles += 1
      self.compile_s += seconds

  def mark(self) -> tuple[float, int, float, int]:
    return time.perf_counter(), self.compiles, self.compile_s, Launcher.starts

  def write(self, nodeid: str, since: tuple[float, int, float, int]) -> None:
    """One line for test `nodeid` (the totals since the `mark` `since`) to $MECEFO_TEST_COSTS."""
    path = os.environ.get(COSTS_ENV)
    if not path:
      return
    now = self.mark()
    line = {'test': nodeid, 'wall_s': round(now[0] - since[0], 3),
            'compiles': now[1] - since[1], 'compile_s': round(now[2] - since[2], 3),
            'processes': now[3] - since[3]}
    with open(path, 'a') as f:  # one short line per write: whole lines from both workers
      f.write(json.dumps(line) + '\n')


COSTS = Costs()
