"""The step loop of one start: each step planned, executed, recorded, then handed to the hooks."""
from __future__ import annotations

import logging
import time

import jax

from mecefo_jax import multihost
from mecefo_jax.config import trained_to_end
from mecefo_jax.fault.controller import AllSlicesDown
from mecefo_jax.records.history import Kind, Recovery
from mecefo_jax.run import hints, recovery_time
from mecefo_jax.run.hooks import Hooks, StepRecord
from mecefo_jax.run.parts import RunParts
from mecefo_jax.run.startup import marks as startup_marks
from mecefo_jax.run.stop import test_block, test_death

log = logging.getLogger('mecefo')


class StepLoop:
  """Trains the steps of one start through its `hooks`. `restarted_by`: the supervisor's part
  of the restart this start is (process 0), whose breakdown `recovery` is once a step is done."""

  def __init__(self, parts: RunParts, hooks: Hooks, restarted_by: dict | None):
    self.parts, self.hooks, self.restarted_by = parts, hooks, restarted_by
    self.recovery: Recovery | None = None

  def run(self, loop_start: float) -> tuple[int, str | None]:
    """Trains until the end, all slices down or a stop; returns (steps done, why it stopped)."""
    p = self.parts
    c, host = p.controller, p.presence.slots[jax.process_index()]
    # What a test's death waits for, so that where it lands is the same in every run.
    settled = ([p.snapshots.wait_until_finished] if p.snapshots else []) + [c.settle]
    step = p.origin.step
    while not self.ended(step):
      self.hooks.before_step(step)
      t_step = time.perf_counter()
      try:
        metrics = c.step(step, t_step - loop_start)  # planned and executed
      except AllSlicesDown as err:
        message = (f'{err}. When devices return, {hints.resume(p.out_dir)} continues from '
                   f'the newest snapshot (every slice back at step {step})')
        log.error('%s', message)
        p.files.all_down_at(step)
        return step, message
      test_block(host, step)
      self.hooks.dispatched(step)
      record = self._record(step, metrics, loop_start, t_step)
      stop = self.hooks.after_step(record)
      if stop is not None:
        return stop.steps_done, stop.message
      test_death(host, step + 1, *settled)
      step += 1
    return step, None

  def ended(self, steps_done: int) -> bool:
    """The run's end is reached: train.steps, or its sample budget (config.trained_to_end)."""
    return trained_to_end(self.parts.cfg, steps_done,
                          self.parts.controller.stream_position())

  def _record(self, step: int, metrics, loop_start: float, t_step: float) -> StepRecord:
    """The step's record, its metrics fetched where a hook wants them and for the first step
    (the start-up clock's end): the fetch waits for the step."""
    p, c = self.parts, self.parts.controller
    p.records.events(c.events)
    record = StepRecord(step, c.last_plan, None, loop_start, built=c.last_built, metrics=metrics,
                        last=self.ended(step + 1))
    due = p.stop.due(step + 1)  # a stop after this step: its loss is the run's last one
    if self.hooks.wants_values(step) or step == p.origin.step or due or record.last:
      # Several processes: a collective every step, carrying this process's stop vote.
      vote = due if multihost.is_multiprocess() else None
      record.values, voted = c.fetch(metrics, vote)
      record.stop_voted = voted if multihost.is_multiprocess() else due
      p.records.reached(step + 1)  # the fetch waited for the step: it is trained
      p.startup.step_done()
      if step == p.origin.step and self.restarted_by is not None:
        self._recovered()
    record.step_s = time.perf_counter() - t_step
    return record

  def _recovered(self) -> None:
    """A restart's first step is trained (process 0): where its time went, in history.jsonl
    (the supervisor prints it) and in report.json."""
    s = self.parts.startup
    self.recovery = recovery_time.measure(self.restarted_by, s.origin, startup_marks(),
                                          s.seconds, s.first_step_end,
                                          self.parts.controller.first_programs)
    self.parts.records.history(Kind.RECOVERED, recovered=self.recovery)
