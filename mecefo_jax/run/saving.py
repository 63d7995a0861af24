"""The hooks that save: snapshots where due (their interval tuned here) and the stop, saved first."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

from mecefo_jax import multihost, sections
from mecefo_jax.records import progress_marks
from mecefo_jax.records.history import Kind
from mecefo_jax.records.snapshot_meta import SnapshotMeta
from mecefo_jax.run.hooks import Hook, RunEnd, StepRecord, StopRun
from mecefo_jax.run.records import RunRecords
from mecefo_jax.run.stop import StopRequest
from mecefo_jax.sections import Draft
from mecefo_jax.snapshot import durable
from mecefo_jax.snapshot.interval import SnapshotInterval
from mecefo_jax.snapshot.manager import Snapshots, memory_kept_when_finished

# A stop's reason where this process did not ask for it (another process's request reached
# the job first): its history record, process 0's, says this.
AGREED_STOP = 'a stop agreed by the job'

log = logging.getLogger('mecefo')


class SnapshotSaver(Hook):
  """Saves the state after the steps the tiers have due (async, one replica); stops the run when
  durable checkpoints keep failing. Each snapshot carries its SnapshotMeta: the `controller`'s
  decider state, the losses `rows` logged and the evals `evals` made so far (hooks before it),
  and the rows of its last step (`rows.maker` runs before it; `rows` writes them after)."""

  def __init__(self, snapshots, controller, rows, evals, records: RunRecords, resume_hint: str,
               keep_when_finished: bool = False):
    self.snapshots, self.controller, self.rows, self.evals = snapshots, controller, rows, evals
    self.keep_when_finished = keep_when_finished  # snapshot.keep_when_finished
    self.records, self.resume_hint = records, resume_hint
    self.checkpoints_failing = False  # stopped by durable saves that kept failing
    self._saved: tuple[int | None, tuple[str, ...]] = (None, ())  # (steps, tiers) last saved
    self._saved_steps: set[int] = set()  # the steps this start saved
    self._last_step: tuple[float, bool] | None = None  # the step in progress: (start, busy)
    self._skipped = 0  # in-memory snapshots skipped (a full tmpfs) that history.jsonl records

  def before_step(self, step: int) -> None:
    # The interval is tuned on iteration-to-iteration walls: the last one is complete now.
    now, sn = time.perf_counter(), self.snapshots
    if sn and self._last_step:
      sn.interval.after_step(step, now - self._last_step[0], self._last_step[1])
    self._last_step = (now, bool(sn) and sn.busy())

  def wants_values(self, step: int) -> bool:
    # With snapshot.every=auto every step is waited for, so that its wall is its own.
    sn = self.snapshots
    return bool(sn) and (sn.interval.tuner is not None or sn.due(step + 1))

  def after_step(self, record: StepRecord) -> StopRun | None:
    # With snapshot.every=1 the line of step t is written once snapshot t is complete
    # (maybe_save waited for it) and t+1 started: a crash after it costs at most step t.
    steps = record.steps_done
    self.save(steps)
    self._record_skips(steps)
    guard = self.snapshots and self.snapshots.durable
    if not (guard and guard.failing):  # the same on every process: they agreed on it
      return None
    self.checkpoints_failing = True
    where = self.save_now(steps)  # in the in-memory tier
    message = durable.stop_message(guard, steps, where, self.resume_hint)
    log.error('%s', message)
    self.records.history(Kind.STOP, step=steps, why='durable checkpoints failing', saved=where)
    return StopRun(message, steps)

  def _record_skips(self, steps: int) -> None:
    """A line in history.jsonl for the in-memory snapshots skipped since the last one (a write
    error: a full tmpfs), so that the run's record says where it had no snapshot."""
    skipped = self.snapshots.skipped if self.snapshots else 0
    if skipped > self._skipped:
      self.records.history(Kind.SNAPSHOT_SKIPPED, step=steps, skipped=skipped - self._skipped)
      self._skipped = skipped

  def save(self, steps_done: int, stop: bool = False) -> None:
    """Async snapshot of the state after `steps_done` steps where due; `stop`: in every tier
    now."""
    sn = self.snapshots
    if not sn:
      return
    # Marked as saving only where it saves; a durable save is timed apart (its device-to-host
    # copy is far longer than the in-memory tier's).
    saving = stop or sn.due(steps_done)
    durable_due = sn.durable is not None and (stop or steps_done % sn.durable_every == 0)
    with (progress_marks.during('saving', f'step {steps_done}', 'durable' if durable_due else
                                'in-memory') if saving else contextlib.nullcontext()):
      started = sn.maybe_save(steps_done, self.controller.state, self.meta(steps_done), stop=stop)
    earlier = self._saved[1] if self._saved[0] == steps_done else ()
    self._saved = (steps_done, earlier + started)
    self._saved_steps.update([steps_done] if started else [])

  def meta(self, steps_done: int) -> dict:
    """The snapshot's meta, as the tiers save it (JSON)."""
    rows = {row.kind: row for row in self.rows.rows_of(steps_done - 1)}
    meta = SnapshotMeta(self.controller.dump_meta(), list(self.rows.losses), steps_done,
                        list(self.evals.evals), rows.get('train'), rows.get('eval'))
    return sections.to_json(meta)

  def newest(self, bound: int, restored: int | None = None) -> int | None:
    """The newest step <= `bound` of a snapshot in the tiers (of one process: those listed,
    else those this start saved, or `restored` from), or None."""
    sn = self.snapshots
    if not sn:
      return None
    tiers = getattr(sn, 'tiers', None)  # one process's SnapshotManager lists them
    in_flight = {max(self._saved_steps, default=None)}  # maybe not written yet
    steps = ({s for tier in tiers for s in tier.steps()} | in_flight if tiers else
             self._saved_steps | {restored})
    return max((s for s in steps if s is not None and s <= bound), default=None)

  def save_now(self, steps: int) -> list[str]:
    """The state after `steps` saved in every tier (those not saved yet) and written; where
    it is: the tiers whose save of it failed are not named."""
    if not self.snapshots:
      return []
    self.save(steps, stop=True)
    self.wait()
    return self.snapshots.where(steps, self.snapshots.written(steps, self._saved[1]))

  def finish(self, steps: int, stopped: str | None) -> None:
    """The final state as a durable checkpoint too (a later --resume extends it), all written."""
    if not stopped:
      self.save(steps, stop=True)
    self.wait()
    self._record_skips(steps)

  def wait(self) -> None:
    if self.snapshots:
      with progress_marks.during('saving', 'waiting for the saves in flight', 'wait'):
        self.snapshots.wait_until_finished(agree=True)

  def report(self, end: RunEnd, report: Draft) -> None:
    """report.json's `snapshots` and `snapshot_interval` sections (their defaults: off)."""
    sn = self.snapshots
    report.snapshots = sn.report() if sn else Snapshots()
    if sn and not end.stopped and not memory_kept_when_finished(sn, self.keep_when_finished):
      # Written before the run's end frees them (RunFiles.close): none is left by then.
      report.snapshots = dataclasses.replace(report.snapshots, retained_steps=[])
    report.snapshot_interval = sn.interval.report() if sn else SnapshotInterval()


