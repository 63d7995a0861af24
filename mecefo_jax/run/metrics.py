"""Metrics of a run: metrics.jsonl (written and read back), TensorBoard scalars when possible."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from pathlib import Path

from mecefo_jax import files, sections
from mecefo_jax.records.metrics import EvalRow, TrainRow
from mecefo_jax.run.storage import OutputGuard
from mecefo_jax.run.rundir import METRICS_FILE, TB_DIR

log = logging.getLogger('mecefo')

# Row keys written as TensorBoard scalars, per row kind (tag = kind/key).
TB_KEYS = {'train': ('loss', 'grad_norm', 'tokens_per_s', 'live_slices'),
           'eval': ('loss', 'perplexity')}


def _finite(obj):
  """`obj` with non-finite floats as None, numpy scalars as Python ones, tuples as lists."""
  if isinstance(obj, dict):
    return {key: _finite(value) for key, value in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_finite(value) for value in obj]
  if hasattr(obj, 'item') and getattr(obj, 'shape', None) == ():  # numpy / jax scalar
    obj = obj.item()
  if isinstance(obj, float) and not math.isfinite(obj):
    return None
  return obj


def to_json(obj, **kwargs) -> str:
  """Strict JSON (RFC 8259) of `obj`: NaN and +-inf anywhere become null, never the bare
  NaN / Infinity that json.dumps writes by default and other JSON readers reject. kwargs go
  to json.dumps (e.g. indent=2)."""
  return json.dumps(_finite(obj), allow_nan=False, **kwargs)


def read_metrics(out_dir: str | Path, warn: bool = True) -> list[TrainRow | EvalRow]:
  """The rows of out_dir's metrics.jsonl in file order ([] without one); a line cut by a crash,
  or one that is no row, is skipped (one warning; `warn=False`: none, another reader warned)."""
  return files.read_jsonl(Path(out_dir) / METRICS_FILE, (TrainRow, EvalRow), warn=warn)


def last_logged_step(out_dir: str | Path, warn: bool = True) -> int | None:
  """The last step a previous process logged to metrics.jsonl (to count steps lost in a crash)."""
  rows = read_metrics(out_dir, warn)
  return rows[-1].step if rows else None


def _tb_writer(directory: Path):
  """A tensorboardX SummaryWriter, or None (with one info line) when it is not installed."""
  try:
    from tensorboardX import SummaryWriter
  except ImportError:
    log.info('tensorboardX is not installed: no TensorBoard files (metrics.jsonl has everything)')
    return None
  # flush_secs: a crashed run keeps all but the last few seconds of scalars.
  return SummaryWriter(str(directory), flush_secs=10)


def _catch_tb_errors(writer, failed: list) -> None:
  """Makes the TensorBoard writer's file writes put their OSError in `failed` instead of
  raising it: in tensorboardX's own thread it would print a traceback and end that thread,
  whose full queue would then block the training thread. (Another tensorboardX without these
  attributes keeps its own behaviour.)"""
  try:
    events = writer._get_file_writer().event_writer._ev_writer
  except AttributeError:
    return
  def guarded(write, always: bool = False):
    def call(*args):
      if failed and not always:
        return None
      try:
        return write(*args)
      except OSError as err:
        failed[:] = failed or [err]
        return None
    return call
  events.write_event, events.flush = guarded(events.write_event), guarded(events.flush)
  # Its file's close flushes what is buffered; after a failure too, so that the file is closed.
  events.close = guarded(events.close, always=True)


class MetricsWriter:
  """Writes each metrics row as one JSON line (flushed at once) and as TensorBoard scalars.

  `fresh`: the run starts at step 0, so rows and event files of an earlier run in `out_dir` are
  dropped; a resumed run appends to them. `enabled=False` writes nothing (the processes of a
  multi-process run other than the one that writes the run's files).
  """

  def __init__(self, out_dir: str | Path, fresh: bool = True, tensorboard: bool = True,
               enabled: bool = True, guard: OutputGuard | None = None):
    """`guard`: a failed write of metrics.jsonl goes to it (the run stops after its step)
    instead of raising; a failed TensorBoard write turns TensorBoard off with one line."""
    out_dir = Path(out_dir)
    self.path = out_dir / METRICS_FILE
    self.tb_dir = out_dir / TB_DIR
    self._file: int | None = None  # metrics.jsonl's descriptor
    self._tb = None
    self._guard = guard or OutputGuard()
    self._tb_failed: list[OSError] = []
    self.tensorboard = False  # event files written (stays True after close)
    if not enabled:
      return
    if fresh:
      for old in self.tb_dir.glob('events.out.tfevents.*'):
        old.unlink()
    else:  # a resume: a row that a crash cut goes first, so that every row parses
      self._guard.attempt(self.path, files.cut_torn_lines, self.path)
    # Rows are appended whole or not at all (files.append_whole), so no torn row is left.
    self._file = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT |
                         (os.O_TRUNC if fresh else 0), 0o644)
    self._tb = _tb_writer(self.tb_dir) if tensorboard else None
    self.tensorboard = self._tb is not None
    if self._tb is not None:
      _catch_tb_errors(self._tb, self._tb_failed)

  def write(self, row: TrainRow | EvalRow) -> TrainRow | EvalRow:
    """Writes `row` stamped with its Unix `time` (the plot's time axis across restarts); the row
    as written."""
    row = dataclasses.replace(row, time=round(time.time(), 3))
    if self._file is None:
      return row
    values = sections.to_json(row)
    self._guard.attempt(self.path, self._write_line, to_json(values) + '\n')
    self._check_tb()
    if self._tb is not None:
      for key in TB_KEYS[row.kind]:
        if isinstance(values[key], (int, float)) and math.isfinite(values[key]):
          self._tb.add_scalar(f'{row.kind}/{key}', values[key], row.step)
    return row

  def _write_line(self, line: str) -> None:
    # Unbuffered: last_logged_step reads it while (or after) we crash.
    files.append_whole(self._file, line.encode())

  def _check_tb(self) -> None:
    """A failed TensorBoard write: one line, TensorBoard off (metrics.jsonl goes on)."""
    if self._tb is None or not self._tb_failed:
      return
    log.warning('TensorBoard files in %s cannot be written (%s): TensorBoard is off for the rest '
                'of this start; training goes on, metrics.jsonl has every row', self.tb_dir,
                self._tb_failed[0].strerror or self._tb_failed[0])
    tb, self._tb = self._tb, None
    with contextlib.suppress(OSError):
      tb.close()

  def close(self) -> None:
    if self._file is not None:
      self._guard.attempt(self.path, os.close, self._file)
      self._file = None
    if self._tb is not None:
      self._tb.close()  # its errors are caught (_catch_tb_errors)
      self._check_tb()
      self._tb = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
