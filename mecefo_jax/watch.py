"""The stall watch: a job whose processes' progress marks stop changing past a deadline measured
on the job itself has stalled; the process that stopped first is named where one can be.

Read by the supervisor (supervisor.py) every poll, without JAX: the marks are files
(records/progress_marks.py). A deadline is the largest allowance of the phases the processes are in
(records/deadlines.py: a multiple of what the job measured of each phase, with floors).

A process in a working phase (WORKING: starting, i.e. its imports and set-up; compiling;
evaluating) that uses CPU makes progress though it writes no mark: each CPU_WINDOW_S (half the
deadline where that is shorter), a share of at least CPU_BUSY of one core restarts the clock, for
at most CPU_CAP_S without a new mark. A cold compile
on a loaded machine takes minutes, and the CPU it uses says it is not hung; a hung start-up
(a peer that never comes, SIGSTOP) uses none.

`--stall-s S` makes every deadline S; 0 turns the watch off. docs/tpu.md says why these.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Container

from mecefo_jax.records import deadlines
from mecefo_jax.records.job import cpu_seconds, process_state
from mecefo_jax.records.progress_marks import ProgressMark, mark_path, read_mark

WORKING = ('starting', 'compiling', 'evaluating')
# 2% of a core: a compile starved on a 2-core machine at load 25 still gets ~8%; a process
# waiting in jax.distributed.initialize for a peer that never comes used 0.5% (5 ticks in 10 s,
# 2026-11-28, this project's 2-core CPU), its gRPC threads in bursts: a 5 s window evens them.
CPU_BUSY, CPU_WINDOW_S, CPU_CAP_S = 0.02, 5.0, 3600.0
_STOPPED_STATES = ('T', 't')  # /proc/PID/stat: stopped by a signal, or by a tracer


@dataclasses.dataclass(frozen=True)
class Stall:
  """A stall: the process that stopped first (None: none could be singled out), why it is that
  one, each process's mark, how long nothing changed and the deadline that ran out."""
  host: int | None
  why: str
  marks: dict[int, ProgressMark | None]  # {host: its mark, None where it wrote none}
  stopped: tuple[int, ...]  # hosts whose process is stopped (SIGSTOP)
  waited_s: float
  deadline_s: float
  deadline_from: str  # what set it: 'measured', 'first' (nothing measured yet), '--stall-s'

  @property
  def start_up(self) -> bool:
    """Every process was still starting (no step dispatched yet)."""
    return all(m is None or m.step < 0 for m in self.marks.values())

  def where(self, host: int, stopped: bool = True) -> str:
    """'training at step 41' / 'starting (jax.distributed.initialize)' / 'no mark yet';
    `stopped`: says so where its process is stopped."""
    mark = self.marks.get(host)
    if mark is None:
      return 'starting (no mark yet: importing)'
    detail = f' ({mark.detail})' if mark.detail else ''
    at = f' at step {mark.step}' if mark.step >= 0 else ''
    return f'{mark.phase}{detail}{at}' + (
        ' (stopped: SIGSTOP)' if stopped and host in self.stopped else '')

  def phases(self) -> str:
    return ', '.join(f'host {h} {self.where(h)}' for h in sorted(self.marks))

  def line(self) -> str:
    """The supervisor's one line."""
    what = 'hung in start-up' if self.start_up else 'stalled'
    head = (f'the job {what}: no progress for {self.waited_s:.1f} s (deadline '
            f'{self.deadline_s:.1f} s, {self.deadline_from}); ')
    if self.host is None:
      return head + (f'no process could be singled out ({self.phases()}): restarting the whole '
                     'job from its last snapshot')
    return head + (f'host {self.host} stopped first, in {self.where(self.host, False)} '
                   f'({self.why}); '
                   f'the others: ' + ', '.join(f'host {h} {self.where(h)}' for h in
                                               sorted(self.marks) if h != self.host))

  def record(self) -> dict:
    """The history.jsonl fields (launch-stall): `note` is failures.txt's line for it."""
    return {'host': self.host, 'why': self.why, 'start_up': self.start_up,
            'waited_s': round(self.waited_s, 3), 'deadline_s': round(self.deadline_s, 3),
            'deadline_from': self.deadline_from, 'stopped': list(self.stopped),
            'phases': {str(h): _seen(m) for h, m in sorted(self.marks.items())},
            'note': (f'host {self.host} stopped first, in {self.where(self.host)}; '
                     if self.host is not None else 'none singled out, the whole job restarted; ')
                    + self.phases()}


def _seen(mark: ProgressMark | None) -> dict:
  """What a stall line keeps of a host's mark (each None where it wrote none)."""
  if mark is None:
    return dict.fromkeys(('phase', 'detail', 'step', 'pid'))
  return {'phase': mark.phase, 'detail': mark.detail, 'step': mark.step, 'pid': mark.pid}


class LocalMarks:
  """Where the watch reads a job's marks and process states: files and /proc on this machine.
  A driver of processes elsewhere hands the watch what its processes report instead
  (ray_driver.py)."""

  def __init__(self, directory: Path):
    self.directory = Path(directory)

  def mark(self, host: int, pid: int) -> ProgressMark | None:
    return read_mark(mark_path(self.directory, host))

  def state(self, host: int, pid: int) -> str | None:
    return process_state(pid)

  def cpu_seconds(self, host: int, pid: int) -> float | None:
    return cpu_seconds(pid)


