"""A node fault log replayed end to end: each approach's steps, restarts and lost work, in time."""
# A node fault is a process death: the survivors restart (`restart_s`), the step in flight is lost;
# the node's return restarts them again. Takeover policies run through the real decider between
# restarts (plan/replay.py); elastic restart is the decider's `drop` under the same restarts;
# checkpoint-restart is replayed node by node (spares, durable checkpoints every `checkpoint_s`).
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from mecefo_jax.core.failures import FailureEvent, TimedEvent
from mecefo_jax.core.goodput import Bucket
from mecefo_jax.plan.replay import Replay, Tally, quiet
from mecefo_jax.plan.simulate import PolicyModel


@dataclasses.dataclass(frozen=True)
class Rejoin:
  """When a repaired node rejoins: 'now'; 'every' `value` hours (at multiples of it from the
  window's start); 'count': once `value` repaired nodes wait."""
  kind: str = 'now'
  value: float = 0.0

  @classmethod
  def parse(cls, spec: str) -> 'Rejoin':
    """'now' | 'every:H' | 'count:K'."""
    kind, _, value = spec.partition(':')
    if kind == 'now' and not value:
      return cls()
    if kind in ('every', 'count') and value:
      try:
        number = float(value)
      except ValueError:
        number = -1.0
      if number > 0 and (kind == 'every' or number == int(number)):
        return cls(kind, number)
    raise ValueError(f"rejoin policy must be now, every:HOURS or count:K, got {spec!r}")

  def __str__(self) -> str:
    return 'now' if self.kind == 'now' else f'{self.kind}:{self.value:g}'


def batched(events: Sequence[TimedEvent], rejoin: Rejoin) -> list[TimedEvent]:
  """`events` with each repair held back until `rejoin` lets the node in; a node failing again
  while it waits never rejoined (its repair and that failure both go)."""
  if rejoin.kind == 'now':
    return list(events)
  out, waiting = [], {}  # slice -> the time its repair is due ('count': inf until released)
  for e in events:
    for s in [s for s, t in waiting.items() if t <= e.time_s]:
      out.append(TimedEvent(waiting.pop(s), s, 'repair'))
    if e.kind == 'fail':
      if waiting.pop(e.slice, None) is None:
        out.append(e)
      continue
    if rejoin.kind == 'every':
      period = rejoin.value * 3600.0
      waiting[e.slice] = math.ceil(e.time_s / period) * period
    else:
      waiting[e.slice] = math.inf
      if len(waiting) >= rejoin.value:
        out += [TimedEvent(e.time_s, s, 'repair') for s in sorted(waiting)]
        waiting.clear()
  out += [TimedEvent(t, s, 'repair') for s, t in waiting.items() if t < math.inf]
  return sorted(out, key=lambda e: (e.time_s, e.kind != 'repair', e.slice))


@dataclasses.dataclass
class Outcome:
  """One replay's totals: samples trained (each counted once), rows by kind, restarts and the
  seconds lost by cause."""
  samples: float = 0.0
  degraded: float = 0.0
  dropped: float = 0.0
  restarts: int = 0
  mix: dict = dataclasses.field(default_factory=dict)  # {(exact, degraded) rows: steps}
  lost_s: dict = dataclasses.field(default_factory=lambda: {
      'restart': 0.0, 'step_in_flight': 0.0, 'since_checkpoint': 0.0, 'waiting_for_repair': 0.0})


