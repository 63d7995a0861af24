"""One host of a job that Ray runs (ray_driver.py): the actor on the host's node that runs the
trainer as its child, answers for it (exit code, progress mark, process state) and stops the
job at an agreed step once the driver's lease runs out.

The trainer runs in a session of its own and dies with the actor's process (PR_SET_PDEATHSIG:
the actor killed, or its node gone). It watches the actor as a local process watches its
supervisor (run/supervised.py: the read end of a pipe whose write end the actor holds). The
actor is detached, so a driver that dies or is stopped does not kill the job at once: each of
the driver's looks renews a lease; past it the actor closes the pipe, every trainer of the job
asks for a stop after its next step (snapshotted, resumable), and the actor then leaves.
Needs Ray only where ray_driver.py makes it an actor; Linux (prctl, /proc).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mecefo_jax.job_rules import last_words, spawn_logged, wait_copied
from mecefo_jax.records.job import SUPERVISOR_ENV, Handoff, HostLook, cpu_seconds, process_state
from mecefo_jax.records.progress_marks import MARKS_ENV, mark_path, read_mark
from mecefo_jax.supervisor import free_port

# A node's own in-memory snapshot directory, in its raylet's environment (a node without one
# uses the trainer's default, the machine's /dev/shm: each machine has its own).
NODE_SNAPSHOT_DIR_ENV = 'MECEFO_NODE_SNAPSHOT_DIR'
GRACE_S = 60.0  # a stop at an agreed step, after the lease ran out, before the trainer is killed
# The child sets PR_SET_PDEATHSIG (1) to SIGKILL, checks that its parent is still the actor
# (it may have died before the prctl), then becomes the trainer: no preexec_fn in a process
# with Ray's threads.
_DIE_WITH_PARENT = ('import ctypes, os, sys\n'
                    'ctypes.CDLL(None, use_errno=True).prctl(1, 9)\n'
                    'if os.getppid() != int(sys.argv[1]): os._exit(137)\n'
                    'os.execv(sys.argv[2], sys.argv[2:])')


class Host:
  """The actor of logical host `host` in one job (ray_driver.py makes it remote)."""

  def __init__(self, host: int, lease_s: float):
    self.host, self.lease_s = host, lease_s
    self.child: subprocess.Popen | None = None
    self.tee: subprocess.Popen | None = None  # the copy of process 0's output to this actor's
    self.log, self.since = None, 0  # the trainer's output file, from this byte on
    self.renewed = time.monotonic()
    self.read_fd, self.write_fd = os.pipe()
    self.marks = Path(tempfile.mkdtemp(prefix='mecefo-marks-'))  # on this node
    threading.Thread(target=self._lease, daemon=True, name='mecefo-lease').start()

  def where(self) -> tuple[str, int]:
    """(This node's address, a TCP port free on it now): the coordinator of the job, asked of
    its process 0's actor."""
    import ray
    return ray.util.get_node_ip_address(), free_port('')

  def start(self, args: list[str], env: dict[str, str], log: str, stopped_s: float,
            echo: bool = False) -> int:
    """Starts `python -m mecefo_jax ARGS` (this node's Python) with the job's `env` over the
    node's; its output to `log` on this node (`echo`: its stderr to this actor's too, which Ray
    shows the driver: process 0's). Its pid."""
    self.renewed = time.monotonic()  # the first look comes after every host's start
    node_dir = os.environ.get(NODE_SNAPSHOT_DIR_ENV)
    args = [*args, f'snapshot.dir={node_dir}'] if node_dir else list(args)
    env = {**os.environ, **env, MARKS_ENV: str(self.marks),
           SUPERVISOR_ENV: Handoff(self.read_fd, os.getpid(), stopped_s).to_env()}
    self.log = Path(log)
    self.since = self.log.stat().st_size if self.log.exists() else 0
    cmd = [sys.executable, '-S', '-c', _DIE_WITH_PARENT, str(os.getpid()), sys.executable,
           '-m', 'mecefo_jax', *args]
    self.child, self.tee = spawn_logged(cmd, env, self.log, echo, pass_fds=(self.read_fd,),
                                        start_new_session=True)
    return self.child.pid

  def look(self) -> HostLook:
    """The trainer now; renews the driver's lease."""
    self.renewed = time.monotonic()
    pid, code = self.child.pid, self.child.poll()
    return HostLook(code, read_mark(mark_path(self.marks, self.host)), process_state(pid),
                    cpu_seconds(pid), None if code is None else self._words())

  def _words(self) -> str:
    """The trainer's last words (it exited): the tail of its output, its tee's copy done."""
    wait_copied(self.tee)
    return last_words(self.log, self.since)

  def signal(self, signum: int) -> None:
    if self.child.poll() is None:
      self.child.send_signal(signum)

  def kill(self) -> int:
    """SIGKILL to the trainer's process group (a stopped one too); its exit code."""
    if self.child.poll() is None:
      try:
        os.killpg(self.child.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    return self.child.wait()

  def wait(self) -> int:
    return self.child.wait()

  def close(self) -> None:
    """The trainer killed if it runs, its mark removed: the actor may go."""
    if self.child is not None:
      self.kill()
    wait_copied(self.tee, end=True)
    shutil.rmtree(self.marks, ignore_errors=True)

  def _lease(self) -> None:
    """Once no look renewed the lease for lease_s (the driver is gone or stopped): the job stops
    at an agreed step (the pipe's end), the trainer is killed past GRACE_S, the actor leaves."""
    while time.monotonic() - self.renewed <= self.lease_s:
      time.sleep(min(1.0, self.lease_s / 4))
    os.close(self.write_fd)
    if self.child is not None:
      try:
        self.child.wait(GRACE_S)
      except subprocess.TimeoutExpired:
        pass
    self.close()
    self._leave()

  def _leave(self) -> None:
    """The actor's process ends (its lease ran out): Ray sees the actor gone."""
    os._exit(0)
