"""Run directories: one run per directory, a lock, config checks on resume, tmpfs errors,
run_state.json on a full disk, what a failed Orbax save leaves in the logs."""
import dataclasses
import errno
import logging
import os
import re
import resource
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest

from mecefo_jax.config import ConfigError, load_config, to_dict
from mecefo_jax import files
from mecefo_jax.run import cli, dir_lock, hints, rundir, storage
from mecefo_jax.records import history
from mecefo_jax.records.history import Kind
from mecefo_jax.records.job import BAD_INPUT
from mecefo_jax.records.run_dir import LOCK
from mecefo_jax.records.run_state import RUN_STATE, RunState, read_run_state, write_run_state

from procs import ROOT, TINY, error_lines, report

RUN = (*TINY, 'train.log_every=1', 'mesh.slice=1')


def train(launcher, out: Path, *args: str, cwd=ROOT, preexec=None) -> tuple[int, str]:
  # Only where given: a preexec_fn (even None) makes it a new process, not a fork server's.
  proc = launcher.train('-q', *(('--out', out) if out else ()), *RUN, *args, cwd=cwd,
                        **({'preexec_fn': preexec} if preexec else {}))
  return proc.returncode, proc.stdout + proc.stderr


def test_a_fresh_run_never_continues_another(launcher, tmp_path):
  out, shm = tmp_path / 'run', tmp_path / 'shm'
  code, log = train(launcher, out, 'train.steps=6', f'snapshot.dir={shm}',
                    'snapshot.durable_every=3')
  assert code == 0, log
  first = read_run_state(out).run_id
  assert not (shm / first).exists()  # a finished run frees its in-memory tier
  assert (out / 'checkpoints' / first).is_dir()
  (out / 'notes.txt').write_text('mine')
  # Another run in the same directory: refused in one line, nothing touched.
  code, log = train(launcher, out, 'train.steps=4', 'optimizer.lr=0.001', f'snapshot.dir={shm}')
  assert code == 2 and log.strip().splitlines()[-1].startswith('error: run directory'), log
  assert 'holds another run (finished)' in log and '--fresh' in log
  assert read_run_state(out).run_id == first
  # --fresh: that run's outputs and checkpoints go, the user's file stays.
  code, log = train(launcher, out, '--fresh', 'train.steps=4', 'optimizer.lr=0.001',
                    f'snapshot.dir={shm}',
                    'snapshot.durable_every=2')
  assert code == 0, log
  second = read_run_state(out).run_id
  assert second != first and not (out / 'checkpoints' / first).exists()
  assert (out / 'notes.txt').read_text() == 'mine'
  assert report(out)['steps'] == 4 and report(out)['config']['optimizer']['lr'] == 0.001


def test_resume_refuses_a_changed_config_naming_the_keys(tmp_path):
  cfg = lambda *o: load_config(None, ['train.steps=4', *o])
  with pytest.raises(ConfigError, match='no run in .* to resume'):
    rundir.check_start(tmp_path, cfg(), resume=True, replace=False)
  run_id = rundir.check_start(tmp_path, cfg(), resume=False, replace=False).run_id
  write_run_state(tmp_path, RunState('stopped', run_id=run_id, config=to_dict(cfg())))
  with pytest.raises(ConfigError, match=r'^resume with a changed config: ') as err:
    rundir.check_start(tmp_path, cfg('optimizer.b1=0.5', 'train.seed=3'), resume=True,
                       replace=False)
  assert f'optimizer.b1 ({cfg().optimizer.b1!r} -> 0.5), train.seed (0 -> 3);' in str(err.value)
  with pytest.raises(ConfigError, match=re.escape('train.steps (4 -> 3)')):  # shorter: refused
    rundir.check_start(tmp_path, cfg('train.steps=3'), resume=True, replace=False)
  # Longer, logging, a lower learning rate: allowed (on_resume); the run keeps its id, and the
  # changes are what the start records.
  checked = rundir.check_start(tmp_path, cfg('train.steps=6', 'train.log_every=2',
                                             'optimizer.lr=1e-4'), resume=True, replace=False)
  assert checked.run_id == run_id
  assert checked.changed == {'optimizer.lr': [cfg().optimizer.lr, 1e-4],
                                'train.log_every': [10, 2], 'train.steps': [4, 6]}
  # In Python (a Trainer) the refusal names the Trainer's arguments; under train.py its flags.
  with pytest.raises(ConfigError, match='holds another run .stopped.; resume it with '
                                        'resume=True, replace it with replace=True, or pass '
                                        'another out_dir$'):
    rundir.check_start(tmp_path, cfg(), resume=False, replace=False)
  with hints.command_line(), pytest.raises(ConfigError, match='resume it with --resume, '
                                           'replace it with --fresh, or pass another --out$'):
    rundir.check_start(tmp_path, cfg(), resume=False, replace=False)
  with pytest.raises(ConfigError, match='^resume=True: there is no run in'):
    rundir.check_start(tmp_path / 'none', cfg(), resume=True, replace=False)