def takeover(events: Sequence[TimedEvent], horizon_s: float, model: PolicyModel,
             restart_s: float, death_lost_s: float) -> tuple[Outcome, Tally]:
  """The decider's plans between events; every batch of events that changes the live set is a
  restart of `restart_s`, a death among them also loses `death_lost_s` of steps (the step in
  flight, those since the last snapshot)."""
  r = Replay(model.decider(), model.costs, move=True, premove_cap=0, built=model.fault_free())
  out, i = Outcome(), 0
  with quiet():
    while r.now < horizon_s:
      deaths = changed = False
      while i < len(events) and events[i].time_s <= r.now:
        e = events[i]
        moved = r.decider.apply(FailureEvent(r.step, e.slice, e.kind, 'replay'))
        changed, deaths, i = changed or moved, deaths or (moved and e.kind == 'fail'), i + 1
      if changed:
        lost = death_lost_s if deaths else 0.0
        r.now += restart_s + lost
        r.tally.goodput[Bucket.RESTART] += restart_s + lost
        out.restarts += 1
        out.lost_s['restart'] += restart_s
        out.lost_s['step_in_flight'] += lost
        continue  # events due during the restart are applied before the next step
      t_next = min(events[i].time_s if i < len(events) else horizon_s, horizon_s)
      if r.decider.live():
        r.window(t_next, horizon_s)
      else:  # every slice is down: no step until a repair
        out.lost_s['waiting_for_repair'] += max(0.0, t_next - r.now)
        r.now = max(r.now, t_next)
  samples = r.decider.state.samples
  out.samples, out.mix = r.tally.samples, r.tally.mix
  out.degraded, out.dropped = float(samples['degraded']), float(samples['dropped'])
  return out, r.tally


def checkpoint_restart(events: Sequence[TimedEvent], n_nodes: int, spares: int, horizon_s: float,
                       step_s: float, rows_per_node: int, restart_s: float, checkpoint_s: float,
                       ) -> Outcome:
  """`n_nodes - spares` nodes train; a death of one restarts the job from its last durable
  checkpoint (taken every `checkpoint_s` of training) on a healthy spare, or, with none, once a
  node is repaired. A spare's death or a repair only changes the pool. Slices are nodes here:
  the first `spares` slices start as the spares."""
  out, down = Outcome(), set()
  job = set(range(spares, n_nodes))
  pool = set(range(spares))  # healthy nodes outside the job
  rate = len(job) * rows_per_node / step_s  # samples per second while training
  now, trained, i = 0.0, 0.0, 0  # trained: seconds of training since the last (re)start
  waiting = False  # the job lacks a node: no restart until a repair
  ready = 0.0  # the restart ends then
  while now < horizon_s:
    t_next = min(events[i].time_s if i < len(events) else horizon_s, horizon_s)
    if not waiting:
      start = max(now, ready)
      if t_next > start:  # training from the end of the restart until the next event
        trained += t_next - start
      now = t_next
    else:
      out.lost_s['waiting_for_repair'] += t_next - now
      now = t_next
    if i >= len(events) or events[i].time_s > now:
      break
    e = events[i]
    i += 1
    if e.kind == 'fail':
      down.add(e.slice)
      pool.discard(e.slice)
      if e.slice in job and not waiting:
        out.samples += (trained - trained % checkpoint_s) * rate
        out.lost_s['since_checkpoint'] += trained % checkpoint_s
        trained, job = 0.0, job - {e.slice}
        waiting = not _fill(job, pool, n_nodes - spares)
        ready = now + restart_s if not waiting else math.inf
        out.restarts += 0 if waiting else 1
        out.lost_s['restart'] += 0.0 if waiting else restart_s
      elif e.slice in job:
        job.discard(e.slice)
    else:
      down.discard(e.slice)
      pool.add(e.slice)
      if waiting and _fill(job, pool, n_nodes - spares):
        waiting, ready = False, now + restart_s
        out.restarts += 1
        out.lost_s['restart'] += restart_s
  out.samples += trained * rate  # the run's end is a checkpoint
  job_rows = (n_nodes - spares) * rows_per_node  # every step: the job's nodes' exact rows
  out.mix = {(job_rows, 0): out.samples / job_rows}
  out.lost_s['restart'] -= max(0.0, ready - horizon_s) if ready < math.inf else 0.0
  return out


def _fill(job: set[int], pool: set[int], size: int) -> bool:
  """Moves healthy spares into `job` until it has `size` nodes; whether it has them."""
  while len(job) < size and pool:
    node = min(pool)
    pool.discard(node)
    job.add(node)
  return len(job) >= size
