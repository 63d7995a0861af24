"""The soak's faults: each injects one real fault into the running job, waits for what the
product does about it, and says which history.jsonl kinds must record it (benchmarks/soak.py)."""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from mecefo_jax.records.history import Kind

KINDS = ('kill', 'stop_worker', 'stop_supervisor', 'full_tmpfs', 'ctrl_c', 'divergence')
RAY_KINDS = (*KINDS, 'lost_node')  # --backend ray: a node of the cluster goes too
# The history kinds a fault leaves; any of these that no injected fault explains disagrees.
FAULT_KINDS = {Kind.LAUNCH_DEATH, Kind.LAUNCH_STALL, Kind.LAUNCH_PEER_LOST, Kind.LAUNCH_TAKE_BACK,
               Kind.LAUNCH_GIVE_UP, Kind.LAUNCH_STUCK, Kind.LAUNCH_ACTOR_LOST, Kind.DIVERGED,
               Kind.SNAPSHOT_SKIPPED, Kind.STOP}
EXPECTED = {'kill': (Kind.LAUNCH_DEATH,), 'stop_worker': (Kind.LAUNCH_STALL,),
            'stop_supervisor': (Kind.STOP, Kind.LAUNCH_TAKE_BACK),
            'full_tmpfs': (Kind.SNAPSHOT_SKIPPED,), 'ctrl_c': (Kind.STOP,),
            'divergence': (Kind.DIVERGED, Kind.ROLLED_BACK),
            'lost_node': (Kind.LAUNCH_ACTOR_LOST, Kind.LAUNCH_DEATH)}
# Besides what EXPECTED names, what each fault may leave (a stop of the job it asks for).
ALSO = {'kill': {Kind.LAUNCH_PEER_LOST}, 'stop_worker': {Kind.LAUNCH_PEER_LOST},
        'lost_node': {Kind.LAUNCH_PEER_LOST}}
# The faults that take one host out of the job, which grows back with it later.
TAKE_A_HOST = ('kill', 'stop_worker', 'lost_node')
HOLD_S = (2.0, 8.0)  # a full tmpfs stays full this long at least, and at most (a skip seen)
AHEAD = 8  # steps from the last logged one to the one made diverged (every process reads
           # it before reaching that step: they run at most a step ahead of the log)
FREE_LEFT = 16 * 4096  # what a full tmpfs has left: less than any snapshot's part
IN_PLACE = {'full_tmpfs'}  # the faults after which the job trains on without a restart


@dataclasses.dataclass
class Injected:
  """One fault as the soak injected it: the ground truth the records are checked against."""
  kind: str
  t: float  # when it was injected (time.time())
  step: int  # the last step logged then
  host: int | None = None  # the host it hit, where it hit one
  recovered_t: float | None = None  # the first step logged after it by a job started after it
  note: str = ''

  @property
  def recovery_s(self) -> float | None:
    return None if self.recovered_t is None else self.recovered_t - self.t


def kill(soak, host: int) -> Injected:
  """SIGKILL of one worker: the supervisor restarts the survivors, the host rejoins later."""
  fault = Injected('kill', time.time(), soak.job.last_step(), host)
  os.kill(soak.job.host_pid(host), signal.SIGKILL)
  return fault


def stop_worker(soak, host: int) -> Injected:
  """SIGSTOP of one worker: the stall watch leaves it out; SIGCONT once the job restarted."""
  pid = soak.job.host_pid(host)
  fault = Injected('stop_worker', time.time(), soak.job.last_step(), host)
  os.kill(pid, signal.SIGSTOP)
  soak.wait_for(lambda: soak.history_since(fault.t, Kind.LAUNCH_STALL), 'the stall seen')
  try:
    os.kill(pid, signal.SIGCONT)  # (the supervisor has killed it by now: nothing to continue)
  except ProcessLookupError:
    pass
  return fault


def stop_supervisor(soak, host: int) -> Injected:
  """SIGSTOP of the supervisor past its --stopped-s: the processes stop the job at an agreed
  step; SIGCONT: the supervisor takes it back."""
  fault = Injected('stop_supervisor', time.time(), soak.job.last_step())
  os.kill(soak.job.proc.pid, signal.SIGSTOP)
  try:
    soak.wait_for(lambda: soak.history_since(fault.t, Kind.STOP), 'the job to stop itself',
                  watch=False)
  finally:
    os.kill(soak.job.proc.pid, signal.SIGCONT)
  return fault


