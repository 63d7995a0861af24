"""The replay's stand-in program cache (keyed by ProgramKey) and its background mover."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Sequence

from mecefo_jax.core import programs
from mecefo_jax.core.programs import MOVED, ProgramKey

PREMOVED = 'premoved'  # moved by the background worker (COMPILED, MOVED: in the foreground)


@dataclasses.dataclass
class BuildStats:
  """Programs a replay built, and the seconds its steps waited for them (the foreground)."""
  compiled: int = 0  # compiled in the foreground: a new shape, or any new program with moves off
  compile_s: float = 0.0
  moved: int = 0  # moved in the foreground: the background worker had not started them
  move_s: float = 0.0
  premoved: int = 0  # moved by the background worker before (or while) their live set came
  premove_wait_s: float = 0.0  # waited for the rest of moves in flight when their set came


class ProgramLedger:
  """What building programs costs, as the executor's program cache builds them, by its rule
  (programs.how_built: with moves on, a move (`move_s`) for each new key of a shape built
  before, else a compile), with no program store."""

  def __init__(self, compile_s: Callable[[ProgramKey], float], move_s: float, move: bool,
               built: Iterable[ProgramKey] = ()):
    """`compile_s(key)`: compile seconds of a program; `built`: programs built before the replay
    (the fault-free run's), not charged."""
    self.compile_s, self.move_s, self.move = compile_s, move_s, move
    self.stats = BuildStats()
    self.forget()
    for key in built:
      self._add(key)

  def forget(self) -> None:
    """A fresh process: nothing is built."""
    self._built: set[ProgramKey] = set()
    self._shapes: set[tuple] = set()

  def has(self, key: ProgramKey) -> bool:
    return key in self._built

  def movable(self, key: ProgramKey) -> bool:
    """`key` is not built and building it would move a program of its shape."""
    return key not in self._built and self._how(key) == MOVED

  def _how(self, key: ProgramKey) -> str:
    return programs.how_built(key, self._shapes, self.move)

  def build(self, key: ProgramKey, ready_at: float | None = None, now: float = 0.0
            ) -> tuple[str | None, float]:
    """Builds `key` at `now` unless built: (how, seconds the step waits). `ready_at`: when the
    background worker finishes moving it (None: it does not move it)."""
    if key in self._built:
      return None, 0.0
    s, how = self.stats, PREMOVED if ready_at is not None else self._how(key)
    if how == PREMOVED:
      wait = max(0.0, ready_at - now)
      s.premoved, s.premove_wait_s = s.premoved + 1, s.premove_wait_s + wait
    elif how == MOVED:
      wait = self.move_s
      s.moved, s.move_s = s.moved + 1, s.move_s + wait
    else:
      wait = self.compile_s(key)
      s.compiled, s.compile_s = s.compiled + 1, s.compile_s + wait
    self._add(key)
    return how, wait

  def _add(self, key: ProgramKey) -> None:
    self._built.add(key)
    self._shapes.add(key.shape)


class Premover:
  """The background worker as the executor runs it: one thread that, after each change of live
  set, moves the programs of the live sets one event away (likeliest first) that would be moves
  and are not built, at most `cap` of them, `ledger.move_s` each, one after another. It never
  compiles (no spare cores for it). At the next change the programs of the set that came are
  taken (a move in flight is waited for), the others are evicted and the rest of the queue is
  dropped; the move in flight finishes before the next queue starts.

  The queue is listed lazily, at the next change, only as far as it decides anything: which of
  the new set's programs the worker had reached, and whether it was still busy. That is the
  queue listed at its own change: in between the foreground builds only the current set's
  refresh and eval programs, which no set one event away shares, nor their shapes (another
  number of slices), so what is movable does not change."""

  def __init__(self, ledger: ProgramLedger, cap: int):
    self.ledger, self.cap, self.move_s = ledger, cap, ledger.move_s
    self._busy_until = 0.0
    self.queue(0.0, (), lambda live: [])

  def queue(self, now: float, sets: Sequence[tuple[int, ...]],
            programs_of: Callable[[tuple[int, ...]], list[ProgramKey]]) -> None:
    """The queue after a change of live set at `now`: the programs `programs_of(s)` for each
    of `sets`, in order."""
    self._sets, self._programs_of = iter(sets if self.cap else ()), programs_of
    self._items: list[ProgramKey] = []
    self._where: dict[ProgramKey, int] = {}
    self._start = max(now, self._busy_until)

  def arrive(self, now: float, live: tuple[int, ...], keys: Sequence[ProgramKey]
             ) -> dict[ProgramKey, float]:
    """At the change to `live` at `now`: when the worker finished (or finishes) moving each of
    `keys` (only those it started before `now`). Drops the queue: call before building any."""
    started = self._started(now)
    if keys:
      self._list(started, stop=live)
    ready = {k: self._done(i) for k in keys if (i := self._where.get(k, started)) < started}
    if started and self._done(started - 1) > now:  # a move may be in flight: it goes on
      self._list(started)
      if len(self._items) >= started:
        self._busy_until = self._done(started - 1)
    self.queue(now, (), self._programs_of)
    return ready

  def _started(self, now: float) -> int:
    """How many queued moves the worker started before `now` (at most `cap`)."""
    if now <= self._start:
      return 0
    if not self.move_s:
      return self.cap
    return min(self.cap, math.ceil((now - self._start) / self.move_s))

  def _done(self, i: int) -> float:
    return self._start + (i + 1) * self.move_s

  def _list(self, n: int, stop: tuple[int, ...] | None = None) -> None:
    """Lists the queue up to `n` programs, or until the set `stop` is listed."""
    while len(self._items) < n:
      live = next(self._sets, None)
      if live is None:
        return
      for key in self._programs_of(live):
        if len(self._items) == self.cap:
          return
        if key not in self._where and self.ledger.movable(key):
          self._where[key] = len(self._items)
          self._items.append(key)
      if live == stop:
        return
