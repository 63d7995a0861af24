"""Failure sources feeding one schedule: deterministic API, Poisson presets, trace files."""
from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from pathlib import Path
from typing import Literal

import numpy as np

# PRESETS (docs/algorithm.md §5) and RATES are declared with the config key that names them.
from mecefo_jax.config import PRESETS, RATES, ConfigError
from mecefo_jax.core import fault_log
from mecefo_jax.core.timed import TimedEvent
from mecefo_jax.files import read_user_text
from mecefo_jax.sections import entry


PAPER_DEVICES = 32  # §5-6: the presets' rates are for the paper's 32-GPU cluster
KINDS = ('fail', 'repair')
log = logging.getLogger('mecefo')


def rate_scale(rate: str, n_slices: int) -> float:
  """The factor on a preset's mean interval: per_device keeps the paper's down fraction at any
  size (PAPER_DEVICES / n_slices), cluster takes the preset's interval as it is."""
  if rate not in RATES:
    raise ConfigError(f"failure rate must be one of {', '.join(RATES)}, got {rate!r}")
  return PAPER_DEVICES / n_slices if rate == 'per_device' else 1.0


def poisson_events(mean_s: float, repair_s: float, n_slices: int, horizon_s: float,
                   seed: int) -> list[TimedEvent]:
  """Failures as a Poisson process of mean interval `mean_s`, each on a random live slice and
  repaired `repair_s` later, over [0, horizon_s); sorted by time, repairs first at equal times
  (a slice repaired and failed at once ends up failed)."""
  rng, t, repaired_at, events = np.random.default_rng(seed), 0.0, {}, []
  while True:
    t += rng.exponential(mean_s)
    if t >= horizon_s:
      return sorted(events, key=lambda e: (e.time_s, e.kind != 'repair', e.slice))
    live = [s for s in range(n_slices) if repaired_at.get(s, -1.0) <= t]
    if not live:
      continue  # every slice is already down: nothing left to hit
    victim = int(rng.choice(live))
    repaired_at[victim] = t + repair_s
    events.append(TimedEvent(t, victim, 'fail'))
    if repaired_at[victim] < horizon_s:
      events.append(TimedEvent(repaired_at[victim], victim, 'repair'))


def apply_event(failed: set[int], kind: str, slice_: int) -> bool:
  """Applies a 'fail' or 'repair' of `slice_` to the set of failed slices; whether it changed
  (failing a failed slice or repairing a live one changes nothing)."""
  if kind == 'fail' and slice_ not in failed:
    failed.add(slice_)
    return True
  if kind == 'repair' and slice_ in failed:
    failed.discard(slice_)
    return True
  return False


@dataclasses.dataclass(frozen=True, order=True)
class FailureEvent:
  """One fail or repair of a slice (report.json's `scheduled_events` rows)."""
  step: int = entry('step', 'step at whose start the event applies')
  slice: int = entry('', 'data-parallel slice index')
  kind: Literal[KINDS] = entry('', 'the slice fails, or is repaired and rejoins')
  source: str = entry('', "where it came from: 'api', 'preset:high', 'trace:FILE', 'error: ...' "
                      "(raised for the slice by a Controller.error_hooks check), 'resume', "
                      "'absent' / 'present' (a start without / again with the slice's devices "
                      "or host)", default='api')

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AppliedEvent(FailureEvent):
  """A failure event as the controller applied it (report.json's `failure_events` rows)."""
  wall_s: float = entry('s', 'run wall time when the controller applied it')
  live: int = entry('slices', 'live slices after it')


