"""history.jsonl: the run's append-only record of what happened, written by process 0 of the
trainer and by the supervisor (its `launch-*` lines): HistoryLine, its one writer (append) and
its one reader (read, and Follower for the lines written since). Each line is fsynced; a line
a crash cut is skipped where read (one warning) and cut at a start (files.cut_torn_lines)."""
from __future__ import annotations

import dataclasses
import enum
import json
import time
from pathlib import Path
from typing import Any

from mecefo_jax import files, sections
from mecefo_jax.records.run_state import Diverged
from mecefo_jax.sections import entry

HISTORY = 'history.jsonl'
_LAUNCH = 'launch-'  # the supervisor's kinds: history.jsonl's name of its --events kinds


class Kind(enum.Enum):
  """What a line records: the trainer's kinds (process 0's), then the supervisor's."""
  START = 'start'  # a start of the trainer: the step it starts from, what it restored, its hosts
  THROWN_AWAY = 'thrown_away'  # steps trained again: the previous processes had trained them
  FAILURE = 'failure'  # a failure event
  SNAPSHOT_SKIPPED = 'snapshot_skipped'  # in-memory snapshots skipped (a full tmpfs)
  CHANGED = 'changed'  # the settings a resume changed
  ROLLED_BACK = 'rolled_back'  # a resume of a diverged run went back to a snapshot before it
  DIVERGED = 'diverged'  # the training loss or gradient norm was not finite
  RECOVERED = 'recovered'  # a restart's first step is trained again: where its time went
  STOP = 'stop'  # the run stopped after a step, saved where it says
  END = 'end'  # the trainer's loop ended: finished or stopped
  LAUNCH_START = 'launch-start'  # the supervisor started the job's processes
  LAUNCH_DEATH = 'launch-death'  # a process died
  LAUNCH_STALL = 'launch-stall'  # the job stalled (watch.py)
  LAUNCH_PEER_LOST = 'launch-peer-lost'  # processes lost a peer and none was seen to die
  LAUNCH_START_AGAIN = 'launch-start-again'  # a death before the run existed: all start again
  LAUNCH_WAIT = 'launch-wait'  # one host left: the supervisor waits for a replacement
  LAUNCH_REJOIN_READY = 'launch-rejoin-ready'  # replacements ready: the job stops to grow
  LAUNCH_REJOIN = 'launch-rejoin'  # hosts rejoin the job
  LAUNCH_TAKE_BACK = 'launch-take-back'  # the job stopped itself while the supervisor was stopped
  LAUNCH_SIGNAL = 'launch-signal'  # SIGINT or SIGTERM to the supervisor: the job stops
  LAUNCH_STUCK = 'launch-stuck'  # processes that did not follow the others out were killed
  LAUNCH_GIVE_UP = 'launch-give-up'  # too few hosts, or too many restarts
  LAUNCH_END = 'launch-end'  # the supervisor's end: the job's exit code
  LAUNCH_PLACE = 'launch-place'  # Ray: the nodes of the job's hosts
  LAUNCH_ACTOR_LOST = 'launch-actor-lost'  # Ray: a host's actor is gone
  LAUNCH_PROBE = 'launch-probe'  # the pod controller: the hosts that answer its probe

  @property
  def by_supervisor(self) -> bool:
    """A line of the supervisor's."""
    return self.value.startswith(_LAUNCH)

  @property
  def event(self) -> str:
    """The kind of the supervisor's --events line (`death` for launch-death)."""
    return self.value.removeprefix(_LAUNCH)


@dataclasses.dataclass
class Recovery:
  """report.json's `recovery` and the `recovered` line: a restart after a failure, process 0's
  view."""
  cause: str = entry('', "what the restart followed: 'death' (a process ended), 'stall' or "
                     "'peer-lost' (a process lost a peer and none was seen to die)")
  host: int | None = entry('', 'the logical host that died or stalled; null when none was '
                           'singled out')
  detect_s: float | None = entry('s', "how late the failure was seen, at most: a death, the "
                                 "supervisor's interval between its look that saw the process "
                                 'alive and the one that saw it ended; null where unknown')
  stop_s: float = entry('s', 'the other processes stopped (killed and reaped), from the detection')
  spawn_s: float = entry('s', "the restarted job's processes spawned, after the stop")
  process_start_s: float = entry('s', "from the spawn to the process's start (its exec)")
  imports_s: float = entry('s', 'Python imports: jax, then the training modules')
  distributed_s: float = entry('s', 'jax.distributed.initialize: every process connected')
  setup_s: float = entry('s', 'the rest of the start-up: devices, data, run directory, snapshot '
                         'tiers, the loop\'s start')
  restore_s: float = entry('s', 'the newest usable snapshot found and restored')
  programs_s: float = entry('s', "the first step's programs compiled or loaded from the program "
                            'store')
  programs_built: dict[str, int] = entry('programs', "those programs by how each was built: "
                                         "'compiled', 'loaded' (the program store), 'moved'")
  first_step_s: float = entry('s', 'the first step trained again, blocked on its metrics')
  total_s: float = entry('s', 'from the detection to the end of the first step trained again')


