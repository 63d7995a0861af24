"""The hooks of a start, in their order: the one place the loop's after-step work is listed."""
from __future__ import annotations

import functools
from typing import Callable, Sequence

from mecefo_jax.run import hints
from mecefo_jax.run.evaluation import Evals
from mecefo_jax.run.hooks import Divergence, Hook, Hooks, ProgressMark
from mecefo_jax.run.metric_rows import MetricRows
from mecefo_jax.run.parts import RunParts
from mecefo_jax.run.saving import SnapshotSaver, Stop, stopping


def ordered(parts: RunParts, progress: str, on_log: Callable[[dict], None] | None,
            extra: Sequence[Hook] = ()) -> tuple[Hooks, SnapshotSaver]:
  """(The hooks of the start of `parts`, its snapshot hook), each carrying over what the restored
  snapshot held. The order: the progress mark (its marks bracket the others' phases),
  divergence (no snapshot holds a diverged state), the eval and the rows made before the
  snapshot (its meta holds them), the snapshot before the rows are written (a crash after a
  row costs at most that step; one between the two loses no row: the next start writes
  them), the user's `extra` hooks, the stop last (voted on once the step is saved)."""
  cfg, c, meta = parts.cfg, parts.controller, parts.origin.meta
  resume_hint = hints.resume(parts.out_dir, parts.presence.n_hosts)
  rows = MetricRows(cfg, parts.out_dir, parts.origin.step, parts.presence.n_slices,
                    tokens=c.tokens_trained, samples=c.stream_position,
                    losses=meta.losses if meta else [],
                    carried=meta.rows if meta else (), mode=progress, on_log=on_log,
                    enabled=parts.files.is_chief, guard=parts.outputs)
  evals = Evals(c, cfg.train.eval_batches, cfg.train.steps - 1, has_eval=parts.corpus.has_eval,
                stopping=functools.partial(stopping, parts.stop), emit=rows.emit,
                evals=list(meta.evals) if meta else [])
  saver = SnapshotSaver(parts.snapshots, c, rows, evals, parts.records, resume_hint,
                        cfg.snapshot.keep_when_finished)
  stop = Stop(parts.stop, saver, parts.records, resume_hint)
  divergence = Divergence(parts.origin, saver, parts.files, parts.records, cfg.optimizer.lr,
                          parts.presence.n_hosts)
  hooks = [ProgressMark(), divergence, evals, rows.maker, saver, rows, *extra, stop]
  return Hooks(hooks), saver