class StallWatch:
  """The marks of the job's processes, looked at each poll; `look()` says when it stalled.
  What it measured carries over to the next job of the same supervisor (a restart).
  `reader`: where marks and states come from (LocalMarks of `directory` by default)."""

  def __init__(self, directory: Path, stall_s: float | None = None, reader=None):
    self.directory, self.stall_s = Path(directory), stall_s
    self.reader = reader or LocalMarks(self.directory)
    self.measured: dict[str, float] = {}  # phase key -> the longest seen, over the job's starts
    self.pids: dict[int, int] = {}
    self.marks: dict[int, ProgressMark] = {}
    self.changed_at = self.marked_at = time.monotonic()
    self._cpu: dict[int, tuple[float, float]] = {}  # host -> (when, its CPU seconds then)

  @property
  def enabled(self) -> bool:
    return self.stall_s != 0

  def start(self, pids: dict[int, int]) -> None:
    """A new job of hosts {host: pid}. An earlier job's marks are left where they are (a new
    process truncates its file; look() reads only the marks of these pids): deleting them now
    could delete a mark that a new process has just made."""
    self.pids, self.marks = dict(pids), {}
    self.changed_at = self.marked_at = time.monotonic()
    # The first window ends a window after the job's start, not after the first look (late on
    # a loaded machine).
    self._cpu = {host: (self.changed_at, used) for host, pid in self.pids.items()
                 if (used := self.reader.cpu_seconds(host, pid)) is not None}

  def look(self, now: float | None = None) -> Stall | None:
    """Reads the marks; a Stall once none changed for longer than the deadline."""
    now = time.monotonic() if now is None else now
    for host, pid in self.pids.items():
      mark = self.reader.mark(host, pid)
      if mark is None or mark.pid != pid:
        continue  # none yet, half-written, or an earlier process's
      if mark != self.marks.get(host):
        self.marks[host], self.changed_at = mark, now
        self.marked_at = now
        for key, seconds in mark.longest.items():
          self.measured[key] = max(self.measured.get(key, 0.0), seconds)
    if not self.enabled:
      return None
    deadline, source = self.deadline()
    if self._working(now, min(CPU_WINDOW_S, deadline / 2)):
      self.changed_at = now
    waited = now - self.changed_at
    if waited <= deadline:
      return None
    host, why, stopped = self.first_stopped()
    return Stall(host, why, {h: self.marks.get(h) for h in self.pids}, stopped, waited,
                 deadline, source)

  def _working(self, now: float, window_s: float) -> bool:
    """Whether a process in a WORKING phase used at least CPU_BUSY of a core over the last
    `window_s` (sampled each window, two or more within a deadline; CPU_CAP_S after the last
    new mark, no longer)."""
    busy = False
    for host, pid in self.pids.items():
      mark = self.marks.get(host)
      if (mark.phase if mark else 'starting') not in WORKING:
        self._cpu.pop(host, None)
        continue
      used = self.reader.cpu_seconds(host, pid)
      then, before = self._cpu.get(host, (None, None))
      if used is None or then is not None and now - then < window_s:
        continue
      self._cpu[host] = (now, used)
      busy |= then is not None and used - before >= CPU_BUSY * (now - then)
    return busy and now - self.marked_at <= CPU_CAP_S

  def deadline(self) -> tuple[float, str]:
    """The largest allowance of the phases the processes are in now."""
    timed = [t for m in self.marks.values() if (t := deadlines.step_s(m)) is not None]
    keys = [deadlines.phase_key(self.marks.get(h)) for h in self.pids] or ['starting']
    step_s = max(timed, default=None)
    return max(deadlines.allowance(k, self.measured, step_s, self.stall_s) for k in keys)

  def stopped_peer(self, exited: Container[int]) -> Stall | None:
    """The stall of a host still running whose process is stopped (SIGSTOP) while others have
    exited for a lost peer: it is the peer they lost, before its deadline (a fresh job's
    phases are not measured yet: theirs can outlast the collectives' timeout); else None."""
    host, why, stopped = self.first_stopped()
    if host is None or host in exited or host not in stopped:
      return None
    waited = time.monotonic() - self.changed_at
    return Stall(host, why, {h: self.marks.get(h) for h in self.pids}, stopped, waited, waited,
                 'its peers lost it')

  def first_stopped(self) -> tuple[int | None, str, tuple[int, ...]]:
    """(The host that stopped first, why that one, the hosts whose process is stopped): a
    stopped process (SIGSTOP) first, else the one alone behind the others (the lowest step
    dispatched, then the fewest marks since: it never reached the wait the others are in)."""
    stopped = tuple(h for h, pid in self.pids.items()
                    if self.reader.state(h, pid) in _STOPPED_STATES)
    at = {h: self._position(self.marks.get(h)) for h in self.pids}
    if stopped:
      first = min(stopped, key=lambda h: at[h])
      return first, 'its process is stopped (SIGSTOP)', stopped
    lowest = min(at.values(), default=None)
    behind = [h for h, p in at.items() if p == lowest]
    if len(behind) == 1 and len(at) > 1:
      return behind[0], 'it never reached the point the others wait in', stopped
    return None, 'every process is at the same point', stopped

  @staticmethod
  def _position(mark: ProgressMark | None) -> tuple[int, int]:
    return (mark.step, mark.in_step) if mark else (-2, 0)


def kill_group(proc: subprocess.Popen) -> None:
  """SIGKILL to `proc`, and to its process group where it leads one of its own (never the
  supervisor's); SIGKILL ends a stopped (SIGSTOP) process too."""
  try:
    if os.getpgid(proc.pid) == proc.pid != os.getpgrp():
      os.killpg(proc.pid, signal.SIGKILL)
    else:
      proc.kill()
  except ProcessLookupError:
    pass
  proc.wait()