def test_a_second_process_cannot_use_a_locked_run_directory(launcher, tmp_path):
  out = tmp_path / 'run'
  out.mkdir()
  holder = launcher.start([sys.executable, '-c', (
      'import fcntl, os, sys, time\n'
      f'fd = os.open({str(out / ".lock")!r}, os.O_RDWR | os.O_CREAT)\n'
      'fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode())\n'
      'print("locked", flush=True); time.sleep(120)')], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == 'locked'
    code, log = train(launcher, out, 'train.steps=2', '--no-snapshots')
    assert code == 2 and f'in use by another training process (pid {holder.pid})' in log, log
  finally:
    holder.kill()
    holder.wait()
  # The holder died (SIGKILL): its lock is stale and taken over.
  code, log = train(launcher, out, 'train.steps=2', '--no-snapshots')
  assert code == 0, log


def test_a_start_after_a_clean_exit_reports_no_stale_lock(tmp_path, capsys, caplog):
  out = tmp_path / 'run'
  assert cli.main(['--out', str(out), '--no-snapshots', 'train.steps=1', 'train.compile_cache=',
                   *RUN]) == 0, capsys.readouterr().err
  assert (out / LOCK).read_text() == ''  # no holder: nothing for the next start to report
  (out / LOCK).write_text('999999999')  # what a killed process leaves: its pid
  caplog.clear()
  with caplog.at_level(logging.INFO, logger='mecefo'):
    dir_lock.unlock(dir_lock.lock(out))
  assert caplog.messages == ['run directory lock of pid 999999999 (no longer running) taken over']
  caplog.clear()
  with caplog.at_level(logging.INFO, logger='mecefo'):
    dir_lock.unlock(dir_lock.lock(out))
  assert caplog.messages == []


def _limit_file_size():
  """Files of at most 128 KiB (the tiny state's in-memory image is larger), and a write past it
  fails with EFBIG instead of killing the process: a full tmpfs, as far as a save can tell."""
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (128 << 10, 128 << 10))


def test_in_memory_snapshot_errors_skip_the_snapshot_and_training_goes_on(launcher, tmp_path):
  out, shm = tmp_path / 'run', tmp_path / 'shm'
  code, log = train(launcher, out, 'train.steps=4', f'snapshot.dir={shm}', 'snapshot.every=1',
                    'snapshot.durable_every=0', preexec=_limit_file_size)
  assert code == 0, log
  snapshots = report(out)['snapshots']
  assert snapshots['skipped'] >= 4 and snapshots['retained_steps'] == [], snapshots
  assert log.count('in-memory snapshot skipped') == snapshots['skipped']
  skips = [line for line in history.read(out) if line.kind is Kind.SNAPSHOT_SKIPPED]
  assert sum(line.skipped for line in skips) == snapshots['skipped'], skips  # where, in the record
  assert 'Traceback' not in log and report(out)['steps'] == 4


def test_the_default_run_directory_replaces_a_finished_run_not_an_unfinished_one(launcher,
                                                                                  tmp_path):
  def default_out(*args):  # no --out: runs/latest under the working directory
    return train(launcher, None, *args, cwd=tmp_path)
  latest, shm = tmp_path / 'runs' / 'latest', tmp_path / 'shm'
  code, log = default_out('train.steps=3', f'snapshot.dir={shm}')
  assert code == 0, log
  first = read_run_state(latest).run_id
  code, log = default_out('train.steps=4', 'optimizer.lr=0.001', f'snapshot.dir={shm}')
  assert code == 0 and 'removed the outputs, snapshots and checkpoints of the previous run' in log
  state = read_run_state(latest)
  assert state.run_id != first and state.config['optimizer']['lr'] == 0.001
  assert report(latest)['steps'] == 4 and not (latest / 'checkpoints' / first).exists()
  # An unfinished run there is never replaced: a changed config is refused in one line.
  write_run_state(latest, dataclasses.replace(state, status='stopped'))
  code, log = default_out('train.steps=4', 'optimizer.b1=0.8', f'snapshot.dir={shm}')
  assert code == 2 and 'resume with a changed config: optimizer.b1' in log, log