def stopping(request: StopRequest, record: StepRecord) -> bool:
  """Whether the run stops after `record`'s step (the same step on every process)."""
  if multihost.is_multiprocess() or record.stop_voted:
    return record.stop_voted
  return request.due(record.steps_done)  # a request that came after the step's record


class Stop(Hook):
  """Ends the run after a step when a stop was requested (a signal, --stop-after, the stop file;
  several processes: as the job voted with the step's metrics), the step saved first."""

  def __init__(self, request: StopRequest, saver: SnapshotSaver, records: RunRecords,
               resume_hint: str):
    self.request, self.saver, self.records = request, saver, records
    self.resume_hint = resume_hint
    self.reason: str | None = None  # why it stopped the run

  def wants_values(self, step: int) -> bool:
    return multihost.is_multiprocess()  # the fetch carries the job's stop vote

  def after_step(self, record: StepRecord) -> StopRun | None:
    if not stopping(self.request, record):
      return None
    steps = record.steps_done
    self.reason = self.request.reason or AGREED_STOP
    where = self.saver.save_now(steps)
    saved = ('saved as the ' + ' and the '.join(where) if where else
             'saved nothing (snapshots are off)' if not self.saver.snapshots else
             durable.NOT_SAVED)
    message = f'stopped by {self.reason} after {steps} step{"s" * (steps != 1)}, {saved}'
    if self.saver.snapshots:
      message += f'; resume with {self.resume_hint}'
    log.warning('%s', message)
    self.records.history(Kind.STOP, step=steps, why=self.reason, saved=where)
    return StopRun(message, steps)

  def report(self, end: RunEnd, report: Draft) -> None:
    report.preempted = self.reason is not None
