"""A diverged run goes back: --resume with a lower learning rate restores the newest snapshot
before the divergence (never a NaN state), and a run that diverged before any says so."""
import json
import logging
import math
import re
import shlex

from mecefo_jax.config import load_config
from mecefo_jax.records import history
from mecefo_jax.records.history import Kind, Rollback
from mecefo_jax.records.job import BAD_INPUT, DIVERGED
from mecefo_jax.run import cli, ending, resume
from mecefo_jax.records.run_state import RUN_STATE
from mecefo_jax.records.run_state import Diverged
from procs import TINY, error_lines, report

# Every step fetched and snapshotted: the last step seen finite is the one before the divergence.
# lr=300 diverges at step 7 of 12 (the schedule spans train.steps; 8 steps never diverge).
STEPS = 12
RUN = (*TINY, 'mesh.slice=1', 'train.compile_cache=', f'train.steps={STEPS}',
       'train.log_every=1', 'train.eval_every=0', 'snapshot.every=1',
       'optimizer.warmup_steps=0')


def _run_state(out) -> dict:
  return json.loads((out / RUN_STATE).read_text())


def _diverged_line(caplog) -> str:
  [line] = [m for m in caplog.messages if 'not finite (' in m and ' at step ' in m]
  return line


def test_a_diverged_run_resumed_with_a_lower_lr_goes_back_before_the_divergence(
    tmp_path, caplog, capsys):
  """lr=300 on this tiny model: a finite loss whose gradient norm is NaN (the state after that
  step would be NaN: never saved). The resume hint's command with a lower optimizer.lr (a key
  whose setting allows it) restores the snapshot of the last step seen finite, takes the newer
  ones (in both tiers) out of the run, records what changed, and trains to the end. (The
  hint's lr/10 diverges again here: at lr=300 this model is wrecked within 3 steps, so the test
  goes to 1e-3.)"""
  out, shm = tmp_path / 'run', tmp_path / 'shm'
  caplog.set_level(logging.INFO, 'mecefo')
  argv = ['--out', str(out), f'snapshot.dir={shm}', 'snapshot.durable_every=1', *RUN]
  assert cli.main([*argv, 'optimizer.lr=300']) == DIVERGED
  first = report(out)
  step = first['diverged_at_step']
  diverged = _run_state(out)['diverged']
  assert diverged == {'diverged_at_step': step, 'last_finite_step': step - 1,
                      'rollback_to': step - 1}
  # Snapshot `step` (saved after step-1, finite) exists but its own step was not finite; none
  # holds the state after it (its update was NaN: it used to be saved, and restored).
  assert max(first['snapshots']['retained_steps']) == step, first['snapshots']
  line = _diverged_line(caplog)
  assert f'the newest snapshot before it is of step {step - 1}' in line, line
  assert any(f'-> not finite at step {step}, eval' in m for m in caplog.messages)
  # optimizer.b1 is no key a resume may change: refused in one line, nothing started.
  state = (out / RUN_STATE).read_bytes()
  assert cli.main(['--out', str(out), '--resume', 'optimizer.b1=0.8']) == BAD_INPUT
  [error] = error_lines(capsys.readouterr().err)
  assert 'resume with a changed config: optimizer.b1 (0.9 -> 0.8)' in error, error
  assert (out / RUN_STATE).read_bytes() == state
  caplog.clear()
  hint = shlex.split(re.search(r'lower learning rate, `(python train\.py [^`]*)`', line)[1])
  assert hint[2:] == ['--out', str(out), '--resume', 'optimizer.lr=30']
  assert cli.main([*hint[2:-1], 'optimizer.lr=1e-3']) == 0
  result = report(out)
  assert result['diverged_at_step'] is None and result['steps'] == STEPS
  assert result['resumed_from_step'] == step - 1
  run_id = _run_id(out)
  # Both tiers held `step`: the in-memory one is deleted, the durable one set aside (kept).
  discarded = [f'in-memory snapshot {shm}/{run_id}/{step}',
               f'durable checkpoint {out}/checkpoints/{run_id}/{step}']
  assert result['rollback'] == {'diverged_at_step': step, 'last_finite_step': step - 1,
                                'to_step': step - 1, 'discarded': discarded}
  assert list((out / 'checkpoints' / 'set_aside' / run_id).glob(f'{step}-*/{step}'))
  assert result['changed_on_resume'] == {'optimizer.lr': [300.0, 0.001]}
  assert all(loss is not None and math.isfinite(loss) for _, loss in result['losses'][step:])
  assert 'diverged' not in _run_state(out)  # a later restart resumes the new timeline
  lines = history.read(out)
  assert [line.kind for line in lines] == [
      Kind.START, Kind.DIVERGED, Kind.END, Kind.THROWN_AWAY, Kind.START, Kind.CHANGED,
      Kind.ROLLED_BACK, Kind.END]
  assert lines[5].settings == {'optimizer.lr': [300.0, 0.001]}
  assert lines[6].rolled_back == Rollback(step, step - 1, step - 1, discarded)
  assert any(m.startswith(f'the run diverged at step {step}: went back to the in-memory '
                          f'snapshot') for m in caplog.messages)


