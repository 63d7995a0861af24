"""Recovery end to end: SIGKILL, spoiled snapshots, durable tier, all slices down, SIGTERM, bad input."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from mecefo_jax.run import cli, metrics
from mecefo_jax.snapshot import manifest, recovery

ROOT = Path(__file__).resolve().parents[1]
STEPS = 14
TINY = ('model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=48', 'model.seq_len=16',
        'model.n_layers=1', 'train.micro_batch=4', 'train.log_every=1', f'train.steps={STEPS}',
        'snapshot.every=1')
ENV = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}  # one CPU device unless asked


def snap_args(shm: Path, *extra: str) -> tuple[str, ...]:
  return ('mesh.slice=1', f'snapshot.dir={shm}', 'snapshot.keep=3', 'snapshot.durable_every=5',
          *extra)


def start(out: Path, *args: str) -> subprocess.Popen:
  """train.py in the background; its output goes to a log file next to `out`."""
  log_path = out.parent / f'{out.name}.{time.monotonic_ns()}.log'
  with open(log_path, 'w') as log:
    proc = subprocess.Popen([sys.executable, 'train.py', '--out', str(out), *TINY, *args],
                            cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)
  proc.log_path = log_path
  return proc


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
  try:
    code = proc.wait(timeout)
  finally:
    if proc.poll() is None:  # timed out, or the test failed while waiting
      proc.kill()
      proc.wait()
  return code, proc.log_path.read_text()


def train(out: Path, *args: str) -> tuple[int, str]:
  return finish(start(out, *args))


def wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 180) -> None:
  deadline = time.monotonic() + timeout
  while (last := metrics.last_logged_step(out)) is None or last < step:
    assert proc.poll() is None, f'train.py exited ({proc.returncode}) before step {step}'
    assert time.monotonic() < deadline, f'step {step} not logged in {timeout} s'
    time.sleep(0.005)


def kill_after(out: Path, step: int, *args: str, sig=signal.SIGKILL) -> tuple[int, str]:
  """Starts train.py and sends `sig` once `step` is in metrics.jsonl."""
  proc = start(out, *args)
  try:
    wait_for_step(proc, out, step)
    os.kill(proc.pid, sig)
  finally:
    code, log = finish(proc)
  return code, log


def report(out: Path) -> dict:
  return json.loads((out / 'report.json').read_text())


def complete_steps(directory: Path) -> list[int]:
  """Step dirs that have a manifest, oldest first."""
  return sorted(int(p.name) for p in directory.iterdir()
                if p.name.isdigit() and (p / manifest.MANIFEST_NAME).exists())


def steps_lost(log: str) -> int:
  return int(re.search(r'so (\d+) step\(s\) are trained again', log).group(1))


@pytest.fixture(scope='module')
def reference(tmp_path_factory) -> str:
  """params_sha256 of an uninterrupted run (no snapshots at all)."""
  out = tmp_path_factory.mktemp('reference') / 'run'
  code, log = train(out, 'mesh.slice=1', '--no-snapshots')
  assert code == 0, log[-3000:]
  return report(out)['params_sha256']


@pytest.fixture(scope='module')
def killed(tmp_path_factory) -> tuple[Path, int]:
  """A run with snapshots SIGKILLed after a seeded random step: (its root, that step)."""
  root = tmp_path_factory.mktemp('killed')
  step = random.Random(7).randrange(6, STEPS - 4)
  code, log = kill_after(root / 'run', step, *snap_args(root / 'shm'))
  assert code == -signal.SIGKILL, log[-3000:]
  assert recovery.read_run_state(root / 'run')['status'] == 'running'
  return root, step


@pytest.fixture
def crashed(killed, tmp_path) -> tuple[Path, Path]:
  """A private copy of the killed run: (run dir, snapshot dir)."""
  shutil.copytree(killed[0], tmp_path / 'copy')
  return tmp_path / 'copy' / 'run', tmp_path / 'copy' / 'shm'


def resume_to_end(out: Path, shm: Path, reference: str, *flags: str) -> tuple[dict, str]:
  code, log = train(out, *snap_args(shm), *flags)
  assert code == 0, log[-3000:]
  result = report(out)
  assert result['steps'] == STEPS and result['params_sha256'] == reference
  assert recovery.read_run_state(out)['status'] == 'finished'
  return result, log


# ---- SIGKILL ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_sigkill_at_random_steps_then_resume_is_bit_exact(crashed, killed, reference):
  out, shm = crashed
  # Same command again: the unfinished run is detected and resumed; killed once more.
  second = random.Random(8).randrange(killed[1] + 2, STEPS - 1)
  code, log = kill_after(out, second, *snap_args(shm))
  assert code == -signal.SIGKILL and 'resumed from the snapshot' in log, log[-3000:]
  assert steps_lost(log) <= 1  # the first kill cost at most the step in flight
  result, log = resume_to_end(out, shm, reference, '--resume')
  assert result['resumed_from_step'] >= second and result['steps_lost'] <= 1, log[-3000:]


def memory_dir(out: Path, shm: Path) -> Path:
  """The run's in-memory tier: one folder per run id under snapshot.dir."""
  return shm / recovery.read_run_state(out)['run_id']


