"""A supervised process watches its supervisor: gone or stopped, the job stops at an agreed step.

The supervisor (supervisor.py) hands each process the read end of a pipe whose only write end it
holds, and says so in SUPERVISOR_ENV (`fd:N:PID`). The kernel closes the write end however the
supervisor ends (an exit, SIGKILL, a crash), so the process sees end-of-file at once; no
polling of a pid that the system may reuse. A process started through a remote shell (the pod
controller) gets `parent` instead: its parent (the ssh session or the controller) ending
re-parents it, which it sees by its parent pid. Either way a supervisor that stays stopped
(SIGSTOP, a suspended terminal) for STOPPED_S counts as gone: it would see no death and restart
nothing. What follows is the stop request's (run/stop.py): every process votes with the step's
metrics, so all stop after the same step, snapshotted, with run_state.json `stopped`.
Standard library only: the supervisor imports it too.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger('mecefo')
SUPERVISOR_ENV = 'MECEFO_SUPERVISOR'
STOPPED_S = 30.0  # a supervisor stopped this long is gone (a terminal's Ctrl-Z stops the workers too)
_LOOK_S = 1.0


def handed_down(read_fd: int, supervisor_pid: int, stopped_s: float = STOPPED_S) -> str:
  """The SUPERVISOR_ENV value that hands `read_fd` down to a process of `supervisor_pid`, which
  stops the job once that supervisor has been stopped for `stopped_s`."""
  return f'fd:{read_fd}:{supervisor_pid}:{stopped_s:g}'


def _stat_fields(pid: int) -> list[str] | None:
  """The fields of /proc/PID/stat after the command name (the state first), None where it
  cannot be read (the process is gone, or this is no Linux)."""
  try:
    return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()
  except (OSError, IndexError):
    return None


def process_state(pid: int) -> str | None:
  """The state letter of /proc/PID/stat ('T': stopped), None where it cannot be read."""
  fields = _stat_fields(pid)
  return fields[0] if fields else None


def cpu_seconds(pid: int) -> float | None:
  """The CPU time process `pid` has used (user + system, all its threads), None where it
  cannot be read."""
  fields = _stat_fields(pid)
  if not fields or len(fields) < 13:
    return None
  return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')  # utime, stime


class Watch:
  """A daemon thread that calls `on_gone(reason)` once when the supervisor is gone or stays
  stopped for `stopped_s`."""

  def __init__(self, spec: str, on_gone: Callable[[str], None], stopped_s: float = STOPPED_S):
    self.on_gone, self.stopped_s = on_gone, stopped_s
    kind, _, rest = spec.partition(':')
    if kind == 'fd':
      fd, pid, *given = rest.split(':')
      self.fd, self.pid = int(fd), int(pid)
      self.stopped_s = float(given[0]) if given else stopped_s
    elif kind == 'parent':
      self.fd, self.pid = None, os.getppid()
    else:
      raise ValueError(f'{SUPERVISOR_ENV}={spec!r}: expected fd:N:PID[:SECONDS] or parent')
    self._thread = threading.Thread(target=self._run, daemon=True, name='mecefo-supervisor')
    self._thread.start()

  def _gone(self) -> str | None:
    """Why the supervisor counts as gone now, or None (waits up to _LOOK_S)."""
    if self.fd is not None:
      ready, _, _ = select.select([self.fd], [], [], _LOOK_S)
      if ready and not os.read(self.fd, 1):
        return f'the supervisor (pid {self.pid}) is gone'
    else:
      time.sleep(_LOOK_S)
      if os.getppid() != self.pid:
        return f'the supervisor (parent pid {self.pid}) is gone'
    return None

  def _run(self) -> None:
    stopped_since = None
    while True:
      reason = self._gone()
      if reason is None and process_state(self.pid) in ('T', 't'):
        stopped_since = stopped_since or time.monotonic()
        if time.monotonic() - stopped_since >= self.stopped_s:
          reason = (f'the supervisor (pid {self.pid}) has been stopped for '
                    f'{self.stopped_s:.0f} s')
      elif reason is None:
        stopped_since = None
      if reason is not None:
        self.on_gone(reason)
        return


def leave_ctrl_c_to_the_supervisor() -> None:
  """A supervised process ignores SIGINT. A terminal's Ctrl-C reaches the whole process group:
  the supervisor alone answers it, asking every process to stop after one agreed step. A SIGINT
  of the process's own could land before or after that request, and a second one ends the
  process without a snapshot while its peers wait in a collective (a hang, or a fatal dump:
  seen at load 13+). Main thread, before jax is imported."""
  if os.environ.get(SUPERVISOR_ENV):
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def watch_supervisor(stop_request) -> Watch | None:
  """Starts the watch SUPERVISOR_ENV asks for (a supervised process), else None; the
  supervisor gone, `stop_request` (run/stop.py) asks the job to stop after its next step."""
  spec = os.environ.pop(SUPERVISOR_ENV, None)  # this process's own: not its children's

  def gone(why: str) -> None:
    log.warning('%s: stopping the job after its next step (snapshotted, resumable with the '
                "supervisor's command)", why)
    stop_request.request(why)
  return Watch(spec, gone) if spec else None
