"""What every snapshot carries besides the state: the decider's state, losses, steps, evals."""
from __future__ import annotations

import dataclasses

from mecefo_jax import files, sections
from mecefo_jax.core.decider import DeciderMeta
from mecefo_jax.records.metrics import LOSS, Eval, EvalRow, TrainRow
from mecefo_jax.sections import entry


@dataclasses.dataclass(frozen=True)
class SnapshotMeta:
  """A snapshot's meta: what a resume carries over besides the state (the run's history up to
  the snapshot's step)."""
  controller: DeciderMeta = entry('', "the decider's state: slices down, events, goodput, samples")
  losses: list[tuple[int, float | None]] = entry(LOSS, '[step, training loss] of every logged '
                                                 'step so far')
  reached: int = entry('steps', 'steps done when it was saved')
  evals: list[Eval] = entry('', 'every eval so far, oldest first')
  # Rows are written after the snapshot of their step (a crash after a row costs at most that
  # step), so a crash between the two would lose them: a start writes those metrics.jsonl lacks.
  train_row: TrainRow | None = entry('', "the train row of its last step, where it has one",
                                     optional=True)
  eval_row: EvalRow | None = entry('', "the eval row of its last step, where it has one",
                                   optional=True)

  @property
  def rows(self) -> list[TrainRow | EvalRow]:
    """Its last step's metrics rows in the order they are written."""
    return [row for row in (self.train_row, self.eval_row) if row is not None]


def from_saved(value: dict) -> SnapshotMeta:
  """The meta a tier restored (JSON) as its record; one that does not read as it (written by
  other code) is a ValueError naming what is wrong."""
  wrong = files.problem(SnapshotMeta, value, "the snapshot's meta")
  if wrong:
    raise ValueError(wrong)
  return sections.from_json(SnapshotMeta, value)
