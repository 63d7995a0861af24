"""The run's stop request: SIGTERM or SIGINT, a step set in advance (--stop-after), a test's death.

A stop is honoured at the end of a step: the loop snapshots that step (both tiers) and exits
resumable. In a multi-process job one process's request becomes the job's at the next step
(run/trainer.py agrees on it with the step's metrics), so every process stops after the same step.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from mecefo_jax import files
from mecefo_jax.records.job import SIGINT_REASON, STOP_FILE

log = logging.getLogger('mecefo')
# Tests place a real death at an exact step: `HOST:STEPS` makes the process of logical host HOST
# SIGKILL itself once STEPS steps are trained and their snapshot is written (tests/test_launch.py).
TEST_DEATH_ENV = 'MECEFO_TEST_SIGKILL'
# `HOST:STEP` blocks the process of logical host HOST for ever inside step STEP, between its
# dispatch and its progress mark (a host thread stuck there), its heartbeat thread running.
TEST_BLOCK_ENV = 'MECEFO_TEST_BLOCK'


class StopRequest:
  """Why the run should stop at the end of this step (None: it should not)."""

  def __init__(self, after_step: int | None = None, out_dir: Path | None = None):
    """`out_dir`: the run directory whose STOP_FILE this process reads (process 0's)."""
    self.reason: str | None = None
    self.after_step = after_step  # --stop-after: stop once this many steps are trained
    self.file = Path(out_dir) / STOP_FILE if out_dir is not None else None
    self._previous: list[tuple[int, object]] = []

  def __bool__(self) -> bool:
    return self.reason is not None

  def watch(self, out_dir: Path) -> StopRequest:
    """Process 0 reads the STOP_FILE of `out_dir` unless it was given another."""
    import jax  # (not at the top: the supervisor imports this module without jax)
    if jax.process_index() == 0 and self.file is None:
      self.file = Path(out_dir) / STOP_FILE
    return self

  def request(self, reason: str) -> None:
    if self.reason is None:
      self.reason = reason

  def due(self, steps_done: int) -> bool:
    """Whether to stop after `steps_done` steps (this process's view)."""
    if self.after_step is not None and steps_done >= self.after_step:
      self.request(f'--stop-after {self.after_step}')
    text = files.read_text(self.file) if self.file is not None else None
    if text is not None:  # whatever it holds (a damaged request is a request too)
      self.request(text.strip()[:200] or 'a stop request')
      self.file.unlink(missing_ok=True)  # honoured: the next start must not stop again
    return bool(self)

  def install(self) -> None:
    """SIGTERM (preemption) and SIGINT (Ctrl-C) request a stop; a second SIGINT raises
    KeyboardInterrupt, for a user who will not wait for the step. A SIGINT ignored by the
    parent (a shell's background job) stays ignored. Main thread only."""
    signums = [signal.SIGTERM]
    signums += [signal.SIGINT] if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else []
    self._previous = [(s, signal.signal(s, self._on_signal)) for s in signums]

  def _on_signal(self, signum, frame) -> None:
    if signum == signal.SIGINT and self:
      raise KeyboardInterrupt
    name = SIGINT_REASON if signum == signal.SIGINT else signal.Signals(signum).name
    self.request(name)
    log.warning('%s: stopping after this step', name)

  def uninstall(self) -> None:
    for signum, previous in self._previous:
      if previous is not None:  # None: a handler set outside Python, which we cannot reinstall
        signal.signal(signum, previous)
    self._previous = []


def test_death(host: int, steps_done: int, *ready) -> None:
  """The death TEST_DEATH_ENV asks for, once `steps_done` steps are trained: every process
  first waits for each callable in `ready` (its snapshot written, its background builds done)
  and, in a multi-process job, for the others to do the same, so that where the death lands
  (the newest complete snapshot of the survivors too) is the same in every run."""
  spec = os.environ.get(TEST_DEATH_ENV)
  if not spec or spec.split(':')[1] != str(steps_done):
    return
  from mecefo_jax import multihost  # jax: only where a test asks for a death
  from mecefo_jax.records import progress_marks
  # A wait no earlier one bounds (background compiles): not a stall (watch.NOT_MEASURED).
  with progress_marks.during('compiling', 'the builds and saves in flight (a test death)', 'wait'):
    for wait in ready:
      wait()
    if multihost.is_multiprocess():
      multihost.allgather_json(host)  # a barrier: every survivor's snapshot is complete
  if spec == f'{host}:{steps_done}':
    log.warning('%s=%s: host %d kills itself (SIGKILL) after step %d', TEST_DEATH_ENV, spec,
                host, steps_done)
    os.kill(os.getpid(), signal.SIGKILL)


def test_block(host: int, step: int) -> None:
  """The block TEST_BLOCK_ENV asks for, if it is this host's and this step: the main thread
  sleeps until the process is killed; jax.distributed's heartbeat goes on in its own thread."""
  if os.environ.get(TEST_BLOCK_ENV) != f'{host}:{step}':
    return
  log.warning('%s=%d:%d: host %d blocks inside step %d', TEST_BLOCK_ENV, host, step, host, step)
  while True:
    time.sleep(3600)
