"""A start's promises: `running` only once the state and first programs are built (a failure
before leaves the run's files byte for byte), no catch-all for a bug, evals off without eval
rows, and durable saves that fail: a line each, the run goes on, a few in a row stop it. The
tests that train are `slow` (whole in-process runs, sharing their programs)."""
import logging

import pytest

from mecefo_jax.fault.controller import Controller
from mecefo_jax.run import cli, rundir
from mecefo_jax.records.job import CHECKPOINTS_FAILING, STOPPED
from mecefo_jax.snapshot import durable, manager, tier
from mecefo_jax.snapshot.capacity import SnapshotError
from mecefo_jax.records.run_state import read_run_state
from procs import TINY, report, tree

# One config for every run of this file (train.steps too): they share their programs.
RUN = [*TINY, 'mesh.slice=2', 'train.steps=8', 'train.log_every=1',
       'train.eval_batches=1', 'train.eval_every=2', 'train.compile_cache=']


@pytest.fixture(scope='module')
def stopped(tmp_path_factory):
  """A run stopped after 2 of 8 steps, and its snapshots."""
  base = tmp_path_factory.mktemp('stopped')
  args = ['--out', str(base / 'run'), *RUN, f'snapshot.dir={base / "shm"}',
          'snapshot.durable_every=1']
  assert cli.main([*args, '--stop-after', '2']) == STOPPED
  return base, args


@pytest.mark.slow  # whole in-process runs
def test_a_start_that_fails_before_running_leaves_every_file_as_it_was(stopped, monkeypatch):
  """An unexpected error (a bug, injected) in the start-up, after the snapshot is restored or
  the new state created and before the first programs are built: its traceback (the exception
  leaves cli.main: train.py exits 1), and run_state.json, history.jsonl, the snapshots and
  checkpoints byte for byte as they were, for a resume and for --fresh alike."""
  base, args = stopped

  def bug(self):
    raise RuntimeError('an injected bug')
  monkeypatch.setattr(Controller, 'build_step_programs', bug)
  before = tree(base / 'run', base / 'shm')
  for flags in (['--resume'], [], ['--fresh']):
    with pytest.raises(RuntimeError, match='an injected bug'):
      cli.main([*args, *flags])
    assert tree(base / 'run', base / 'shm') == before, flags
  assert read_run_state(base / 'run').status == 'stopped'


@pytest.mark.slow  # whole in-process runs
def test_no_eval_rows_turn_evals_off_the_final_one_too(tmp_path, caplog):
  """--data text:FILE?eval_fraction=0 was accepted, then raised a DataError at the first eval
  and left the run `running`, so that every later start crashed alike."""
  text = tmp_path / 'a.txt'
  text.write_text('plain words for a small run without held-out rows. ' * 60)
  out = tmp_path / 'run'
  caplog.set_level(logging.INFO, 'mecefo')
  assert cli.main(['--out', str(out), *RUN, '--data', f'text:{text}?eval_fraction=0',
                   '--no-snapshots']) == 0
  result = report(out)
  assert (result['eval_loss'], result['eval_perplexity'], result['evals']) == (None, None, [])
  assert result['steps'] == 8 and read_run_state(out).status == 'finished'
  assert 'holds no eval rows (eval_fraction=0): evals are off, the final one too' in caplog.text
  assert 'eval n/a (perplexity n/a' in caplog.text  # the summary line


def _failing_durable_saves(monkeypatch) -> None:
  real = tier.Tier._start_save

  def save(self, step, args):
    if self.name == 'durable':
      raise OSError(28, 'No space left on device (a test)')
    return real(self, step, args)
  monkeypatch.setattr(tier.Tier, '_start_save', save)


@pytest.mark.slow  # whole in-process runs
def test_durable_saves_that_fail_are_a_line_each_then_stop_the_run(tmp_path,
                                                                    monkeypatch, caplog):
  out = tmp_path / 'run'
  args = ['--out', str(out), *RUN, f'snapshot.dir={tmp_path / "shm"}',
          'snapshot.durable_every=1']
  caplog.set_level(logging.WARNING, 'mecefo')
  with monkeypatch.context() as m:
    _failing_durable_saves(m)
    assert cli.main(args) == CHECKPOINTS_FAILING
  failed = [msg for msg in caplog.messages if msg.startswith('durable checkpoint ')]
  assert [msg.split(' failed')[0] for msg in failed] == [
      'durable checkpoint 1', 'durable checkpoint 2', 'durable checkpoint 3'], caplog.messages
  assert all('No space left on device (a test)' in msg for msg in failed)
  stop = next(msg for msg in caplog.messages if 'the run stopped after 4 step(s), saved as the '
              'in-memory snapshot' in msg)
  assert stop.startswith(f'{durable.FAILURES_TO_STOP} durable checkpoint(s) in a row failed')
  result = report(out)
  assert result['steps'] == 4 and result['snapshots']['durable_failed'] == 3
  assert read_run_state(out).status == 'stopped'
  # The durable directory works again: the printed command resumes from the in-memory tier.
  assert '--resume' in stop and cli.main([*args, '--resume']) == 0
  assert report(out)['resumed_from_step'] == 4 and report(out)['snapshots']['durable_failed'] == 0


@pytest.mark.slow  # whole in-process runs
def test_a_durable_failure_while_the_in_memory_tier_fails_too_stops_at_once(
    tmp_path, monkeypatch, caplog):
  caplog.set_level(logging.WARNING, 'mecefo')

  def no_room(self, *args, **kwargs):
    raise SnapshotError('tmpfs full (a test)')
  _failing_durable_saves(monkeypatch)
  monkeypatch.setattr(manager.SnapshotManager, '_split_sources', no_room)  # every memory save
  out = tmp_path / 'run'
  assert cli.main(['--out', str(out), *RUN, f'snapshot.dir={tmp_path / "m"}', 'snapshot.every=1',
                   'snapshot.durable_every=1']) == CHECKPOINTS_FAILING
  result = report(out)
  assert result['steps'] == 2 and result['snapshots']['durable_failed'] == 1
  assert result['snapshots']['skipped'] == 3  # steps 1, 2, and 2 again at the stop
  assert 'the run stopped after 2 step(s), saved in no snapshot (the in-memory tier fails too' in \
      caplog.text


class _Tier:
  directory = 'ckpt'

  def __init__(self, error):
    self.error = error
    self.discarded = []  # the failed saves whose leftovers went (process 0's, in a real tier)

  def discard_failed(self, step):
    self.discarded.append(step)

  def wait(self):
    if self.error:
      raise SnapshotError(self.error)

  def save(self, step, state, meta, **kwargs):
    return True


def test_the_processes_of_a_job_agree_on_a_durable_failure_any_of_them_saw():
  """The durable checkpoint is written by all processes together; one's failure is every
  process's (their errors gathered at the same step), so that all count and stop alike."""
  errors = [None, 'process 1: commit failed']
  guards = [durable.DurableGuard(_Tier(e), agree=lambda _: errors) for e in errors]
  for _ in range(durable.FAILURES_TO_STOP):
    for guard in guards:
      assert guard.save(1, None, {})
      guard.settle()
  assert [(g.failed, g.in_a_row, g.failing) for g in guards] == 2 * [(3, 3, True)]
  assert [g.tier.discarded for g in guards] == 2 * [[1, 1, 1]]  # once all agreed it failed
  assert not guards[0].save(2, None, {})  # failing: nothing more is started
