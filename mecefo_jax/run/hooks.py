"""The loop's hooks: one typed record per trained step, and small objects that act on it in order."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from pathlib import Path
from typing import Callable, Iterator, Sequence

from mecefo_jax.core.decider import StepPlan
from mecefo_jax.records import progress_marks
from mecefo_jax.records.history import Kind
from mecefo_jax.records.metrics import EvalRow, TrainRow
from mecefo_jax.records.run_state import Diverged
from mecefo_jax.run import hints
from mecefo_jax.sections import Draft

log = logging.getLogger('mecefo')
# A test's transient divergence (benchmarks/soak.py): while the file this names holds a step
# number, that step's training loss reads as NaN on every process (each reads it alike), before
# the step is saved anywhere; once the file is gone, a resume trains that step again, finite.
TEST_POISON_ENV = 'MECEFO_TEST_POISON'


@dataclasses.dataclass
class StepRecord:
  """One step as the loop ran it: the plan, the metrics (when fetched) and the rows to write."""
  step: int  # the step just run (0-based)
  plan: StepPlan  # what the decider planned for it: live slices, roles, programs, eval
  values: dict | None  # its metrics on the host (loss, grad_norm, lr, ...); None: not fetched
  loop_start: float  # time.perf_counter() when the loop started (rows' wall_s count from it)
  step_s: float = 0.0  # its wall until this record: dispatch, and the step itself if fetched
  built: tuple = ()  # the programs it waited for: ((ProgramKey, 'compiled'|'loaded'|'moved'),)
  stop_voted: bool = False  # the run stops after this step (several processes: as the job voted)
  last: bool = False  # the run's end is reached after it (train.steps or the sample budget)
  metrics: dict | None = None  # its metrics still on the devices (values: fetched to the host)
  train_row: TrainRow | None = None  # its train row (MetricRows'), where one is logged
  eval_row: EvalRow | None = None  # its held-out eval (Evals'), where one ran after it

  @property
  def rows(self) -> list[TrainRow | EvalRow]:
    """Its metrics rows in the order they are written: the train row, then the eval's."""
    return [row for row in (self.train_row, self.eval_row) if row is not None]

  @property
  def steps_done(self) -> int:
    return self.step + 1

  @property
  def live(self) -> tuple[int, ...]:
    return self.plan.live


@dataclasses.dataclass(frozen=True)
class RunEnd:
  """How the loop ended: the steps done, its wall time, why it stopped early (None: finished)."""
  steps_done: int
  wall_s: float
  stopped: str | None


@dataclasses.dataclass(frozen=True)
class StopRun:
  """A hook's decision to end the run: why, and the steps it counts as done."""
  message: str
  steps_done: int


class Hook:
  """One concern of the loop, with its own cadence and state; every method is optional.

  The loop calls `before_step(step)`, dispatches the step, calls `dispatched(step)`, waits for
  it where its metrics are fetched, then `after_step(record)` of every hook in order (a StopRun
  ends the run there), and `at_end(loop_start, stopped)` after the last step.
  `wants_values(step)`: the step's metrics must be fetched (it waits for the step)."""

  def before_step(self, step: int) -> None:
    pass

  def dispatched(self, step: int) -> None:
    pass

  def wants_values(self, step: int) -> bool:
    return False

  def after_step(self, record: StepRecord) -> StopRun | None:
    return None

  def at_end(self, loop_start: float, stopped: str | None) -> None:
    pass

  def opened(self) -> contextlib.AbstractContextManager:
    """What the hook holds open while the loop runs (files, a progress bar)."""
    return contextlib.nullcontext()

  def report(self, end: RunEnd, report: Draft) -> None:
    """Sets the report.json keys this hook owns on `report` (run/report_schema.Report)."""


class Every(Hook):
  """`fn(record)` after every `n`-th step (steps n-1, 2n-1, ...), its metrics fetched for it."""

  def __init__(self, n: int, fn: Callable[[StepRecord], None]):
    if n < 1:
      raise ValueError(f'Every(n) needs n >= 1, got {n}')
    self.n, self.fn = n, fn

  def wants_values(self, step: int) -> bool:
    return (step + 1) % self.n == 0

  def after_step(self, record: StepRecord) -> None:
    if self.wants_values(record.step):
      self.fn(record)


class ProgressMark(Hook):
  """Marks each step once dispatched, before the loop waits for it, where the supervisor reads
  it (records/progress_marks.py): a process stuck before that point is the one the others wait for."""

  def dispatched(self, step: int) -> None:
    progress_marks.dispatched(step)


