"""report.json of a run: the sections from their owners, as report_schema.Report declares them."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from mecefo_jax import multihost
from mecefo_jax.config import to_dict
from mecefo_jax.core.failures import AppliedEvent
from mecefo_jax.model import train_state
from mecefo_jax.run.evaluation import Eval
from mecefo_jax.run.report_schema import SCHEMA_VERSION, Report, Throughput
from mecefo_jax.snapshot import image, store
from mecefo_jax.snapshot.interval import SnapshotInterval
from mecefo_jax.snapshot.store import Snapshots
from mecefo_jax.step import store as program_store


def param_count(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def build(run, steps_done: int, wall_s: float, stopped: str | None, tensorboard: bool) -> dict:
  """The report of Trainer `run` after `steps_done` steps in `wall_s` seconds."""
  c, cfg = run.controller, run.cfg
  losses = run.losses
  evals = [Eval(**e) for e in run.evals]
  final_eval = evals[-1] if evals and not stopped else None
  throughput = _throughput(run, steps_done, wall_s)
  precompile, programs, plans = c.programs_report(*_other_compiles(run))
  return dataclasses.asdict(Report(
      schema_version=SCHEMA_VERSION,
      steps=steps_done, first_loss=losses[0][1] if losses else None,
      final_loss=losses[-1][1] if losses else None, tokens=run.tokens_trained(),
      wall_s=wall_s, tokens_per_s=throughput.tokens_per_s, compile_s=run.compile_s,
      throughput=throughput,
      eval_loss=final_eval and final_eval.loss,
      eval_perplexity=final_eval and final_eval.perplexity, evals=evals,
      params_sha256=params_sha256(run),
      param_count=param_count(run.state.params), entropy_floor=run.corpus.entropy_floor(),
      losses=losses, mesh=dict(run.mesh.shape), device=jax.devices()[0].device_kind,
      compute_dtype=run.compute_dtype,
      step_memory=run.memory, takeover=cfg.faults.takeover,
      failures=cfg.faults.failures, failure_events=[AppliedEvent(**e) for e in c.events],
      scheduled_events=list(run.schedule.all_events()),
      samples=dict(c.samples), goodput=c.ledger.report(), stopped=stopped,
      preempted=run.stop_reason is not None, diverged_at_step=run.diverged_at,
      startup=run.startup.report(),
      resumed_from_step=run.resumed_from, steps_lost=run.steps_lost,
      steps_lost_total=run.records.steps_lost_total(),
      live_slices_at_end=list(c.live()),
      snapshots=run.snapshots.report() if run.snapshots else Snapshots(),
      snapshot_interval=_interval(run),
      precompile=precompile, programs=programs, plans=plans,
      tensorboard_dir=str(run.out_dir / 'tb') if tensorboard else None,
      config=to_dict(cfg)))


def _other_compiles(run) -> tuple[int, float]:
  """The XLA compiles of this process outside the booked programs (eager ops, conversions), and
  their seconds."""
  now, then = program_store.compile_counts(), run.compiles_at_start
  return now['other'] - then['other'], round(now['other_s'] - then['other_s'], 3)


def dry_run_info(run) -> dict:
  """What --dry-run prints: sizes, mesh, the compiled fault-free step's memory (per device)."""
  return {'param_count': param_count(run.state.params), 'mesh': dict(run.mesh.shape),
          'devices': f'{jax.device_count()} x {jax.devices()[0].device_kind}',
          'global_batch': [run.n_slices, run.cfg.train.micro_batch, run.cfg.model.seq_len],
          'compute_dtype': run.compute_dtype, 'state_bytes': store.state_nbytes(run.state),
          'compile_s': round(run.compile_s, 2),
          'startup': dataclasses.asdict(run.startup.report()),
          'step_memory_bytes': run.memory, 'data': run.corpus.describe()}


def _interval(run) -> SnapshotInterval:
  """How the in-memory snapshot interval was chosen (snapshot.every=auto) or set."""
  every = run.snapshots.every if run.snapshots else 0
  return run.tuner.report(every) if run.tuner else SnapshotInterval(every=every)


def _throughput(run, steps_done: int, wall_s: float) -> Throughput:
  """Rates of this process (a resumed run counts from its resume), eval time left out."""
  train_s = max(wall_s - run.eval_s, 1e-9)
  tokens = run.tokens_trained() - run.tokens_at_start
  return Throughput(tokens_per_s=tokens / train_s,
                    steps_per_s=(steps_done - run.start_step) / train_s,
                    tokens_per_step=(run.n_slices * run.cfg.train.micro_batch *
                                     run.cfg.model.seq_len),
                    train_s=train_s, eval_s=run.eval_s)


def params_sha256(run) -> str:
  """Of the live replicas' params (multi-process: hashed where a replica is, sent to all)."""
  if not multihost.is_multiprocess():
    return train_state.params_sha256(run.state.params)
  c = run.controller
  source = multihost.first_process(c.submesh(c.state_slices))
  digest = None
  if jax.process_index() == source:
    params = run.state.params
    leaves = image.local_replica(params)
    digest = train_state.params_sha256(jax.tree.unflatten(jax.tree.structure(params), leaves))
  return multihost.broadcast_bytes(digest and digest.encode(), source).decode()
