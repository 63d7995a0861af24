"""The job's protocol: what a supervisor and its training processes tell each other (exit codes,
the stop request, the supervisor's hand-down, the launch command, a Ray host's look) and what
the supervisor reads of a process in /proc. Standard library only: every supervisor imports it."""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
from pathlib import Path

from mecefo_jax.records.progress_marks import ProgressMark
from mecefo_jax.sections import entry

# ---- exit codes: train.py's and its supervisor's (docs/errors.md) ------------------------------

BAD_INPUT = 2  # config, flags, data or run directory: one `error: ...` line
ALL_DOWN = 3  # every slice down: stopped, resumable once slices are back
DIVERGED = 4  # a non-finite training loss
CHECKPOINTS_FAILING = 5  # durable saves kept failing: stopped, resumable from in-memory snapshots
OUTPUTS_FAILING = 6  # a run-directory write failed (a full disk): stopped after its step, resumable
PEER_LOST = 7  # a collective failed: a peer process of the job is gone (one `error:` line)
# The supervisor gone and this process without a new progress mark past its own deadline (stuck
# in a collective with a stopped peer): it ends where it is, its last snapshot stands.
ABANDONED = 8
STOPPED = 128 + signal.SIGTERM  # SIGTERM or Ctrl-C: checkpointed at the end of a step, resumable
INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C without a final snapshot (too early, or twice)
# train.py's own stops: every process of a job exits with them alike, so none is a death.
JOB_EXITS = {BAD_INPUT: 'bad input', ALL_DOWN: 'all slices down', DIVERGED: 'diverged',
             CHECKPOINTS_FAILING: 'durable checkpoints failing',
             OUTPUTS_FAILING: 'run directory not writable'}

# ---- the stop request (run/stop.py honours it) ------------------------------------------------

# A file in the run directory asking the job to stop after its current step (its text: why).
# The supervisor writes it to grow the job back: unlike a signal it cannot arrive before a
# process can honour it, so where the job stops does not depend on timing.
STOP_FILE = 'stop_request'
SIGINT_REASON = 'SIGINT (Ctrl-C)'  # its text for a Ctrl-C (the run's exit code tells it apart)

# ---- the launch command, which the processes' hints print (run/hints.py) ----------------------

# The supervisor's own command line, which it hands to the processes it starts: a run it made
# is resumed by rerunning it (the restarts are its job, --host-slot and all). Its arguments,
# and the command they were given to (`mecefo-launch` or `python -m mecefo_jax.launch`).
LAUNCH_ENV = 'MECEFO_LAUNCH_ARGS'
LAUNCH_COMMAND_ENV = 'MECEFO_LAUNCH_COMMAND'
LAUNCH_MODULE = 'mecefo_jax.launch'


def command(module: str, argv0: str | None = None) -> str:
  """How the user started the command of `module`: an installed script by its name
  (pyproject.toml's [project.scripts]: `mecefo-launch`), else `python -m MODULE`."""
  name = Path(sys.argv[0] if argv0 is None else argv0).name
  return name if name.startswith('mecefo-') else f'python -m {module}'


# ---- the supervisor's hand-down (run/supervised.py watches it) --------------------------------

SUPERVISOR_ENV = 'MECEFO_SUPERVISOR'
STOPPED_S = 30.0  # a supervisor stopped this long is gone (Ctrl-Z stops the workers too)
PARENT = 'parent'  # SUPERVISOR_ENV of a process whose parent watches it (a remote shell's session)


@dataclasses.dataclass(frozen=True)
class Handoff:
  """What a supervised process watches (SUPERVISOR_ENV): the read end `fd` of a pipe whose only
  write end supervisor `pid` holds, or (`fd` None) its parent process; a supervisor stopped
  (SIGSTOP) for `stopped_s` counts as gone."""
  fd: int | None = entry('', 'the read end of the supervisor\'s pipe; None: watch the parent',
                         default=None)
  pid: int | None = entry('', 'the supervisor\'s pid (None: the parent\'s, looked up)',
                          default=None)
  stopped_s: float = entry('s', 'a supervisor stopped this long is gone', default=STOPPED_S)

  def to_env(self) -> str:
    """`fd:N:PID:S`, or `parent`."""
    return PARENT if self.fd is None else f'fd:{self.fd}:{self.pid}:{self.stopped_s:g}'

  @classmethod
  def from_env(cls, spec: str) -> Handoff:
    """The hand-down SUPERVISOR_ENV holds (`fd:N:PID[:SECONDS]` or `parent`); ValueError for
    anything else."""
    kind, _, rest = spec.partition(':')
    if kind == 'fd':
      fd, pid, *given = rest.split(':')
      return cls(int(fd), int(pid), float(given[0]) if given else STOPPED_S)
    if spec == PARENT:
      return cls()
    raise ValueError(f'{SUPERVISOR_ENV}={spec!r}: expected fd:N:PID[:SECONDS] or {PARENT}')


# ---- a Ray host's answer to the driver's look (ray_host.py, ray_driver.py) --------------------

@dataclasses.dataclass(frozen=True)
class HostLook:
  """The trainer of a Ray host now, as its actor answers the driver's look (all None: no
  answer yet)."""
  code: int | None = entry('', 'its exit code, None while it runs', default=None)
  mark: ProgressMark | None = entry('', 'its progress mark, None before the first or where read '
                                    'half-written', default=None)
  state: str | None = entry('', 'its /proc state letter (process_state), None where unread',
                            default=None)
  cpu: float | None = entry('s', 'the CPU time it used (cpu_seconds), None where unread',
                            default=None)
  words: str | None = entry('', 'the tail of its output once it exited (its last words: an '
                            "abort's cause), None while it runs", default=None)


# ---- what the supervisor reads of a process in /proc -------------------------------------------

def stat_fields(pid: int) -> list[str] | None:
  """The fields of /proc/PID/stat after the command name (the state first), None where it
  cannot be read (the process is gone, or this is no Linux)."""
  try:
    return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()
  except (OSError, IndexError):
    return None


def process_state(pid: int) -> str | None:
  """The state letter of /proc/PID/stat ('T': stopped), None where it cannot be read."""
  fields = stat_fields(pid)
  return fields[0] if fields else None


def cpu_seconds(pid: int) -> float | None:
  """The CPU time process `pid` has used (user + system, all its threads), None where it
  cannot be read."""
  fields = stat_fields(pid)
  if not fields or len(fields) < 13:
    return None
  return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')  # utime, stime
