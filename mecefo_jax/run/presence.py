"""Which of a run's slices this start has devices for: their mesh and logical ids.

A run's slice count N (and, with several processes, its host count H) is fixed when the run is
made and recorded in run_state.json. A later start may hold fewer: one process with fewer
devices (the first slices are present), or a job restarted with the surviving processes only,
each naming the logical host it is (`--host-slot`, default its process id). Host h holds slices
h*N/H .. (h+1)*N/H - 1, whichever process it is, so its in-memory snapshot part stays valid.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh

from mecefo_jax import files, multihost, sections, sharding
from mecefo_jax.config import Config, ConfigError
from mecefo_jax.records.run_state import RunState, read_run_state
from mecefo_jax.run import hints

log = logging.getLogger('mecefo')


@dataclasses.dataclass(frozen=True)
class Presence:
  mesh: jax.sharding.Mesh  # the present slices' devices, rows in logical order
  n_slices: int  # the run's N
  ids: tuple[int, ...]  # logical id of each mesh row
  slots: tuple[int, ...] = (0,)  # logical host of each process (by process id)
  n_hosts: int = 1  # the run's H

  def host_slices(self) -> list[tuple[int, ...]]:
    """The logical slices of each host of this job, by logical host."""
    per_host = self.n_slices // self.n_hosts
    return [tuple(range(h * per_host, (h + 1) * per_host)) for h in sorted(self.slots)]


def find(cfg: Config, out_dir: Path, resume: bool, host_slot: int | None = None) -> Presence:
  """The present slices of this start (recorded N and H when resuming, else this job's)."""
  recorded = (_recorded(out_dir) if resume else None) or RunState('', '')
  if multihost.is_multiprocess():
    return _job(cfg, recorded, host_slot)
  if (recorded.n_hosts or 1) > 1:
    raise ConfigError(f'the run in {str(out_dir)!r} was trained by {recorded.n_hosts} '
                      f'processes, whose snapshot parts one process cannot read; resume it with '
                      f'{hints.resume(out_dir, recorded.n_hosts)}')
  if host_slot not in (None, 0):
    raise ConfigError(f'--host-slot={host_slot} needs a multi-process run')
  n_slices = recorded.n_slices
  if not n_slices:
    mesh = sharding.make_mesh(cfg.mesh)
    _warn_idle(cfg, mesh)
    return Presence(mesh, mesh.shape['slice'], tuple(range(mesh.shape['slice'])))
  mesh = sharding.present_mesh(cfg.mesh, n_slices)
  present = mesh.shape['slice']
  if present < n_slices:
    log.warning("%d of the run's %d slices present: slices %s are absent from this start on, "
                'their micro-batches taken over (faults.takeover=%s)', present, n_slices,
                list(range(present, n_slices)), cfg.faults.takeover)
  return Presence(mesh, n_slices, tuple(range(present)))


def _warn_idle(cfg: Config, mesh: Mesh) -> None:
  """A new run whose mesh leaves devices of this process unused says so (they would idle)."""
  idle, in_slice = jax.device_count() - mesh.devices.size, cfg.mesh.fsdp * cfg.mesh.tensor
  if idle:
    log.warning('the mesh uses %d of the %d devices: %d idle (mesh.slice=%d x mesh.fsdp=%d '
                'x mesh.tensor=%d); mesh.slice=%d would use them all', mesh.devices.size,
                jax.device_count(), idle, mesh.shape['slice'], cfg.mesh.fsdp, cfg.mesh.tensor,
                jax.device_count() // in_slice)


def _recorded(out_dir: Path) -> RunState | None:
  """run_state.json as process 0 reads it (the run directory may be its alone)."""
  state = read_run_state(out_dir) if jax.process_index() == 0 else None
  if multihost.is_multiprocess():
    text = multihost.broadcast_bytes(files.json_text(state).encode(), 0)
    state = sections.from_json(RunState | None, json.loads(text))
  return state


def _job(cfg: Config, recorded: RunState, host_slot: int | None) -> Presence:
  n_hosts = recorded.n_hosts or jax.process_count()
  slots = host_slots(host_slot, n_hosts)
  if not recorded.n_slices:  # a new run: every process is its own host
    mesh = sharding.make_mesh(cfg.mesh)
    check_job(cfg, mesh)
    return Presence(mesh, mesh.shape['slice'], tuple(range(mesh.shape['slice'])), slots, n_hosts)
  n_slices, in_slice = recorded.n_slices, cfg.mesh.fsdp * cfg.mesh.tensor
  per_host = n_slices // n_hosts
  if n_slices % n_hosts or per_host * in_slice != jax.local_device_count():
    raise ConfigError(
        f'this run has {n_slices} slices of {in_slice} device(s) on {n_hosts} hosts, i.e. '
        f'{n_slices * in_slice // n_hosts} device(s) per process; this process has '
        f'{jax.local_device_count()}')
  by_slot = sorted(range(len(slots)), key=slots.__getitem__)
  devices = [d for p in by_slot for d in jax.devices() if d.process_index == p]
  mesh = Mesh(np.asarray(devices).reshape(len(slots) * per_host, cfg.mesh.fsdp, cfg.mesh.tensor),
              sharding.MESH_AXES, axis_types=(AxisType.Auto,) * 3)
  ids = tuple(slots[p] * per_host + j for p in by_slot for j in range(per_host))
  if len(slots) < n_hosts:
    absent = sorted(set(range(n_hosts)) - set(slots))
    log.warning("%d of the run's %d hosts present (absent: %s): slices %s are taken over "
                '(faults.takeover=%s)', len(slots), n_hosts, absent,
                sorted(set(range(n_slices)) - set(ids)), cfg.faults.takeover)
  return Presence(mesh, n_slices, ids, slots, n_hosts)


def check_job(cfg: Config, mesh: Mesh) -> None:
  """A new run of a multi-process job: every process holds the same number of whole slices,
  and every device of the job is used (one line naming the rule otherwise)."""
  processes, devices = jax.process_count(), jax.device_count()
  n = mesh.shape['slice']
  if n % processes or mesh.devices.size != devices:
    per_slice = cfg.mesh.fsdp * cfg.mesh.tensor
    raise ConfigError(
        f'mesh.slice={cfg.mesh.slice} on {processes} processes of {devices // processes} '
        f'device(s): every process of a job holds the same number of whole slices, so mesh.slice '
        f'x mesh.fsdp x mesh.tensor must be the job\'s {devices} devices and mesh.slice a '
        f'multiple of {processes} (e.g. mesh.slice={devices // per_slice})')


def host_slots(host_slot: int | None, n_hosts: int) -> tuple[int, ...]:
  """Each process's logical host (index: process id), gathered from every process's
  --host-slot and checked: distinct and in [0, n_hosts)."""
  if host_slot is None and jax.process_count() != n_hosts:
    raise ConfigError(f'this run has {n_hosts} hosts and this job {jax.process_count()} '
                      f'processes: give each process the logical host it is (--host-slot, '
                      f'0..{n_hosts - 1}; the supervisor mecefo_jax.launch does)')
  mine = jax.process_index() if host_slot is None else host_slot
  table = multihost_utils.process_allgather(np.array([mine], np.int64))
  slots = tuple(int(x) for x in np.asarray(table).ravel())
  if len(set(slots)) < len(slots) or not all(0 <= s < n_hosts for s in slots):
    raise ConfigError(f'--host-slot: the processes claim hosts {list(slots)} (by process id); '
                      f'each of the run\'s hosts 0..{n_hosts - 1} may be claimed at most once')
  return slots
