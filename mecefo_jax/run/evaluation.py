"""The eval hook: held-out evals after the steps the decider plans one for, and after the last."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from mecefo_jax.records import progress_marks
from mecefo_jax.records.metrics import Eval, EvalRow
from mecefo_jax.run.hooks import Hook, RunEnd, StepRecord
from mecefo_jax.sections import Draft


def perplexity(loss: float) -> float:
  with np.errstate(over='ignore'):  # a loss past ~709 nats is an infinite perplexity, no warning
    return float(np.exp(loss))


class Evals(Hook):
  """Held-out evals after the steps the decider plans one for (train.eval_every) and after the
  last step; each eval's row follows its step's train row. `evals`: those of earlier starts."""

  def __init__(self, controller, n_batches: int, last_step: int, *, has_eval: bool,
               stopping: Callable[[StepRecord], bool], emit: Callable[[EvalRow], None],
               evals: list[Eval]):
    self.controller, self.n_batches, self.last_step = controller, n_batches, last_step
    self.has_eval, self.stopping, self.emit = has_eval, stopping, emit
    self.evals = evals  # oldest first

  def after_step(self, record: StepRecord) -> None:
    if record.last:  # the end by a sample budget may come after train.steps - 1
      self.last_step = record.step
    if self.has_eval and record.plan.eval is not None and not self.stopping(record):
      record.eval_row = self.row(record.step, record.loop_start)

  def at_end(self, loop_start: float, stopped: str | None) -> None:
    done = self.evals and self.evals[-1].step == self.last_step
    if self.has_eval and not stopped and not done:
      self.emit(self.row(self.last_step, loop_start))  # the final eval

  def row(self, step: int, loop_start: float) -> EvalRow:
    # The loop dispatches steps ahead of their results: wait for them first, or the eval's
    # time (left out of step time and tokens/s) would hold up to log_every steps' compute.
    self.controller.wait_for_steps()
    t0 = time.perf_counter()
    with progress_marks.during('evaluating', f'after step {step}'):
      loss = self.controller.evaluate(self.n_batches)
    spent = time.perf_counter() - t0
    # An eval is not step time; its compile, if any, is booked as compile by the program cache.
    self.controller.exclude_from_steps(spent)
    row = EvalRow(step, loss, perplexity(loss), eval_s=spent,
                  wall_s=time.perf_counter() - loop_start,
                  live_slices=len(self.controller.live()))
    self.evals.append(row.eval)
    return row

  def report(self, end: RunEnd, report: Draft) -> None:
    """report.json's evals: every one, and the final one's loss unless the run stopped early."""
    evals = report.evals = list(self.evals)
    final = evals[-1] if evals and not end.stopped else None
    report.eval_loss, report.eval_perplexity = final and final.loss, final and final.perplexity
