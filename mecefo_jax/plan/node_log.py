"""A node fault log, JSON (benchmarks/traces/) or CSV `node,start,end`, read as faults."""
from __future__ import annotations

import csv
import datetime
import math

from mecefo_jax.config import ConfigError
from mecefo_jax.core import fault_log
from mecefo_jax.core.fault_log import Fault

HEADER = ('node', 'start', 'end')
UNITS = ('auto', 'days', 's', 'iso')
# 'auto' reads the first row's start: a number from EPOCH_S_MIN on is epoch seconds (10^6 days
# would be 2,700 years of log), a smaller one days, anything else ISO 8601.
EPOCH_S_MIN = 1e6
UNIT_WORDS = {'days': 'a number of days >= 0', 's': 'a number of epoch seconds',
              'iso': 'an ISO 8601 time such as 2024-03-01T12:00:00Z'}


def read(path: str, unit: str = 'auto') -> list[Fault]:
  """The faults of the log at `path` in time order, or one ConfigError line naming the file, the
  line (the event, in a JSON log) and what is wrong."""
  text = _text(path)
  if fault_log.is_node_log(text):
    if unit not in ('auto', 'days'):
      raise ConfigError(f'{path}: a JSON node log holds days (event_time); --time-unit {unit} '
                        'is for a CSV log')
    return fault_log.parse(text, path)
  return parse_csv(text, path, unit)


def _text(path: str) -> str:
  try:
    with open(path, encoding='utf-8') as f:
      return f.read().removeprefix('\ufeff')
  except UnicodeDecodeError:
    raise ConfigError(f'{path}: cannot read the fault log: not UTF-8 text') from None
  except OSError as err:
    raise ConfigError(f'{path}: cannot read the fault log: {err.strerror or err}') from None


def parse_csv(text: str, where: str, unit: str = 'auto') -> list[Fault]:
  """A CSV log: a header `node,start,end`, then one outage a row (an empty end: still down at
  the log's end). Days are taken as they are; epoch seconds and ISO 8601 times become days from
  the log's earliest start."""
  rows = list(csv.reader(text.splitlines()))
  if not any(any(c.strip() for c in r) for r in rows):
    raise ConfigError(f'{where}: the fault log is empty (expected a header node,start,end and '
                      'one row per outage)')
  header = tuple(c.strip().lower() for c in rows[0])
  if header != HEADER:
    raise ConfigError(f"{where}:1: the header must be node,start,end, got {','.join(rows[0])!r}")
  body = [(n, r) for n, r in enumerate(rows[1:], 2) if any(c.strip() for c in r)]
  if not body:
    raise ConfigError(f'{where}: no outage after the header node,start,end')
  unit = _detected(body[0], where) if unit == 'auto' else unit
  spans = [_span(n, r, unit, where) for n, r in body]
  if unit == 'days':
    return _faults(spans, 0.0, 1.0)
  return _faults(spans, min(start for _, _, start, _ in spans), fault_log.DAY_S)


def _detected(first: tuple[int, list[str]], where: str) -> str:
  """The unit of the first row's start (EPOCH_S_MIN)."""
  n, row = first
  start = row[1].strip() if len(row) > 1 else ''
  try:
    return 's' if float(start) >= EPOCH_S_MIN else 'days'
  except ValueError:
    pass
  try:
    _iso(start)
    return 'iso'
  except ValueError:
    raise ConfigError(f'{where}:{n}: start {start!r} is neither a number (days, epoch seconds) '
                      'nor an ISO 8601 time') from None


def _span(n: int, row: list[str], unit: str, where: str) -> tuple[int, str, float, float | None]:
  """(line, node, start, end or None) of one row, times in the unit's seconds or days."""
  if len(row) != 3:
    raise ConfigError(f'{where}:{n}: expected 3 fields node,start,end, got {len(row)}: '
                      f'{",".join(row)!r}')
  node, start, end = (c.strip() for c in row)
  if not node:
    raise ConfigError(f'{where}:{n}: the node is empty')
  t0 = _time(start, unit, f'{where}:{n}: start')
  t1 = _time(end, unit, f'{where}:{n}: end') if end else None
  if t1 is not None and t1 < t0:
    raise ConfigError(f'{where}:{n}: end {end!r} is before start {start!r}')
  return n, node, t0, t1


def _time(text: str, unit: str, what: str) -> float:
  """`text` in `unit`: days as they are; epoch seconds and ISO 8601 as seconds."""
  try:
    value = _iso(text) if unit == 'iso' else float(text)
  except ValueError:
    value = math.nan
  if not (math.isfinite(value) and (unit != 'days' or value >= 0)):
    raise ConfigError(f'{what} {text!r} is not {UNIT_WORDS[unit]} (--time-unit {unit})')
  return value


def _iso(text: str) -> float:
  """Epoch seconds of an ISO 8601 time (one without a zone: UTC)."""
  t = datetime.datetime.fromisoformat(text)
  if t.tzinfo is None:
    t = t.replace(tzinfo=datetime.timezone.utc)
  return t.timestamp()


def _faults(spans: list, origin: float, per_day: float) -> list[Fault]:
  """Each row's start and end as faults, in days from `origin` (times in units of 1/`per_day`
  days), in time order; each row its own fault (Desc: its line), so overlapping rows of one
  node merge into one outage."""
  out = []
  for n, node, start, end in spans:
    kind = ('csv', 'outage', f'line {n}')
    out.append(Fault(n, node, (start - origin) / per_day, True, kind))
    if end is not None:
      out.append(Fault(n, node, (end - origin) / per_day, False, kind))
  return sorted(out, key=lambda f: f.day)
