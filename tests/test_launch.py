"""The supervisor with real deaths: a SIGKILLed process's slices are taken over by the survivors
at once, a replacement rejoins, a process whose slices all fail skips every program until they
rejoin from another process, and the run equals a one-process replay of its failures.txt."""
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from mecefo_jax import launch
from procs import kill, report, wait_for

# 3 processes x 2 CPU devices, one slice per device: host h holds slices 2h, 2h+1.
STEPS = 250
ARGS = ['mesh.slice=6', 'mesh.fsdp=1', 'mesh.ordered_reduce=true', f'train.steps={STEPS}',
        'train.log_every=1', 'train.micro_batch=4', 'model.n_layers=1', 'model.seq_len=32',
        'snapshot.every=1', 'train.eval_every=0', 'train.plot=false']
# The survivors' job starts (~12 s here), then trains ~100 steps until the rejoin; the job of
# all hosts then trains the rest, host 2 with no live slice for steps 200-209 (this trace).
REJOIN_AFTER_S = 25
TRACE = '200 4 fail\n200 5 fail\n210 4 repair\n210 5 repair\n'


def _events(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _metrics_rows(run: Path) -> int:
  path = run / 'metrics.jsonl'
  return len(path.read_text().splitlines()) if path.exists() else 0


def _supervise(launcher, tmp: Path, *launch_args):
  events, trace = tmp / 'events.jsonl', tmp / 'trace.txt'
  trace.write_text(TRACE)
  # faults.precompile=always: each job compiles into its program store the programs of the job
  # that restarts after a host's death (on CPU `auto` leaves it off).
  cmd = [sys.executable, '-m', 'mecefo_jax.launch', '-n', '3', '--devices-per-process', '2',
         '--events', str(events), *launch_args, '--', '--out', str(tmp / 'run'),
         f'snapshot.dir={tmp / "shm"}', f'--failures=trace:{trace}', 'faults.precompile=always',
         *ARGS]
  log = open(tmp / 'launch.log', 'wb')
  return launcher.start(cmd, env=launcher.env(compile_cache=False), stdout=log, stderr=log), events


def test_a_killed_process_is_taken_over_and_its_replacement_rejoins(launcher, tmp_path):
  proc, events = _supervise(launcher, tmp_path, '--rejoin-after', str(REJOIN_AFTER_S))
  run = tmp_path / 'run'
  try:
    wait_for(lambda: _metrics_rows(run) >= 5, 300, 'training', proc)
    # The survivors' programs are in the store before the death (the test checks they load).
    wait_for(lambda: 'background builds done' in (tmp_path / 'launch.log').read_text(), 300,
             'the background builds', proc)
    victim = _events(events)[0]['pids']['1']
    os.kill(victim, signal.SIGKILL)  # host 1: slices 2 and 3
    code = proc.wait(timeout=600)
  finally:
    kill(proc)  # and any process of its session left (its train.py children)
  log = (tmp_path / 'launch.log').read_text(errors='replace')
  assert code == 0, log[-4000:]
  kinds = [e['kind'] for e in _events(events)]
  assert kinds[:3] == ['start', 'death', 'start'] and 'rejoin' in kinds, kinds
  assert 'rebuilt from the parity of the others' in log  # host 1's snapshot part
  assert 'slice 2 FAILED (absent)' in log and 'slice 2 repaired, rejoining (present)' in log
  # The survivors' job loaded the takeover's programs that the first job had stored, moved
  # onto its own devices; the rejoined job loaded the first job's programs.
  restart = log[log.index('slice 2 FAILED (absent)'):log.index('slice 2 repaired, rejoining')]
  assert 'loaded from the store the update program onto slices [0, 1, 4, 5]' in restart, restart
  result = report(run)
  assert result['programs']['loaded'] >= 1, result['programs']
  steps = {(e['slice'], e['kind'], e['source']): e['step'] for e in result['failure_events']}
  assert len(steps) == len(result['failure_events']) == 8, result['failure_events']
  assert {(s, kind): steps[s, kind, 'trace:trace.txt'] for s in (4, 5)
          for kind in ('fail', 'repair')} == {(4, 'fail'): 200, (5, 'fail'): 200,
                                              (4, 'repair'): 210, (5, 'repair'): 210}
  for s in (2, 3):
    assert steps[s, 'repair', 'present'] > steps[s, 'fail', 'absent'], \
        'the survivors trained no step before the rejoin'
  assert result['samples']['dropped'] == 0 and result['samples']['degraded'] > 0
  assert result['steps'] == STEPS and result['live_slices_at_end'] == list(range(6))

  # One process with every device, replaying the run's failures: the same parameters.
  replay = launcher.train('-q', '--host-devices=6', '--out', tmp_path / 'replay',
                          f'--failures=trace:{run / "failures.txt"}', '--no-snapshots', *ARGS,
                          timeout=600)
  assert replay.returncode == 0, replay.stderr[-3000:]
  reference = report(tmp_path / 'replay')
  assert result['params_sha256'] == reference['params_sha256']
  assert result['samples'] == reference['samples']


@pytest.mark.parametrize('argv, expected', [
    (['-n', '3', '--', '--host-devices=2'], '--host-devices is set by'),
    (['-n', '1'], 'need -n >= 2'),
    (['-n', '2', '--rejoin-after', '-5'], 'argument --rejoin-after: must be >= 0, got -5'),
    (['-n', '2', '--rejoin-after', 'nan'], 'argument --rejoin-after: must be >= 0, got nan')])
def test_supervisor_input_errors_are_one_line(capsys, argv, expected):
  with pytest.raises(SystemExit) as stop:
    launch.parse_args(argv)
  assert stop.value.code == 2
  [line] = capsys.readouterr().err.splitlines()
  assert line.startswith('error: ') and expected in line, line
