"""REFT-style snapshots: async Orbax saves to tmpfs with checksum manifests, plus a durable tier."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from mecefo_jax import sharding
from mecefo_jax.files import default_snapshot_dir  # noqa: F401 -- its home for the run layer
from mecefo_jax.config import check_setting
from mecefo_jax.sections import entry
from mecefo_jax.snapshot import image
from mecefo_jax.snapshot.capacity import SnapshotError, check_capacity
from mecefo_jax.snapshot.durable import DurableGuard
from mecefo_jax.snapshot.interval import Interval
from mecefo_jax.snapshot.tier import PerBlockLayout, Tier, _on_cpu, private_copy

log = logging.getLogger(__name__)

@dataclasses.dataclass
class Snapshots:
  """report.json's `snapshots` section (the defaults: a run without snapshots)."""
  enabled: bool = entry('', 'snapshot.enabled (false with --no-snapshots)', default=False)
  dir: str | None = entry('', 'in-memory tier directory (tmpfs); null when disabled', default=None)
  every: int = entry('steps', 'snapshot.every; 0 when disabled', default=0)
  saved: int = entry('', 'in-memory snapshots written by this process', default=0)
  skipped: int = entry('', 'in-memory snapshots skipped on a write error (e.g. tmpfs full), with a '
                       'warning each; training went on', default=0)
  retained_steps: list[int] = entry('steps', "in-memory snapshots left on disk (this host's part): "
                                    'none where a finished run frees that tier', factory=list)
  durable_dir: str | None = entry('', 'durable checkpoint directory; null if none', default=None)
  durable_every: int = entry('steps', 'snapshot.durable_every; 0 if no durable tier', default=0)
  durable_saved: int = entry('', 'durable checkpoints written by this process', default=0)
  durable_failed: int = entry('', 'durable checkpoints that failed to save, with a line each; '
                              'training went on (3 in a row stop the run, exit 5)', default=0)
  durable_retained_steps: list[int] = entry('steps', 'durable checkpoints on disk at the end',
                                            factory=list)
  set_aside: list[str] = entry('', 'snapshots and checkpoints that failed their checks at this '
                               'start, moved aside, not deleted: where each now is '
                               '(docs/snapshots.md)', factory=list)


def tiers_report(memory: Tier, every: int, saved: int, skipped: int, durable: Tier | None,
                 durable_every: int, durable_saved: int, durable_failed: int) -> Snapshots:
  """The `snapshots` section of a manager with these tiers (`durable`: None without one).
  `durable_saved`: the durable saves started, of which the `durable_failed` are not written."""
  section = Snapshots(enabled=True, dir=str(memory.directory), every=every, saved=saved,
                      skipped=skipped, retained_steps=sorted(memory.steps()),
                      set_aside=[w for t in (memory, durable) if t for w in t.set_aside_where])
  if durable is None:
    return section
  return dataclasses.replace(section, durable_dir=str(durable.directory),
                             durable_every=durable_every,
                             durable_saved=durable_saved - durable_failed,
                             durable_failed=durable_failed,
                             durable_retained_steps=sorted(durable.steps()))


def memory_kept_when_finished(snapshots, keep_when_finished: bool) -> bool:
  """Whether a finished run keeps its in-memory tier (a manager's): asked to
  (snapshot.keep_when_finished), or its last durable save failed (that tier then holds the
  only copy of the end)."""
  guard = snapshots.durable
  return keep_when_finished or bool(guard and not guard.last_ok)


def rolled_back(step: int) -> str:
  """Why a snapshot newer than a rollback's (to `step`) is set aside."""
  return f'newer than step {step}, the step a resume of the diverged run went back to'


def state_nbytes(state: Any) -> int:
  """Logical (global, one replica) byte size of the leaves of `state`; works on abstract leaves."""
  return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
             for leaf in jax.tree.leaves(state))


# ---- the manager ----------------------------------------------------------------------------------

