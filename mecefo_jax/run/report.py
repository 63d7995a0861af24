"""report.json of a run: every key is documented in docs/report.md and checked by report_schema."""
from __future__ import annotations

import jax
import numpy as np

from mecefo_jax import multihost
from mecefo_jax.config import to_dict
from mecefo_jax.model import llama, train_state
from mecefo_jax.run.hooks import RunEnd
from mecefo_jax.run.report_schema import SCHEMA, SCHEMA_VERSION
from mecefo_jax.snapshot import image, store
from mecefo_jax.step import store as program_store


def param_count(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def build(run, end: RunEnd) -> dict:
  """The report of Trainer `run` whose loop ended as `end`: its sections from their owners
  (the hooks, the controller, the start-up clock), in docs/report.md's order."""
  c, cfg = run.controller, run.cfg
  owned = run.hooks.report(end)
  report = {
      'schema_version': SCHEMA_VERSION, 'steps': end.steps_done, 'wall_s': end.wall_s,
      'compile_s': run.startup.compile_s, 'params_sha256': params_sha256(run),
      'param_count': param_count(run.state.params), 'entropy_floor': run.corpus.entropy_floor(),
      'mesh': dict(run.presence.mesh.shape), 'device': jax.devices()[0].device_kind,
      'compute_dtype': run.files.compute_dtype, 'step_memory': c.step_memory,
      'takeover': cfg.faults.takeover, 'failures': cfg.faults.failures,
      'failure_events': c.events,
      'scheduled_events': [e.to_dict() for e in run.schedule.all_events()],
      'samples': dict(c.samples), 'goodput': c.goodput, 'stopped': end.stopped,
      'startup': run.startup.report(), 'resumed_from_step': run.origin.resumed_from,
      'steps_lost': run.origin.steps_lost, 'steps_lost_total': run.records.steps_lost_total(),
      'live_slices_at_end': list(c.live()), **_programs(run), 'config': to_dict(cfg), **owned}
  return {key: report[key] for key in SCHEMA.fields}


def _programs(run) -> dict:
  """The controller's `precompile` and `programs` sections; programs with the scan's unroll and
  the XLA compiles of this process outside the booked programs (eager ops, conversions)."""
  sections = run.controller.programs_report()
  now, then = program_store.compile_counts(), run.startup.compiles_at_start
  sections['programs'].update(scan_unroll=llama.SCAN_UNROLL,
                              other_compiles=now['other'] - then['other'],
                              other_compile_s=round(now['other_s'] - then['other_s'], 3))
  return sections


def describe(run) -> str:
  """The start line: model, mesh, batch, failures, snapshots, start-up times."""
  n, f, mesh = param_count(run.state.params), run.cfg.faults, run.presence.mesh
  return (f'model {n / 1e6:.2f}M params | mesh {dict(mesh.shape)} on {jax.device_count()} '
          f'{jax.devices()[0].platform} device(s), compute {run.files.compute_dtype} | '
          f'global batch {run.presence.n_slices}x{run.cfg.train.micro_batch}x'
          f'{run.cfg.model.seq_len} tokens | failures {f.failures}, takeover {f.takeover} | '
          f'snapshots {"on" if run.snapshots else "off"} | compile '
          f'{run.startup.compile_s:.1f}s | {run.startup.describe()}')


def dry_run_info(run) -> dict:
  """What --dry-run prints: sizes, mesh, the compiled fault-free step's memory (per device)."""
  return {'param_count': param_count(run.state.params), 'mesh': dict(run.presence.mesh.shape),
          'devices': f'{jax.device_count()} x {jax.devices()[0].device_kind}',
          'global_batch': [run.presence.n_slices, run.cfg.train.micro_batch,
                           run.cfg.model.seq_len],
          'compute_dtype': run.files.compute_dtype, 'state_bytes': store.state_nbytes(run.state),
          'compile_s': round(run.startup.compile_s, 2), 'startup': run.startup.report(),
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
