"""The start-up clock: what a run waits for before its first step (report.json's `startup`)."""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Literal

from mecefo_jax.sections import entry

# What first_step_s counts from (Startup.first_step_from documents each).
ORIGINS = ('process', 'train.py', 'trainer')


@dataclasses.dataclass
class Startup:
  """report.json's `startup` section: this process's wait for its first step."""
  init_lower_s: float | None = entry('s', 'the initializer (params, AdamW state) traced and '
                                     'lowered; null when the state was restored')
  init_compile_s: float | None = entry('s', 'the initializer compiled ahead of time; null when '
                                       'restored')
  init_run_s: float | None = entry('s', 'the initializer run until the state exists (blocked); '
                                   'null when restored')
  init_loaded: bool | None = entry('', 'the initializer loaded from the program store '
                                   '(init_compile_s is then its load); null when restored')
  restore_s: float | None = entry('s', 'a resume: finding and restoring the newest usable snapshot '
                                  '(until the state exists; also when none was usable); null '
                                  'without resume')
  first_programs_s: float | None = entry('s', "the first step's programs compiled or loaded from "
                                         "the program store (the takeover's at a start with slices "
                                         'down)')
  first_step_run_s: float | None = entry('s', "the first step itself: from the training loop's "
                                         'start to its end, blocked on its metrics (data, '
                                         'dispatch, run)')
  first_step_s: float | None = entry('s', 'wall time from first_step_from to the end of this '
                                     "process's first step, blocked on its metrics; null if it "
                                     'trained none')
  first_step_from: Literal[ORIGINS] = entry('', "'process': the process start (train.py on Linux: "
                                            "/proc/self/stat), 'train.py': train.py's first "
                                            "statement (no /proc), 'trainer': Trainer() (a "
                                            'notebook or a script)')


# The clock's phases, filled by step/initializer.create, resume.initial_state and the trainer,
# in this order.
KEYS = tuple(f.name for f in dataclasses.fields(Startup))[:-1]
_entry: float | None = None  # time.time() at train.py's first statement, when it runs
_marks: dict[str, float] = {}  # train.py's start-up marks: time.time() at each (mark)


def mark(name: str) -> None:
  """train.py reached `name` ('jax_imported', 'distributed', 'imported'): a restart's
  breakdown (run/recovery_time.py) reads them."""
  _marks[name] = time.time()


def marks() -> dict[str, float]:
  return dict(_marks)


def mark_entry(at: float) -> None:
  """train.py's first statement: this process is a training run, so its first step is timed
  from the process start (`at`, train.py's time.time() before its imports, where /proc is not)."""
  global _entry
  _entry = at


def process_age_s() -> float | None:
  """Seconds since this process started, from Linux's /proc (the process's start in clock
  ticks after boot, against the uptime; 10 ms resolution); None where there is no /proc."""
  try:
    stat = Path('/proc/self/stat').read_text()
    uptime_s = float(Path('/proc/uptime').read_text().split()[0])
    start_ticks = int(stat.rsplit(')', 1)[1].split()[19])  # field 22; the name may hold spaces
  except (OSError, ValueError, IndexError):
    return None
  return max(0.0, uptime_s - start_ticks / os.sysconf('SC_CLK_TCK'))


def origin() -> tuple[float, str]:
  """(time.time() the first step's clock runs from, which of ORIGINS it is): the process start
  when train.py runs (else a notebook's kernel start would count), else now (a Trainer built in
  a running interpreter)."""
  if _entry is None:
    return time.time(), 'trainer'
  age = process_age_s()
  return (time.time() - age, 'process') if age is not None else (_entry, 'train.py')


class StartupClock:
  """Seconds of each start-up phase (`seconds`: KEYS, None until measured or where a phase did
  not happen) and of the whole wait for the first step."""

  def __init__(self):
    self.origin, self.origin_kind = origin()
    self.first_step_end: float | None = None  # time.time() at the first step's end
    self.seconds: dict[str, float | None] = dict.fromkeys(KEYS)
    self.compile_s = 0.0  # the state built and the first step's programs (report: compile_s)
    from mecefo_jax.step.program_store import compile_counts  # (jax: this module stays standard-only)
    self.compiles_at_start = compile_counts()  # report: programs.other_compiles
    self._loop_start: float | None = None

  def programs_built(self, first_programs_s: float | None, compile_s: float) -> None:
    """The first step's programs are built, `compile_s` after the state's build started."""
    self.seconds['first_programs_s'] = first_programs_s
    self.compile_s = compile_s

  def loop_started(self) -> None:
    """The training loop starts: the first step's own time runs from here."""
    self._loop_start = time.perf_counter()

  def step_done(self) -> None:
    """After a step's metrics were fetched (it is trained): the first one stops the clock."""
    if self.seconds['first_step_s'] is None:
      self.first_step_end = time.time()
      self.seconds['first_step_s'] = self.first_step_end - self.origin
      if self._loop_start is not None:
        self.seconds['first_step_run_s'] = time.perf_counter() - self._loop_start

  def report(self) -> Startup:
    return Startup(**self.seconds, first_step_from=self.origin_kind)

  def describe(self) -> str:
    """The start line's part: the state and the first step's programs (compile_s), then its
    phases: init lower+compile+run, restore, the first step's programs."""
    s = self.seconds
    parts = []
    if s['init_lower_s'] is not None:
      parts.append(f"init {s['init_lower_s']:.1f}+{s['init_compile_s']:.1f}+"
                   f"{s['init_run_s']:.1f}s (lower+compile+run)")
    if s['restore_s'] is not None:
      parts.append(f"restore {s['restore_s']:.1f}s")
    if s['first_programs_s'] is not None:
      parts.append(f"first programs {s['first_programs_s']:.1f}s")
    return (f'state + first programs {self.compile_s:.1f}s: ' + ', '.join(parts) if parts else
            'start-up not timed')
