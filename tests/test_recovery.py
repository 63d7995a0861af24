"""Recovery end to end: SIGKILL, all slices down, SIGTERM, bad input (spoiled snapshots and the
durable fallback are tested in-process: tests/test_snapshot.py)."""
import os
import random
import re
import shlex
import shutil
import signal
import sys
import time
import types
from pathlib import Path

import pytest

from mecefo_jax.run import cli, metrics
from mecefo_jax.run import rundir
from mecefo_jax.snapshot import manifest
from mecefo_jax.records.run_dir import MANIFEST_NAME
from mecefo_jax.records.run_state import read_run_state
from procs import TINY, error_lines, kill, report, wait_for

STEPS = 14
RUN = (*TINY, 'train.log_every=1', f'train.steps={STEPS}', 'snapshot.every=1')


def snap_args(shm: Path, *extra: str) -> tuple[str, ...]:
  return ('mesh.slice=1', f'snapshot.dir={shm}', 'snapshot.keep=3', 'snapshot.durable_every=5',
          *extra)


def start(launcher, out: Path, *args: str):
  """train.py in the background; its output goes to a log file next to `out`."""
  log_path = out.parent / f'{out.name}.{time.monotonic_ns()}.log'
  with open(log_path, 'w') as log:
    proc = launcher.start([sys.executable, 'train.py', '--out', out, *RUN, *args], stdout=log,
                          stderr=log)
  proc.log_path = log_path
  return proc


def finish(proc, timeout: float = 240) -> tuple[int, str]:
  try:
    code = proc.wait(timeout)
  finally:
    kill(proc)  # timed out, or the test failed while waiting
  return code, proc.log_path.read_text()


def train(launcher, out: Path, *args: str) -> tuple[int, str]:
  return finish(start(launcher, out, *args))


def kill_after(launcher, out: Path, step: int, *args: str, sig=signal.SIGKILL) -> tuple[int, str]:
  """Starts train.py and sends `sig` once `step` is in metrics.jsonl."""
  proc = start(launcher, out, *args)
  try:
    wait_for(lambda: (metrics.last_logged_step(out) or -1) >= step, 180, f'step {step}', proc)
    os.kill(proc.pid, sig)
  finally:
    code, log = finish(proc)
  return code, log


def complete_steps(directory: Path) -> list[int]:
  """Step dirs that have a manifest, oldest first."""
  return sorted(int(p.name) for p in directory.iterdir()
                if p.name.isdigit() and (p / MANIFEST_NAME).exists())


def steps_lost(log: str) -> int:
  return int(re.search(r'so (\d+) step\(s\) are trained again', log).group(1))


@pytest.fixture(scope='module')
def reference(launcher, tmp_path_factory) -> str:
  """params_sha256 of an uninterrupted run (no snapshots at all)."""
  out = tmp_path_factory.mktemp('reference') / 'run'
  code, log = train(launcher, out, 'mesh.slice=1', '--no-snapshots')
  assert code == 0, log[-3000:]
  return report(out)['params_sha256']


def memory_dir(out: Path, shm: Path) -> Path:
  """The run's in-memory tier: one folder per run id under snapshot.dir."""
  return shm / read_run_state(out).run_id


def durable_dir(out: Path) -> Path:
  return out / 'checkpoints' / read_run_state(out).run_id


def resume_to_end(launcher, out: Path, shm: Path, reference: str, *flags: str) -> tuple[dict, str]:
  code, log = train(launcher, out, *snap_args(shm), *flags)
  assert code == 0, log[-3000:]
  result = report(out)
  assert result['steps'] == STEPS and result['params_sha256'] == reference
  assert read_run_state(out).status == 'finished'
  return result, log


# ---- SIGKILL ----------------------------------------------------------------------------------

def test_sigkill_at_random_steps_then_resume_is_bit_exact(launcher, reference, tmp_path):
  out, shm = tmp_path / 'run', tmp_path / 'shm'
  first = random.Random(7).randrange(4, STEPS - 6)
  code, log = kill_after(launcher, out, first, *snap_args(shm))
  assert code == -signal.SIGKILL, log[-3000:]
  assert read_run_state(out).status == 'running'
  # Same command again: the unfinished run is detected and resumed; killed once more.
  second = random.Random(8).randrange(first + 2, STEPS - 1)
  code, log = kill_after(launcher, out, second, *snap_args(shm))
  assert code == -signal.SIGKILL and 'resumed from the in-memory snapshot' in log, log[-3000:]
  # The first kill cost at most the step whose snapshot was being written and the one after
  # it (.reached counts every step the killed process finished).
  assert steps_lost(log) <= 2
  result, log = resume_to_end(launcher, out, shm, reference, '--resume')
  assert result['resumed_from_step'] >= second and result['steps_lost'] <= 2, log[-3000:]
  assert complete_steps(durable_dir(out))[-1] == STEPS  # the durable tier, every 5 and the end