def _poisoned(step: int) -> bool:
  """Whether TEST_POISON_ENV's file names `step`."""
  path = os.environ.get(TEST_POISON_ENV)
  try:
    return bool(path) and int(Path(path).read_text()) == step
  except (OSError, ValueError):  # no file (the usual case), or being replaced
    return False


class Divergence(Hook):
  """Ends the run at a non-finite training loss or gradient norm, before that step is saved
  anywhere; `diverged` then says where, and the last step seen finite (the rollback's bound).

  `origin`: this start (run/resume.Start: its first step, the snapshot it restored); `saver`:
  the snapshots this start saved (the rollback's target, `saver.newest`); `files`: the run's
  files (run_state.json records the divergence, run/run_files.RunFiles); `records`:
  history.jsonl; `lr` and `n_hosts`: the commands its line gives."""

  def __init__(self, origin, saver, files, records, lr: float, n_hosts: int = 1):
    self.origin, self.saver, self.files, self.records = origin, saver, files, records
    self.lr, self.n_hosts = lr, n_hosts
    self.last_finite = origin.step - 1  # the restored snapshot's step was seen finite before
    self.diverged: Diverged | None = None

  @property
  def diverged_at(self) -> int | None:
    return self.diverged and self.diverged.diverged_at_step

  def after_step(self, record: StepRecord) -> StopRun | None:
    values = record.values or {}
    if _poisoned(record.step):
      values = {**values, 'loss': math.nan}
    bad = [(k, values[k]) for k in ('loss', 'grad_norm')
           if values.get(k) is not None and not math.isfinite(values[k])]
    if not bad:
      self.last_finite = record.step if values else self.last_finite
      return None
    # The state after the last step seen finite is finite (its gradients were), but the loss
    # of its own next step was not seen: a rollback goes to a snapshot of a step <= it.
    target = (self.saver.newest(self.last_finite, self.origin.resumed_from)
              if self.last_finite >= 0 else None)
    self.diverged = Diverged(record.step, self.last_finite, target)
    self.files.diverged(self.diverged)
    self.records.history(Kind.DIVERGED, diverged=self.diverged)
    out_dir = self.files.out_dir
    rollback, fresh = hints.rollback(out_dir, self.lr, self.n_hosts), hints.fresh(out_dir)
    names = ' and '.join('gradient norm' if k == 'grad_norm' else k for k, _ in bad)
    head = (f'the training {names} {"is" if len(bad) == 1 else "are"} not finite '
            f'({", ".join(str(v) for _, v in bad)}) at step {record.step}: the run stopped '
            f'without saving that step')
    if target is None:
      message = (f'{head}, before any snapshot of a step seen finite, so there is nothing to go '
                 f'back to; start anew with a lower optimizer.lr or more '
                 f'optimizer.warmup_steps ({fresh})')
    else:
      message = (f'{head}; the newest snapshot before it is of step {target} (the last step '
                 f'seen finite: {self.last_finite}): go back to it with a lower learning rate, '
                 f'{rollback}, or start anew ({fresh})')
    log.error('%s', message)
    return StopRun(message, record.step)

  def report(self, end: RunEnd, report: Draft) -> None:
    report.diverged_at_step = self.diverged_at


class Hooks:
  """The loop's hooks in their order: progress mark, divergence, eval, snapshot, metrics, the
  user's, stop — no snapshot holds a diverged state, an eval's result is in the next
  snapshot's meta, and the stop is voted on once the step is saved."""

  def __init__(self, ordered: Sequence[Hook]):
    self.ordered = tuple(ordered)

  def __iter__(self) -> Iterator[Hook]:
    return iter(self.ordered)

  def before_step(self, step: int) -> None:
    for hook in self.ordered:
      hook.before_step(step)

  def dispatched(self, step: int) -> None:
    for hook in self.ordered:
      hook.dispatched(step)

  def wants_values(self, step: int) -> bool:
    return any(hook.wants_values(step) for hook in self.ordered)

  def after_step(self, record: StepRecord) -> StopRun | None:
    for hook in self.ordered:
      stop = hook.after_step(record)
      if stop is not None:
        return stop
    return None

  def at_end(self, loop_start: float, stopped: str | None) -> None:
    for hook in self.ordered:
      hook.at_end(loop_start, stopped)

  def report(self, end: RunEnd, report: Draft) -> None:
    """Every hook's report.json keys."""
    for hook in self.ordered:
      hook.report(end, report)

  @contextlib.contextmanager
  def opened(self):
    with contextlib.ExitStack() as stack:
      for hook in self.ordered:
        stack.enter_context(hook.opened())
      yield self