@dataclasses.dataclass(frozen=True)
class SupervisorPart:
  """The supervisor's part of a restart, in the `launch-start` line that starts the restarted
  job (`recovery`); times from time.time()."""
  cause: str = entry('', "what the restart follows: 'death', 'stall' or 'peer-lost'")
  host: int | None = entry('', 'the logical host that died or stalled; null: none singled out')
  detect_s: float | None = entry('s', 'how late the failure was seen, at most; null: unknown')
  detected_t: float = entry('s', "the supervisor's look that saw the failure")
  stopped_t: float = entry('s', 'the other processes stopped')
  spawned_t: float = entry('s', "the restarted job's processes spawned")


@dataclasses.dataclass
class Rollback:
  """report.json's `rollback` and the `rolled_back` line: a resume of a diverged run, where it
  diverged and the snapshot it went back to."""
  diverged_at_step: int = entry('step', 'the step whose training loss or gradient norm was not '
                                'finite (the previous start\'s diverged_at_step)')
  last_finite_step: int = entry('step', 'the last step seen with a finite loss and gradient '
                                'norm: the snapshot gone back to is of a step <= it')
  to_step: int = entry('step', 'step of the snapshot gone back to (= resumed_from_step)')
  discarded: list[str] = entry('', 'the snapshots newer than it, taken out of the run: '
                               'in-memory ones deleted, durable ones set aside (kept on disk)')


def _key(unit: str, doc: str) -> Any:
  """A key of some kinds' lines: the others lack it (read as None)."""
  return entry(unit, doc, optional=True)


@dataclasses.dataclass(frozen=True)
class HistoryLine:
  """A line: when, what kind, then that kind's keys, in the order its writer gave them. A key
  named as a kind (recovered, diverged, rolled_back) is that kind's whole record, its keys
  inline in the line."""
  t: float = entry('s', 'when it was written (time.time())')
  kind: Kind = entry('', 'what it records')
  elapsed_s: float | None = _key('s', "the supervisor's lines: since it started")
  step: int | None = _key('step', 'start: the step restored; stop, end, snapshot_skipped, '
                          'changed: the steps trained; launch-take-back: where the job stopped')
  from_step: int | None = _key('step', 'thrown_away: the step the start restored')
  to_step: int | None = _key('step', 'thrown_away: the steps the previous processes trained')
  restored: str | None = _key('', 'start: the snapshot restored, in words (null: none)')
  hosts: list[int] | None = _key('', 'start: the logical hosts of the job; launch-start, '
                                 'launch-rejoin(-ready), launch-peer-lost, launch-probe: those '
                                 'it is about')
  live: list[int] | None = _key('', 'start: the live slices')
  event: dict[str, Any] | None = _key('', 'failure: the event (core/failures.py FailureEvent)')
  skipped: int | None = _key('snapshots', 'snapshot_skipped: in-memory snapshots skipped since '
                             'the last such line')
  settings: dict[str, list] | None = _key('', "changed: {key: [the run's value, this start's]}")
  status: str | None = _key('', "end: 'finished' or 'stopped'")
  why: str | None = _key('', "stop, end: why; launch-stall: why that host; launch-actor-lost: "
                         "Ray's words")
  saved: list[str] | None = _key('', 'stop: the snapshots the last step is saved as')
  pids: dict[str, int] | None = _key('', 'launch-start: {host: pid}')
  recovery: SupervisorPart | None = _key('', "launch-start of a restart: the supervisor's part "
                                         'of its breakdown')
  host: int | None = _key('', 'the host a line of the supervisor is about: dead, stalled (null: '
                          'none singled out), failed in start-up, lost (Ray)')
  code: int | None = _key('', "launch-death: the host's exit code; launch-end: the job's")
  start_up: bool | None = _key('', 'launch-stall: every process was still starting')
  waited_s: float | None = _key('s', 'launch-stall: how long no mark changed')
  deadline_s: float | None = _key('s', 'launch-stall: the deadline that ran out')
  deadline_from: str | None = _key('', "launch-stall: what set it: 'measured', 'first', "
                                   "'--stall-s'")
  stopped: list[int] | None = _key('', 'launch-stall: the hosts whose process is stopped')
  phases: dict[str, dict[str, Any]] | None = _key('', 'launch-stall: {host: its mark\'s phase, '
                                                  'detail, step and pid}')
  note: str | None = _key('', "launch-stall: failures.txt's comment for it")
  nodes: dict[str, str] | None = _key('', 'launch-place: {host: Ray node id}')
  lost: list[int] | None = _key('', 'launch-probe: the hosts that do not answer')
  recovered: Recovery | None = _key('', 'recovered: its whole record')
  diverged: Diverged | None = _key('', 'diverged: its whole record')
  rolled_back: Rollback | None = _key('', 'rolled_back: its whole record')