# ---- all slices down, SIGTERM ----------------------------------------------------------------

def test_all_slices_down_stops_cleanly_and_the_printed_hint_resumes(launcher, tmp_path):
  """Every slice down at step 5: the run stops (exit 3) and prints the resume command; run
  with the devices back, it continues from step 5 as if nothing had failed."""
  out, trace = tmp_path / 'run', tmp_path / 'trace.txt'
  trace.write_text('5 0 fail\n5 1 fail\n11 0 repair\n')
  args = ('--host-devices', '2', 'mesh.slice=2', f'snapshot.dir={tmp_path / "shm"}',
          '--failures', f'trace:{trace}')
  code, log = train(launcher, out, *args)
  assert code == 3 and 'all 2 slices are down at step 5' in log, log[-3000:]
  hint = re.search(r'When devices return, `(python train\.py [^`]*)`', log).group(1)
  assert hint == f'python train.py --out {out} --resume', log[-3000:]
  stopped = report(out)
  assert stopped['steps'] == 5 and stopped['stopped'] and not stopped['preempted']
  assert read_run_state(out).status == 'stopped'
  # The devices are back: the hint exactly as printed (the run's config and its 2 simulated
  # devices come from run_state.json).
  resumed = launcher.train(*shlex.split(hint)[2:])
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  result = report(out)
  assert (result['steps'], result['resumed_from_step'], result['stopped']) == (STEPS, 5, None)
  assert result['live_slices_at_end'] == [0, 1] and result['samples']['dropped'] == 0
  events = [(e['step'], e['slice'], e['kind'], e['source']) for e in result['failure_events']]
  assert events == [(5, 0, 'fail', f'trace:{trace.name}'), (5, 1, 'fail', f'trace:{trace.name}'),
                    (5, 0, 'repair', 'resume'), (5, 1, 'repair', 'resume')]
  # The stop lost no work and both slices ran every step: as if nothing had failed.
  code, log = train(launcher, tmp_path / 'fault_free', '--host-devices', '2', 'mesh.slice=2',
                    '--no-snapshots')
  assert code == 0 and report(tmp_path / 'fault_free')['params_sha256'] == result['params_sha256']


def test_sigterm_saves_a_durable_checkpoint_and_exits(launcher, tmp_path, reference):
  """Preemption (SIGTERM; Ctrl-C goes through the same handler: tests/test_cli_errors.py): a
  durable checkpoint of the stop step, exit 143, and a resume from it once memory is lost."""
  out, shm = tmp_path / 'run', tmp_path / 'shm'
  args = ('mesh.slice=1', f'snapshot.dir={shm}', 'snapshot.durable_every=1000')
  code, log = kill_after(launcher, out, 4, *args, sig=signal.SIGTERM)
  assert code == 128 + signal.SIGTERM and 'stopped by SIGTERM after ' in log, log[-3000:]
  stopped = report(out)
  assert stopped['preempted'] and '--resume' in stopped['stopped']
  durable = complete_steps(durable_dir(out))
  assert durable == [stopped['steps']] and stopped['steps'] >= 5
  assert manifest.verify_manifest(durable_dir(out) / str(durable[0])) is None
  assert not [p for p in memory_dir(out, shm).iterdir() if 'tmp' in p.name]  # none half-written
  shutil.rmtree(shm)  # a preempted machine loses its memory: the durable checkpoint must do
  code, log = train(launcher, out, *args)
  assert code == 0 and 'skipping' not in log, log[-3000:]
  result = report(out)
  assert (result['resumed_from_step'], result['steps_lost']) == (durable[0], 0)
  assert result['params_sha256'] == reference


# ---- bad input (in-process) -------------------------------------------------------------------

def main_in_process(capsys, out: Path, *args: str) -> tuple[int, list[str]]:
  code = cli.main(['--out', str(out), *TINY, 'mesh.slice=1', 'train.compile_cache=', *args])
  return code, error_lines(capsys.readouterr().err)


def test_missing_snapshot_parent_fails_before_training(tmp_path, capsys):
  code, lines = main_in_process(capsys, tmp_path / 'run', f'snapshot.dir={tmp_path}/nope/shm')
  assert code == 2 and len(lines) == 1, lines
  assert f'{tmp_path}/nope/shm: parent {tmp_path}/nope does not exist' in lines[0]
  assert 'snapshot.dir=' in lines[0]
  assert not (tmp_path / 'run' / 'metrics.jsonl').exists()


def bad_dirs(tmp_path):
  (tmp_path / 'file').write_text('x')
  yield tmp_path / 'file' / 'shm', 'is not a directory'
  if os.path.isdir('/proc'):  # not writable even for root
    yield Path('/proc/mecefo-test'), '/proc is not writable'
  if os.geteuid() != 0:  # root writes into a 0o500 directory anyway
    (tmp_path / 'ro').mkdir(mode=0o500)
    yield tmp_path / 'ro' / 'shm', 'is not writable'


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
