"""report.json of a run: its keys filled in by their owners, as report_schema.Report declares them."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from mecefo_jax import files, multihost
from mecefo_jax.config import end_setting, to_dict
from mecefo_jax.core.failures import AppliedEvent
from mecefo_jax.core.goodput import Seconds
from mecefo_jax.model import train_state
from mecefo_jax.records.history import Kind, Recovery
from mecefo_jax.records.run_state import RUN_STATE
from mecefo_jax.run import ending, plot, rundir
from mecefo_jax.run.hooks import Hooks, RunEnd
from mecefo_jax.run.metrics import to_json
from mecefo_jax.run.parts import RunParts
from mecefo_jax.run.report_schema import SCHEMA_VERSION, Report
from mecefo_jax.run.startup import StartupClock
from mecefo_jax.sections import Draft
from mecefo_jax.snapshot import image, manager
from mecefo_jax.step import program_store


def param_count(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def build(parts: RunParts, hooks: Hooks, recovery: Recovery | None, end: RunEnd) -> Report:
  """The report of the start of `parts` whose loop ended as `end`: the keys of the run and of
  the controller here, the hooks' from the `hooks` (each hook's `report`); `recovery`: the
  restart's breakdown, if this start is one."""
  p, c, cfg, r = parts, parts.controller, parts.cfg, Draft(Report)
  r.schema_version, r.steps, r.wall_s = SCHEMA_VERSION, end.steps_done, end.wall_s
  r.stopped = end.stopped
  r.compile_s, r.startup = p.startup.compile_s, p.startup.report()
  r.recovery = recovery
  r.params_sha256, r.param_count = params_sha256(c), param_count(c.state.params)
  r.entropy_floor, r.config = p.corpus.entropy_floor(), to_dict(cfg)
  r.mesh, r.device = dict(p.presence.mesh.shape), jax.devices()[0].device_kind
  r.compute_dtype, r.step_memory = p.files.compute_dtype, c.step_memory
  r.takeover, r.failures = cfg.faults.takeover, cfg.faults.failures
  r.failure_events = [AppliedEvent(**e) for e in c.events]
  r.failures_note = ending.no_failure_note(cfg, p.presence.n_slices, end.steps_done, c.events)
  r.scheduled_events = list(p.schedule.all_events())
  r.trace_nodes_by_slice = p.schedule.trace_nodes
  r.samples, r.goodput, r.live_slices_at_end = dict(c.samples), Seconds(**c.goodput), list(c.live())
  r.resumed_from_step, r.steps_lost = p.origin.resumed_from, p.origin.steps_lost
  r.rollback, r.changed_on_resume = p.origin.rollback, p.files.changed
  r.steps_lost_total = p.records.steps_lost_total()
  r.precompile, r.programs, r.plans = c.programs_report(*_other_compiles(p.startup))
  hooks.report(end, r)
  return r.build()


def write_ending(parts: RunParts, report: Report) -> None:
  """The run's files at the end of its loop: report.json, the end line of history.jsonl,
  run_state.json, the plot."""
  p, stopped = parts, report.stopped
  status = 'stopped' if stopped else 'finished'
  if p.files.is_chief:
    p.outputs.attempt(p.out_dir / rundir.REPORT, files.replace_text, p.out_dir / rundir.REPORT,
                      to_json(dataclasses.asdict(report), indent=2))
  p.records.history(Kind.END, status=status, step=report.steps, why=stopped or
                    f'trained {end_setting(p.cfg)[0]}')
  # run_state.json tells the truth on a full disk too: written in place if need be.
  p.outputs.attempt(p.out_dir / RUN_STATE, p.files.write_state, status)
  if p.cfg.train.plot and p.files.is_chief and p.outputs.error is None:
    plot.plot_or_warn(p.out_dir)


def _other_compiles(startup: StartupClock) -> tuple[int, float]:
  """The XLA compiles of this process outside the booked programs (eager ops, conversions), and
  their seconds."""
  now, then = program_store.compile_counts(), startup.compiles_at_start
  return now['other'] - then['other'], round(now['other_s'] - then['other_s'], 3)


def describe(parts: RunParts) -> str:
  """The start line: model, mesh, batch, failures, snapshots, the state's and first programs'
  build (compile_s) and its phases."""
  p, n, f = parts, param_count(parts.controller.state.params), parts.cfg.faults
  return (f'model {n / 1e6:.2f}M params | mesh {dict(p.presence.mesh.shape)} on '
          f'{jax.device_count()} {jax.devices()[0].platform} device(s), compute '
          f'{p.files.compute_dtype} | global batch {p.presence.n_slices}x'
          f'{p.cfg.train.micro_batch}x{p.cfg.model.seq_len} tokens | failures {f.failures}, '
          f'takeover {f.takeover} | snapshots {"on" if p.snapshots else "off"} | '
          f'{p.startup.describe()}')


def dry_run_info(parts: RunParts) -> dict:
  """What --dry-run prints: sizes, mesh, the compiled fault-free step's memory (per device)."""
  p, state = parts, parts.controller.state
  return {'param_count': param_count(state.params), 'mesh': dict(p.presence.mesh.shape),
          'devices': f'{jax.device_count()} x {jax.devices()[0].device_kind}',
          'global_batch': [p.presence.n_slices, p.cfg.train.micro_batch, p.cfg.model.seq_len],
          'compute_dtype': p.files.compute_dtype, 'state_bytes': manager.state_nbytes(state),
          'compile_s': round(p.startup.compile_s, 2),
          'startup': dataclasses.asdict(p.startup.report()),
          'step_memory_bytes': p.controller.step_memory, 'data': p.corpus.describe()}


def params_sha256(controller) -> str:
  """Of the live replicas' params (multi-process: hashed where a replica is, sent to all)."""
  if not multihost.is_multiprocess():
    return train_state.params_sha256(controller.state.params)
  source = multihost.first_process(controller.state_mesh)
  digest = None
  if jax.process_index() == source:
    params = controller.state.params
    leaves = image.local_replica(params)
    digest = train_state.params_sha256(jax.tree.unflatten(jax.tree.structure(params), leaves))
  return multihost.broadcast_bytes(digest and digest.encode(), source).decode()
