"""Storage faults of a run (a full disk, an I/O error): each one line, never a flood of tracebacks.

docs/errors.md lists what each fault does: a failed durable save is counted (3 in a row stop the
run, exit 5); a run-directory write that fails (metrics.jsonl, history.jsonl, report.json)
stops the run after its step, snapshotted (exit 6); a TensorBoard write that fails turns
TensorBoard off and training goes on.
"""
from __future__ import annotations

import errno
import logging
import sys
from pathlib import Path

def quiet_failed_saves() -> None:
  """A failed Orbax save (a full disk) leaves asyncio futures that nobody awaits and tensorstore
  callbacks into its closed event loop; Python prints each with its traceback (hundreds of
  `Event loop is closed`), while the snapshot code reports the failure in one line. Those two
  kinds are dropped, every other message stays. For train.py's process (the cli); once."""
  if getattr(sys.unraisablehook, 'mecefo', False):
    return
  logging.getLogger('asyncio').addFilter(
      lambda record: 'exception was never retrieved' not in record.getMessage())
  default = sys.unraisablehook

  def hook(unraisable) -> None:
    if not (isinstance(unraisable.exc_value, RuntimeError) and
            str(unraisable.exc_value) == 'Event loop is closed'):
      default(unraisable)
  hook.mecefo = True
  sys.unraisablehook = hook


def no_space(err: BaseException) -> bool:
  return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


class OutputGuard:
  """The run directory's writes of one start (process 0's): the first that fails (a full disk,
  an I/O error) asks the run to stop after its step, `stop(reason)`, which the stop line then
  gives; the same fault's later failures are skipped without a line, so that the run still
  ends (snapshotted, run_state.json `stopped`: written in place if need be)."""

  def __init__(self, stop=None):
    """`stop`: None raises the write's OSError (no run to stop)."""
    self._stop = stop
    self.error: str | None = None  # the first failed write, in words

  def attempt(self, path: Path, write, *args, **kwargs) -> bool:
    """`write(*args, **kwargs)`, which writes `path`; False (the run stopping) where it raised
    OSError."""
    try:
      write(*args, **kwargs)
      return True
    except OSError as err:
      if self._stop is None:
        raise
      if self.error is None:
        kind = 'a full disk' if no_space(err) else 'a failed write'
        self.error = f'{kind} ({path}: {err.strerror or err})'
        self._stop(self.error)
      return False
