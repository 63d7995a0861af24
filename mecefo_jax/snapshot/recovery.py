"""Snapshots in a run: open the tiers, save each step off the critical path, resume bit-exactly."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import jax

from mecefo_jax import multihost
from mecefo_jax.config import Config, ConfigError
from mecefo_jax.model.train_state import abstract_state, state_shardings
from mecefo_jax.snapshot.host import HostSnapshots
from mecefo_jax.snapshot.store import SnapshotError, SnapshotManager, default_snapshot_dir

log = logging.getLogger('mecefo')
RUN_STATE = 'run_state.json'


def run_name(out_dir: Path) -> str:
  """Stable per run directory, so a resumed trainer finds its tmpfs snapshots."""
  resolved = str(Path(out_dir).resolve())
  return f'{Path(resolved).name}-{hashlib.sha1(resolved.encode()).hexdigest()[:8]}'


def open_manager(cfg: Config, out_dir: Path, state_bytes: int) -> SnapshotManager | None:
  """The snapshot tiers of this run (capacity checked now), or None with --no-snapshots."""
  sn = cfg.snapshot
  if not sn.enabled:
    return None
  directory = Path(sn.dir) if sn.dir else default_snapshot_dir(run_name(out_dir))
  durable = sn.durable_dir or str(Path(out_dir).resolve() / 'checkpoints')
  try:
    if multihost.is_multiprocess():
      if sn.durable_every:
        log.warning('multi-process run: durable checkpoints are off (per-host in-memory '
                    'snapshots with parity only; see docs/tpu.md)')
      return HostSnapshots(directory, cfg, every=sn.every, keep=sn.keep)
    return SnapshotManager(directory, every=sn.every, keep=sn.keep, durable_dir=durable,
                           durable_every=sn.durable_every, durable_keep=sn.durable_keep,
                           state_bytes=state_bytes)
  except SnapshotError as err:
    raise ConfigError(f'{err} (set snapshot.dir=..., or --no-snapshots)') from None


def restore(manager: SnapshotManager | HostSnapshots, cfg: Config, mesh):
  """(step, state on the full mesh, meta) from the newest intact snapshot, else None."""
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_state(cfg), state_shardings(cfg, mesh))
  return manager.restore_latest(target)


def write_run_state(out_dir: Path, status: str, **extra) -> None:
  """`running` until the run ends; a `running` or `stopped` run is resumed automatically."""
  tmp = Path(out_dir) / (RUN_STATE + '.tmp')
  tmp.write_text(json.dumps({'status': status, **extra}))
  tmp.replace(Path(out_dir) / RUN_STATE)


def read_run_state(out_dir: Path) -> dict:
  """The run_state.json of `out_dir`, {} if there is none."""
  path = Path(out_dir) / RUN_STATE
  return json.loads(path.read_text()) if path.is_file() else {}


def unfinished(out_dir: Path) -> bool:
  return read_run_state(out_dir).get('status') in ('running', 'stopped')


def last_logged_step(out_dir: Path) -> int | None:
  """The last step a previous process logged to metrics.jsonl (to count steps lost in a crash)."""
  path = Path(out_dir) / 'metrics.jsonl'
  if not path.is_file():
    return None
  last = None
  for line in path.read_text().splitlines():
    try:
      last = json.loads(line)['step']
    except (ValueError, KeyError):
      continue  # a line cut by the crash
  return last