class FailureSchedule:
  """Events by step; the controller applies a step's events before planning that step."""

  def __init__(self, n_slices: int):
    self.n_slices = n_slices
    self._events: dict[int, list[FailureEvent]] = defaultdict(list)
    # A node fault log's: the node each slice replays (None: one that never fails in the log).
    self.trace_nodes: list[str | None] | None = None

  def _add(self, slice_: int, step: int, kind: str, source: str) -> None:
    if not 0 <= slice_ < self.n_slices:
      raise ConfigError(f'failure event slice {slice_} out of range [0, {self.n_slices})')
    if step < 0:
      raise ConfigError(f'failure event step must be >= 0, got {step}')
    self._events[step].append(FailureEvent(step, slice_, kind, source))

  def fail_at(self, slice_: int, step: int, source: str = 'api') -> 'FailureSchedule':
    self._add(slice_, step, 'fail', source)
    return self

  def repair_at(self, slice_: int, step: int, source: str = 'api') -> 'FailureSchedule':
    self._add(slice_, step, 'repair', source)
    return self

  def events_at(self, step: int) -> list[FailureEvent]:
    # Repairs first: a slice repaired and failed again in one step ends up failed.
    return sorted(self._events.get(step, ()), key=lambda e: (e.kind != 'repair', e.slice))

  def all_events(self) -> list[FailureEvent]:
    return sorted(e for evs in self._events.values() for e in evs)

  def failed_sets(self, steps: int):
    """The failed slices at each step in [0, steps), as the controller sees them."""
    failed = set()
    for step in range(steps):
      for e in self.events_at(step):
        apply_event(failed, e.kind, e.slice)
      yield frozenset(failed)

  @classmethod
  def preset(cls, name: str, n_slices: int, steps: int, cluster_step_s: float,
             seed: int = 0, interval_scale: float = 1.0) -> 'FailureSchedule':
    """Poisson failures on random live slices over `steps` steps of `cluster_step_s` seconds;
    the preset's mean interval times `interval_scale`."""
    if name not in PRESETS:
      raise ConfigError(f"failure preset must be one of {', '.join(PRESETS)}, got {name!r}")
    mean_h, repair_h = PRESETS[name]
    return cls.from_timed(poisson_events(mean_h * interval_scale * 3600.0, repair_h * 3600.0,
                                         n_slices, steps * cluster_step_s, seed),
                          n_slices, cluster_step_s, f'preset:{name}')

  @classmethod
  def from_timed(cls, events: list[TimedEvent], n_slices: int, cluster_step_s: float,
                 source: str) -> 'FailureSchedule':
    """Timed events (sorted) at the step of their time: step = time // cluster_step_s."""
    sched, failed_at = cls(n_slices), {}
    for e in events:
      step = int(e.time_s // cluster_step_s)
      if e.kind == 'fail':
        failed_at[e.slice] = step
        sched.fail_at(e.slice, step, source)
      else:  # a repair within its failure's step still costs that step: it lands on the next
        sched.repair_at(e.slice, max(step, failed_at.get(e.slice, -1) + 1), source)
    return sched

  @classmethod
  def from_trace(cls, path: str | Path, n_slices: int, text: str | None = None,
                 source: str | None = None, log: fault_log.LogMapping | None = None,
                 cluster_step_s: float = 60.0) -> 'FailureSchedule':
    """One event per line: `step slice fail|repair`; blank lines and # comments ignored. Or a
    JSON node fault log (core/fault_log.py), mapped by `log` (default LogMapping()) to steps of
    `cluster_step_s` seconds (a *.json file is one, JSON or not), its nodes as `trace_nodes`.
    `text`: the file's text if already read; `source`: the events' (default trace:<name>)."""
    path = Path(path)
    sched, source = cls(n_slices), source or f'trace:{path.name}'
    text = read_user_text(path, 'failure trace', ConfigError) if text is None else text
    if fault_log.is_node_log(text) or path.suffix.lower() == '.json':
      played = fault_log.replay(text, str(path), n_slices, log or fault_log.LogMapping())
      sched = cls.from_timed(played.events, n_slices, cluster_step_s, source)
      sched.trace_nodes = played.nodes
      return sched
    for lineno, line in enumerate(text.splitlines(), 1):
      fields = line.split('#', 1)[0].split()
      if not fields:
        continue
      numbers = all(f.isascii() and f.isdigit() for f in fields[:2])  # '²'.isdigit(), int fails
      if len(fields) != 3 or fields[2] not in KINDS or not numbers:
        raise ConfigError(f"{path}:{lineno}: expected 'step slice fail|repair', got {line.strip()!r}")
      step, slice_ = int(fields[0]), int(fields[1])
      try:
        (sched.fail_at if fields[2] == 'fail' else sched.repair_at)(slice_, step, source)
      except ConfigError as err:  # a slice the run does not have: where it is written
        raise ConfigError(f'{path}:{lineno}: {err}') from None
    sched._warn_no_ops(f'failure trace {path}')
    return sched

  def _warn_no_ops(self, where: str) -> None:
    """A warning per event that changes nothing (likely a typo in a trace): a fail of a slice
    already down, a repair of a live one; one for no events at all (an empty file, say)."""
    if not self._events:
      log.warning('%s holds no events: the run has no failures', where)
    failed = set()
    for step in sorted(self._events):
      for e in self.events_at(step):
        if not apply_event(failed, e.kind, e.slice):
          log.warning('%s: step %d: %s of slice %d, which is %s: ignored', where, step, e.kind,
                      e.slice, 'already down' if e.kind == 'fail' else 'live')

  @classmethod
  def from_spec(cls, spec: str, n_slices: int, steps: int, cluster_step_s: float,
                seed: int, rate: str = 'per_device', log: fault_log.LogMapping | None = None
                ) -> 'FailureSchedule':
    """'none' | 'low' | 'mid' | 'high' | 'trace:PATH'; a preset's interval is scaled by
    rate_scale(rate, n_slices); a node fault log is mapped by `log`."""
    if spec == 'none':
      return cls(n_slices)
    if spec.startswith('trace:'):
      return cls.from_trace(spec[len('trace:'):], n_slices, log=log,
                            cluster_step_s=cluster_step_s)
    return cls.preset(spec, n_slices, steps, cluster_step_s, seed, rate_scale(rate, n_slices))


def write_trace(path: str | Path, events: list[dict]) -> None:
  """Failure events (FailureEvent.to_dict() rows) as a trace file that from_trace reads back."""
  lines = [f"{e['step']} {e['slice']} {e['kind']}  # {e['source']}" for e in events]
  tmp = Path(path).with_suffix('.tmp')
  tmp.write_text(''.join(f'{line}\n' for line in lines))
  tmp.replace(path)
