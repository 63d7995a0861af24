"""A failing durable tier: each failed save one line, the run going on; K in a row stop it."""
from __future__ import annotations

import logging
from typing import Callable

from mecefo_jax.snapshot.capacity import SnapshotError
from mecefo_jax.snapshot.tier import Tier

log = logging.getLogger('mecefo')
# Failed durable saves in a row after which the run stops (resumable from its in-memory
# snapshots): a durable directory that keeps failing (a bucket unreachable, a full disk) would
# otherwise leave a long run with nothing that outlives the machine.
FAILURES_TO_STOP = 3


class DurableGuard:
  """Settles the durable tier's saves: a failed one is one logged line and the run goes on with
  its in-memory tier; FAILURES_TO_STOP in a row, or one while the in-memory tier is failing
  too, make `failing` true (the trainer then stops). `agree(error) -> [error of each process]`:
  in a multi-process job every process's outcome is gathered, so that all count alike and stop
  after the same step."""

  def __init__(self, tier: Tier, agree: Callable[[str | None], list] | None = None):
    self.tier, self._agree = tier, agree
    self.failed = 0  # failed saves (report.json snapshots.durable_failed)
    self.in_a_row = 0
    self.failing = False
    self.last_ok = True  # the last settled save was written
    self._pending: int | None = None  # the step of the save not settled yet

  def settle(self, agree: bool = True, memory_ok: bool = True) -> None:
    """Waits for the save in flight and books its outcome. `agree`: all processes call this
    now (multi-process: a collective). `memory_ok`: the in-memory tier holds recent steps."""
    error = None
    try:
      self.tier.wait()
    except SnapshotError as err:
      error = str(err)
    if agree and self._agree is not None:
      error = next((e for e in self._agree(error) if e), None)
    step, self._pending = self._pending, None
    if error is None:
      self.in_a_row = 0 if step is not None else self.in_a_row
      self.last_ok = self.last_ok if step is None else True
      return
    if step is not None and (agree or self._agree is None):  # no process writes it any more
      self.tier.discard_failed(step)
    self.failed, self.in_a_row, self.last_ok = self.failed + 1, self.in_a_row + 1, False
    self.failing = self.in_a_row >= FAILURES_TO_STOP or not memory_ok
    log.error('durable checkpoint %s failed (%d in a row; the run stops at %d or when the '
              'in-memory tier fails too), training goes on with the in-memory snapshots: %s',
              step if step is not None else '?', self.in_a_row, FAILURES_TO_STOP, error)

  def save(self, step: int, state, meta: dict, **kwargs) -> bool:
    """Tier.save, after settle(); False (nothing started) once the tier is failing."""
    if self.failing:
      return False
    started = self.tier.save(step, state, meta, **kwargs)
    if started:
      self._pending = step
    return started


# A stop (a signal, a full disk) whose step no tier could write: their lines say why.
NOT_SAVED = ('saved in no snapshot (its saves failed: see the lines above; the newest snapshot '
             'that was written is where a resume starts)')


def stop_message(guard: DurableGuard, steps: int, where: list[str], resume: str) -> str:
  """Why and where the run stops, and how to go on."""
  saved = ('saved as the ' + ' and the '.join(where) if where else
           'saved in no snapshot (the in-memory tier fails too; the newest snapshot that was '
           'written is where a resume starts)')
  return (f'{guard.in_a_row} durable checkpoint(s) in a row failed to save (in '
          f'{guard.tier.directory}; see the lines above): the run stopped after {steps} step(s), '
          f'{saved}; once the durable directory works again, resume with {resume}')