def durable_dir(out: Path) -> Path:
  return out / 'checkpoints' / recovery.read_run_state(out)['run_id']


def newest_intact_after(out: Path, shm: Path, spoiled: int) -> int:
  """The step a resume should pick once memory snapshot `spoiled` is unusable."""
  memory = [step for step in complete_steps(memory_dir(out, shm)) if step != spoiled]
  return max(memory + complete_steps(durable_dir(out)))


def test_truncated_newest_snapshot_is_skipped(crashed, reference):
  out, shm = crashed
  newest = complete_steps(memory_dir(out, shm))[-1]
  files = [p for p in (memory_dir(out, shm) / str(newest)).rglob('*') if p.is_file()]
  largest = max(files, key=lambda p: p.stat().st_size)
  os.truncate(largest, largest.stat().st_size // 2)
  expected = newest_intact_after(out, shm, newest)
  result, log = resume_to_end(out, shm, reference)
  assert re.search(rf'skipping memory snapshot .*/{newest}: .* fails its checksum', log), log
  assert result['resumed_from_step'] == expected


def test_snapshot_without_manifest_is_never_used(crashed, reference):
  out, shm = crashed
  newest = complete_steps(memory_dir(out, shm))[-1]
  (memory_dir(out, shm) / str(newest) / manifest.MANIFEST_NAME).unlink()  # as if killed before the manifest
  expected = newest_intact_after(out, shm, newest)
  result, log = resume_to_end(out, shm, reference)
  assert re.search(rf'skipping memory snapshot .*/{newest}: no manifest', log), log
  assert result['resumed_from_step'] == expected


def test_durable_checkpoint_when_memory_snapshots_are_lost(crashed, killed, reference):
  out, shm = crashed
  durable = complete_steps(durable_dir(out))[-1]
  assert durable % 5 == 0 and durable <= killed[1] + 1
  shutil.rmtree(shm)  # host memory lost (e.g. the machine rebooted)
  result, log = resume_to_end(out, shm, reference)
  assert result['resumed_from_step'] == durable and 'skipping' not in log, log[-3000:]


# ---- all slices down, SIGTERM ----------------------------------------------------------------

@pytest.mark.slow
def test_all_slices_down_stops_cleanly_then_resume_continues(tmp_path):
  trace = tmp_path / 'trace.txt'
  trace.write_text('5 0 fail\n5 1 fail\n11 0 repair\n')
  args = ('--host-devices', '2', 'mesh.slice=2', f'snapshot.dir={tmp_path / "shm"}',
          '--failures', f'trace:{trace}')
  code, log = train(tmp_path / 'run', *args)
  assert code == 3 and 'all 2 slices are down at step 5' in log and '--resume' in log, log[-3000:]
  stopped = report(tmp_path / 'run')
  assert stopped['steps'] == 5 and stopped['stopped'] and not stopped['preempted']
  assert recovery.read_run_state(tmp_path / 'run')['status'] == 'stopped'
  code, log = train(tmp_path / 'run', *args, '--resume')  # the devices are back
  assert code == 0, log[-3000:]
  result = report(tmp_path / 'run')
  assert (result['steps'], result['resumed_from_step'], result['stopped']) == (STEPS, 5, None)
  assert result['live_slices_at_end'] == [0, 1] and result['samples']['dropped'] == 0
  events = [(e['step'], e['slice'], e['kind'], e['source']) for e in result['failure_events']]
  assert events == [(5, 0, 'fail', f'trace:{trace.name}'), (5, 1, 'fail', f'trace:{trace.name}'),
                    (5, 0, 'repair', 'resume'), (5, 1, 'repair', 'resume')]
  # The stop lost no work and both slices ran every step: as if nothing had failed.
  code, log = train(tmp_path / 'fault_free', '--host-devices', '2', 'mesh.slice=2', '--no-snapshots')
  assert code == 0 and report(tmp_path / 'fault_free')['params_sha256'] == result['params_sha256']


@pytest.mark.slow
def test_sigterm_saves_a_durable_checkpoint_and_exits(tmp_path, reference):
  out, shm = tmp_path / 'run', tmp_path / 'shm'
  args = ('mesh.slice=1', f'snapshot.dir={shm}', 'snapshot.durable_every=1000')
  code, log = kill_after(out, 4, *args, sig=signal.SIGTERM)
  assert code == 128 + signal.SIGTERM and 'stopped by SIGTERM after step' in log, log[-3000:]
  stopped = report(out)
  assert stopped['preempted'] and '--resume' in stopped['stopped']
  durable = complete_steps(durable_dir(out))
  assert durable == [stopped['steps']] and stopped['steps'] >= 5
  assert manifest.verify_manifest(durable_dir(out) / str(durable[0])) is None
  assert not [p for p in memory_dir(out, shm).iterdir() if 'tmp' in p.name]  # none half-written
  shutil.rmtree(shm)  # a preempted machine loses its memory: the durable checkpoint must do
  code, log = train(out, *args)
  assert code == 0, log[-3000:]
  result = report(out)
  assert (result['resumed_from_step'], result['steps_lost']) == (durable[0], 0)
  assert result['params_sha256'] == reference


# ---- bad input ----------------------------------------------------------------------------------

def error_lines(text: str) -> list[str]:
  return [line for line in text.splitlines() if line.startswith('error:')]


def test_missing_snapshot_parent_fails_before_training(tmp_path):
  code, log = train(tmp_path / 'run', 'mesh.slice=1', f'snapshot.dir={tmp_path}/nope/shm')
  lines = error_lines(log)
  assert code == 2 and len(lines) == 1, log[-3000:]
  assert f'{tmp_path}/nope/shm: parent {tmp_path}/nope does not exist' in lines[0]
  assert 'snapshot.dir=' in lines[0] and 'step 0' not in log
  assert not (tmp_path / 'run' / 'metrics.jsonl').exists()


def bad_dirs(tmp_path):
  (tmp_path / 'file').write_text('x')
  yield tmp_path / 'file' / 'shm', 'is not a directory'
  if os.path.isdir('/proc'):  # not writable even for root
    yield Path('/proc/mecefo-test'), '/proc is not writable'
  if os.geteuid() != 0:  # root writes into a 0o500 directory anyway
    (tmp_path / 'ro').mkdir(mode=0o500)
    yield tmp_path / 'ro' / 'shm', 'is not writable'


def main_in_process(capsys, out: Path, *args: str) -> tuple[int, list[str]]:
  code = cli.main(['--out', str(out), *TINY, 'mesh.slice=1', *args])
  return code, error_lines(capsys.readouterr().err)


def test_unusable_snapshot_dirs_fail_with_one_line(tmp_path, capsys):
  for directory, needle in bad_dirs(tmp_path):
    code, lines = main_in_process(capsys, tmp_path / 'run', f'snapshot.dir={directory}')
    assert code == 2 and len(lines) == 1 and needle in lines[0], (directory, lines)
  assert not (tmp_path / 'run' / 'metrics.jsonl').exists()


def test_too_small_snapshot_dir_fails_with_one_line(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(shutil, 'disk_usage', lambda path: types.SimpleNamespace(free=4096))
  code, lines = main_in_process(capsys, tmp_path / 'run', f'snapshot.dir={tmp_path}/shm')
  assert code == 2 and len(lines) == 1, lines
  assert re.search(r'0\.0 MiB free < [\d.]+ MiB needed \(2\+1 snapshots of', lines[0])


def test_no_snapshots_never_touches_the_snapshot_dir(tmp_path, capsys):
  missing = tmp_path / 'nope' / 'shm'
  code, lines = main_in_process(capsys, tmp_path / 'run', '--no-snapshots', 'train.steps=2',
                                f'snapshot.dir={missing}')
  assert code == 0 and not lines and not (tmp_path / 'nope').exists()
  assert not (tmp_path / 'run' / 'checkpoints').exists()
  assert report(tmp_path / 'run')['steps'] == 2
