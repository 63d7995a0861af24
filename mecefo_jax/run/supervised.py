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
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger('mecefo')
SUPERVISOR_ENV = 'MECEFO_SUPERVISOR'
STOPPED_S = 30.0  # a supervisor stopped this long is gone (a terminal's Ctrl-Z stops the workers too)
_LOOK_S = 1.0


def handed_down(read_fd: int, supervisor_pid: int) -> str:
  """The SUPERVISOR_ENV value that hands `read_fd` down to a process of `supervisor_pid`."""
  return f'fd:{read_fd}:{supervisor_pid}'


def process_state(pid: int) -> str | None:
  """The state letter of /proc/PID/stat ('T': stopped), None where it cannot be read."""
  try:
    return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0]
  except (OSError, IndexError):
    return None


class Watch:
  """A daemon thread that calls `on_gone(reason)` once when the supervisor is gone or stays
  stopped for `stopped_s`."""

  def __init__(self, spec: str, on_gone: Callable[[str], None], stopped_s: float = STOPPED_S):
    self.on_gone, self.stopped_s = on_gone, stopped_s
    kind, _, rest = spec.partition(':')
    if kind == 'fd':
      fd, _, pid = rest.partition(':')
      self.fd, self.pid = int(fd), int(pid)
    elif kind == 'parent':
      self.fd, self.pid = None, os.getppid()
    else:
      raise ValueError(f'{SUPERVISOR_ENV}={spec!r}: expected fd:N:PID or parent')
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


def watch_supervisor(stop_request) -> Watch | None:
  """Starts the watch SUPERVISOR_ENV asks for (a supervised process), else None; the
  supervisor gone, `stop_request` (run/stop.py) asks the job to stop after its next step."""
  spec = os.environ.pop(SUPERVISOR_ENV, None)  # this process's own: not its children's

  def gone(why: str) -> None:
    log.warning('%s: stopping the job after its next step (snapshotted, resumable with the '
                "supervisor's command)", why)
    stop_request.request(why)
  return Watch(spec, gone) if spec else None
