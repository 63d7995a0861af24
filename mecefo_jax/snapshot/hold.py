"""A test hook: a durable save held inside Orbax's commit (its tmp directory there) until a gate."""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger('mecefo')
# `STEPS:GATE`: the durable save of step STEPS stops after its files are written into Orbax's
# *.orbax-checkpoint-tmp directory and before it is renamed into place, until the file GATE
# exists (at most WAIT_S). Once the training thread waits for that save (nothing else of the
# run moves then), GATE.held is written: the run is held inside a durable save
# (tests/test_lock.py starts a second trainer on its directory then).
HOLD_ENV = 'MECEFO_TEST_HOLD_DURABLE'
WAIT_S = 300.0


class Hold:
  def __init__(self, spec: str):
    step, _, gate = spec.partition(':')
    self.step, self.gate = int(step), Path(gate)
    self._in_commit = threading.Event()

  def in_commit(self, step: int | None) -> None:
    """Orbax's post-finalization callback (its commit thread), before the rename."""
    if step != self.step:
      return
    self._in_commit.set()
    deadline = time.monotonic() + WAIT_S
    while not self.gate.exists() and time.monotonic() < deadline:
      time.sleep(0.02)

  def before_wait(self, step: int | None) -> None:
    """The training thread is about to wait for the save of `step`."""
    if step != self.step or self.gate.exists():
      return
    self._in_commit.wait(WAIT_S)
    log.warning('%s: durable save of step %d held until %s exists', HOLD_ENV, step, self.gate)
    Path(f'{self.gate}.held').write_text(str(os.getpid()))


def from_env() -> Hold | None:
  spec = os.environ.get(HOLD_ENV)
  return Hold(spec) if spec else None
