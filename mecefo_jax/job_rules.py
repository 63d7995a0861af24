"""How a supervisor reads its job, whatever runs its processes (here, ssh, Ray): their exits (a
death, a survivor's, a failed start-up, in words), the run they train (resumed, started) and
the TPU slices its hosts form (--slice-hosts: the unit that fails and rejoins whole)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from mecefo_jax import spawn
from mecefo_jax.config import ConfigError
from mecefo_jax.records import history, run_state
from mecefo_jax.records.history import Kind
from mecefo_jax.records.job import BAD_INPUT, JOB_EXITS, PEER_LOST, STOPPED

SURVIVOR_EXITS = (STOPPED, PEER_LOST)  # a process's exits that are not its death
# A death by SIGABRT may be a survivor's: gloo's checks (and jax's coordination client) abort a
# process whose peer died in a collective, and the peer's own exit can show a look later (a
# loaded suite run: gloo's "Received data size doesn't match expected size" on host 0 after
# host 1's SIGKILL, seen first, so host 0 was taken for the dead one), or half a minute later
# where the dead process is on another machine (Ray notices a lost node by its health checks).
ABORTED = -signal.SIGABRT
# What an abort's last words say when a peer's death caused it (jax 0.10.2, run here): gloo in a
# collective, or jax's coordination service ("The following tasks are unhealthy (stopped sending
# heartbeats)" in process 0, "Polled an error from coordination service" in each of the others).
PEER_WORDS = ('Connection closed by peer', 'Connection reset by peer', 'Socket closed',
              "Received data size doesn't match", 'Polled an error from coordination service',
              'JAX distributed service detected fatal errors', 'stopped sending heartbeats')
WORDS_BYTES = 8192  # the tail of a process's output read for its last words


def exit_text(code: int) -> str:
  if code < 0:
    return f'killed by {signal.Signals(-code).name}'
  names = {**JOB_EXITS, PEER_LOST: 'lost a peer'}
  return f'exit {code}' + (f' ({names[code]})' if code in names else '')


def dead(exited: dict[int, int], peer_aborted: set[int] = frozenset()) -> list[int]:
  """The hosts among `exited` ({host: code}) whose exit is a death (a signal, a crash), less
  those `peer_aborted` (aborts a peer's death caused: survivors)."""
  return [h for h, c in exited.items() if c != 0 and c not in JOB_EXITS and
          c not in SURVIVOR_EXITS and h not in peer_aborted]


def peer_caused(words: str) -> bool:
  """Whether an abort's last words say that a peer's death caused it (PEER_WORDS)."""
  return any(w in words for w in PEER_WORDS)


def blamed(died: list[int], exited: dict[int, int]) -> int | None:
  """Of the hosts that `died`, the one a restart is for: the first whose exit is not an abort;
  None when every one is an abort (the death that caused them may not show yet)."""
  return next((h for h in died if exited[h] != ABORTED), None)


def failed_in_start_up(exited: dict[int, int], first: int, local: bool) -> list[int]:
  """The hosts whose process failed in start-up, `first` first (its lines are on the
  terminal): an input error, or (`local`: the run directory is here) an error of its own; none
  where a process was killed (a death: restarted)."""
  if any(c < 0 for c in exited.values()):
    return []
  return sorted((h for h, c in exited.items() if c == BAD_INPUT or local and c > 0 and
                 c not in JOB_EXITS and c not in SURVIVOR_EXITS), key=lambda h: h != first)


def spawn_logged(cmd: list[str], env: dict, log: Path, echo: bool, fork: bool = False,
                 **popen) -> tuple[subprocess.Popen, subprocess.Popen | None]:
  """Starts `cmd` with its output appended to `log`; the process and its tee. With `echo` its
  stderr goes to this process's stderr too (its stdout inherited), through a `tee` of its own,
  which outlives an abort of the process, so that its last words reach the file too (`-i`: a
  Ctrl-C to the terminal's group leaves it copying the job's own stop lines). `fork`: a worker
  is forked from this process where it can be (spawn.py: its imports paid once)."""
  log.parent.mkdir(parents=True, exist_ok=True)
  fd, tee = None, None  # echo without a tee: on the terminal only, no last words read for it
  if not echo:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  elif shutil.which('tee') is not None:
    read, fd = os.pipe()
    tee = subprocess.Popen(['tee', '-i', '-a', str(log)], stdin=read, stdout=2)
    os.close(read)
  streams = dict(stderr=fd) if echo else dict(stdout=fd, stderr=subprocess.STDOUT)
  try:
    if fork and set(popen) <= {'pass_fds'} and spawn.forkable(cmd, env):
      return spawn.fork(cmd, env, **streams, **popen), tee
    return subprocess.Popen(cmd, env=env, **streams, **popen), tee
  finally:
    if fd is not None:
      os.close(fd)  # the child holds it


def wait_copied(tee: subprocess.Popen | None, end: bool = False, wait_s: float = 2.0) -> None:
  """Waits (bounded) for a tee to copy all its process wrote: it ends when that output closes
  (something the process started may still hold it); `end`: then it is ended."""
  if tee is None:
    return
  try:
    tee.wait(wait_s)
  except subprocess.TimeoutExpired:
    if end:
      tee.kill()
      tee.wait()


def last_words(log: Path, since: int = 0) -> str:
  """The last WORDS_BYTES of what a process wrote to `log` past byte `since` ('' for none)."""
  try:
    with open(log, 'rb') as f:
      f.seek(max(since, f.seek(0, 2) - WORDS_BYTES))
      return f.read().decode(errors='replace')
  except OSError:
    return ''


class Outputs:
  """A job's outputs as its supervisor keeps them: each process's in its host's log file
  (process 0's stderr echoed through a tee), each log's size at the job's start, and the exits
  that were aborts a peer's death caused (read off their last words once)."""

  def __init__(self, log_dir: Path):
    self.log_dir = log_dir
    self.tees: dict[int, subprocess.Popen] = {}  # host -> the tee of its process's stderr
    self.sizes: dict[int, int] = {}  # host -> its log's size at this job's start
    self.read: set[int] = set()  # hosts whose exit's last words were read
    self.peer_aborted: set[int] = set()  # hosts whose abort a peer's death caused

  def log(self, host: int) -> Path:
    return self.log_dir / f'host{host}.log'

  def new_job(self, hosts: list[int]) -> None:
    self.end()
    self.sizes = {h: self.log(h).stat().st_size if self.log(h).exists() else 0 for h in hosts}
    self.read, self.peer_aborted = set(), set()

  def spawn(self, host: int, cmd: list[str], env: dict, echo: bool, fork: bool, **popen):
    proc, tee = spawn_logged(cmd, env, self.log(host), echo, fork, **popen)
    if tee is not None:
      self.tees[host] = tee
    return proc

  def words(self, host: int) -> str:
    """The last words of `host`'s process in this job (it exited)."""
    wait_copied(self.tees.get(host))
    return last_words(self.log(host), self.sizes.get(host, 0))

  def peer_aborts(self, exited: dict[int, int], words) -> set[int]:
    """The hosts among `exited` whose abort a peer's death caused, by their last words
    (`words(host)`: the transport's), each read once."""
    for h in set(exited) - self.read:
      self.read.add(h)
      if exited[h] == ABORTED and peer_caused(words(h)):
        self.peer_aborted.add(h)
    return self.peer_aborted

  def end(self) -> None:
    """The tees of the job that ended, done copying (bounded) and reaped."""
    for tee in self.tees.values():
      wait_copied(tee, end=True)
    self.tees = {}


def error_lines(log: Path, since: int) -> list[str]:
  """The `error:` lines a process wrote to `log` past byte `since` (else its last line)."""
  with open(log, 'rb') as f:
    f.seek(since)
    lines = f.read().decode(errors='replace').splitlines()
  return [line for line in lines if line.startswith('error:')] or lines[-1:]


def resuming(train_args: list[str], out: Path) -> bool:
  """Whether a job of `train_args` resumes the run in `out`: --resume, or an unfinished run
  there (train.py resumes it on its own)."""
  if '--resume' in train_args or '--fresh' in train_args:
    return '--resume' in train_args
  try:
    return run_state.unfinished(out)
  except ConfigError:  # a damaged run_state.json: train.py says so in its own line
    return False


def starts(out: Path) -> int:
  """The starts the run's history.jsonl records (a job writes one once it trains)."""
  lines = history.read(out) if out.is_dir() else []
  return sum(line.kind is Kind.START for line in lines)


def tpu_slice(host: int, slice_hosts: int) -> list[int]:
  """The logical hosts of `host`'s TPU slice: hosts K*u .. K*u+K-1 are slice u (K =
  `slice_hosts`; with 1, a host alone)."""
  first = host // slice_hosts * slice_hosts
  return list(range(first, first + slice_hosts))


def megascale_env(hosts: list[int], slot: int, slice_hosts: int,
                  coordinator: str) -> dict[str, str]:
  """TPU multislice, for the process of logical host `slot` in the job of `hosts`: the job's TPU
  slices numbered 0.. in logical order (so that process ids, numbered by slot, are those jax
  derives from them), the coordinator on process 0's host (`coordinator`: its address)."""
  units = sorted({h // slice_hosts for h in hosts})
  return {'MEGASCALE_NUM_SLICES': str(len(units)),
          'MEGASCALE_SLICE_ID': str(units.index(slot // slice_hosts)),
          'MEGASCALE_COORDINATOR_ADDRESS': coordinator}
