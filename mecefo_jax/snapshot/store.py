"""REFT-style snapshots: async Orbax saves to tmpfs with checksum manifests, plus a durable tier."""
from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
import math
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from mecefo_jax import sharding
from mecefo_jax.snapshot import image
from mecefo_jax.snapshot.capacity import SnapshotError, check_capacity
from mecefo_jax.snapshot.manifest import verify_manifest, write_manifest

log = logging.getLogger(__name__)

# report.json's `snapshots` section of a run without snapshots, or its durable part without that tier.
OFF_DURABLE = {'durable_dir': None, 'durable_every': 0, 'durable_saved': 0,
               'durable_retained_steps': []}
OFF = {'enabled': False, 'dir': None, 'every': 0, 'saved': 0, 'skipped': 0, 'retained_steps': [],
       **OFF_DURABLE}

_ORBAX_SAVE_LOCK = threading.Lock()  # two Orbax save() calls at once (two tiers) break its commit


class SnapshotWarning(UserWarning):
  """A snapshot was skipped because its checksums do not match."""


def state_nbytes(state: Any) -> int:
  """Logical (global, one replica) byte size of the leaves of `state`; works on abstract leaves."""
  return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
             for leaf in jax.tree.leaves(state))


def default_snapshot_dir(run_name: str) -> Path:
  """/dev/shm/mecefo/<run_name>: tmpfs, so snapshots outlive a crash of the trainer process."""
  base = Path('/dev/shm') if Path('/dev/shm').is_dir() else Path(tempfile.gettempdir())
  return base / 'mecefo' / run_name


# ---- copies that donation cannot touch ------------------------------------------------------------

def private_copy(state: Any) -> Any:
  """A copy of `state` that no train step will donate: fresh device buffers, same shardings."""
  leaves, treedef = jax.tree.flatten(state)
  on_device = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
  copies = jax.device_put([leaves[i] for i in on_device],
                          [leaves[i].sharding for i in on_device], may_alias=False)
  for i, copy in zip(on_device, copies):
    leaves[i] = copy
  return jax.tree.unflatten(treedef, leaves)


def _on_cpu(state: Any) -> bool:
  return any(device.platform == 'cpu'
             for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)
             for device in leaf.sharding.device_set)


# ---- one tier: an Orbax manager plus manifests ----------------------------------------------------

