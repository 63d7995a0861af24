"""The run's lock before anything: a trainer held inside a durable save (a test hook) is left
untouched by second starts on its directory (a plain one, --resume, --fresh, a two-process job
and a supervised one), each refused in one line; the first trains on to the end unharmed."""
import subprocess
import sys
import threading
from pathlib import Path

from mecefo_jax.supervisor import free_port
from mecefo_jax.snapshot import hold
from mecefo_jax.snapshot.hold import HOLD_ENV
from mecefo_jax.snapshot.manifest import verify_manifest
from mecefo_jax.snapshot.manager import default_snapshot_dir
from mecefo_jax.records import run_dir
from mecefo_jax.records.job import BAD_INPUT
from mecefo_jax.records.run_state import read_run_state
from procs import ROOT, TINY, error_lines, kill, report, tree, wait_all, wait_for

STEPS = 3
ARGS = ['-q', *TINY, f'train.steps={STEPS}', 'train.log_every=1',
        'train.eval_batches=1', 'snapshot.every=1', 'snapshot.durable_every=1']


def _in_use(code: int, err: str, pid: int) -> bool:
  lines = error_lines(err)
  return code == BAD_INPUT and len(lines) == 1 and \
      f'is in use by another training process (pid {pid})' in lines[0]


def test_a_second_start_never_touches_a_run_held_inside_a_durable_save(launcher, tmp_path):
  out, calm, gate = tmp_path / 'run', tmp_path / 'undisturbed', tmp_path / 'gate'
  shm = [default_snapshot_dir(run_dir.run_name(d)) for d in (out, calm)]
  env = launcher.env()
  first = launcher.start([sys.executable, ROOT / 'train.py', '--out', out, *ARGS],
                         env={**env, HOLD_ENV: f'{STEPS}:{gate}'}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
  undisturbed = launcher.start([sys.executable, ROOT / 'train.py', '--out', calm, *ARGS],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    # The first run's last durable save is written into Orbax's tmp directory and held there
    # (before its rename), the training thread waiting for it: nothing of the run moves.
    wait_for(lambda: Path(f'{gate}.held').exists(), 240, 'the held durable save', first)
    run_id = read_run_state(out).run_id
    checkpoints = out / 'checkpoints' / run_id
    assert [p.name for p in checkpoints.glob('*.orbax-checkpoint-tmp*')] == [
        f'{STEPS}.orbax-checkpoint-tmp'], sorted(p.name for p in checkpoints.iterdir())
    assert read_run_state(out).status == 'running'
    before = tree(out, shm[0])
    for flags in ([], ['--resume'], ['--fresh']):
      second = launcher.train('--out', out, *flags, *ARGS, timeout=240)
      assert _in_use(second.returncode, second.stderr, first.pid), (flags, second.stderr)
      assert tree(out, shm[0]) == before, flags  # paths, sizes and hashes
    # A job of two processes: process 0 finds the lock taken and tells the other, which
    # touches nothing either; both exit with the line.
    port = free_port()
    job = [launcher.start([sys.executable, ROOT / 'train.py', f'--coordinator=127.0.0.1:{port}',
                           '--num-processes=2', f'--process-id={p}', '--host-devices=1',
                           '--out', out, *ARGS], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) for p in (0, 1)]
    codes = wait_all(job, 240)
    assert all(_in_use(c, p.stderr.read(), first.pid) for c, p in zip(codes, job)), codes
    assert tree(out, shm[0]) == before
    # The supervisor looks before it writes anything (its logs, its history lines).
    supervised = launcher.python('-m', 'mecefo_jax.launch', '-n', '2', '--', '--out', out,
                                 *ARGS, timeout=60)
    assert _in_use(supervised.returncode, supervised.stderr, first.pid), supervised.stderr
    assert tree(out, shm[0]) == before
    assert first.poll() is None, 'the held run died'
    gate.touch()  # the save goes on: renamed into place, its manifest written
    assert wait_all([first, undisturbed], 240) == [0, 0], first.stderr.read()[-3000:]
    assert verify_manifest(checkpoints / str(STEPS)) is None
    assert not list(checkpoints.glob('*.orbax-checkpoint-tmp*'))
    assert report(out)['snapshots']['durable_retained_steps'][-1] == STEPS
    assert report(out)['snapshots']['durable_failed'] == 0
    assert report(out)['params_sha256'] == report(calm)['params_sha256']
    assert read_run_state(out).status == 'finished'
  finally:
    for proc in (first, undisturbed):
      kill(proc)
    for directory in shm:
      subprocess.run(['rm', '-rf', str(directory)], check=True)


def test_the_hold_hook_holds_its_step_alone_until_the_gate(tmp_path, monkeypatch):
  gate = tmp_path / 'gate'
  monkeypatch.setenv(HOLD_ENV, f'3:{gate}')
  held = hold.from_env()
  held.in_commit(2)  # another step: not held
  held.before_wait(2)
  assert not Path(f'{gate}.held').exists()
  commit = threading.Thread(target=held.in_commit, args=(3,))
  commit.start()
  held.before_wait(3)  # returns once the commit is held, and says so
  assert Path(f'{gate}.held').exists() and commit.is_alive()
  gate.touch()
  commit.join(10)
  assert not commit.is_alive()
