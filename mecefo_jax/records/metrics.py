"""metrics.jsonl's rows (TrainRow, EvalRow) and the held-out Eval they share with report.json and
the snapshot meta."""
from __future__ import annotations

import dataclasses
from typing import Literal

from mecefo_jax.sections import entry

LOSS = 'nats/token'
WRITTEN = ("Unix time the row was written (rows of runs before report schema 8 lack it; "
           "`training.png`'s wall-time axis counts a supervised restart's gap from it)")


@dataclasses.dataclass(frozen=True)
class Eval:
  """One held-out eval (report.json's and the snapshot meta's `evals`, an eval row's first keys)."""
  step: int = entry('step', 'last training step before the eval (the eval sees the params '
                    'after it)')
  loss: float | None = entry(LOSS, 'mean held-out loss over `train.eval_batches` batches of '
                             'live slices × `train.micro_batch` sequences (sample ids disjoint '
                             'from training); null if not finite (diverged)')
  perplexity: float | None = entry('', 'exp(loss); null if not finite')


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainRow:
  """A train row: every train.log_every steps and after the last (a stopped run's last too)."""
  kind: Literal['train'] = entry('', 'row kind', default='train')
  step: int = entry('step', 'the step (0-based)')
  degraded_tokens: float = entry('tokens', 'tokens processed by degraded passes in the step')
  exact_tokens: float = entry('tokens', 'tokens processed by normal (exact) passes in the step')
  grad_norm: float | None = entry('', 'global gradient norm before clipping; null if not finite')
  loss: float | None = entry(LOSS, 'training loss of the step (mean over the processed tokens); '
                             'null if not finite (diverged)')
  wall_s: float = entry('s', 'time since the start of the training loop of this process')
  live_slices: int = entry('slices', 'live slices after the step')
  tokens_per_s: float = entry('tokens/s', 'tokens trained since the previous train row / time '
                              'since it, eval time left out')
  first_sample: int | None = entry(
      'sample', '`requeue` only: the first sample id of the stream the step trained; its ids '
      'are the next (exact_tokens + degraded_tokens) / model.seq_len, slice by slice',
      optional=True)
  time: float | None = entry('s', WRITTEN, optional=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _EvalKind:
  """An eval row's first key (a dataclass's fields start with its last base's: `kind` precedes
  Eval's in EvalRow)."""
  kind: Literal['eval'] = entry('', 'row kind', default='eval')


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalRow(Eval, _EvalKind):
  """An eval row: an Eval as it ran, written after its step's train row."""
  eval_s: float = entry('s', 'time the eval took (its first run on a live set includes '
                        'compiling)')
  wall_s: float = entry('s', 'as in train rows')
  live_slices: int = entry('slices', 'slices the eval ran on')
  time: float | None = entry('s', 'as in train rows', optional=True)

  @property
  def eval(self) -> Eval:
    return Eval(self.step, self.loss, self.perplexity)