class SnapshotManager:
  """In-memory snapshots every `every` steps (keep `keep`), durable ones every `durable_every`."""

  def __init__(self, directory: str | os.PathLike, *, every: int | Interval = 1, keep: int = 2,
               durable_dir: str | os.PathLike | None = None, durable_every: int = 0,
               durable_keep: int = 3, min_free_factor: float = 1.1,
               state_bytes: int | None = None, copy_before_save: bool | None = None):
    """`state_bytes` checks capacity now, else at the first save. `copy_before_save`: None = only
    on CPU, where the 'host copy' Orbax takes may be a view of the device buffer (see maybe_save).
    `every`: steps between in-memory snapshots, or the run's Interval (snapshot.every=auto)."""
    self.interval = every if isinstance(every, Interval) else Interval(every)
    counts = dict(every=self.interval.every, keep=keep, durable_every=durable_every,
                  durable_keep=durable_keep)
    for name, value in counts.items():
      check_setting(f'snapshot.{name}', value, error=SnapshotError)
    if durable_every and durable_dir is None:
      raise SnapshotError(f'durable_every={durable_every} needs a durable_dir')
    self.keep = keep
    self.durable_every, self.durable_keep = durable_every, durable_keep
    self.min_free_factor = min_free_factor
    self.copy_before_save = copy_before_save
    durable_dir = durable_dir if durable_every else None
    self._check_dirs(Path(directory), durable_dir, state_bytes or 0)
    self._capacity_checked = state_bytes is not None
    self._memory = Tier('memory', directory, keep, compress=False, packed=True)
    self._durable = Tier('durable', durable_dir, durable_keep) if durable_dir else None
    self.durable = DurableGuard(self._durable) if self._durable else None
    # Saves started by this manager (in-memory ones that failed in the background taken off).
    self.started = dict.fromkeys(('memory', 'durable'), 0)
    self.skipped = 0  # in-memory snapshots lost to write errors
    self._memory_ok = True  # the last in-memory save was not skipped
    self._sources: tuple = (None, None)  # (slices' device ids, split_sources) of the last save
    self.per_block: list[str] = []  # in-memory snapshots of the per-block layout passed over
    self.discarded: list[str] = []  # snapshots newer than a rollback's, taken out of the run

  @property
  def tiers(self) -> list[Tier]:
    return [self._memory] + ([self._durable] if self._durable else [])

  @property
  def set_aside(self) -> list[str]:
    """Where the snapshots this start set aside are."""
    return [where for tier in self.tiers for where in tier.set_aside_where]

  def _check_dirs(self, directory: Path, durable_dir, state_bytes: int) -> None:
    check_capacity(directory, state_bytes, self.keep, factor=self.min_free_factor)
    if durable_dir is not None and '://' not in str(durable_dir):  # buckets: nothing to check
      check_capacity(Path(durable_dir), state_bytes, self.durable_keep,
                     factor=self.min_free_factor, key='snapshot.durable_dir')

  @property
  def every(self) -> int:
    return self.interval.every

  def due(self, step: int) -> bool:
    """Whether maybe_save(step, ...) will save anything (without force_durable)."""
    return self.interval.due(step) or bool(self._durable and step % self.durable_every == 0)

  def maybe_save(self, step: int, state: Any, meta: dict, *,
                 stop: bool = False) -> tuple[str, ...]:
    """Starts an async snapshot of `state` (replicated over its mesh's slices: one replica is
    saved) when `step` is due; returns the tiers it started ('memory', 'durable').

    `stop`: the run stops after this step: every tier saves it, due or not.

    Blocks only for a save still in flight and for the copy of `state` off the buffers that the
    next (donating) train step reuses. The in-memory tier packs `state` into its reused host
    image here (one copy; image.py) and writes it in a background thread.

    The durable tier saves an Orbax pytree. Orbax's save() does the device-to-host transfer
    synchronously (np.asarray of each shard) and writes in a background thread. On GPU/TPU that
    is a real host copy. On CPU the 'host copy' of a shard written whole is a zero-copy view of
    the device buffer; jax 0.10's CPU runtime then silently declines to donate that buffer, so
    the data stays right but the donation is lost, and nothing promises either. So on CPU we
    first take a private device copy (device_put with may_alias=False) that nobody donates;
    as nothing can touch that copy, Orbax's save() of it then runs in a background thread too.
    """
    memory_due = stop or self.interval.due(step)
    durable_due = self._durable is not None and (stop or step % self.durable_every == 0)
    if not (memory_due or durable_due):
      return ()
    # The slices hold identical copies: the capacity check and the durable tier take the first
    # slice's (views made only then: a tree of views a step costs as much as the part's save).
    if not self._capacity_checked:
      durable_dir = self._durable.directory if self._durable else None
      self._check_dirs(Path(self._memory.directory), durable_dir,
                       state_nbytes(sharding.first_replica(state)))
      self._capacity_checked = True
    meta = json.loads(json.dumps(meta))  # written later in the background: freeze it now
    if memory_due and not self._save_memory(step, state, meta):
      memory_due = False
    if durable_due:
      self.durable.settle(memory_ok=self._memory_ok)
      durable_due = not self.durable.failing
    if durable_due:
      first = sharding.first_replica(state)
      copy = self.copy_before_save if self.copy_before_save is not None else _on_cpu(first)
      # The copy is complete before the next train step can donate what it was copied from.
      snapshot = jax.block_until_ready(private_copy(first)) if copy else first
      durable_due = self.durable.save(step, snapshot, meta, background=copy)
    started = ('memory',) * memory_due + ('durable',) * durable_due
    for tier in started:
      self.started[tier] += 1
    return started

  def _save_memory(self, step: int, state: Any, meta: dict) -> bool:
    """The in-memory tier is an optimisation: a write error (tmpfs full, I/O) skips that
    snapshot with a warning and training goes on with the durable tier and the next one."""
    self._memory_wait()
    try:
      saved = self._memory.save(step, state, meta, sources=self._split_sources(state))
    except (SnapshotError, OSError) as err:
      self._skip(err)
      return False
    self._memory_ok = self._memory_ok or saved
    return saved

  def _split_sources(self, state: Any) -> list:
    """image.split_sources of `state`, kept while its slices stay the same."""
    mesh = getattr(jax.tree.leaves(state)[0].sharding, 'mesh', None)
    key = tuple(d.id for d in mesh.devices.flat) if hasattr(mesh, 'devices') else None
    if self._sources[0] != key:
      self._sources = (key, image.split_sources(state))
    return self._sources[1]

  def _memory_wait(self) -> None:
    try:
      self._memory.wait()
    except SnapshotError as err:  # the previous in-memory snapshot failed while being written
      self.started['memory'] -= 1  # not written after all
      self._skip(err)

  def _skip(self, err: BaseException) -> None:
    if self._memory._last_saved is not None:  # no save is in flight: its leftovers go
      self._memory.discard_failed(self._memory._last_saved)
    self.skipped, self._memory_ok = self.skipped + 1, False
    log.warning('in-memory snapshot skipped (%d so far), training goes on: %s', self.skipped, err)

  def restore_latest(self, target: Any, at_most: int | None = None
                     ) -> tuple[int, Any, dict, str] | None:
    """(step, state, meta, where) of the newest intact snapshot, in-memory before durable, else
    None.

    `target`: pytree of jax.ShapeDtypeStruct with .sharding (or arrays) to restore onto.
    Snapshots that fail their checks are skipped with a line and set aside (Tier.verified), so
    that the steps trained again after this restore can be saved under their numbers.
    `at_most`: only a snapshot of a step <= it (a rollback); the newer ones are then taken out
    of the run (Tier.discard_after; `discarded` says where they were).
    """
    self.wait_until_finished()
    candidates = sorted(((step, rank, tier) for rank, tier in enumerate(self.tiers)
                         for step in tier.steps() if at_most is None or step <= at_most),
                        key=lambda c: (-c[0], c[1]))
    for step, _, tier in candidates:
      if not tier.verified(step):
        continue
      try:
        state, meta = tier.restore(step, target)
      except PerBlockLayout as old:  # kept on disk: an older mecefo-jax can still resume it
        log.warning('%s; it is kept, not restored: trying an older snapshot', old)
        self.per_block.append(tier.describe(step))
        continue
      if at_most is not None:
        why = rolled_back(step)
        self.discarded = [where for t in self.tiers for where in t.discard_after(step, why)]
      return step, state, meta, tier.describe(step)
    return None

  def where(self, step: int, tiers: tuple[str, ...]) -> list[str]:
    """Where the snapshots of `step` that maybe_save started (`tiers`) are, in words."""
    return [tier.describe(step) for tier in self.tiers if tier.name in tiers]

  def written(self, step: int, tiers: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `tiers` whose snapshot of `step` was written whole (after
    wait_until_finished): a failed save is no place to name."""
    return tuple(t.name for t in self.tiers if t.name in tiers and t.last_written == step)

  def report(self) -> Snapshots:
    return tiers_report(self._memory, self.every, self.started['memory'], self.skipped,
                        self._durable, self.durable_every, self.started['durable'],
                        self.durable.failed if self.durable else 0)

  def busy(self) -> bool:
    """Whether the in-memory snapshot is still being written in the background."""
    return self._memory.busy()

  def wait_until_finished(self, agree: bool = False) -> None:
    """Blocks until every started snapshot is written and has its manifest (a failed one is
    a line: the memory tier's a skip, the durable tier's a failure). `agree`: ignored (one
    process)."""
    self._memory_wait()
    if self._durable:
      self.durable.settle(memory_ok=self._memory_ok)

  def close(self) -> None:
    self.wait_until_finished()
    for tier in self.tiers:
      tier.close()

  def __enter__(self) -> SnapshotManager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
