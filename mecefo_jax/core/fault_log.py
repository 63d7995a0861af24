"""Node fault logs (a cluster's JSON record of each server's faults) as slice events."""
from __future__ import annotations

import dataclasses
import json
import logging
import math

import numpy as np

from mecefo_jax.config import ConfigError
from mecefo_jax.core.timed import TimedEvent

DAY_S = 86400.0
FIELDS = ('node_id', 'event_time', 'event_type', 'fault_type')
EVENT_TYPES = ('fault_start', 'fault_end')
FAULT_KEYS = ('Level', 'Class', 'Desc')
log = logging.getLogger('mecefo')


def is_node_log(text: str) -> bool:
  """A JSON node fault log (a list), not `step slice fail|repair` lines."""
  return text.lstrip()[:1] in ('[', '{')


@dataclasses.dataclass(frozen=True)
class LogMapping:
  """How a node log becomes slice events (docs/failures.md, "Real fault logs"): the cluster's
  size (a log lists only the nodes that failed; 0: those), the fault classes that count, the
  window's first day, log seconds per simulated second, the seed of the node-to-slice draw."""
  nodes: int = 0
  classes: str = 'all'
  start_day: float = 0.0
  compress: float = 1.0
  seed: int = 0

  @classmethod
  def of(cls, cfg) -> 'LogMapping':
    f = cfg.faults
    return cls(f.trace_nodes, f.trace_classes, f.trace_start_day, f.trace_compress, cfg.train.seed)


@dataclasses.dataclass(frozen=True)
class Fault:
  """One validated event of a log."""
  index: int
  node: str
  day: float
  start: bool
  kind: tuple[str, str, str]  # (Level, Class, Desc)


def parse(text: str, where: str) -> list[Fault]:
  """The log's events, checked, in time order: an empty file, not JSON, no events or an event
  without its fields (or with others) is one ConfigError line naming it; events out of time
  order are sorted, with one warning."""
  if not text.strip():
    raise ConfigError(f'{where}: the fault log is empty (a JSON list of events expected)')
  try:
    raw = json.loads(text)
  except json.JSONDecodeError as err:
    raise ConfigError(f'{where}: not a JSON fault log: {err.msg} at line {err.lineno} column '
                      f'{err.colno}') from None
  if not isinstance(raw, list):
    raise ConfigError(f'{where}: a fault log is a JSON list of events, got a {type(raw).__name__}')
  if not raw:
    raise ConfigError(f'{where}: the fault log has no events')
  return _sorted([_event(i, e, where) for i, e in enumerate(raw)], where)


def _sorted(faults: list[Fault], where: str) -> list[Fault]:
  """`faults` by time, in file order at one time (an end and a start there keep their order);
  one warning with the count of events earlier than one before them in the file."""
  late, last = [], -math.inf
  for f in faults:
    if f.day < last:
      late.append((f, last))
    last = max(last, f.day)
  if late:
    (f, after), n = late[0], len(late)
    log.warning('%s: %d event(s) out of time order (the first: event %d, node %s, day %g, after '
                'day %g): sorted by event_time', where, n, f.index, f.node, f.day, after)
  return sorted(faults, key=lambda f: f.day)  # stable


def _event(i: int, e, where: str) -> Fault:
  """Event `i` checked field by field."""
  bad = lambda what: ConfigError(f'{where}: event {i}: {what}; got {json.dumps(e)[:120]}')
  if not isinstance(e, dict):
    raise bad('not an object')
  unknown = [k for k in e if k not in FIELDS]
  if unknown:  # a misspelt field would otherwise read as a missing one, or pass unseen
    raise bad(f"unknown field(s) {', '.join(map(repr, unknown))} (an event has "
              f"{', '.join(FIELDS)})")
  node, day, typ, kind = (e.get(k) for k in FIELDS)
  if not isinstance(node, str) or not node:
    raise bad('node_id must be a non-empty string')
  if isinstance(day, bool) or not isinstance(day, (int, float)) or not 0 <= day < math.inf:
    raise bad('event_time must be a number of days >= 0')
  if typ not in EVENT_TYPES:
    raise bad(f"event_type must be {' or '.join(EVENT_TYPES)}")
  if not isinstance(kind, dict) or not all(isinstance(kind.get(k), str) for k in FAULT_KEYS):
    raise bad(f"fault_type must be an object with strings {', '.join(FAULT_KEYS)}")
  return Fault(i, node, float(day), typ == 'fault_start', tuple(kind[k] for k in FAULT_KEYS))


def window(faults: list[Fault], days: str) -> tuple[float, float]:
  """The window 'A:B' in the log's days (either end left out: the log's first day 0, its last
  event's day)."""
  start, _, end = days.partition(':')
  last = max((f.day for f in faults), default=0.0)
  return float(start or 0.0), float(end) if end else last


def counted(faults: list[Fault], classes: str, where: str) -> list[Fault]:
  """The faults of the classes that count: `classes` is 'all' or comma-separated terms, each a
  Level or Class name to count or, after '-', one not to (only exclusions: all but those)."""
  terms = [t.strip() for t in classes.split(',') if t.strip()]
  names = {n for f in faults for n in f.kind[:2]}
  for t in terms:
    if t not in ('all', '-all') and t.lstrip('-') not in names:
      raise ConfigError(f'{where}: fault class {t.lstrip("-")!r} is in no event of the log '
                        f"(its levels and classes: {', '.join(sorted(names))})")
  keep = {t for t in terms if not t.startswith('-')}
  drop = {t[1:] for t in terms if t.startswith('-')}
  everything = not keep or 'all' in keep
  return [f for f in faults
          if (everything or keep & set(f.kind[:2])) and not drop & set(f.kind[:2])]


