"""Background building of the programs of live sets one failure or repair away."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Iterable

from mecefo_jax.sections import entry

log = logging.getLogger('mecefo')


@dataclasses.dataclass
class Precompile:
  """report.json's `precompile` section (the defaults: no precompiler)."""
  enabled: bool = entry('', 'faults.precompile resolved (auto: on for GPU/TPU single-process)',
                        default=False)
  live_sets: int = entry('', 'live sets whose programs were compiled in the background', default=0)
  seconds: float = entry('s', 'background compile time, off the critical path', default=0.0)


class Precompiler:
  """One daemon thread running `build_live_set(live)` for the wanted live sets, in order, each
  once while it stays wanted.

  The training thread only waits for a program that is still being built when it needs it; time
  spent here off the critical path is `seconds`, not the goodput's `compile`.
  """

  def __init__(self, build_live_set: Callable[[tuple[int, ...]], None]):
    self._build = build_live_set
    self._pending: list[tuple[int, ...]] = []
    self._done: set[tuple[int, ...]] = set()
    self._busy = False
    self._stop = False
    self._cond = threading.Condition()
    self.seconds, self.compiled = 0.0, 0
    self._thread = threading.Thread(target=self._work, daemon=True, name='mecefo-precompile')
    self._thread.start()

  def want(self, live_sets: Iterable[tuple[int, ...]]) -> None:
    """From now on these live sets, likeliest first: sets no longer wanted leave the queue,
    and a set built before is built again once it is wanted after it was not."""
    live_sets = list(live_sets)
    with self._cond:
      self._done &= set(live_sets)
      self._pending = [s for s in live_sets if s not in self._done]
      self._cond.notify_all()

  def summary(self) -> Precompile:
    return Precompile(enabled=True, live_sets=self.compiled, seconds=self.seconds)

  def wait(self) -> None:
    """Blocks until every live set wanted so far is built."""
    with self._cond:
      self._cond.wait_for(lambda: self._stop or not (self._pending or self._busy))

  @property
  def stopping(self) -> bool:
    """stop() was called: a build of several programs may end after the one it is on."""
    return self._stop

  def stop(self) -> None:
    """Stops after the live set being built (so the process can exit cleanly)."""
    with self._cond:
      self._stop = True
      self._cond.notify_all()
    self._thread.join()

  def _work(self) -> None:
    while True:
      with self._cond:
        self._cond.wait_for(lambda: self._stop or self._pending)
        if self._stop:
          return
        live, self._busy = self._pending.pop(0), True
      t0 = time.perf_counter()
      try:
        self._build(live)
        self.seconds += time.perf_counter() - t0
        self.compiled += 1
      except Exception as err:  # noqa: BLE001 -- a failed build only costs a later one
        log.warning('building the programs of live set %s ahead failed: %s: %s', list(live),
                    type(err).__name__, err)
      with self._cond:
        self._done.add(live)
        self._busy = False
        if not self._pending:
          log.info('background builds done (%d live sets, %.1f s)', self.compiled, self.seconds)
        self._cond.notify_all()
