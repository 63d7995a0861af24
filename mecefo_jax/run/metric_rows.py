"""The hook that shows and writes metrics rows: the terminal, metrics.jsonl (+ TensorBoard), on_log."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Sequence

from mecefo_jax import sections
from mecefo_jax.config import Config, sample_budget
from mecefo_jax.records.metrics import EvalRow, TrainRow
from mecefo_jax.run.hooks import Hook, RunEnd, StepRecord
from mecefo_jax.run.metrics import MetricsWriter, last_logged_step
from mecefo_jax.run.rundir import TB_DIR
from mecefo_jax.run.progress import Progress
from mecefo_jax.run.report_schema import Throughput
from mecefo_jax.run.storage import OutputGuard
from mecefo_jax.sections import Draft


class MetricRows(Hook):
  """A train row every train.log_every steps and after the last; each row of a step (its evals
  after its train row) to the terminal, metrics.jsonl and `on_log(row)`.

  `tokens()`: tokens trained so far; `samples()`: the stream's samples trained or counted
  (the unit of a sample budget's end); `losses`: [step, loss] of the rows written before this
  start (a resume). The evals' seconds, left out of tokens/s, are their rows' (`eval_s`)."""

  def __init__(self, cfg: Config, out_dir: Path, start_step: int, n_slices: int, *,
               tokens: Callable[[], int], samples: Callable[[], int], losses: list,
               carried: Sequence = (), mode: str = 'auto',
               on_log: Callable[[dict], None] | None = None,
               enabled: bool = True, guard: OutputGuard | None = None):
    self.cfg, self.out_dir, self.start_step, self.n_slices = cfg, out_dir, start_step, n_slices
    self.tokens, self.samples, self.losses = tokens, samples, losses
    self.budget = sample_budget(cfg)  # the run ends at it where set, else at train.steps
    self.eval_s = 0.0  # seconds this start spent in evals (its eval rows')
    self.mode, self.on_log, self.enabled, self.guard = mode, on_log, enabled, guard
    self.tensorboard = False  # event files written
    self.tokens_at_start = 0
    self._progress: Progress | None = None
    self._writer: MetricsWriter | None = None
    self._window = (0.0, 0, 0.0)  # (time, tokens, eval seconds) at the last train row
    self.made: StepRecord | None = None  # the last step rows were made for
    self.carried = carried
    self.maker = _RowMaker(self)  # the hook that makes each step's rows (before the snapshot's)

  @contextlib.contextmanager
  def opened(self):
    total, done, unit = ((self.budget, self.samples(), 'sample') if self.budget else
                         (self.cfg.train.steps, self.start_step, 'step'))
    progress = Progress(total, done, self.n_slices, self.cfg.faults.takeover, self.mode,
                        unit=unit)
    writer = MetricsWriter(self.out_dir, fresh=self.start_step == 0, enabled=self.enabled,
                           guard=self.guard)
    self.tokens_at_start = self.tokens()
    self._window = (time.perf_counter(), self.tokens_at_start, self.eval_s)
    with writer, progress:
      self._writer, self._progress = writer, progress
      self._write_carried()
      try:
        yield
      finally:
        self.tensorboard = writer.tensorboard
        self._writer = self._progress = None

  def wants_values(self, step: int) -> bool:
    return step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps - 1

  def make(self, record: StepRecord) -> None:
    """Sets the step's train row where one is logged (the maker: before its snapshot, whose
    meta carries it)."""
    if record.eval_row is not None:  # made before the step's train row: left out of its rate
      self.eval_s += record.eval_row.eval_s
    if self.wants_values(record.step) or record.stop_voted or record.last:  # a stop's too
      record.train_row = self._train_row(record)
      self.losses.append((record.step, record.train_row.loss))
    if record.rows:
      self.made = record

  def rows_of(self, step: int) -> list[TrainRow | EvalRow]:
    """The rows made for `step` (its train row, then its eval's) where it is the last step
    with rows: what a snapshot of the state after it carries."""
    return self.made.rows if self.made is not None and self.made.step == step else []

  def after_step(self, record: StepRecord) -> None:
    loss = record.values['loss'] if record.values else (record.metrics or {}).get('loss')
    self._progress.step(len(record.live), loss, self.samples() if self.budget else None)
    for row in record.rows:
      self._show(row)

  def _write_carried(self) -> None:
    """The restored snapshot's rows that metrics.jsonl lacks, written first (not shown)."""
    if not self.enabled or not self.carried:
      return
    last = last_logged_step(self.out_dir, warn=False)  # the resume's reading warned
    for row in self.carried:
      if last is None or row.step > last:
        self._writer.write(row)

  def emit(self, row: EvalRow) -> None:
    """An eval row made after the loop (the final eval), its seconds counted."""
    self.eval_s += row.eval_s
    self._show(row)

  def _show(self, row: TrainRow | EvalRow) -> None:
    """A metrics row to the terminal, metrics.jsonl (+ TensorBoard) and the on_log callback (as
    the dict written)."""
    if isinstance(row, TrainRow):
      self._progress.train_row(row)
    else:
      self._progress.eval_row(row)
    written = self._writer.write(row)
    if self.on_log is not None:
      self.on_log(sections.to_json(written))

  def _train_row(self, record: StepRecord) -> TrainRow:
    now, tokens = time.perf_counter(), self.tokens()
    # tokens/s since the previous train row, eval time left out: dips show failures and rejoins.
    t0, tokens0, eval0 = self._window
    seconds = max(now - t0 - (self.eval_s - eval0), 1e-9)
    self._window = (now, tokens, self.eval_s)
    return TrainRow(step=record.step, **record.values, wall_s=now - record.loop_start,
                    live_slices=len(record.live), tokens_per_s=(tokens - tokens0) / seconds,
                    first_sample=record.plan.first_id)

  def report(self, end: RunEnd, report: Draft) -> None:
    """report.json's losses, tokens and rates (of this process: a resumed run counts from its
    resume; eval time left out), and where the TensorBoard files are."""
    losses, train_s = self.losses, max(end.wall_s - self.eval_s, 1e-9)
    report.losses, report.tokens = losses, self.tokens()
    report.first_loss = losses[0][1] if losses else None
    report.final_loss = losses[-1][1] if losses else None
    throughput = Throughput(
        tokens_per_s=(self.tokens() - self.tokens_at_start) / train_s,
        steps_per_s=(end.steps_done - self.start_step) / train_s,
        tokens_per_step=self.n_slices * self.cfg.train.micro_batch * self.cfg.model.seq_len,
        train_s=train_s, eval_s=self.eval_s)
    report.throughput, report.tokens_per_s = throughput, throughput.tokens_per_s
    report.tensorboard_dir = str(self.out_dir / TB_DIR) if self.tensorboard else None


class _RowMaker(Hook):
  """MetricRows' rows of each step, made before its snapshot so that the snapshot's meta holds
  them: a crash after the snapshot and before the rows are written loses none."""

  def __init__(self, rows: MetricRows):
    self.rows = rows

  def after_step(self, record: StepRecord) -> None:
    self.rows.make(record)