def test_a_resume_reads_the_runs_own_copy_of_its_trace_where_the_given_one_is_gone(tmp_path):
  given, out = tmp_path / 'trace.txt', tmp_path / 'run'
  out.mkdir()
  given.write_text('2 1 fail\n')
  trace = rundir.read_trace(out, f'trace:{given}', resume=False)
  assert (trace.path, trace.text, trace.source) == (given, '2 1 fail\n', 'trace:trace.txt')
  rundir.keep_trace(out, trace)
  given.write_text('9 0 fail\n')  # what the given path holds later is not the run's trace
  copy = rundir.read_trace(out, f'trace:{given}', resume=True)
  assert (copy.path, copy.text, copy.source) == (out / rundir.TRACE, '2 1 fail\n',
                                                 'trace:trace.txt')
  given.unlink()
  assert rundir.read_trace(out, f'trace:{given}', resume=True).text == '2 1 fail\n'
  (out / rundir.TRACE).unlink()  # a run from before copies were kept, its trace gone
  with pytest.raises(ConfigError, match=rf"'{given}' not found, and '{out}' holds no copy"):
    rundir.read_trace(out, f'trace:{given}', resume=True)
  assert rundir.read_trace(out, 'high', resume=True) is None


def test_an_impossible_device_count_is_refused_before_any_work(tmp_path, capsys):
  """--host-devices beyond what XLA's CPU client runs is one line, exit 2, before jax starts
  and before the run directory is made."""
  with pytest.raises(SystemExit) as exited:
    cli.main(['--out', str(tmp_path / 'run'), '--host-devices', '1000'])
  assert exited.value.code == BAD_INPUT
  [line] = error_lines(capsys.readouterr().err)
  assert 'argument --host-devices: must be <= 256, got 1000' in line, line
  assert not (tmp_path / 'run').exists()


def test_orbax_closed_loop_noise_is_dropped_and_every_other_report_stays(monkeypatch, caplog):
  """What a failed Orbax save leaves behind (tensorstore callbacks into its closed event loop,
  futures nobody awaited) is dropped; any other unraisable exception or asyncio error still
  reaches the hook before it (Python's, which prints it)."""
  reached = []
  monkeypatch.setattr(sys, 'unraisablehook', lambda u: reached.append(str(u.exc_value)))
  storage.quiet_failed_saves()
  hook = sys.unraisablehook
  storage.quiet_failed_saves()  # once: a second call wraps nothing more
  assert sys.unraisablehook is hook

  def unraisable(err):
    return types.SimpleNamespace(exc_type=type(err), exc_value=err, exc_traceback=None,
                                 err_msg=None, object=None)
  hook(unraisable(RuntimeError('Event loop is closed')))
  hook(unraisable(RuntimeError('something else')))
  assert reached == ['something else']
  asyncio_log = logging.getLogger('asyncio')
  with caplog.at_level(logging.ERROR, 'asyncio'):
    asyncio_log.error('_GatheringFuture exception was never retrieved')
    asyncio_log.error('Task was destroyed but it is pending!')
  assert caplog.messages == ['Task was destroyed but it is pending!']


def test_run_state_is_written_in_place_when_the_disk_has_no_room_for_a_new_file(
    tmp_path, monkeypatch):
  """An atomic replace needs a new file, which a full disk refuses (ENOSPC: made here by
  failing files.replace_text, the OS boundary); run_state.json is then written over its own
  bytes, so its status says the truth. Longer text than the file holds is not written."""
  write_run_state(tmp_path, RunState('running', run_id='abc', config={'a': 1}))

  def full(path, text):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
  monkeypatch.setattr(files, 'replace_text', full)
  write_run_state(tmp_path, RunState('stopped', run_id='abc', config={'a': 1}))
  assert read_run_state(tmp_path) == RunState('stopped', run_id='abc', config={'a': 1})
  with pytest.raises(OSError):
    write_run_state(tmp_path, RunState('finished', run_id='abc', config={'a': 1, 'b': 2}))
  assert read_run_state(tmp_path).status == 'stopped'
  assert [p.name for p in tmp_path.iterdir()] == [RUN_STATE]
