"""Held-out loss on fixed rows, the same whichever slices are live (docs/algorithm.md §5); its hook."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from mecefo_jax import multihost, sharding
from mecefo_jax.data import order
from mecefo_jax.run.hooks import Hook, RunEnd, StepRecord


def held_out_loss(controller, n_batches: int) -> float:
  """Mean token loss over `n_batches` global batches of held-out ids (disjoint from training)
  of all the run's slices, computed on the slices that hold the state now."""
  live, b = controller.state_slices, controller.micro_batch
  mesh = controller.submesh(live)
  program = controller.evaluator(live)
  ids = np.concatenate([order.sample_ids(i, controller.n_slices, b, 'eval').ravel()
                        for i in range(n_batches)])
  per_call, loss_sum, tokens = len(live) * b, 0.0, 0.0
  for start in range(0, len(ids), per_call):
    chunk = ids[start:start + per_call]
    out = None
    if multihost.is_local(mesh):  # each process reads the rows of its own slices only
      batch = multihost.put_batch(
          lambda i, chunk=chunk: _rows(controller.corpus, chunk[i * b:(i + 1) * b], b),
          (len(live), b, controller.corpus.seq_len + 1), sharding.batch_sharding(mesh))
      out = program(controller.state.params, batch)
    values = multihost.fetch(out, mesh, keys=('loss_sum', 'tokens'))
    loss_sum, tokens = loss_sum + values['loss_sum'], tokens + values['tokens']
  return loss_sum / tokens


def _rows(corpus, ids: np.ndarray, b: int) -> np.ndarray:
  """The rows of `ids`, then rows of -1 up to `b` (padding, which counts for nothing)."""
  rows = corpus.sequences(ids)
  return np.concatenate([rows, np.full((b - len(ids), rows.shape[1]), -1, rows.dtype)])


def perplexity(loss: float) -> float:
  return float(np.exp(loss))


class Evals(Hook):
  """Held-out evals after the steps the decider plans one for (train.eval_every) and after the
  last step; each eval's row follows its step's train row. `evals`: those of earlier starts."""

  def __init__(self, controller, n_batches: int, last_step: int, *, has_eval: bool,
               stopping: Callable[[StepRecord], bool], emit: Callable[[dict], None],
               evals: list[dict]):
    self.controller, self.n_batches, self.last_step = controller, n_batches, last_step
    self.has_eval, self.stopping, self.emit = has_eval, stopping, emit
    self.evals = evals  # {step, loss, perplexity}, oldest first
    self.seconds = 0.0  # spent in this start's evals

  def after_step(self, record: StepRecord) -> None:
    if self.has_eval and record.plan.eval is not None and not self.stopping(record):
      record.rows.append(self.row(record.step, record.loop_start))

  def at_end(self, loop_start: float, stopped: str | None) -> None:
    done = self.evals and self.evals[-1]['step'] == self.last_step
    if self.has_eval and not stopped and not done:
      self.emit(self.row(self.last_step, loop_start))  # the final eval

  def row(self, step: int, loop_start: float) -> dict:
    t0 = time.perf_counter()
    loss = held_out_loss(self.controller, self.n_batches)
    spent = time.perf_counter() - t0
    self.seconds += spent
    # An eval is not step time; its compile, if any, is booked as compile by the program cache.
    self.controller.exclude_from_steps(spent)
    self.evals.append({'step': step, 'loss': loss, 'perplexity': perplexity(loss)})
    return {'kind': 'eval', **self.evals[-1], 'eval_s': spent,
            'wall_s': time.perf_counter() - loop_start,
            'live_slices': len(self.controller.live())}

  def report(self, end: RunEnd) -> dict:
    """report.json's evals: every one, and the final one's loss unless the run stopped early."""
    final = self.evals[-1] if self.evals and not end.stopped else None
    return {'eval_loss': final and final['loss'], 'eval_perplexity': final and final['perplexity'],
            'evals': self.evals}
