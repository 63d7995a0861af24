"""The hooks of a start, in their order: the one place the loop's after-step work is listed."""
from __future__ import annotations

from typing import Callable, Sequence

from mecefo_jax import sections
from mecefo_jax.records.history import Kind
from mecefo_jax.records.metrics import Eval
from mecefo_jax.run import hints
from mecefo_jax.run.evaluation import Evals
from mecefo_jax.run.hooks import Divergence, Hook, Hooks, ProgressMark
from mecefo_jax.run.metric_rows import MetricRows
from mecefo_jax.run.saving import SnapshotSaver, Stop


def ordered(run, progress: str, on_log: Callable[[dict], None] | None,
            extra: Sequence[Hook] = ()) -> tuple[Hooks, SnapshotSaver]:
  """(The hooks of Trainer `run`, its snapshot hook), each carrying over what the restored
  snapshot held. The order: the progress mark (its marks bracket the others' phases),
  divergence (no snapshot holds a diverged state), the eval before the snapshot (its result
  is in the snapshot's meta), the snapshot before the metrics row (a crash after a row costs
  at most that step), the user's `extra` hooks, the stop last (voted on once the step is
  saved)."""
  cfg, c, meta = run.cfg, run.controller, run.origin.meta or {}
  resume_hint = hints.resume(run.out_dir, run.presence.n_hosts)
  rows = MetricRows(cfg, run.out_dir, run.origin.step, run.presence.n_slices,
                    tokens=c.tokens_trained, eval_s=lambda: evals.seconds,
                    losses=meta.get('losses', []), mode=progress, on_log=on_log,
                    enabled=run.files.is_chief, guard=run.outputs)
  saver = SnapshotSaver(run.snapshots, lambda: c.state, lambda steps: {
      'controller': c.dump_meta(), 'losses': rows.losses, 'reached': steps,
      'evals': sections.to_json(evals.evals)}, run.records, resume_hint,
      cfg.snapshot.keep_when_finished)
  stop = Stop(run.stop, saver, run.records, resume_hint)
  evals = Evals(c, cfg.train.eval_batches, cfg.train.steps - 1, has_eval=run.corpus.has_eval,
                stopping=stop.stopping, emit=rows.emit,
                evals=[sections.from_json(Eval, e) for e in meta.get('evals', [])])
  divergence = Divergence(
      run.origin.step, lambda bound: saver.newest(bound, run.origin.resumed_from),
      lambda lr: (hints.rollback(run.out_dir, lr, run.presence.n_hosts), hints.fresh(run.out_dir)),
      cfg.optimizer.lr, lambda diverged: (run.files.diverged(diverged),
                                          run.records.history(Kind.DIVERGED, diverged=diverged)))
  hooks = [ProgressMark(), divergence, evals, saver, rows, *extra, stop]
  return Hooks(hooks), saver
