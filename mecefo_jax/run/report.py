"""report.json of a run: its keys filled in by their owners, as report_schema.Report declares them."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from mecefo_jax import multihost
from mecefo_jax.config import to_dict
from mecefo_jax.core.failures import AppliedEvent
from mecefo_jax.core.goodput import Seconds
from mecefo_jax.model import train_state
from mecefo_jax.run import ending
from mecefo_jax.run.hooks import RunEnd
from mecefo_jax.run.report_schema import SCHEMA_VERSION, Report
from mecefo_jax.sections import Draft
from mecefo_jax.snapshot import image, manager
from mecefo_jax.step import program_store


def param_count(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def build(run, end: RunEnd) -> dict:
  """The report of Trainer `run` whose loop ended as `end`: the keys of the run and of the
  controller here, the hooks' from the hooks (each hook's `report`)."""
  c, cfg, r = run.controller, run.cfg, Draft(Report)
  r.schema_version, r.steps, r.wall_s = SCHEMA_VERSION, end.steps_done, end.wall_s
  r.stopped = end.stopped
  r.compile_s, r.startup = run.startup.compile_s, run.startup.report()
  r.recovery = run.recovery
  r.params_sha256, r.param_count = params_sha256(run), param_count(run.state.params)
  r.entropy_floor, r.config = run.corpus.entropy_floor(), to_dict(cfg)
  r.mesh, r.device = dict(run.presence.mesh.shape), jax.devices()[0].device_kind
  r.compute_dtype, r.step_memory = run.files.compute_dtype, c.step_memory
  r.takeover, r.failures = cfg.faults.takeover, cfg.faults.failures
  r.failure_events = [AppliedEvent(**e) for e in c.events]
  r.failures_note = ending.no_failure_note(cfg, run.presence.n_slices, end.steps_done, c.events)
  r.scheduled_events = list(run.schedule.all_events())
  r.trace_nodes_by_slice = run.schedule.trace_nodes
  r.samples, r.goodput, r.live_slices_at_end = dict(c.samples), Seconds(**c.goodput), list(c.live())
  r.resumed_from_step, r.steps_lost = run.origin.resumed_from, run.origin.steps_lost
  r.rollback, r.changed_on_resume = run.origin.rollback, run.files.changed
  r.steps_lost_total = run.records.steps_lost_total()
  r.precompile, r.programs, r.plans = c.programs_report(*_other_compiles(run))
  run.hooks.report(end, r)
  return dataclasses.asdict(r.build())


def _other_compiles(run) -> tuple[int, float]:
  """The XLA compiles of this process outside the booked programs (eager ops, conversions), and
  their seconds."""
  now, then = program_store.compile_counts(), run.startup.compiles_at_start
  return now['other'] - then['other'], round(now['other_s'] - then['other_s'], 3)


def describe(run) -> str:
  """The start line: model, mesh, batch, failures, snapshots, the state's and first programs'
  build (compile_s) and its phases."""
  n, f, mesh = param_count(run.state.params), run.cfg.faults, run.presence.mesh
  return (f'model {n / 1e6:.2f}M params | mesh {dict(mesh.shape)} on {jax.device_count()} '
          f'{jax.devices()[0].platform} device(s), compute {run.files.compute_dtype} | '
          f'global batch {run.presence.n_slices}x{run.cfg.train.micro_batch}x'
          f'{run.cfg.model.seq_len} tokens | failures {f.failures}, takeover {f.takeover} | '
          f'snapshots {"on" if run.snapshots else "off"} | {run.startup.describe()}')


def dry_run_info(run) -> dict:
  """What --dry-run prints: sizes, mesh, the compiled fault-free step's memory (per device)."""
  return {'param_count': param_count(run.state.params), 'mesh': dict(run.presence.mesh.shape),
          'devices': f'{jax.device_count()} x {jax.devices()[0].device_kind}',
          'global_batch': [run.presence.n_slices, run.cfg.train.micro_batch,
                           run.cfg.model.seq_len],
          'compute_dtype': run.files.compute_dtype, 'state_bytes': manager.state_nbytes(run.state),
          'compile_s': round(run.startup.compile_s, 2),
          'startup': dataclasses.asdict(run.startup.report()),
          'step_memory_bytes': run.controller.step_memory, 'data': run.corpus.describe()}


def params_sha256(run) -> str:
  """Of the live replicas' params (multi-process: hashed where a replica is, sent to all)."""
  if not multihost.is_multiprocess():
    return train_state.params_sha256(run.state.params)
  source = multihost.first_process(run.controller.state_mesh)
  digest = None
  if jax.process_index() == source:
    params = run.state.params
    leaves = image.local_replica(params)
    digest = train_state.params_sha256(jax.tree.unflatten(jax.tree.structure(params), leaves))
  return multihost.broadcast_bytes(digest and digest.encode(), source).decode()
