"""What the training loop does after each step (AFTER_STEP's order): divergence, eval, snapshot,
metrics, stop; a mixin of run/trainer.py's Trainer, whose attributes it uses."""
from __future__ import annotations

import logging
import math

from mecefo_jax import multihost
from mecefo_jax.run import hints
from mecefo_jax.snapshot import durable

log = logging.getLogger('mecefo')
# Each a `_after_<name>` method that may end the run with a message, in this order: no snapshot
# ever holds a diverged state, an eval's result is in the snapshot's meta, and a stop is voted
# on once the step is saved.
AFTER_STEP = ('divergence', 'eval', 'snapshot', 'metrics', 'stop')


class AfterStep:
  """The after-step handlers, the stop and divergence messages, and the snapshots they take."""

  def _after_divergence(self, step, values, rows, t_start) -> str | None:
    if values and not math.isfinite(values['loss']):
      return self._diverged(step, values['loss'])
    return None

  def _after_eval(self, step, values, rows, t_start) -> None:
    due = self.corpus.has_eval and self.controller.decider.eval_due(step)
    if due and not self._stopping(step + 1):
      rows.append(self._eval_row(step, t_start))

  def _after_snapshot(self, step, values, rows, t_start) -> str | None:
    # With snapshot.every=1 the line of step t is written once snapshot t is complete
    # (maybe_save waited for it) and t+1 started: a crash after it costs at most step t.
    self._snapshot(step + 1)
    guard = self.snapshots and self.snapshots.durable
    if not (guard and guard.failing):  # the same on every process: they agreed on it
      return None
    self.checkpoints_failing = True
    where = self._save_now(step + 1)  # in the in-memory tier
    message = durable.stop_message(guard, step + 1, where,
                                   hints.resume(self.out_dir, self.presence.n_hosts))
    log.error('%s', message)
    self.records.history('stop', step=step + 1, why='durable checkpoints failing', saved=where)
    return message

  def _after_metrics(self, step, values, rows, t_start) -> None:
    if step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps - 1:
      rows.insert(0, self._train_row(step, values, t_start))
      self.losses.append((step, rows[0]['loss']))
    for row in rows:
      self._emit(row)

  def _after_stop(self, step, values, rows, t_start) -> str | None:
    if not self._stopping(step + 1):
      return None
    self.stop_reason = self.stop.reason or 'a stop agreed by the job'
    where = self._save_now(step + 1)
    saved = ('saved as the ' + ' and the '.join(where) if where else
             'saved nothing (snapshots are off)' if not self.snapshots else
             'already saved in the snapshots of that step')
    message = f'stopped by {self.stop_reason} after step {step + 1}, {saved}'
    if self.snapshots:
      message += f'; resume with {hints.resume(self.out_dir, self.presence.n_hosts)}'
    log.warning('%s', message)
    self.records.history('stop', step=step + 1, why=self.stop_reason, saved=where)
    return message

  def _save_now(self, steps: int) -> list[str]:
    """Where the state after `steps` is saved, in every tier (those not saved yet), written."""
    where = (self._saved[1] if self._saved[0] == steps else []) + self._snapshot(steps, stop=True)
    if self.snapshots:
      self.snapshots.wait_until_finished(agree=True)
    return where

  def _stopping(self, steps_done: int) -> bool:
    """Whether the run stops after `steps_done` steps: in a multi-process job, as voted with
    the step's metrics (so that every process stops after the same step)."""
    if multihost.is_multiprocess():
      return self._stop_agreed
    return self.stop.due(steps_done)

  def _diverged(self, step: int, loss: float) -> str:
    self.diverged_at = step
    message = (f'the training loss is not finite ({loss}) at step {step}: the run stopped '
               f'without saving that step (the snapshots and checkpoints hold earlier steps); '
               f'start anew with a lower optimizer.lr or more optimizer.warmup_steps '
               f'({hints.fresh(self.out_dir)})')
    log.error('%s', message)
    return message

  def _snapshot(self, steps_done: int, stop: bool = False) -> list[str]:
    """Async snapshot of the state after `steps_done` steps (one replica, copied off donation)
    where due; `stop`: in every tier now. Returns where the snapshots it started are."""
    sn = self.snapshots
    if not sn:
      return []
    c = self.controller
    meta = {'controller': c.dump_meta(), 'losses': self.losses, 'reached': steps_done,
            'evals': self.evals}
    where = sn.where(steps_done, sn.maybe_save(steps_done, c.state, meta, stop=stop))
    self._saved = (steps_done, where)
    return where