def _run_id(out) -> str:
  return _run_state(out)['run_id']


def test_a_run_diverged_before_any_snapshot_says_so_and_its_resume_starts_nothing(
    tmp_path, caplog, capsys):
  """lr=1e9: the loss of step 1 is NaN; the only snapshot (1, after step 0) is of that step, so
  there is nothing to go back to: the run says so, and --resume refuses in one line."""
  out = tmp_path / 'run'
  caplog.set_level(logging.INFO, 'mecefo')
  assert cli.main(['--out', str(out), f'snapshot.dir={tmp_path}/shm', *RUN,
                   'optimizer.lr=1e9']) == DIVERGED
  line = _diverged_line(caplog)
  assert 'before any snapshot of a step seen finite, so there is nothing to go back to' in line
  assert '--resume' not in line and '--fresh' in line, line
  assert _run_state(out)['diverged'] == {'diverged_at_step': 1, 'last_finite_step': 0,
                                         'rollback_to': None}
  before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
  assert cli.main(['--out', str(out), '--resume', 'optimizer.lr=1e-3']) == BAD_INPUT
  [error] = error_lines(capsys.readouterr().err)
  assert error.startswith(f'error: --resume: the run in {out} diverged at step 1 before any '
                          'snapshot of a step <= 0'), error
  assert 'nothing was started' in error and '--fresh' in error, error
  assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_a_failure_preset_that_applied_no_failure_says_so_last_and_in_the_report(
    tmp_path, caplog):
  out = tmp_path / 'run'
  caplog.set_level(logging.INFO, 'mecefo')
  assert cli.main(['--out', str(out), *TINY, 'mesh.slice=2', 'train.steps=3',
                   'train.compile_cache=', f'snapshot.dir={tmp_path}/shm',
                   '--failures', 'high']) == 0
  note = report(out)['failures_note']
  assert report(out)['failure_events'] == [] and note == caplog.messages[-1]
  # 3 steps of 60 s = 0.05 h; high: 0.5 h per cluster device, 32 devices over 2 slices: 8 h.
  assert note.startswith('--failures high produced no failure in this run: its 3 steps at '
                         'faults.cluster_step_s=60 cover 0.05 simulated hours, and the preset '
                         'fails one of its 2 slice(s) every 8 hours on average'), note
  assert '0.01 failures expected' in note, note


def test_no_failure_note_where_a_failure_was_applied_or_none_was_asked_for():
  high, none = (load_config(None, ['faults.failures=' + f]) for f in ('high', 'none'))
  assert ending.no_failure_note(high, 2, 3, [{'step': 1, 'slice': 0, 'kind': 'fail'}]) is None
  assert ending.no_failure_note(none, 2, 3, []) is None
  assert ending.no_failure_note(high, 2, 3, []) is not None


def test_going_back_with_the_optimizer_it_diverged_with_is_a_warning(caplog):
  back = Rollback(diverged_at_step=9, last_finite_step=8, to_step=5, discarded=[])
  resume.same_optimizer(back, {'optimizer.warmup_steps': [20, 100]})
  assert not caplog.messages
  resume.same_optimizer(back, {'train.log_every': [10, 1]})
  [line] = caplog.messages
  assert line.startswith('the run goes back to step 5 with the optimizer settings it diverged '
                         'with at step 9: it will likely diverge again'), line


def test_a_run_diverged_at_its_first_step_without_snapshots_says_both(tmp_path):
  line = resume._nothing_before(Diverged(0, -1, None), tmp_path, None)
  assert (f'the run in {tmp_path} diverged at step 0, its first step (snapshots are off), so '
          'there is no snapshot to go back to; nothing was started') in line
