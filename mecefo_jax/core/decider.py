"""The decider: from the failure state alone, the plan of every step (no devices).

Every process of a job holds one and, fed the same events, makes the same plans; the executor
(fault/executor.py) carries them out and the failure simulator (benchmarks/simulate.py)
replays them with a cost model. docs/architecture.md shows where it sits.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
from typing import Any, Iterator, Mapping

from mecefo_jax.core import programs
from mecefo_jax.core.failures import AppliedEvent, FailureEvent, FailureSchedule, apply_event
from mecefo_jax.core.goodput import Goodput
from mecefo_jax.core.programs import ProgramKey, RunPrograms
from mecefo_jax.core.roles import Role, slice_list
from mecefo_jax.core.takeover import Assignment, Planner
from mecefo_jax.sections import entry

log = logging.getLogger('mecefo')


class StreamMismatch(ValueError):
  """A snapshot's sample counters disagree with the live slices its failure events give."""


@dataclasses.dataclass(frozen=True)
class DeciderMeta:
  """DeciderState as a snapshot's meta carries it (its `controller` entry)."""
  failed: list[int] = entry('slices', 'the slices down after the snapshot\'s step')
  events: list[dict[str, Any]] = entry('', 'the failure events applied so far (report.json\'s '
                                       'failure_events rows)')
  goodput: dict[str, float] = entry('s', 'goodput seconds by kind so far')
  samples: dict[str, int] = entry('samples', 'exact, degraded and dropped samples so far')


@dataclasses.dataclass
class DeciderState:
  """What the decider carries across steps, saved with every snapshot (`to_meta`)."""
  failed: set[int] = dataclasses.field(default_factory=set)
  events: list[dict] = dataclasses.field(default_factory=list)
  goodput: Goodput = dataclasses.field(default_factory=Goodput)
  samples: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def to_meta(self) -> DeciderMeta:
    return DeciderMeta(sorted(self.failed), list(self.events), self.goodput.seconds,
                       dict(self.samples))

  @classmethod
  def from_meta(cls, meta: DeciderMeta) -> 'DeciderState':
    return cls(set(meta.failed), list(meta.events), Goodput(meta.goodput),
               collections.Counter(meta.samples))


