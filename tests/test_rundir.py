"""Run directories: one run per directory, a lock, config checks on resume, tmpfs errors."""
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mecefo_jax.snapshot import recovery

ROOT = Path(__file__).resolve().parents[1]
TINY = ('model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=48', 'model.seq_len=16',
        'model.n_layers=1', 'train.micro_batch=4', 'train.log_every=1', 'train.plot=false',
        'mesh.slice=1')
ENV = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}  # one CPU device


def train(out: Path, *args: str, preexec=None, timeout: float = 240) -> tuple[int, str]:
  proc = subprocess.run([sys.executable, 'train.py', '-q', '--out', str(out), *TINY, *args],
                        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout,
                        preexec_fn=preexec)
  return proc.returncode, proc.stdout + proc.stderr


def report(out: Path) -> dict:
  return json.loads((out / 'report.json').read_text())


def test_a_fresh_run_never_continues_another(tmp_path):
  out, shm = tmp_path / 'run', tmp_path / 'shm'
  code, log = train(out, 'train.steps=6', f'snapshot.dir={shm}', 'snapshot.durable_every=3')
  assert code == 0, log
  first = recovery.read_run_state(out)['run_id']
  assert not (shm / first).exists()  # a finished run frees its in-memory tier
  assert (out / 'checkpoints' / first).is_dir()
  (out / 'notes.txt').write_text('mine')
  # Another run in the same directory: refused in one line, nothing touched.
  code, log = train(out, 'train.steps=4', 'optimizer.lr=0.001', f'snapshot.dir={shm}')
  assert code == 2 and log.strip().splitlines()[-1].startswith('error: run directory'), log
  assert 'holds another run (finished)' in log and '--fresh' in log
  assert recovery.read_run_state(out)['run_id'] == first
  # --fresh: that run's outputs and checkpoints go, the user's file stays.
  code, log = train(out, '--fresh', 'train.steps=4', 'optimizer.lr=0.001', f'snapshot.dir={shm}',
                    'snapshot.durable_every=2')
  assert code == 0, log
  second = recovery.read_run_state(out)['run_id']
  assert second != first and not (out / 'checkpoints' / first).exists()
  assert (out / 'notes.txt').read_text() == 'mine'
  assert report(out)['steps'] == 4 and report(out)['config']['optimizer']['lr'] == 0.001


def test_resume_refuses_a_changed_config_naming_the_keys(tmp_path):
  out = tmp_path / 'run'
  code, log = train(out, 'train.steps=4', '--no-snapshots')
  assert code == 0, log
  code, log = train(out, '--resume', 'train.steps=4', 'optimizer.lr=0.5', 'train.seed=3',
                    '--no-snapshots')
  last = log.strip().splitlines()[-1]
  assert code == 2 and last.startswith('error: resume with a changed config:'), log
  assert 'optimizer.lr (0.01 -> 0.5)' in last and 'train.seed (0 -> 3)' in last
  code, log = train(out, '--resume', 'train.steps=3', '--no-snapshots')  # shorter: refused
  assert code == 2 and 'train.steps (4 -> 3)' in log
  code, log = train(out, '--resume', 'train.steps=6', 'train.log_every=2', '--no-snapshots')
  assert code == 0, log  # longer, and logging: safe


def test_a_second_process_cannot_use_a_locked_run_directory(tmp_path):
  out = tmp_path / 'run'
  out.mkdir()
  holder = subprocess.Popen([sys.executable, '-c', (
      'import fcntl, os, sys, time\n'
      f'fd = os.open({str(out / ".lock")!r}, os.O_RDWR | os.O_CREAT)\n'
      'fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode())\n'
      'print("locked", flush=True); time.sleep(120)')], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == 'locked'
    code, log = train(out, 'train.steps=2', '--no-snapshots')
    assert code == 2 and f'in use by another training process (pid {holder.pid})' in log, log
  finally:
    holder.kill()
    holder.wait()
  # The holder died (SIGKILL): its lock is stale and taken over.
  code, log = train(out, 'train.steps=2', '--no-snapshots')
  assert code == 0, log


def _limit_file_size():
  """Files of at most 128 KiB (the tiny state's in-memory image is larger), and a write past it
  fails with EFBIG instead of killing the process: a full tmpfs, as far as a save can tell."""
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (128 << 10, 128 << 10))


def test_in_memory_snapshot_errors_skip_the_snapshot_and_training_goes_on(tmp_path):
  out, shm = tmp_path / 'run', tmp_path / 'shm'
  code, log = train(out, 'train.steps=4', f'snapshot.dir={shm}', 'snapshot.every=1',
                    'snapshot.durable_every=0', preexec=_limit_file_size)
  assert code == 0, log
  snapshots = report(out)['snapshots']
  assert snapshots['skipped'] >= 4 and snapshots['retained_steps'] == [], snapshots
  assert log.count('in-memory snapshot skipped') == snapshots['skipped']
  assert 'Traceback' not in log and report(out)['steps'] == 4


def test_all_slices_down_before_the_first_snapshot_resumes_past_it(tmp_path):
  out, trace = tmp_path / 'run', tmp_path / 'trace.txt'
  trace.write_text('1 0 fail\n1 1 fail\n')
  args = ('mesh.slice=2', '--host-devices', '2', f'--failures=trace:{trace}', 'train.steps=5',
          'snapshot.every=10', 'snapshot.durable_every=0', f'snapshot.dir={tmp_path / "shm"}')
  code, log = train(out, *args)
  assert code == 3 and f'python train.py --out {out} --resume' in log, log
  code, log = train(out, *args)  # the printed hint, as the user would run it
  assert code == 0 and report(out)['steps'] == 5, log


def test_default_run_directory_replaces_a_finished_run_and_resumes_an_unfinished_one(tmp_path):
  def default_out(*args):  # no --out: runs/latest under the working directory
    proc = subprocess.run([sys.executable, str(ROOT / 'train.py'), '-q', *TINY, *args],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
    return proc.returncode, proc.stdout + proc.stderr
  latest, shm = tmp_path / 'runs' / 'latest', tmp_path / 'shm'
  code, log = default_out('train.steps=3', f'snapshot.dir={shm}')
  assert code == 0, log
  first = recovery.read_run_state(latest)['run_id']
  code, log = default_out('train.steps=4', 'optimizer.lr=0.001', f'snapshot.dir={shm}')
  assert code == 0 and 'removed the outputs, snapshots and checkpoints of the previous run' in log
  state = recovery.read_run_state(latest)
  assert state['run_id'] != first and state['config']['optimizer']['lr'] == 0.001
  assert report(latest)['steps'] == 4 and not (latest / 'checkpoints' / first).exists()
  # An unfinished run there is never replaced: a changed config is refused in one line.
  recovery.write_run_state(latest, 'stopped', **{k: v for k, v in state.items() if k != 'status'})
  code, log = default_out('train.steps=4', 'optimizer.lr=0.002', f'snapshot.dir={shm}')
  assert code == 2 and 'resume with a changed config: optimizer.lr' in log, log
