"""The supervisor with a real death placed at an exact step (the process SIGKILLs itself, as a
test hook asks), a rejoin and a stop at exact steps (stop requests, not sleeps): the survivors
take over at once, every step and record is kept across the restarts, the printed resume
command works as printed, and the run equals a one-process replay of its failures.txt."""
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from mecefo_jax import launch
from mecefo_jax.run import rundir
from mecefo_jax.run.exits import STOPPED
from mecefo_jax.run.stop import TEST_DEATH_ENV
from procs import ROOT, report, usage_error

# 3 processes x 2 CPU devices, one slice per device: host h holds slices 2h, 2h+1.
STEPS, DEATH, STOP = 60, 12, 40
ARGS = ['mesh.slice=6', 'mesh.fsdp=1', 'mesh.ordered_reduce=true', f'train.steps={STEPS}',
        'train.log_every=1', 'train.micro_batch=4', 'model.n_layers=1', 'model.seq_len=32',
        'snapshot.every=1', 'train.eval_every=0', 'train.plot=false']
# Slices 4 and 5 (host 2) fail and are repaired after the rejoin: host 2 has no live slice then.
TRACE = '30 4 fail\n30 5 fail\n36 4 repair\n36 5 repair\n'


def _events(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _strip(events: list[dict]) -> list[tuple]:
  return [(e['step'], e['slice'], e['kind']) for e in events]


def test_a_death_a_rejoin_and_a_stop_keep_every_step_and_record(launcher, tmp_path):
  events, trace = tmp_path / 'events.jsonl', tmp_path / 'trace.txt'
  trace.write_text(TRACE)
  run = tmp_path / 'run'
  # Host 1 dies after step 12 (its snapshot written, the background builds done); its
  # replacement is ready at once, so the survivors' job stops after its first step (13) and
  # the job of all hosts trains on to the stop at 40. faults.precompile=always: the first job
  # compiles into the program store the programs of the job that restarts after a death.
  cmd = [sys.executable, '-m', 'mecefo_jax.launch', '-n', '3', '--devices-per-process', '2',
         '--rejoin-after', '0', '--events', str(events), '--', '--out', str(run),
         f'snapshot.dir={tmp_path / "shm"}', f'--failures=trace:{trace}',
         'faults.precompile=always', *ARGS, '--stop-after', str(STOP)]
  env = launcher.env(compile_cache=False)
  first = launcher.run(cmd, timeout=600, env={**env, TEST_DEATH_ENV: f'1:{DEATH}'})
  log = first.stdout + first.stderr
  assert first.returncode == STOPPED, log[-4000:]
  kinds = [e['kind'] for e in _events(events)]
  assert kinds == ['start', 'death', 'start', 'rejoin-ready', 'rejoin', 'start', 'end'], kinds
  assert 'snapshot 12: part of host 1 rebuilt from the parity of the others' in log
  survivors = log[log.index('host 1 (pid'):log.index('host(s) [1] rejoin')]
  # The survivors' job loaded the takeover's programs that the first job had stored, moved
  # onto its own devices, and stopped after its first step, saved in both tiers.
  assert 'loaded from the store the update program onto slices [0, 1, 4, 5]' in survivors
  assert f'stopped by the grow-back of host(s) [1] after step {DEATH + 1}, saved as the ' \
         'in-memory snapshot parts' in survivors
  stopped = report(run)
  assert stopped['steps'] == STOP and stopped['preempted'] and 'durable checkpoint' in \
      stopped['stopped']

  # The resume command the stop printed, run exactly as printed: nothing trained again.
  resume = re.findall(r'resume with `(python -m mecefo_jax\.launch [^`]*)`', log)[-1]
  assert '--stop-after' not in resume
  second = launcher.run([sys.executable, *shlex.split(resume)[1:]], timeout=600, env=env)
  assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
  result = report(run)
  assert (result['steps'], result['resumed_from_step'], result['steps_lost'],
          result['steps_lost_total']) == (STEPS, STOP, 0, 0)
  assert result['programs']['loaded'] >= 1, result['programs']
  assert _strip(result['failure_events']) == [
      (DEATH, 2, 'fail'), (DEATH, 3, 'fail'), (DEATH + 1, 2, 'repair'), (DEATH + 1, 3, 'repair'),
      (30, 4, 'fail'), (30, 5, 'fail'), (36, 4, 'repair'), (36, 5, 'repair')]
  assert result['samples']['dropped'] == 0 and result['samples']['degraded'] > 0
  assert result['live_slices_at_end'] == list(range(6))
  history = rundir.read_history(run)
  assert [e['kind'] for e in history if e['kind'] in ('stop', 'launch-death')] == [
      'launch-death', 'stop', 'stop']
  assert [e['step'] for e in history if e['kind'] == 'stop'] == [DEATH + 1, STOP]

  # failures.txt's own replay line, run exactly as printed (from tmp_path: runs/latest there):
  # one process with every device, the same records and parameters.
  line = (run / 'failures.txt').read_text().splitlines()[0]
  replay_cmd = re.fullmatch(r'# replay: `(python train\.py [^`]*)`', line).group(1)
  replay = launcher.run([sys.executable, ROOT / 'train.py', *shlex.split(replay_cmd)[2:]],
                        timeout=600, cwd=tmp_path, env=env)
  assert replay.returncode == 0, replay.stderr[-3000:]
  reference = report(tmp_path / 'runs' / 'latest')
  assert result['params_sha256'] == reference['params_sha256']
  assert result['samples'] == reference['samples']
  assert _strip(result['failure_events']) == _strip(reference['failure_events'])


@pytest.mark.parametrize('argv, expected', [
    (['-n', '3', '--', '--host-devices=2'], '--host-devices is set by'),
    (['-n', '1'], 'need -n >= 2'),
    (['-n', '2', '--rejoin-after', '-5'], 'argument --rejoin-after: must be >= 0, got -5'),
    (['-n', '2', '--rejoin-after', 'nan'], 'argument --rejoin-after: must be >= 0, got nan')])
def test_supervisor_input_errors_are_one_line(capsys, argv, expected):
  line = usage_error(capsys, launch.parse_args, argv)
  assert expected in line, line
