"""The terminal's progress: a bar on a TTY, plain lines otherwise, quiet; the build lines."""
import io
import logging
import threading
from pathlib import Path

import pytest

from mecefo_jax.records.metrics import EvalRow, TrainRow
from mecefo_jax.run import progress

ROOT = Path(__file__).resolve().parents[1]

ROW = TrainRow(step=4, degraded_tokens=0.0, exact_tokens=64.0, grad_norm=0.5, loss=3.25,
               wall_s=1.0, live_slices=1, tokens_per_s=12345.0)
EVAL = EvalRow(4, 3.0, 20.09, eval_s=0.1, wall_s=1.1, live_slices=1)


class FakeTTY(io.StringIO):
  def isatty(self):
    return True


def _show(mode, stream, caplog):
  with caplog.at_level(logging.INFO, logger='mecefo'):
    with progress.Progress(20, 0, 2, 'neighbor', mode=mode, stream=stream) as p:
      p.step(1)
      p.train_row(ROW)
      logging.getLogger('mecefo').warning('step 5: slice 1 FAILED')
      p.eval_row(EVAL)
    return p.mode, [r.getMessage() for r in caplog.records]


def test_plain_lines_are_shown_when_logging_is_not_configured():
  # A notebook or script calling Trainer(progress='plain') without logging.basicConfig: INFO
  # is not enabled for the 'mecefo' logger (other tests may have configured it: reset it here).
  log, root = logging.getLogger('mecefo'), logging.getLogger()
  saved = log.level, log.propagate, root.level
  log.setLevel(logging.NOTSET)
  root.setLevel(logging.WARNING)
  try:
    handlers = list(log.handlers)
    stream = io.StringIO()
    with progress.Progress(20, 0, 2, 'neighbor', mode='plain', stream=stream) as p:
      p.train_row(ROW)
      log.info('compiling the %s', 'fused program onto slices [0]')  # as step/cache.py says
      p.eval_row(EVAL)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and 'step 4/20 loss 3.2500' in lines[0], lines
    assert lines[1].endswith('compiling the fused program onto slices [0]'), lines
    assert 'eval at step' in lines[2], lines
    assert not log.isEnabledFor(logging.INFO) and log.propagate and log.handlers == handlers
  finally:
    log.setLevel(saved[0])
    log.propagate = saved[1]
    root.setLevel(saved[2])


def test_plain_log_lines_when_stderr_is_not_a_tty(caplog):
  stream = io.StringIO()
  mode, messages = _show('auto', stream, caplog)
  assert mode == 'plain' and stream.getvalue() == ''
  assert 'step 4/20 loss 3.2500 grad_norm 0.500 live 1/2 (neighbor takeover) tok/s 12345' in messages
  assert any(m.startswith('eval at step 4: loss 3.0000') for m in messages)


def test_progress_bar_on_a_tty(caplog):
  pytest.importorskip('tqdm')
  stream = FakeTTY()
  mode, messages = _show('auto', stream, caplog)
  bar = stream.getvalue()
  assert mode == 'bar' and 'train:' in bar and '1/20' in bar
  for field in ('loss 3.2500', '12.3k tok/s', 'live 1/2', 'neighbor takeover', 'eval 3.0000'):
    assert field in bar, bar
  assert not any(m.startswith('step 4/20') for m in messages)  # the bar shows those
  assert 'step 5: slice 1 FAILED' in messages  # warnings still printed as they happen


def test_quiet_shows_no_step_or_eval_lines(caplog):
  stream = FakeTTY()
  mode, messages = _show('quiet', stream, caplog)
  assert mode == 'quiet' and stream.getvalue() == ''
  assert messages == ['step 5: slice 1 FAILED']


def test_the_bar_and_the_plain_log_say_when_a_program_is_built(caplog):
  """The program cache's line before a compile (or a wait for the background one) in the
  training thread is the bar's state until the step is done (the plain log shows the line:
  test_plain_lines_are_shown_when_logging_is_not_configured)."""
  pytest.importorskip('tqdm')
  cache = (ROOT / 'mecefo_jax' / 'step' / 'cache.py').read_text()
  assert all(f"log.info('{line}" in cache for line in progress.BUILDING)  # the lines it watches
  stream, log = FakeTTY(), logging.getLogger('mecefo')
  with caplog.at_level(logging.INFO, logger='mecefo'):
    with progress.Progress(20, 0, 2, 'spread', mode='bar', stream=stream) as p:
      p.step(2)
      log.info('compiling the %s', 'fused program onto slices [0]')
      assert stream.getvalue().endswith('compiling the fused program onto slices [0] ...]')
      elsewhere = threading.Thread(target=log.info, args=('compiling the %s', 'eval (background)'))
      elsewhere.start()
      elsewhere.join()
      assert 'eval (background)' not in stream.getvalue()  # another thread's build: not ours
      p.step(1)
      assert not stream.getvalue().endswith('...]') and 'live 1/2' in stream.getvalue()


class _DeviceLoss:
  """A device scalar as the bar sees it: ready or not (jax.Array's is_ready), one shard."""

  def __init__(self, value: float, ready: bool):
    self.value, self.ready = value, ready
    self.addressable_shards = [type('Shard', (), {'data': value})()]

  def is_ready(self) -> bool:
    return self.ready


def test_the_bar_shows_the_newest_trained_steps_loss_not_the_last_logged_row():
  """Between logged rows the bar follows every step's loss as soon as it is computed, without
  waiting for it: a step still running leaves the previous step's loss shown."""
  pytest.importorskip('tqdm')
  stream = FakeTTY()
  with progress.Progress(20, 0, 2, 'spread', mode='bar', stream=stream) as p:
    p.train_row(ROW)  # step 4's row: loss 3.25
    p.step(2, _DeviceLoss(3.125, ready=True))
    assert p._fields['loss'] == 'loss 3.1250'
    p.step(2, _DeviceLoss(3.0, ready=False))  # dispatched, not computed: the last ready one
    assert p._fields['loss'] == 'loss 3.1250'
    p.step(2, 2.5)  # a fetched loss (a logged step)
    assert p._fields['loss'] == 'loss 2.5000'
    p.step(2, None)  # a process that ran no part of the step
    assert p._fields['loss'] == 'loss 2.5000'


def test_a_run_to_a_sample_budget_counts_samples_not_steps(caplog):
  """requeue trains fewer samples a step while a slice is down: its end is a sample count, and
  the bar and the lines count toward that, not toward train.steps."""
  pytest.importorskip('tqdm')
  stream = FakeTTY()
  with progress.Progress(64, 8, 2, 'requeue', mode='bar', stream=stream, unit='sample') as p:
    p.step(2, 3.0, samples=16)
    p.step(1, 2.9, samples=20)  # one slice of two down: 4 samples, not 8
    assert (p._bar.n, p._bar.total, p._bar.unit) == (20, 64, 'sample')
  with caplog.at_level(logging.INFO, logger='mecefo'):
    with progress.Progress(64, 0, 2, 'requeue', mode='plain', stream=io.StringIO(),
                           unit='sample') as p:
      p.step(1, 3.25, samples=4)
      p.train_row(ROW)
  assert 'step 4 samples 4/64 loss 3.2500' in caplog.text, caplog.text