_TYPES = {key: tp for key, tp, _, _ in sections.fields(HistoryLine)}
# The kinds whose line is one record whole, and that record.
_WHOLE = {kind: sections.nullable(_TYPES[kind.value]) for kind in Kind if kind.value in _TYPES}
_WHOLE_KEYS = {kind.value for kind in _WHOLE}


def _keys(kind: Kind, fields: dict) -> dict:
  """`fields` as the line's keys, in the order given, each checked against HistoryLine; the
  kind's own record (the key named as the kind) spread inline."""
  keys = {}
  for key, value in fields.items():
    tp, value, found = _TYPES.get(key), sections.to_json(value), []
    if tp is None or key in _WHOLE_KEYS and key != kind.value:
      raise TypeError(f'a {kind.value} line: HistoryLine declares no key {key!r} for it')
    sections.check(tp, value, key, found)
    if found:
      raise TypeError(f'a {kind.value} line: {found[0]}')
    keys.update(value if key == kind.value else {key: value})
  return keys


def append(out_dir: Path, kind: Kind, *, elapsed_s: float | None = None,
           events: Path | None = None, **fields) -> None:
  """One line of `out_dir`'s history.jsonl (fsynced; rewritten only to cut a torn line at a
  start): now, `kind`, then its keys `fields`. The supervisor's lines: `elapsed_s` since it
  started; the same line to `events` (--events, its kind without `launch-`); written to
  history.jsonl only once the run directory exists."""
  line = {'t': round(time.time(), 3), **({} if elapsed_s is None else {'elapsed_s': elapsed_s}),
          'kind': kind.value, **_keys(kind, fields)}
  if events:
    files.append_line(Path(events), json.dumps({**line, 'kind': kind.event}))
  if not kind.by_supervisor or Path(out_dir).is_dir():
    files.append_line(Path(out_dir) / HISTORY, json.dumps(line))


def parse(value) -> HistoryLine | None:
  """The line that `value` (a line's parsed JSON) holds; None where it holds none (another
  shape). A whole record that cannot be read is left None (a line of an earlier version)."""
  if files.problem(HistoryLine, value, '') is not None:
    return None
  line = sections.from_json(HistoryLine, value)
  record = _WHOLE.get(line.kind)
  if record is not None and files.problem(record, value, '') is None:
    line = dataclasses.replace(line, **{line.kind.value: sections.from_json(record, value)})
  return line


def read(out_dir: Path, warn: bool = True) -> list[HistoryLine]:
  """history.jsonl's lines ([] without the file); a line cut by a crash, or of another shape,
  is skipped with one warning for the file (`warn`)."""
  return files.read_jsonl(Path(out_dir) / HISTORY, parse, warn)


class Follower:
  """The lines written to `out_dir`'s history.jsonl since it was made (the supervisor's look
  for its restarted job's `recovered` line)."""

  def __init__(self, out_dir: Path):
    self.path = Path(out_dir) / HISTORY
    self.offset = self.path.stat().st_size if self.path.exists() else 0

  def new(self) -> list[HistoryLine]:
    """The complete lines written since the last call (a line of another shape left out)."""
    try:
      with open(self.path, 'rb') as f:
        f.seek(self.offset)
        data = f.read()
    except OSError:
      return []
    data = data[:data.rfind(b'\n') + 1]
    self.offset += len(data)
    lines = (parse(_value(text)) for text in data.decode('utf-8', 'replace').splitlines())
    return [line for line in lines if line is not None]


def _value(text: str):
  """The JSON `text` holds, None where it is no JSON (a torn line)."""
  try:
    return json.loads(text)
  except ValueError:
    return None
