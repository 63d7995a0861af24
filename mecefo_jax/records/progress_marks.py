"""Progress marks: each training process's step in flight and phase (ProgressMark), in a small
file per host that its supervisor reads without JAX (mecefo_jax/watch.py decides from them what
a stall is).

The supervisor names a directory in MARKS_ENV; process of logical host h then keeps
`<dir>/host<h>.mark` up to date: one pwrite of MARK_BYTES (a CRC, then JSON, padded), in place,
no fsync: a few microseconds, once per dispatched step and twice per phase it enters and leaves
(compiling, evaluating, saving). Without MARKS_ENV (train.py alone) every call does nothing.
Marks are written from the main thread only: background builds are not the step's wait.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import threading
import time
import zlib
from pathlib import Path

from mecefo_jax import files, sections
from mecefo_jax.sections import entry

MARKS_ENV = 'MECEFO_PROGRESS_DIR'  # the directory a supervisor reads its job's marks in
PHASES = ('starting', 'compiling', 'training', 'evaluating', 'saving')
MARK_BYTES = 1024
_RECENT_STEPS = 32  # the step times a mark carries the longest of


@dataclasses.dataclass(frozen=True)
class ProgressMark:
  """One process's mark, as its file holds it."""
  pid: int = entry('', 'the process that wrote it')
  step: int = entry('step', 'the last step dispatched (-1 before the first)')
  in_step: int = entry('marks', 'marks written since that dispatch: the phases the step went '
                       'through after it (every process of a job goes through the same ones, '
                       'so (step, in_step) orders them)')
  phase: str = entry('', 'what it does: starting, compiling, training, evaluating, saving, '
                     'ending')
  key: str = entry('', 'the phase, or `phase/kind`, it is timed as')
  detail: str = entry('', "what it waits for ('jax.distributed.initialize', a program); may "
                      'be empty')
  since: float = entry('s', 'when the phase began (time.time())')
  step_s: float = entry('s', 'the longest of the recent step times (dispatch to dispatch, other '
                        'phases left out)')
  steps_timed: int = entry('steps', 'the recent step times it took the longest of')
  longest: dict[str, float] = entry('s', 'the longest this process spent in each phase key '
                                    "other than training ('start-up': from its first mark to "
                                    'its first step)')


def mark_path(directory: Path, host: int) -> Path:
  return Path(directory) / f'host{host}.mark'


class Marks:
  """One process's mark (ProgressMark): written in place after every change."""

  def __init__(self, path: Path):
    self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    self.step, self.in_step, self.phase, self.detail, self.key = -1, 0, 'starting', '', 'starting'
    self.since = self._t0 = time.time()
    self.longest: dict[str, float] = {}
    self._recent: collections.deque = collections.deque(maxlen=_RECENT_STEPS)
    self._dispatched_at: float | None = None  # of the last step
    self._other_s = 0.0  # time in other phases since that dispatch
    self._write()

  def dispatched(self, step: int) -> None:
    """Step `step` is dispatched; the process waits for it next."""
    now = time.time()
    self._leave(now)
    if self.step < 0:  # the whole start-up, from the first mark: a restart's allowance is
      self.longest['start-up'] = now - self._t0  # measured on it (never on a part of one)
    if self._dispatched_at is not None:
      self._recent.append(max(0.0, now - self._dispatched_at - self._other_s))
    self._dispatched_at, self._other_s = now, 0.0
    self.step, self.in_step, self.since = step, 0, now
    self.phase, self.detail, self.key = 'training', '', 'training'
    self._write()

  def enter(self, phase: str, detail: str = '', kind: str = '') -> tuple[str, str, str]:
    """Enters `phase` now (`kind`: a kind of it timed apart, e.g. a durable save); returns the
    (phase, detail, kind) it left."""
    left, now = (self.phase, self.detail, self.key.partition('/')[2]), time.time()
    self._leave(now)
    self.phase, self.detail, self.since = phase, detail, now
    self.key = f'{phase}/{kind}' if kind else phase
    self.in_step += 1
    self._write()
    return left

  def _leave(self, now: float) -> None:
    """The phase held until `now` ends: its time is booked."""
    spent = now - self.since
    if self.phase != 'training':
      self.longest[self.key] = max(self.longest.get(self.key, 0.0), spent)
      self._other_s += spent

  def mark(self) -> ProgressMark:
    return ProgressMark(pid=os.getpid(), step=self.step, in_step=self.in_step, phase=self.phase,
                        key=self.key, detail=self.detail[:200], since=round(self.since, 3),
                        step_s=round(max(self._recent, default=0.0), 4),
                        steps_timed=len(self._recent),
                        longest={k: round(v, 3) for k, v in self.longest.items()})

  def _write(self) -> None:
    text = json.dumps(sections.to_json(self.mark()), separators=(',', ':'))
    data = f'{zlib.crc32(text.encode()):08x} {text}'.encode()[:MARK_BYTES]
    os.pwrite(self._fd, data.ljust(MARK_BYTES), 0)

  def close(self) -> None:
    os.close(self._fd)


def read_mark(path: Path) -> ProgressMark | None:
  """The mark in `path`; None where there is none or it was read half-written (its CRC fails)."""
  try:
    with open(path, 'rb') as f:
      data = f.read(MARK_BYTES).decode(errors='replace').strip()
  except OSError:
    return None
  crc, _, text = data.partition(' ')
  if f'{zlib.crc32(text.encode()):08x}' != crc:
    return None
  try:
    value = json.loads(text)
  except ValueError:
    return None
  return None if files.problem(ProgressMark, value, '') else sections.from_json(ProgressMark, value)


_marks: Marks | None = None


def open_marks(host: int) -> None:
  """This process's marks, where its supervisor asks for them (MARKS_ENV): in phase starting."""
  global _marks
  directory = os.environ.get(MARKS_ENV)
  if directory and _marks is None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    _marks = Marks(mark_path(Path(directory), host))


def current() -> ProgressMark | None:
  """This process's mark as it stands (None where its supervisor asked for none); any thread."""
  return _marks.mark() if _marks is not None else None


def _main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


def dispatched(step: int) -> None:
  if _marks is not None and _main_thread():
    _marks.dispatched(step)


def enter(phase: str, detail: str = '') -> None:
  if _marks is not None and _main_thread():
    _marks.enter(phase, detail)


@contextlib.contextmanager
def during(phase: str, detail: str = '', kind: str = ''):
  """In `phase` while the block runs, then back in the phase it was in."""
  if _marks is None or not _main_thread():
    yield
    return
  left = _marks.enter(phase, detail, kind)
  try:
    yield
  finally:
    _marks.enter(*left)
