"""Snapshots in a run: open the tiers (checked before any file of the run is touched), restore."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import jax
from etils import epath

from mecefo_jax import multihost
from mecefo_jax.config import Config, ConfigError
from mecefo_jax.model.train_state import abstract_state, state_shardings
from mecefo_jax.snapshot.interval import Interval
from mecefo_jax.snapshot.host import HostSnapshots
from mecefo_jax.snapshot.capacity import SnapshotError, check_writable
from mecefo_jax.snapshot.manager import SnapshotManager

log = logging.getLogger('mecefo')


def remove_tree(directory: str) -> None:
  """Deletes a durable tier's directory: a local one, or one in a bucket (gs://...)."""
  if '://' not in directory:
    shutil.rmtree(directory, ignore_errors=True)
    return
  path = epath.Path(directory)
  try:
    if path.exists():
      path.rmtree()
  except Exception as err:  # noqa: BLE001 -- a bucket we cannot reach: say so, do not fail
    log.warning('could not remove the durable checkpoints in %s: %s', directory, err)


def _make_parent(tier_dir: Path, *, given: bool, key: str) -> None:
  """Creates the directory that holds a tier's run-id directory. Defaults are made with their
  parents; a directory the user gave must have an existing, writable parent (one-line error)."""
  if not given:
    tier_dir.parent.mkdir(parents=True, exist_ok=True)
  elif not tier_dir.parent.exists():
    check_writable(tier_dir.parent, key)
    tier_dir.parent.mkdir(exist_ok=True)  # another process of the job may make it first


def open_manager(cfg: Config, memory_dir: Path, durable_dir: str, state_bytes: int,
                 slots=None) -> SnapshotManager | HostSnapshots | None:
  """The snapshot tiers in `memory_dir` and `durable_dir` (capacity checked now), or None with
  --no-snapshots. `slots`: multi-process, the logical host of each process (HostSnapshots)."""
  sn = cfg.snapshot
  if not sn.enabled:
    return None
  try:
    _make_parent(memory_dir, given=bool(sn.dir), key='snapshot.dir')
    if sn.durable_every and '://' not in durable_dir:  # buckets: Orbax creates what it needs
      _make_parent(Path(durable_dir), given=bool(sn.durable_dir), key='snapshot.durable_dir')
    every = Interval.of(sn.every, sn.overhead_budget, sn.max_every)
    if multihost.is_multiprocess():
      return HostSnapshots(memory_dir, cfg, every, slots=slots, durable_dir=durable_dir)
    return SnapshotManager(memory_dir, every=every, keep=sn.keep, durable_dir=durable_dir,
                           durable_every=sn.durable_every, durable_keep=sn.durable_keep,
                           state_bytes=state_bytes)
  except SnapshotError as err:
    raise ConfigError(str(err)) from None  # it names the key to set


def restore(manager: SnapshotManager | HostSnapshots, cfg: Config, mesh,
            at_most: int | None = None):
  """(step, state on the full mesh, meta, where) from the newest usable snapshot of any tier
  (`at_most`: of a step <= it, the newer ones taken out of the run), else None."""
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_state(cfg), state_shardings(cfg, mesh))
  return manager.restore_latest(target, at_most)