@dataclasses.dataclass
class Plans:
  """report.json's `plans`: the step plans of this process (fault/controller.py's PlanChain)."""
  steps: int = entry('steps', 'steps planned by this process (a step retried after a slice error '
                     'counts again)')
  digest: str = entry('', 'a running hash of every plan: equal on every process of a job')


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """One step, decided: who is live, who runs which rows in which role, the programs run."""
  step: int
  live: tuple[int, ...]
  assignment: Assignment  # rows and role of every live slice, rows nobody runs (drop)
  programs: tuple[ProgramKey, ...]  # the step's: the fused one, or the groups and the update
  refresh: ProgramKey | None  # the svd basis refresh run before the step
  rejoins: tuple[int, ...]  # repaired slices that receive the state before the step
  samples: Mapping[str, int]  # exact / degraded / dropped rows of the step
  eval: ProgramKey | None = None  # the held-out eval run after the step (train.eval_every)
  first_id: int | None = None  # `requeue`: the stream's first id this step trains (else by step)

  @property
  def roles(self) -> dict[int, Role]:
    return self.assignment.roles

  @property
  def processed(self) -> int:
    return self.samples['exact'] + self.samples['degraded']

  @property
  def fused(self) -> bool:
    return self.programs[0].kind is programs.FUSED

  def built(self) -> tuple[ProgramKey, ...]:
    """The programs the step needs, in the order it runs them: the refresh, the step's, the
    eval."""
    return (*[self.refresh] * (self.refresh is not None), *self.programs,
            *[self.eval] * (self.eval is not None))

  def digest(self) -> str:
    """A hash of everything decided: equal on every process of a job (checked there)."""
    keys = [[k.kind.name, list(k.slices), _plain(k.variant)] for k in self.built()]
    roles = [[s, _plain(r)] for s, r in sorted(self.roles.items())]
    text = json.dumps([self.step, self.live, roles, keys, self.rejoins, dict(self.samples),
                       *[self.first_id] * (self.first_id is not None)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _plain(x):
  return dataclasses.astuple(x) if dataclasses.is_dataclass(x) else x


class Decider:
  """The failure state and every decision made from it: the live slices, their roles and rows,
  the programs, rejoins, basis refreshes and evals of each step, the sample counts."""

  def __init__(self, planner: Planner, run: RunPrograms, schedule: FailureSchedule, tau: int,
               present: tuple[int, ...] | None = None, state: DeciderState | None = None):
    """`present`: the slices with devices in this start (default all); the others are absent,
    failed until a later start; `tau`: steps between svd basis refreshes (mecefo.tau)."""
    self.planner, self.run, self.schedule, self.tau = planner, run, schedule, tau
    # requeue: the rows not taken are trained later, not dropped (takeover.Policy.defers)
    self.defers = planner.checked_policy().defers
    self.n_slices = planner.n_slices
    self.present = tuple(range(self.n_slices) if present is None else present)
    self.state = state or DeciderState()
    self.held = self.present  # the slices holding the train state
    self.bases_step = -1  # the step of the last basis refresh (the state's bases_step)
    self.devices_back_at: int | None = None  # resumed after every slice was down at this step
    self._forget_plans()
    self._down: dict[int, None] = {}  # the failed slices in the order they failed
    for e in self.state.events:
      self._note(e['slice'], e['kind'])
    self._live_of: frozenset[int] | None = None  # the failed slices `_live` was listed for
    self._live: tuple[int, ...] = ()

  # --- failure state -------------------------------------------------------------------------
  def live(self) -> tuple[int, ...]:
    failed = self.state.failed
    if failed != self._live_of:  # listed again only after a change (a replay asks often)
      self._live_of = frozenset(failed)
      self._live = tuple(s for s in range(self.n_slices) if s not in failed)
    return self._live

  def apply(self, event: FailureEvent, wall_s: float = 0.0) -> bool:
    """Applies one failure or repair; whether it changed the live slices."""
    failed = self.state.failed
    if event.kind == 'repair' and event.slice in failed and event.slice not in self.present:
      log.warning('step %d: slice %d cannot be repaired here (%s): its devices are absent; '
                  'it rejoins at a start with them present', event.step, event.slice, event.source)
      return False
    if not apply_event(failed, event.kind, event.slice):
      return False  # no change (already failed / not failed)
    self._note(event.slice, event.kind)
    self._forget_plans()
    applied = AppliedEvent(**event.to_dict(), wall_s=wall_s, live=len(self.live()))
    self.state.events.append(applied.to_dict())
    log.warning('step %d: slice %d %s (%s); live slices %s', event.step, event.slice,
                'FAILED' if event.kind == 'fail' else 'repaired, rejoining', event.source,
                slice_list(self.live()))
    return True

  def _forget_plans(self) -> None:
    """Plans and program lists are kept by live set from one event to the next: a step plans
    its live set every step, the controller lists the programs of the sets one event away twice
    per change (to keep and to build). Rebound, not cleared: the background builder reads them."""
    self._assignments: dict[tuple[int, ...], Assignment] = {}
    self._listed: dict[tuple, tuple[ProgramKey, ...]] = {}  # (live, refreshed) -> programs_for

  def _note(self, s: int, kind: str) -> None:
    self._down.pop(s, None)
    if kind == 'fail':
      self._down[s] = None

  def down_longest_first(self) -> list[int]:
    """The failed slices, longest down first: the likeliest repaired next where repairs take
    about the same time (a failure set from outside the events, last, in slice order)."""
    failed = self.state.failed
    known = [s for s in self._down if s in failed]
    return known + sorted(failed.difference(known))

  def advance(self, step: int, wall_s: float = 0.0) -> tuple[list[tuple[int, ...]], bool]:
    """Applies the events of `step` (repairs first). Returns the live sets the state must be
    placed on before the step's failures, in order (a step's repairs take effect before its
    failures: the repaired slices receive the state then, so that a peer failing in the same
    step can still hand it over), and whether the live slices changed."""
    placements, changed = [], False
    for event in self.schedule.events_at(step):
      if event.kind == 'fail' and not set(self.live()) <= set(self.held):
        placements.append(self.live())
        self.held = self.live()
      changed |= self.apply(event, wall_s)
    if step == self.devices_back_at:
      for s in sorted(self.state.failed):
        changed |= self.apply(FailureEvent(step, s, 'repair', 'resume'), wall_s)
    return placements, changed

  def apply_presence(self, step: int) -> None:
    """At a start: slices without devices fail ('absent') from `step` on; absent ones whose
    devices are back rejoin ('present'), as after a repair. The schedule cannot repair an
    absent slice (no devices): its repairs wait for a later start."""
    for s in range(self.n_slices):
      if s not in self.present:
        self.apply(FailureEvent(step, s, 'fail', 'absent'))
      elif s in self.state.failed and self._last_source(s) == 'absent':
        self.apply(FailureEvent(step, s, 'repair', 'present'))

  def _last_source(self, s: int) -> str | None:
    return next((e['source'] for e in reversed(self.state.events) if e['slice'] == s), None)

  # --- plans ---------------------------------------------------------------------------------
  def assignment(self, live: tuple[int, ...]) -> Assignment:
    """The planner's rows and roles of `live` (planned once per live set between events)."""
    found = self._assignments.get(live)
    if found is None:
      found = self._assignments[live] = self.planner.plan(live)
    return found

  def decide(self, step: int) -> StepPlan:
    """The plan of `step` on the live slices (no change until `commit`)."""
    live = self.live()
    a = self.assignment(live)
    step_programs = programs.programs_for(programs.Need(live, a.roles, self.run), ('step',))
    refresh = None
    if self.run.refresh and self._degraded(a) and self._refresh_due(step):
      kind = programs.REFRESH_WARM if self._warm() else programs.REFRESH_COLD
      refresh = ProgramKey(kind, live)
    exact = sum(r.exact for r in a.roles.values())
    degraded = sum(r.degraded for r in a.roles.values())
    not_taken = self.n_slices * self.planner.micro_batch - exact - degraded
    samples = {'exact': exact, 'degraded': degraded, 'dropped': 0 if self.defers else not_taken}
    rejoins = tuple(s for s in live if s not in self.held)
    evaluate = ProgramKey(programs.EVAL, live) if self.eval_due(step) else None
    return StepPlan(step, live, a, tuple(step_programs), refresh, rejoins, samples, evaluate,
                    self.stream_position() if self.defers else None)

  def stream_position(self) -> int:
    """The first sample id of the stream not trained yet: every sample counted so far (under
    step-indexed ids, step x the global batch; under `requeue`, the samples trained)."""
    return sum(self.state.samples.values())

  def stream_position_of_events(self, step: int) -> int:
    """The stream position at `step` from the applied failure events alone (the live-set
    history): under `requeue`, the sum of live_s x B over the steps s before `step`; else step x
    the global batch (every row counted, trained or not)."""
    b = self.planner.micro_batch
    if not self.defers:
      return step * self.n_slices * b
    failed, position, s = set(), 0, 0  # s: the first step not counted yet
    for e in sorted(self.state.events, key=lambda e: e['step']):  # stable: applied order kept
      if e['step'] >= step:
        break
      position += (e['step'] - s) * (self.n_slices - len(failed)) * b
      s = e['step']
      apply_event(failed, e['kind'], e['slice'])
    return position + (step - s) * (self.n_slices - len(failed)) * b

  def check_stream(self, step: int) -> None:
    """Raises StreamMismatch where the restored sample counters (the stream position, carried
    in the snapshot meta) disagree with the position the failure events give at `step`."""
    carried, recomputed = self.stream_position(), self.stream_position_of_events(step)
    if carried != recomputed:
      raise StreamMismatch(
          f'the snapshot at step {step} counts {carried} samples trained, but its failure events '
          f'give {recomputed} ({dict(self.state.samples)}): its records disagree; the samples '
          f'of a resume from it would not follow the stream')

  def commit(self, plan: StepPlan) -> None:
    """`plan` runs."""
    for key, n in plan.samples.items():
      self.state.samples[key] += n
    if plan.refresh is not None:
      self.bases_step = plan.step
    self.held = plan.live

  def next_change(self, step: int) -> int:
    """The first step after `step` whose plan may differ from `step`'s other than by its step
    number when no event comes: a basis refresh or an eval is due then (after `commit`)."""
    nxt = []
    first, _ = self.refreshes_from(step + 1)
    if first is not None:
      nxt.append(first)
    if self.run.eval_every:
      nxt.append(self.next_eval(step))
    return min(nxt, default=1 << 62)

  def refreshes_from(self, step: int) -> tuple[int | None, int]:
    """(first, every): the steps from `step` on, first, first + every, ..., whose plans run
    the basis refresh while no event comes (first None: none, no degraded work or no refresh)."""
    if not (self.run.refresh and self._degraded(self.assignment(self.live()))):
      return None, self.tau
    return (step if self._refresh_due(step) else self.bases_step + self.tau), self.tau

  def eval_due(self, step: int) -> bool:
    """An eval runs after `step` (train.eval_every)."""
    return bool(self.run.eval_every) and (step + 1) % self.run.eval_every == 0

  def next_eval(self, step: int) -> int:
    """The first step after `step` that an eval follows (train.eval_every > 0)."""
    return step + 1 + (-(step + 2) % self.run.eval_every)

  def _refresh_due(self, step: int) -> bool:
    return self.bases_step < 0 or step - self.bases_step >= self.tau

  def _warm(self) -> bool:
    return self.run.refresh == 'warm' and self.bases_step >= 0

  @staticmethod
  def _degraded(a: Assignment) -> bool:
    return any(r.degraded for r in a.roles.values())

  # --- programs ahead of need ----------------------------------------------------------------
  def programs_for(self, live: tuple[int, ...]) -> list[ProgramKey]:
    """Every program steps on `live` request: the step's, the basis refreshes, the eval (listed
    once per live set between events)."""
    refreshed = self.bases_step >= 0
    found = self._listed.get((live, refreshed))
    if found is None:
      need = programs.Need(live, self.assignment(live).roles, self.run, refreshed)
      found = self._listed[live, refreshed] = tuple(programs.programs_for(need))
    return list(found)

  def next_live_sets(self, hosts: list[tuple[int, ...]] | None = None
                     ) -> Iterator[tuple[int, ...]]:
    """The live sets one event away among the present slices, likeliest first, listed as
    taken; with `hosts` (the slices of each host), the survivors of each host's death instead."""
    live = self.live()
    if hosts:
      return (s for s in (tuple(x for x in live if x not in h) for h in hosts) if s)
    sets = programs.next_live_sets(live, self.n_slices, self.down_longest_first())
    if len(self.present) == self.n_slices:
      return sets
    present = set(self.present)
    return (s for s in sets if present.issuperset(s))
