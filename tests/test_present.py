"""Logical vs present slices: a run resumed with devices for fewer slices keeps its N slices."""
import signal

import pytest

from mecefo_jax.config import ConfigError, load_config
from mecefo_jax.run import presence
from mecefo_jax.run import rundir
from mecefo_jax.records.run_state import RunState, read_run_state, write_run_state
from procs import error_lines, report
from test_recovery import STEPS, kill_after, train


def test_a_resume_with_devices_for_fewer_slices_keeps_the_runs_slices(devices, tmp_path, caplog):
  cfg = load_config(None, ['mesh.slice=4', 'mesh.fsdp=4'])  # 16 devices: 2 of 4 slices here
  with pytest.raises(ConfigError, match='exceeds the 8 available'):  # a new run: it must fit
    presence.find(cfg, tmp_path, resume=True)
  write_run_state(tmp_path, RunState('stopped', run_id='abc', n_slices=4))
  found = presence.find(cfg, tmp_path, resume=True)
  assert (found.n_slices, found.ids, dict(found.mesh.shape)) == (4, (0, 1), {
      'slice': 2, 'fsdp': 4, 'tensor': 1})
  assert "2 of the run's 4 slices present: slices [2, 3] are absent" in caplog.text
  with pytest.raises(ConfigError, match='needs a multi-process run'):
    presence.find(cfg, tmp_path, resume=True, host_slot=1)


def test_a_restart_with_fewer_processes_must_name_their_hosts(devices):
  """A run of 3 hosts restarted as a job of fewer processes without --host-slot: one line
  (docs/errors.md); each process names its host, and no host twice or out of range."""
  with pytest.raises(ConfigError, match=r'this run has 3 hosts and this job 1 processes: give '
                                        r'each process the logical host it is \(--host-slot'):
    presence.host_slots(None, 3)
  assert presence.host_slots(2, 3) == (2,)
  with pytest.raises(ConfigError, match=r'the processes claim hosts \[3\]'):
    presence.host_slots(3, 3)


def test_absent_slices_are_taken_over_and_rejoin_when_present_again(launcher, tmp_path):
  out, shm = tmp_path / 'run', tmp_path / 'shm'
  on = lambda devices: ('--host-devices', str(devices), 'mesh.slice=4', f'snapshot.dir={shm}',
                       '--takeover', 'spread')  # the absent slice's rows degraded
  code, log = kill_after(launcher, out, 3, *on(4))  # SIGKILL after step 3
  assert code == -signal.SIGKILL, log[-3000:]
  # The machine comes back with devices for 3 slices only: slice 3 is absent, not waited for.
  code, log = kill_after(launcher, out, 8, *on(3))
  assert code == -signal.SIGKILL and '3 of the run\'s 4 slices present' in log, log[-3000:]
  assert 'slice 3 FAILED (absent)' in log, log[-3000:]
  assert read_run_state(out).n_slices == 4
  # All 4 present again: slice 3 rejoins, the run ends with nothing dropped.
  code, log = train(launcher, out, *on(4))
  assert code == 0 and 'slice 3 repaired, rejoining (present)' in log, log[-3000:]
  result = report(out)
  events = [(e['slice'], e['kind'], e['source']) for e in result['failure_events']]
  assert events == [(3, 'fail', 'absent'), (3, 'repair', 'present')], events
  assert result['samples']['dropped'] == 0 and result['samples']['degraded'] > 0
  assert result['live_slices_at_end'] == [0, 1, 2, 3]
  # The same failures replayed in one uninterrupted 4-slice run give the same parameters.
  fail, repair = (e['step'] for e in result['failure_events'])
  trace = tmp_path / 'failures.txt'
  trace.write_text(f'{fail} 3 fail\n{repair} 3 repair\n')
  code, log = train(launcher, tmp_path / 'replay', '--host-devices', '4', 'mesh.slice=4',
                    '--no-snapshots', '--failures', f'trace:{trace}', '--takeover', 'spread')
  assert code == 0, log[-3000:]
  assert report(tmp_path / 'replay')['params_sha256'] == result['params_sha256']
  assert report(tmp_path / 'replay')['steps'] == STEPS


def test_no_slice_present_is_one_line(launcher, tmp_path):
  out = tmp_path / 'run'
  code, log = train(launcher, out, '--host-devices', '4', 'mesh.slice=2', 'mesh.fsdp=2',
                    '--no-snapshots', 'train.steps=2')
  assert code == 0, log[-3000:]
  code, log = train(launcher, out, '--host-devices', '1', 'mesh.slice=2', 'mesh.fsdp=2',
                    '--no-snapshots', 'train.steps=3', '--resume')
  errors = error_lines(log)
  assert code == 2 and len(errors) == 1 and 'not one slice' in errors[0], log[-3000:]


def test_a_new_run_that_leaves_devices_idle_says_so(tmp_path, caplog):
  cfg = load_config(None, ['mesh.slice=3'])  # of the 8 fake devices
  found = presence.find(cfg, tmp_path, resume=False)
  assert found.mesh.devices.size == 3
  assert ('the mesh uses 3 of the 8 devices: 5 idle (mesh.slice=3 x mesh.fsdp=1 x '
          'mesh.tensor=1); mesh.slice=8 would use them all') in caplog.text
  caplog.clear()
  presence.find(load_config(None, ['mesh.slice=4', 'mesh.fsdp=2']), tmp_path, resume=False)
  assert 'idle' not in caplog.text