def full_tmpfs(soak, host: int) -> Injected:
  """The snapshots' tmpfs filled until a snapshot is skipped (HOLD_S: at least, at most), then
  emptied: snapshots are skipped while it is full, training goes on."""
  fault = Injected('full_tmpfs', time.time(), soak.job.last_step())
  if not soak.mounted:
    fault.note = soak.mount_note
    return fault
  filler = soak.shm / 'filler'
  fault.note = f'{_fill(filler) >> 20} MiB filled, {shutil.disk_usage(soak.shm).free} bytes left'
  least, most = (fault.t + s for s in HOLD_S)
  # Kept full while held: a save that replaces an older snapshot frees the older one's pages
  # (a tiny model's snapshot fits in what one such free leaves: seen under load, no skip).
  soak.wait_for(lambda: _fill(filler) < 0 or time.time() > most or (
      time.time() > least and soak.history_since(fault.t, Kind.SNAPSHOT_SKIPPED)),
      'the full tmpfs held')
  filler.unlink()
  # Its record: a skip shows once the next save waits for the failed one (a step later).
  soak.wait_for(lambda: soak.history_since(fault.t, Kind.SNAPSHOT_SKIPPED), 'the skips recorded')
  return fault


def _fill(path: Path) -> int:
  """Fills the filesystem of `path` but for a few pages (the next save fails: ENOSPC) with
  one file, grown where it is there already; its size. The job's saves come and go meanwhile:
  a fill that no longer fits is tried again smaller."""
  with open(path, 'ab') as f:
    for _ in range(100):
      size = shutil.disk_usage(path.parent).free - FREE_LEFT
      if size <= 0:
        break
      try:
        os.posix_fallocate(f.fileno(), os.fstat(f.fileno()).st_size, size)
      except OSError:
        continue  # a save took some of it meanwhile
    return os.fstat(f.fileno()).st_size


def ctrl_c(soak, host: int) -> Injected:
  """A terminal's Ctrl-C to the whole job (every process of its group), then the same command
  again: the job stops at an agreed step, snapshotted, and resumes from it."""
  fault = Injected('ctrl_c', time.time(), soak.job.last_step())
  os.killpg(soak.job.proc.pid, signal.SIGINT)
  code = soak.job.wait(300)
  fault.note = f'the supervisor exited {code}'
  soak.launch()
  return fault


def divergence(soak, host: int) -> Injected:
  """A step some way ahead made to read as diverged (run/hooks.TEST_POISON_ENV): the job stops
  without saving it; the poison gone, the same command resumes from a snapshot before it and
  trains it again."""
  at = soak.job.last_step() + AHEAD
  tmp = soak.poison.with_suffix('.tmp')
  tmp.write_text(str(at))
  os.replace(tmp, soak.poison)
  fault = Injected('divergence', time.time(), soak.job.last_step(), note=f'step {at}')
  try:
    code = soak.job.wait(600)
  except subprocess.TimeoutExpired:
    code = None
  finally:
    soak.poison.unlink(missing_ok=True)
  fault.note += f'; the supervisor exited {code}'
  soak.launch()
  return fault


def lost_node(soak, host: int) -> Injected:
  """--backend ray: the node of `host` removed from the cluster (its raylet, its actor, its
  trainer and its snapshot part with it) and a fresh node added: the job goes on without the
  host, which rejoins on the spare node."""
  from benchmarks import ray_cluster  # Ray's: imported by a Ray soak only
  node = [e for e in soak.job.events() if e['kind'] == 'place'][-1]['nodes'][str(host)]
  fault = Injected('lost_node', time.time(), soak.job.last_step(), host)
  ray_cluster.remove_node(soak.cluster, node)
  fault.note = f'node {node[:8]} removed, node {ray_cluster.add_node(soak.cluster)[:8]} added'
  return fault


INJECT = {'kill': kill, 'stop_worker': stop_worker, 'stop_supervisor': stop_supervisor,
          'full_tmpfs': full_tmpfs, 'ctrl_c': ctrl_c, 'divergence': divergence,
          'lost_node': lost_node}


def mount_tmpfs(path: Path, mib: int) -> str | None:
  """Mounts a tmpfs of `mib` MiB at `path` (a full one can then be made without touching the
  machine's /dev/shm); None once mounted, else why not (no privilege: the fault is skipped)."""
  path.mkdir(parents=True, exist_ok=True)
  done = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={mib}m', 'tmpfs', str(path)],
                        capture_output=True, text=True)
  return None if done.returncode == 0 else (done.stderr.strip() or f'mount exit {done.returncode}')


def unmount(path: Path) -> None:
  subprocess.run(['umount', '-l', str(path)], capture_output=True)
