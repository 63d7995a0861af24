"""Background compilation of the programs of live sets one failure or repair away."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Iterable

log = logging.getLogger('mecefo')


def next_live_sets(live: tuple[int, ...], n_slices: int) -> list[tuple[int, ...]]:
  """Live sets one event away: one more slice down (failures first: likelier), or one back."""
  down = [tuple(s for s in live if s != f) for f in live if len(live) > 1]
  back = [tuple(sorted((*live, r))) for r in range(n_slices) if r not in live]
  return down + back


class Precompiler:
  """One daemon thread compiling `compile_live_set(live)` for queued live sets, each once.

  The training thread only waits for a program that is still compiling when it needs it; time
  spent here off the critical path is `seconds`, not the goodput's `compile`.
  """

  def __init__(self, compile_live_set: Callable[[tuple[int, ...]], None]):
    self._compile = compile_live_set
    self._queue: queue.Queue = queue.Queue()
    self._seen: set[tuple[int, ...]] = set()
    self._stop = threading.Event()
    self.seconds, self.compiled = 0.0, 0
    self._thread = threading.Thread(target=self._work, daemon=True, name='mecefo-precompile')
    self._thread.start()

  def want(self, live_sets: Iterable[tuple[int, ...]]) -> None:
    for live in live_sets:
      if live not in self._seen:
        self._seen.add(live)
        self._queue.put(live)

  def summary(self) -> dict:
    """report.json's `precompile` section."""
    return {'enabled': True, 'live_sets': self.compiled, 'seconds': self.seconds}

  def wait(self) -> None:
    """Blocks until every live set queued so far is compiled."""
    self._queue.join()

  def stop(self) -> None:
    """Stops after the program being compiled (so the process can exit cleanly)."""
    self._stop.set()
    self._queue.put(None)
    self._thread.join()

  def _work(self) -> None:
    while (live := self._queue.get()) is not None:
      try:
        if not self._stop.is_set():
          t0 = time.perf_counter()
          self._compile(live)
          self.seconds += time.perf_counter() - t0
          self.compiled += 1
      except Exception as err:  # noqa: BLE001 -- a failed precompile only costs a later compile
        log.warning('precompile of live set %s failed: %s: %s', list(live), type(err).__name__, err)
      finally:
        self._queue.task_done()
      if self._queue.empty():
        log.info('background builds done (%d live sets, %.1f s)', self.compiled, self.seconds)
    self._queue.task_done()