class Tier:
  """An async Orbax CheckpointManager whose finished steps get a checksum manifest.

  `compress`: zstd on the arrays. It saves ~10% of the bytes of trained weights but doubles the
  CPU time of a save (60m state: ~0.95 vs ~0.5 s), so the every-step in-memory tier skips it.
  `packed`: save the state as one byte image (image.py) packed into a host buffer that this tier
  reuses, with its layout beside it; else as an Orbax pytree (portable across meshes and models'
  shardings, and ~3x the CPU per save for llama_60m's 254 leaves).
  """

  def __init__(self, name: str, directory: str | os.PathLike, keep: int, compress: bool = True,
               local: bool = False, packed: bool = False):
    """`local`: this process alone saves its own arrays into its own directory (per-host
    snapshots of a multi-process run). Else all processes of a multi-process run write one
    checkpoint together (the durable tier), process 0 its manifest."""
    self.name, self.packed = name, packed
    self._image: np.ndarray | None = None  # the packed tier's host buffer, reused
    self.directory = epath.Path(directory)
    self.writes_manifest = local or jax.process_index() == 0
    kwargs, registry, manager_kwargs = {}, {}, {}
    shared = jax.process_count() > 1 and not local
    if shared:
      # Named processes make Orbax sync through the distributed client's barriers, not device
      # collectives, which its background commit would interleave with the train step's.
      kwargs = {'multiprocessing_options': ocp.options.MultiprocessingOptions(
          primary_host=0, active_processes=set(range(jax.process_count())))}
    if local:
      me = jax.process_index()
      kwargs = {'multiprocessing_options': ocp.options.MultiprocessingOptions(
          primary_host=None, active_processes={me}, barrier_sync_key_prefix=f'host{me}')}
      manager_kwargs = {'enable_per_process_directory_creation': True}
      # Every process writes its own shards (no primary host, no replica dedup across hosts).
      registry = {'type_handler_registry': ocp.type_handlers.create_type_handler_registry(
          (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None,
                                                     use_replica_parallel=False)))}
    if local or shared:
      self.directory.mkdir(parents=True, exist_ok=True)  # Orbax's create= is refused here
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                           create=not (local or shared),
                                           cleanup_tmp_directories=True,
                                           **kwargs, **manager_kwargs)
    if packed:  # the image is ours until the save is finished: Orbax need not copy it
      registry = {'type_handler_registry': ocp.type_handlers.create_type_handler_registry(
          (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
          (jax.Array, ocp.type_handlers.ArrayHandler()))}  # unused; silences Orbax's warning
    handlers = {'state': ocp.PyTreeCheckpointHandler(use_compression=compress, **kwargs, **registry),
                'meta': ocp.JsonCheckpointHandler(**kwargs)}
    if packed:
      handlers['layout'] = ocp.JsonCheckpointHandler(**kwargs)
    self._orbax = ocp.CheckpointManager(self.directory, item_handlers=handlers, options=options)
    # One long-lived worker: starting a thread per save cost the training thread ~30 ms on a
    # 2-core host right after a step (Thread.start waits until the new thread runs).
    self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f'mecefo-{name}-save')
    self._finisher: concurrent.futures.Future | None = None
    self._last_saved: int | None = None
    self._error: BaseException | None = None

  def describe(self, step: int) -> str:
    """Where snapshot `step` is, in words (for messages)."""
    kind = 'in-memory snapshot' if self.name == 'memory' else 'durable checkpoint'
    return f'{kind} {self.step_dir(step)}'

  def step_dir(self, step: int) -> epath.Path:
    return self.directory / str(step)

  def steps(self) -> list[int]:
    self._orbax.reload()  # another process (the crashed trainer) may have written them
    return sorted(self._orbax.all_steps(), reverse=True)

  def save(self, step: int, state: Any, meta: dict, *, background: bool = False,
           sources=None) -> bool:
    """Starts saving `state`; False if this tier saved `step` last (another snapshot of that
    step, of an older timeline, is replaced).
    `background`: Orbax's save() runs in the finisher thread too, for a private copy that no
    train step donates; else its D2H copy happens here. A packed tier copies `state` into its
    image here (`sources`: image.pack's devices) and saves that in the background."""
    self.wait()
    if step == self._last_saved:
      return False  # this tier saved that step's state already (a stop right after a save)
    if step in self._orbax.all_steps():
      # Not this timeline's: steps trained again after a restore from an older snapshot, or a
      # torn save. Keeping it would resume from a state this run no longer holds.
      self._orbax.delete(step)
    self._last_saved = step
    items = {'meta': ocp.args.JsonSave(meta)}
    if self.packed:
      self._image, layout = image.pack(state, self._image, sources)  # off donated buffers
      items.update(state=ocp.args.PyTreeSave({'image': self._image}),
                   layout=ocp.args.JsonSave(layout))
      background = True
    else:
      items['state'] = ocp.args.PyTreeSave(state)
    args = ocp.args.Composite(**items)
    if not background:
      self._start_save(step, args)  # returns once the D2H copy is done
    self._finisher = self._worker.submit(self._finish, step, args if background else None)
    return True

  def _start_save(self, step: int, args) -> None:
    with _ORBAX_SAVE_LOCK:
      self._orbax.save(step, args=args, force=True)

  def _finish(self, step: int, args) -> None:
    try:
      if args is not None:
        self._start_save(step, args)
      self._orbax.wait_until_finished()  # the step dir is renamed into place by now
      if self.writes_manifest:
        write_manifest(self.step_dir(step))
    except BaseException as e:  # surfaced by the next wait() in the training thread
      self._error = e

  def busy(self) -> bool:
    """Whether a save of this tier is still being written in the background."""
    return self._finisher is not None and not self._finisher.done()

  def wait(self) -> None:
    if self._finisher is not None:
      self._finisher.result()  # _finish keeps its error for below
      self._finisher = None
    try:
      self._orbax.wait_until_finished()  # a save whose finisher was not started yet (SIGTERM)
    except Exception as e:  # noqa: BLE001 -- Orbax raises a failed save's error here again
      self._error = self._error or e
    if self._error is not None:
      error, self._error = self._error, None
      raise SnapshotError(f'{self.name} snapshot in {self.directory} failed: {error}') from error

  def restore(self, step: int, target: Any) -> tuple[Any, dict]:
    if self.packed:
      return self._restore_image(step, target)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    args = ocp.args.Composite(state=ocp.args.PyTreeRestore(target, restore_args=restore_args),
                              meta=ocp.args.JsonRestore())
    restored = self._orbax.restore(step, args=args)
    return restored.state, restored.meta

  def restore_first_rows(self, step: int, lengths: dict[str, int], device) -> tuple[dict, dict]:
    """({name: row 0 as numpy}, meta) of a snapshot of [n, length] arrays of which this process
    saved row 0 (HostSnapshots), read onto `device` alone (rows 1.. are not here)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = {k: ocp.ArrayRestoreArgs(sharding=sharding, global_shape=(1, n), strict=False)
            for k, n in lengths.items()}
    restored = self._orbax.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(restore_args=args), meta=ocp.args.JsonRestore()))
    return {k: np.asarray(v)[0] for k, v in restored.state.items()}, restored.meta

  def read_meta(self, step: int) -> dict:
    """The meta saved with `step`, without its state."""
    return self._orbax.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def _restore_image(self, step: int, target: Any) -> tuple[Any, dict]:
    saved = self._orbax.restore(step, args=ocp.args.Composite(layout=ocp.args.JsonRestore())).layout
    wanted = image.layout(target)
    if saved != wanted:
      diff = next((s, w) for s, w in itertools.zip_longest(saved, wanted) if s != w)
      raise SnapshotError(f'{self.step_dir(step)} holds another state than this run '
                          f'({len(saved)} vs {len(wanted)} leaves, first difference: saved '
                          f'{diff[0]}, wanted {diff[1]}): a changed config? Resume with the '
                          f'config it was saved with, or start anew (--fresh, or another --out)')
    args = ocp.args.Composite(
        state=ocp.args.PyTreeRestore(restore_args={'image': ocp.RestoreArgs(restore_type=np.ndarray)}),
        meta=ocp.args.JsonRestore())
    restored = self._orbax.restore(step, args=args)
    return image.unpack(restored.state['image'], target), restored.meta

  def delete(self, step: int) -> None:
    self._orbax.delete(step)

  def verified(self, step: int, problem: str | None = None, *, check: bool = True) -> bool:
    """Whether snapshot `step` passes its checksums (`check`; else `problem` is what a check
    found elsewhere); one that does not is skipped with a warning and deleted, so that the steps
    trained again after a restore can be saved under its number."""
    problem = verify_manifest(self.step_dir(step)) if check else problem
    if problem is None:
      return True
    message = f'skipping {self.name} snapshot {self.step_dir(step)}: {problem}'
    if problem.startswith('no manifest'):
      log.warning(message)  # expected after a crash during a save
    else:
      warnings.warn(message, SnapshotWarning, stacklevel=3)
    self.delete(step)
    return False

  def report(self, prefix: str, every: int, saved: int) -> dict:
    """This tier's part of report.json's `snapshots` section."""
    return {f'{prefix}dir': str(self.directory), f'{prefix}every': every,
            f'{prefix}saved': saved, f'{prefix}retained_steps': sorted(self.steps())}

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._worker.shutdown()
      self._orbax.close()


# ---- the manager ----------------------------------------------------------------------------------

class SnapshotManager:
  """In-memory snapshots every `every` steps (keep `keep`), durable ones every `durable_every`."""

  def __init__(self, directory: str | os.PathLike, *, every: int = 1, keep: int = 2,
               durable_dir: str | os.PathLike | None = None, durable_every: int = 0,
               durable_keep: int = 3, min_free_factor: float = 1.1,
               state_bytes: int | None = None, copy_before_save: bool | None = None):
    """`state_bytes` checks capacity now, else at the first save. `copy_before_save`: None = only
    on CPU, where the 'host copy' Orbax takes may be a view of the device buffer (see maybe_save)."""
    if every < 1 or keep < 1 or durable_every < 0 or durable_keep < 1:
      raise SnapshotError(f'need every >= 1, keep >= 1, durable_every >= 0, durable_keep >= 1; got '
                          f'{every}, {keep}, {durable_every}, {durable_keep}')
    if durable_every and durable_dir is None:
      raise SnapshotError(f'durable_every={durable_every} needs a durable_dir')
    self.every, self.keep = every, keep
    self.durable_every, self.durable_keep = durable_every, durable_keep
    self.min_free_factor = min_free_factor
    self.copy_before_save = copy_before_save
    durable_dir = durable_dir if durable_every else None
    self._check_dirs(Path(directory), durable_dir, state_bytes or 0)
    self._capacity_checked = state_bytes is not None
    self._memory = Tier('memory', directory, keep, compress=False, packed=True)
    self._durable = Tier('durable', durable_dir, durable_keep) if durable_dir else None
    self.started = dict.fromkeys(('memory', 'durable'), 0)  # saves started by this manager
    self.skipped = 0  # in-memory snapshots lost to write errors
    self._sources: tuple = (None, None)  # (slices' device ids, split_sources) of the last save

  @property
  def tiers(self) -> list[Tier]:
    return [self._memory] + ([self._durable] if self._durable else [])

  def _check_dirs(self, directory: Path, durable_dir, state_bytes: int) -> None:
    check_capacity(directory, state_bytes, self.keep, factor=self.min_free_factor)
    if durable_dir is not None and '://' not in str(durable_dir):  # buckets: nothing to check
      check_capacity(Path(durable_dir), state_bytes, self.durable_keep,
                     factor=self.min_free_factor)

  def due(self, step: int) -> bool:
    """Whether maybe_save(step, ...) will save anything (without force_durable)."""
    return step % self.every == 0 or bool(self._durable and step % self.durable_every == 0)

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
    memory_due = stop or step % self.every == 0
    durable_due = self._durable is not None and (stop or step % self.durable_every == 0)
    if not (memory_due or durable_due):
      return ()
    replicas, state = state, sharding.first_replica(state)  # the slices hold identical copies
    if not self._capacity_checked:
      durable_dir = self._durable.directory if self._durable else None
      self._check_dirs(Path(self._memory.directory), durable_dir, state_nbytes(state))
      self._capacity_checked = True
    meta = json.loads(json.dumps(meta))  # written later in the background: freeze it now
    if memory_due and not self._save_memory(step, replicas, meta):
      memory_due = False
    if durable_due:
      copy = self.copy_before_save if self.copy_before_save is not None else _on_cpu(state)
      # The copy is complete before the next train step can donate what it was copied from.
      snapshot = jax.block_until_ready(private_copy(state)) if copy else state
      durable_due = self._durable.save(step, snapshot, meta, background=copy)
    started = ('memory',) * memory_due + ('durable',) * durable_due
    for tier in started:
      self.started[tier] += 1
    return started

  def _save_memory(self, step: int, state: Any, meta: dict) -> bool:
    """The in-memory tier is an optimisation: a write error (tmpfs full, I/O) skips that
    snapshot with a warning and training goes on with the durable tier and the next one."""
    self._memory_wait()
    try:
      return self._memory.save(step, state, meta, sources=self._split_sources(state))
    except (SnapshotError, OSError) as err:
      self._skip(err)
      return False

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
      self._skip(err)

  def _skip(self, err: BaseException) -> None:
    self.skipped += 1
    log.warning('in-memory snapshot skipped (%d so far), training goes on: %s', self.skipped, err)

  def restore_latest(self, target: Any) -> tuple[int, Any, dict, str] | None:
    """(step, state, meta, where) of the newest intact snapshot, in-memory before durable, else
    None.

    `target`: pytree of jax.ShapeDtypeStruct with .sharding (or arrays) to restore onto.
    Snapshots that fail their checks are skipped with a warning and deleted, so that the steps
    trained again after this restore can be saved under their numbers.
    """
    self.wait_until_finished()
    candidates = sorted(((step, rank, tier) for rank, tier in enumerate(self.tiers)
                         for step in tier.steps()), key=lambda c: (-c[0], c[1]))
    for step, _, tier in candidates:
      if tier.verified(step):
        state, meta = tier.restore(step, target)
        return step, state, meta, tier.describe(step)
    return None

  def where(self, step: int, tiers: tuple[str, ...]) -> list[str]:
    """Where the snapshots of `step` that maybe_save started (`tiers`) are, in words."""
    return [tier.describe(step) for tier in self.tiers if tier.name in tiers]

  def report(self) -> dict:
    """report.json's `snapshots` section (docs/report.md)."""
    durable = (self._durable.report('durable_', self.durable_every, self.started['durable'])
               if self._durable else OFF_DURABLE)
    return {'enabled': True, **self._memory.report('', self.every, self.started['memory']),
            'skipped': self.skipped, **durable}

  def busy(self) -> bool:
    """Whether the in-memory snapshot is still being written in the background."""
    return self._memory.busy()

  def wait_until_finished(self) -> None:
    """Blocks until every started snapshot is written and has its manifest."""
    self._memory_wait()
    if self._durable:
      self._durable.wait()

  def close(self) -> None:
    self._memory_wait()  # a failed in-memory save is a warning here too
    for tier in self.tiers:
      tier.close()

  def __enter__(self) -> SnapshotManager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
