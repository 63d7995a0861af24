"""Terminal output of the training loop: a tqdm bar on a TTY, plain log lines otherwise, or quiet."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

from mecefo_jax.records.metrics import EvalRow, TrainRow

log = logging.getLogger('mecefo')

MODES = ('auto', 'bar', 'plain', 'quiet')
# The program cache's lines (step/cache.py) that start a wait for a program in the training
# thread: the bar shows them as its state until the next step is done.
BUILDING = ('compiling the ', 'waiting for the background build')


def resolve_mode(mode: str, stream) -> str:
  """'auto': a bar when `stream` is a terminal and tqdm is installed, else plain lines."""
  if mode not in MODES:
    raise ValueError(f'progress mode must be one of {", ".join(MODES)}, got {mode!r}')
  if mode != 'auto':
    return mode
  if not getattr(stream, 'isatty', lambda: False)():
    return 'plain'  # a log file or a pipe: a bar would fill it with carriage returns
  try:
    import tqdm  # noqa: F401
  except ImportError:
    return 'plain'
  return 'bar'


def _sized(stream) -> bool:
  """False for a terminal that reports 0 columns or rows (a pty nobody sized, e.g. `script`)."""
  try:
    size = os.get_terminal_size(stream.fileno())
  except (AttributeError, OSError, ValueError):
    return False
  return size.columns > 0 and size.lines > 0


def _rate(tokens_per_s: float) -> str:
  for unit, scale in (('M', 1e6), ('k', 1e3)):
    if tokens_per_s >= scale:
      return f'{tokens_per_s / scale:.1f}{unit}'
  return f'{tokens_per_s:.0f}'


def _ready(loss) -> float | None:
  """`loss` on the host if it is computed: a float as it is, a device scalar once ready (a
  process that ran no part of the step has None)."""
  if loss is None or isinstance(loss, float):
    return loss
  if not loss.is_ready() or not loss.addressable_shards:
    return None
  return float(loss.addressable_shards[0].data)


class Progress:
  """What the trainer shows per step. Use as a context manager around the training loop.

  bar: tqdm bar (step, loss, tokens/s, live slices, takeover mode); log records (failures,
  repairs, evals) go through tqdm.write so they do not break the bar. plain: the log line of
  every logged step. quiet: nothing (warnings still reach the log).
  """

  def __init__(self, total: int, initial: int, n_slices: int, takeover: str, mode: str = 'auto',
               stream=None, unit: str = 'step'):
    # unit 'sample': a run that ends at a sample budget (train.samples / train.tokens), whose
    # step count is not known ahead (requeue trains fewer samples a step while a slice is down).
    self.total, self.n_slices, self.takeover, self.unit = total, n_slices, takeover, unit
    self._done = initial  # steps or samples done
    self.stream = stream if stream is not None else sys.stderr
    self.mode = resolve_mode(mode, self.stream)
    self._bar = None
    self._stack = contextlib.ExitStack()
    self._fields = {'loss': '', 'rate': '', 'live': '', 'mode': '', 'eval': ''}
    self._losses: list = []  # the last two steps' losses, floats or device scalars

  def __enter__(self) -> Progress:
    if self.mode == 'plain' and not log.isEnabledFor(logging.INFO):
      # Called from Python with logging unconfigured (INFO dropped): lines of our own for the run.
      handler = logging.StreamHandler(self.stream)
      handler.setFormatter(logging.Formatter('%(asctime)s %(message)s', '%H:%M:%S'))
      saved = log.level, log.propagate
      log.addHandler(handler)
      log.setLevel(logging.INFO)
      log.propagate = False
      self._stack.callback(self._restore_log, handler, saved)
    if self.mode == 'bar':
      from tqdm import tqdm
      from tqdm.contrib.logging import logging_redirect_tqdm

      # tqdm draws nothing on a terminal of size 0x0: give it a fixed size there.
      size = {'dynamic_ncols': True} if _sized(self.stream) else {'ncols': 120, 'nrows': 24}
      self._bar = self._stack.enter_context(
          tqdm(total=self.total, initial=self._done, unit=self.unit, desc='train',
               file=self.stream, leave=True, **size))
      self._stack.enter_context(logging_redirect_tqdm())
      watch = _Building(self)
      log.addHandler(watch)
      self._stack.callback(log.removeHandler, watch)
    return self

  @staticmethod
  def _restore_log(handler, saved) -> None:
    log.removeHandler(handler)
    log.setLevel(saved[0])
    log.propagate = saved[1]

  def __exit__(self, *exc) -> None:
    self._stack.close()
    self._bar = None

  def _mode(self, live: int) -> str:
    return 'normal' if live == self.n_slices else f'{self.takeover} takeover'

  def building(self, what: str) -> None:
    """A program is being built for the next step (`what`: the cache's line): the bar says so
    at once, until that step is done (the plain log has the line itself)."""
    if self._bar is not None:
      self._fields['state'] = what.rstrip('.') + ' ...'
      self._show(refresh=True)

  def step(self, live: int, loss=None, samples: int | None = None) -> None:
    """One training step done with `live` slices up; `loss`: its loss, a float or a device
    scalar, shown once computed (no wait: the newest step whose loss is ready); `samples`: the
    stream's samples done after it (unit 'sample')."""
    done = self._done + 1 if self.unit == 'step' else samples
    advanced, self._done = done - self._done, done
    if self._bar is None:
      return
    built = self._fields.pop('state', None) is not None
    self._fields.update(live=f'live {live}/{self.n_slices}', mode=self._mode(live))
    self._losses = [*self._losses[-1:], loss]
    shown = next((v for v in map(_ready, reversed(self._losses)) if v is not None), None)
    if shown is not None:
      self._fields['loss'] = f'loss {shown:.4f}'
    self._bar.update(advanced)
    self._show(refresh=built)  # at once after a build: the bar said it was building

  def train_row(self, row: TrainRow) -> None:
    if self.mode == 'plain':
      live = row.live_slices
      mode = '' if live == self.n_slices else f' ({self._mode(live)})'
      at = (f'{row.step}/{self.total}' if self.unit == 'step' else
            f'{row.step} samples {self._done}/{self.total}')
      log.info('step %s loss %.4f grad_norm %.3f live %d/%d%s tok/s %.0f', at, row.loss,
               row.grad_norm, live, self.n_slices, mode, row.tokens_per_s)
    elif self._bar is not None:
      self._fields.update(loss=f'loss {row.loss:.4f}', rate=f'{_rate(row.tokens_per_s)} tok/s')
      self._show()

  def eval_row(self, row: EvalRow) -> None:
    if self.mode == 'quiet':
      return
    if self._bar is not None:
      self._fields['eval'] = f'eval {row.loss:.4f}'
      self._show()
    log.info('eval at step %d: loss %.4f perplexity %.3f (%.1fs)', row.step, row.loss,
             row.perplexity, row.eval_s)

  def _show(self, refresh: bool = False) -> None:
    text = ' | '.join(v for v in self._fields.values() if v)
    self._bar.set_postfix_str(text, refresh=refresh)


class _Building(logging.Handler):
  """Passes the program cache's BUILDING lines of the thread that trains to Progress.building."""

  def __init__(self, progress: Progress):
    super().__init__(logging.INFO)
    self.progress, self.thread = progress, threading.get_ident()

  def emit(self, record: logging.LogRecord) -> None:
    if record.thread == self.thread and str(record.msg).startswith(BUILDING):
      self.progress.building(record.getMessage())
