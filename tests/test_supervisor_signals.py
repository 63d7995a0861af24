"""Signals to a supervised job, and its start-up: Ctrl-C to the whole process group (as a
terminal sends it) stops the job after one agreed step with both tiers saved (the supervisor
alone answers it: the same path as a Ctrl-C to it alone); a second Ctrl-C to the supervisor
stops the job at once and says what is saved; a supervisor stopped
(SIGSTOP) long enough for its job to stop itself takes the job back when it runs again; a
start-up that stalls before the run exists restarts as a fresh start, not a resume of nothing.
Real processes and signals, one core kept busy by another process where the issue saw it fail."""
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from mecefo_jax.files import default_snapshot_dir
from mecefo_jax.records import history
from mecefo_jax.records.history import Kind
from mecefo_jax.records.run_dir import run_name
from mecefo_jax.records.run_state import read_run_state
from mecefo_jax.run import rundir
from procs import TINY, busy_core, kill, report, wait_for

BASE = [*TINY, 'mesh.slice=2', 'train.log_every=1', 'train.eval_every=0']


def _events(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _reached(run: Path) -> int:
  return rundir.read_reached(run) or 0


def _start(launcher, cmd, log: Path) -> subprocess.Popen:
  """The supervisor, its output (and process 0's) to `log`: a pipe that nobody reads while the
  test waits would fill and block process 0."""
  with open(log, 'wb') as f:
    return launcher.start(cmd, stdout=f, stderr=subprocess.STDOUT)


def _end(proc: subprocess.Popen, log: Path, timeout: float) -> str:
  proc.wait(timeout=timeout)
  return log.read_text()


def _clean_stop(run: Path, proc: subprocess.Popen, out: str) -> int:
  """The job stopped by a signal after one agreed step, both tiers saved: exit 143,
  run_state.json `stopped`, a stop record, no temporary checkpoint, no dump. Its step."""
  assert proc.returncode == 143, out[-3000:]
  assert read_run_state(run).status == 'stopped'
  stop = [line for line in history.read(run) if line.kind is Kind.STOP][-1]
  assert stop.why == 'SIGINT (Ctrl-C)' and len(stop.saved) == 2, stop
  assert not list(run.glob('checkpoints/**/*.orbax-checkpoint-tmp*'))
  logs = out + ''.join(p.read_text() for p in (run / 'logs').glob('host*.log'))
  for bad in ('Traceback', 'Fatal', 'without a final snapshot', 'F0000', 'Check failed'):
    assert bad not in logs, logs[-3000:]
  return stop.step


def test_ctrl_c_stops_the_job_at_one_step_and_a_stopped_supervisor_takes_it_back(launcher,
                                                                                  tmp_path):
  run, events = tmp_path / 'run', tmp_path / 'events.jsonl'
  cmd = [sys.executable, '-m', 'mecefo_jax.launch', '-n', '2', '--stopped-s', '2', '--events',
         events, '--', '--out', run, 'train.steps=100000', *BASE]
  shm = default_snapshot_dir(run_name(run))
  try:
    # 1. The supervisor SIGSTOPped past --stopped-s: the job stops itself at an agreed step;
    # SIGCONT: the supervisor restarts it from there. Then Ctrl-C to the whole group. The busy
    # core from the SIGSTOP on: the job's start-up is no part of this, and the hog's CPU counts.
    proc = _start(launcher, cmd, tmp_path / 'first.log')
    wait_for(lambda: _reached(run) >= 5, 300, 'step 5', proc)
    with busy_core():
      os.kill(proc.pid, signal.SIGSTOP)
      wait_for(lambda: any(line.kind is Kind.STOP for line in history.read(run, warn=False)),
               120, 'the job to stop itself')
      stopped_at = [line for line in history.read(run) if line.kind is Kind.STOP][-1].step
      os.kill(proc.pid, signal.SIGCONT)
      wait_for(lambda: _reached(run) >= stopped_at + 3, 300, 'the job taken back', proc)
      os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the group
      out = _end(proc, tmp_path / 'first.log', 240)
    assert [e['kind'] for e in _events(events)] == ['start', 'take-back', 'start', 'signal',
                                                    'end'], out[-3000:]
    assert 'the job stopped itself after step' in out and 'restarting it from there' in out
    first = _clean_stop(run, proc, out)
    assert first > stopped_at
    # 2. Quiet machine, Ctrl-C to the supervisor alone, twice: the resumed job is killed at
    # once, and the line says what a resume continues from.
    proc = _start(launcher, cmd, tmp_path / 'second.log')
    wait_for(lambda: _reached(run) >= first + 3, 300, 'the resumed job to train', proc)
    proc.send_signal(signal.SIGINT)
    # (Two signals pending at once are one: the second is sent once the first is answered.)
    wait_for(lambda: _events(events)[-1]['kind'] == 'signal', 60, 'the first answered', proc)
    proc.send_signal(signal.SIGINT)
    out = _end(proc, tmp_path / 'second.log', 120)
    assert proc.returncode == 143, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert 'SIGINT: the job was killed at once, without a final snapshot; the newest complete ' \
           'in-memory snapshot is step ' in last and 'resume it with the same command' in last
    pids = [p for e in _events(events) if e['kind'] == 'start' for p in e['pids'].values()]
    assert not [p for p in pids if Path(f'/proc/{p}').exists()], 'processes of the job left'
  finally:
    shutil.rmtree(shm, ignore_errors=True)


def test_a_start_up_stall_before_the_run_exists_starts_it_anew(launcher, tmp_path):
  """Host 2 SIGSTOPped in its imports: the others wait for it in jax.distributed's start-up,
  the stall names it, and the whole job starts again, host 2 included, as a fresh start of the
  same run (no run_state.json yet: a --resume would be refused, and no snapshot holds host 2's
  slices for the others). The finished run leaves nothing in tmpfs."""
  run, events = tmp_path / 'run', tmp_path / 'events.jsonl'
  shm = default_snapshot_dir(run_name(run))
  log = tmp_path / 'launch.log'
  proc = _start(launcher, [sys.executable, '-m', 'mecefo_jax.launch', '-n', '3', '--stall-s', '5',
                           '--events', events, '--', '--out', run, 'train.steps=6', *TINY,
                           'mesh.slice=3', 'train.eval_every=0'], log)
  try:
    wait_for(lambda: _events(events), 60, 'the start line', proc)
    os.kill(_events(events)[0]['pids']['2'], signal.SIGSTOP)
    out = _end(proc, log, 300)
  finally:
    kill(proc)
    shutil.rmtree(shm, ignore_errors=True) if proc.returncode else None
  assert proc.returncode == 0, out[-3000:]
  kinds = [e['kind'] for e in _events(events)]
  # --stall-s bounds every phase: at load 15-30 a final save of the restarted job ran past it
  # once (a stall, a restart from its snapshot, the same end), which is not this test's case.
  assert kinds[:4] == ['start', 'stall', 'start-again', 'start'] and kinds[-1] == 'end', out[-3000:]
  assert 'start-again' not in kinds[4:], out[-3000:]
  assert _events(events)[3]['hosts'] == [0, 1, 2]
  stall = _events(events)[1]
  assert stall['host'] == 2 and stall['start_up'], stall
  # The start-again's job starts the run anew (a later stall of the 5 s deadline resumes it).
  started = [line for line in out.splitlines() if 'started hosts' in line]
  assert 'resuming the run' not in started[1] and 'no run to resume' not in out, started
  assert report(run)['steps'] == 6
  assert not shm.exists(), list(shm.rglob('*'))