def down_intervals(faults: list[Fault], where: str) -> dict[str, list[tuple[float, float]]]:
  """Each node's down time in days, [start, end) merged: a node is down while any of its faults
  is open (starts and ends paired by node and fault type; an end and a start at one time keep it
  down). Untidy events are read with a warning naming them: a start of a fault already open is
  part of it; an end with no start before it means down since the log's first day; an end of a
  fault already ended is ignored. A fault still open at the log's end stays down (end inf).
  A fault that ends when it starts (a zero-length [t, t), an orphan end on the first day
  included) takes no time: dropped, its node stays up, one warning with the count."""
  first = faults[0].day if faults else 0.0
  open_at: dict[tuple, float] = {}
  ended: set[tuple] = set()
  spans: dict[str, list[tuple[float, float]]] = {}
  for f in faults:
    key = (f.node, f.kind)
    name = f'{where}: event {f.index} (node {f.node}, day {f.day:g}, {f.kind[1]})'
    if f.start:
      if key in open_at:
        log.warning('%s: fault_start of a fault already open since day %g: read as one fault',
                    name, open_at[key])
      else:
        open_at[key] = f.day
    elif key in open_at:
      spans.setdefault(f.node, []).append((open_at.pop(key), f.day))
      ended.add(key)
    elif key in ended:
      log.warning('%s: fault_end of a fault that ended already: ignored', name)
    else:
      log.warning('%s: fault_end with no fault_start before it: down since the log\'s first '
                  'day (%g)', name, first)
      spans.setdefault(f.node, []).append((first, f.day))
      ended.add(key)
  for (node, _), start in open_at.items():
    spans.setdefault(node, []).append((start, math.inf))
  zero = sum(b <= a for s in spans.values() for a, b in s)
  if zero:
    log.warning('%s: %d fault(s) end when they start (zero length): dropped, their nodes stay up',
                where, zero)
  kept = {node: merged([(a, b) for a, b in s if b > a]) for node, s in spans.items()}
  return {node: s for node, s in kept.items() if s}


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
  """[start, end) spans, sorted, those that touch or overlap made one."""
  out: list[list[float]] = []
  for a, b in sorted(spans):
    if out and a <= out[-1][1]:
      out[-1][1] = max(out[-1][1], b)
    else:
      out.append([a, b])
  return [(a, b) for a, b in out]


def draw_nodes(logged: list[str], n_slices: int, nodes: int, seed: int, where: str
               ) -> list[str | None]:
  """The node of each slice: `n_slices` of the cluster's `nodes` drawn without replacement
  (seeded) from the `logged` ones (sorted) and those that never fail in the log (None)."""
  nodes = nodes or len(logged)
  if nodes < len(logged):
    raise ConfigError(f'{where}: {len(logged)} nodes fail in the log, more than the cluster size '
                      f'{nodes} (faults.trace_nodes)')
  if n_slices > nodes:
    raise ConfigError(f'{where}: {n_slices} slices, but the cluster has {nodes} nodes '
                      '(faults.trace_nodes): each slice replays one node')
  pool = logged + [None] * (nodes - len(logged))
  return [pool[i] for i in np.random.default_rng(seed).permutation(nodes)[:n_slices]]


def timed_events(down: dict, slice_nodes: list[str | None], start_day: float, end_day: float,
                 compress: float) -> list[TimedEvent]:
  """Slice events in simulated seconds from the window's start: each slice fails and is repaired
  as its node went down and came back within [start_day, end_day); a node down at the start is
  down from second 0. Sorted by time, repairs first at equal times."""
  scale = DAY_S / compress
  events = []
  for s, node in enumerate(slice_nodes):
    for a, b in down.get(node, ()) if node is not None else ():
      if b <= start_day or a >= end_day:
        continue
      events.append(TimedEvent((max(a, start_day) - start_day) * scale, s, 'fail'))
      if b < end_day:
        events.append(TimedEvent((b - start_day) * scale, s, 'repair'))
  return sorted(events, key=lambda e: (e.time_s, e.kind != 'repair', e.slice))


@dataclasses.dataclass(frozen=True)
class Replay:
  """A log replayed on slices: each slice's node (draw_nodes; None: one that never fails in the
  log) and the slices' timed events."""
  nodes: list[str | None]
  events: list[TimedEvent]


def replay(text: str, where: str, n_slices: int, mapping: LogMapping,
           end_day: float = math.inf) -> Replay:
  """The log `text` replayed by `n_slices` slices under `mapping`, up to `end_day`."""
  if not mapping.compress > 0:
    raise ConfigError(f'{where}: the compression factor must be > 0, got {mapping.compress}')
  faults = parse(text, where)
  down = down_intervals(counted(faults, mapping.classes, where), where)
  # Every node of the log is drawn from, whatever the class filter: one seed, one draw.
  nodes = draw_nodes(sorted({f.node for f in faults}), n_slices, mapping.nodes, mapping.seed, where)
  return Replay(nodes, timed_events(down, nodes, mapping.start_day, end_day, mapping.compress))


def slice_events(text: str, where: str, n_slices: int, mapping: LogMapping,
                 end_day: float = math.inf) -> list[TimedEvent]:
  """The log `text` as the timed events of `n_slices` slices under `mapping` (replay's)."""
  return replay(text, where, n_slices, mapping, end_day).events
