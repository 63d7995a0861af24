"""What each test pays for, where $MECEFO_TEST_COSTS names a file: one JSON line per test with its
wall (setup, call and teardown), its CPU seconds (this process and the descendants it waited
for: a test that waits on deadlines shows less CPU than wall), the processes it started
(procs.Launcher) and the XLA compiles it ran in this process (count, seconds). benchmarks/suite_table.py makes docs/development.md's
table of the slowest tests from these lines and pytest's own durations (--junitxml)."""
from __future__ import annotations

import json
import os
import resource
import time

from mecefo_jax.step.program_store import compile_counts
from procs import Launcher, forked_cpu_s

COSTS_ENV = 'MECEFO_TEST_COSTS'


def _cpu_s() -> float:
  """CPU seconds (user + system) of this process and of every descendant it has waited for,
  the fork server's children among them (tests/forkserver.py)."""
  return forked_cpu_s() + sum(u.ru_utime + u.ru_stime for u in (
      resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def mark() -> tuple[float, int, float, int, float]:
  """This pytest process's totals now: time, XLA compiles (step/program_store.py counts every
  one; a program loaded from a store is none) and their seconds, processes started, CPU s."""
  c = compile_counts()
  return (time.perf_counter(), c['booked'] + c['other'], c['booked_s'] + c['other_s'],
          Launcher.starts, _cpu_s())


def write(nodeid: str, since: tuple[float, int, float, int, float]) -> None:
  """One line for test `nodeid` (the totals since the `mark` `since`) to $MECEFO_TEST_COSTS."""
  path = os.environ.get(COSTS_ENV)
  if not path:
    return
  now = mark()
  line = {'test': nodeid, 'wall_s': round(now[0] - since[0], 3),
          'compiles': now[1] - since[1], 'compile_s': round(now[2] - since[2], 3),
          'processes': now[3] - since[3], 'cpu_s': round(now[4] - since[4], 3)}
  with open(path, 'a') as f:  # one short line per write: whole lines from both workers
    f.write(json.dumps(line) + '\n')
