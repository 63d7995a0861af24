"""A supervised process watches its supervisor: gone or stopped, the job stops at an agreed step.

The supervisor (supervisor.py) hands each process the read end of a pipe whose only write end it
holds, and says so in SUPERVISOR_ENV (records/job.py Handoff: `fd:N:PID:S`). The kernel closes
the write end however the supervisor ends (an exit, SIGKILL, a crash), so the process sees
end-of-file at once; no polling of a pid that the system may reuse. A process started through
a remote shell (the pod controller) gets `parent` instead: its parent (the ssh session or the
controller) ending re-parents it, which it sees by its parent pid. Either way a supervisor that
stays stopped (SIGSTOP, a suspended terminal) for its S seconds (STOPPED_S) counts as gone: it
would see no death and restart nothing. What follows is the stop request's (run/stop.py): every
process votes with the step's metrics, so all stop after the same step, snapshotted, with
run_state.json `stopped`. A process that makes no progress after that (blocked in a collective
whose peer is stopped or gone unreported) ends by itself past its own stall deadline
(records/deadlines.py) with exit ABANDONED: nothing would ever end it otherwise.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from typing import Callable

from mecefo_jax.records import deadlines, progress_marks
from mecefo_jax.records.job import ABANDONED, SUPERVISOR_ENV, Handoff, process_state
from mecefo_jax.records.progress_marks import ProgressMark
from mecefo_jax.run import ending

log = logging.getLogger('mecefo')
_LOOK_S = 1.0


class Watch:
  """A daemon thread that calls `on_gone(reason)` once when the supervisor `handoff` names is
  gone or stays stopped for its `stopped_s`, then `on_stuck(why)` if this process's progress
  mark (`mark()`) stays unchanged past its own deadline."""

  def __init__(self, handoff: Handoff, on_gone: Callable[[str], None],
               on_stuck: Callable[[str], None],
               mark: Callable[[], ProgressMark | None] = progress_marks.current):
    self.on_gone, self.on_stuck, self.mark = on_gone, on_stuck, mark
    self.fd, self.stopped_s = handoff.fd, handoff.stopped_s
    self.pid = os.getppid() if handoff.fd is None else handoff.pid
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
    self.on_gone(reason := self._wait_until_gone())
    self._end_when_stuck(reason)

  def _wait_until_gone(self) -> str:
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
        return reason

  def _end_when_stuck(self, reason: str) -> None:
    """Once asked to stop, the process is its own stall watch: no new progress mark for its own
    deadline (records/deadlines.py), counted from the later of its last mark and the
    supervisor's end, calls `on_stuck` (a peer it waits for in a collective may never come:
    stopped, or gone with a host whose death no one will report)."""
    gone_at = time.time()
    # The process holding the job's coordination service ends last: its end would make jax
    # abort the others (a C++ trace) before they could say their line (seen in the suite).
    grace_s = ending.SERVICE_LINGER_S if ending.hosts_service() else 0.0
    while True:
      time.sleep(_LOOK_S)
      mark = self.mark()
      quiet_s = time.time() - max(gone_at, mark.since if mark else gone_at)
      if quiet_s > (deadline_s := deadlines.own_deadline(mark) + grace_s):
        where = (f'{mark.phase} at step {mark.step}' if mark else 'its start-up')
        self.on_stuck(f'{reason} and this process has made no progress for {quiet_s:.0f} s '
                      f'(in {where}; its own deadline {deadline_s:.0f} s)')
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

  def stuck(why: str) -> None:
    print(f'error: {why}: exit {ABANDONED} without a final snapshot (its last one stands: '
          "resume with the supervisor's command)", file=sys.stderr, flush=True)
    os._exit(ABANDONED)  # the main thread may be inside a collective that never returns
  return Watch(Handoff.from_env(spec), gone, stuck) if spec else None
