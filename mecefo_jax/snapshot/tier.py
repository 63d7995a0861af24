"""One snapshot tier: an async Orbax CheckpointManager whose finished steps get checksum manifests."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from mecefo_jax.model import layout as param_layout
from mecefo_jax.snapshot import aside, hold, image
from mecefo_jax.snapshot.capacity import SnapshotError, test_dev_full
from mecefo_jax.snapshot.manifest import NO_MANIFEST, verify_manifest, write_manifest

log = logging.getLogger(__name__)

_ORBAX_SAVE_LOCK = threading.Lock()  # two Orbax save() calls at once (two tiers) break its commit
_CLOSE_TRIES = 8  # closes of an Orbax manager, each raising one part's error of a failed save
_RELIST_TRIES = 5  # listings of a tier that a step removed meanwhile can fail


# Every snapshot's meta says its parameter layout (model/layout.py); one without it was written
# before the scanned model (per-block parameters).
LAYOUT_KEY = 'param_layout'


class PerBlockLayout(SnapshotError):
  """An in-memory snapshot of the per-block layout: this version restores it only from a
  durable checkpoint (converted), so it is kept on disk and passed over."""


def is_per_block(meta: dict) -> bool:
  return meta.get(LAYOUT_KEY) != param_layout.STACKED


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
    self._hold = hold.from_env() if name == 'durable' else None  # a test hook
    # Directories made in the save() call, not signalled from a thread: Orbax's signals are
    # keys `awaitable_signals_contract_<operation id>/...` in jax.distributed's key-value
    # store, shared by every process, with one process-wide operation counter that every
    # save of every manager advances. Two tiers saving from two threads advance it in a
    # different order in each process, and each process's local tier uses the same keys as
    # its peers' and deletes them when its save ends: a multi-process job then waited for a
    # signal that was never set or was deleted (Orbax's timeout: 20 min), every process in
    # `saving` (seen under load at durable_every=1 within a few hundred steps). Without
    # signals no such key is written or read (tests/test_snapshot_tiers.py).
    manager_kwargs['async_options'] = ocp.AsyncOptions(
        create_directories_asynchronously=False,
        post_finalization_callback=self._hold and (lambda: self._hold.in_commit(self._last_saved)))
    # Cleans up the *.orbax-checkpoint-tmp directories a killed save left: only ever opened
    # with the run's lock held (run/trainer.py), so never a running trainer's save in flight.
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                           create=not (local or shared),
                                           cleanup_tmp_directories=True,
                                           **kwargs, **manager_kwargs)
    if packed:  # the image is ours until the save is finished: Orbax need not copy it
      registry = {'type_handler_registry': ocp.type_handlers.create_type_handler_registry(
          (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)),
          (jax.Array, ocp.type_handlers.ArrayHandler()))}  # unused; silences Orbax's warning

    def open_orbax(cleanup: bool) -> ocp.CheckpointManager:
      """A new Orbax manager of this tier, with new handlers (a closed manager closed its own)."""
      handlers = {'state': ocp.PyTreeCheckpointHandler(use_compression=compress, **kwargs,
                                                       **registry),
                  'meta': ocp.JsonCheckpointHandler(**kwargs)}
      if packed:
        handlers['layout'] = ocp.JsonCheckpointHandler(**kwargs)
      return ocp.CheckpointManager(self.directory, item_handlers=handlers, options=
                                   dataclasses.replace(options, cleanup_tmp_directories=cleanup))
    self._open_orbax = open_orbax
    self._orbax = open_orbax(cleanup=True)
    # One long-lived worker: starting a thread per save cost the training thread ~30 ms on a
    # 2-core host right after a step (Thread.start waits until the new thread runs).
    self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f'mecefo-{name}-save')
    self._finisher: concurrent.futures.Future | None = None
    self._last_saved: int | None = None
    self.last_written: int | None = None  # the last step whose save wait() found written whole
    self._discarded: set[int] = set()  # steps whose failed saves' leftovers were removed
    self._error: BaseException | None = None
    self.set_aside_where: list[str] = []  # the snapshots this tier set aside: where each now is

  def describe(self, step: int) -> str:
    """Where snapshot `step` is, in words (for messages)."""
    kind = 'in-memory snapshot' if self.name == 'memory' else 'durable checkpoint'
    return f'{kind} {self.step_dir(step)}'

  def step_dir(self, step: int) -> epath.Path:
    return self.directory / str(step)

  def steps(self) -> list[int]:
    for tries_left in reversed(range(_RELIST_TRIES)):
      try:  # another process (the crashed trainer) may have written them
        self._orbax.reload()
        break
      except FileNotFoundError:  # a step removed between Orbax's listing and its stat of it
        if not tries_left:  # (this tier's own finisher keeping max_to_keep; seen in CI)
          raise
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
      # torn save. Keeping it would resume from a state this run no longer holds. A durable
      # one is set aside (disk); an in-memory one (RAM) of a timeline no longer trained goes.
      if self.name == 'durable' and self.writes_manifest:
        self.set_aside(step, f'an older timeline\'s step {step}, replaced by this run\'s')
      elif self.name != 'durable':
        self._orbax.delete(step)
    self._last_saved = step
    items = {'meta': ocp.args.JsonSave({**meta, LAYOUT_KEY: param_layout.STACKED})}
    if self.packed:
      self._image, layout = image.pack(state, self._image, sources)  # off donated buffers
      items.update(state=ocp.args.PyTreeSave({'image': self._image}),
                   layout=ocp.args.JsonSave(layout))
      background = True
    else:
      items['state'] = ocp.args.PyTreeSave(state)
    args = ocp.args.Composite(**items)
    if not background:
      try:
        self._start_save(step, args)  # returns once the D2H copy is done
      except Exception as e:  # noqa: BLE001 -- a failed save, raised by wait() like _finish's
        self._error = e
        return True
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
      if test_dev_full(self.name):
        with open('/dev/full', 'w') as full:  # a test's full disk: ENOSPC at the flush
          full.write('{}')
      if self.writes_manifest:
        write_manifest(self.step_dir(step))
    except BaseException as e:  # surfaced by the next wait() in the training thread
      self._error = e

  def busy(self) -> bool:
    """Whether a save of this tier is still being written in the background."""
    return self._finisher is not None and not self._finisher.done()

  def wait(self) -> None:
    """Waits for the save in flight; raises SnapshotError where it failed."""
    in_flight = self._finisher is not None
    if self._hold and in_flight:
      self._hold.before_wait(self._last_saved)
    if in_flight:
      self._finisher.result()  # _finish keeps its error for below
      self._finisher = None
    try:
      self._orbax.wait_until_finished()  # a save whose finisher was not started yet (SIGTERM)
    except Exception as e:  # noqa: BLE001 -- Orbax raises a failed save's error here again
      self._error = self._error or e
    if self._error is not None:
      error, self._error = self._error, None
      self._reopen()
      raise SnapshotError(f'{self.name} snapshot in {self.directory} failed: {error}') from error
    if in_flight:
      self.last_written = self._last_saved

  def _close_orbax(self) -> BaseException | None:
    """Closes the Orbax manager once every thread of its saves has ended; returns the first
    error of a failed save that its close raised (each part of a save, its commit and each
    metadata write, raises its own error once: the close is repeated until none is left)."""
    first = None
    for _ in range(_CLOSE_TRIES):
      try:
        self._orbax.close()
        return first
      except Exception as err:  # noqa: BLE001 -- a failed save's, reported by wait() already
        first = first or err
    return first

  def _reopen(self) -> None:
    """After a failed save: Orbax's threads of that save can outlive the error we got (its
    commit still writing the *.orbax-checkpoint-tmp directory, which it would then leave, and
    raise into the next save or the tier's close): the manager is closed, all of them waited
    for, and a new one opened (no cleanup of its own: discard_failed removes the leftovers)."""
    self._close_orbax()
    self._orbax = self._open_orbax(cleanup=False)

  def restore(self, step: int, target: Any) -> tuple[Any, dict]:
    """(state on `target`'s shardings, meta) of snapshot `step`. A durable checkpoint of the
    per-block layout is converted to stacked blocks; an in-memory one raises PerBlockLayout."""
    per_block = is_per_block(self.read_meta(step))
    if per_block and self.packed:
      raise PerBlockLayout(f'{self.describe(step)} has the per-block parameter layout of '
                           f'mecefo-jax before the scanned model')
    state, meta = self._restore_image(step, target) if self.packed else self._restore_tree(
        step, target, per_block)
    meta.pop(LAYOUT_KEY, None)
    return state, meta

  def _restore_tree(self, step: int, target: Any, per_block: bool) -> tuple[Any, dict]:
    want = param_layout.per_block(target, param_layout.n_layers(target)) if per_block else target
    restore_args = ocp.checkpoint_utils.construct_restore_args(want)
    args = ocp.args.Composite(state=ocp.args.PyTreeRestore(want, restore_args=restore_args),
                              meta=ocp.args.JsonRestore())
    restored = self._orbax.restore(step, args=args)
    if not per_block:
      return restored.state, restored.meta
    log.warning('%s has the per-block parameter layout of mecefo-jax before the scanned model: '
                'converted to stacked blocks', self.describe(step))
    shardings = jax.tree.map(lambda x: x.sharding, target)
    return jax.jit(param_layout.stacked, out_shardings=shardings)(restored.state), restored.meta

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

  def discard_after(self, step: int, why: str) -> list[str]:
    """Takes this tier's snapshots of steps after `step` out of the run (a timeline gone back
    from): in-memory ones deleted, durable ones set aside (kept on disk, by the process that
    writes the manifests); where each was, in words."""
    newer = [s for s in self.steps() if s > step]
    for s in newer:
      if self.name != 'durable':
        self.delete(s)
      elif self.writes_manifest:
        self.set_aside(s, why)
    return [self.describe(s) for s in newer]

  def discard_failed(self, step: int) -> None:
    """Removes what a failed save of `step` left: Orbax's `*.orbax-checkpoint-tmp` directories
    and a step directory without its manifest (ours, never finished; no checkpoint that was
    whole). Where this process writes the manifests, once no save is in flight."""
    if not self.writes_manifest:
      return
    self._discarded.add(step)
    leftovers = list(self.directory.glob(f'{step}.orbax-checkpoint-tmp*'))
    if self.step_dir(step).exists() and verify_manifest(self.step_dir(step)) == NO_MANIFEST:
      leftovers.append(self.step_dir(step))
    for path in leftovers:
      try:
        path.rmtree() if path.is_dir() else path.unlink()
      except OSError as err:  # a bucket out of reach: the next start's Orbax cleans it up
        log.warning('could not remove %s of a failed save: %s', path, err)
    self._orbax.reload()

  def verified(self, step: int, problem: str | None = None, *, check: bool = True) -> bool:
    """Whether snapshot `step` passes its checksums (`check`; else `problem` is what a check
    found elsewhere). One that does not is skipped and set aside (aside.py), never deleted,
    with a line; but an in-memory snapshot without a manifest, a save its process did not
    finish (it died writing it), is deleted, as Orbax deletes its own unfinished saves. In a
    multi-process durable tier only process 0 moves it (the others skip it)."""
    problem = verify_manifest(self.step_dir(step)) if check else problem
    if problem is None:
      return True
    if self.name == 'memory' and problem == NO_MANIFEST:
      log.warning('skipping memory snapshot %s: %s; deleted (a save its process did not '
                  'finish)', self.step_dir(step), problem)
      self.delete(step)
    elif self.writes_manifest:
      self.set_aside(step, problem)
    return False

  def set_aside(self, step: int, problem: str) -> None:
    """Moves snapshot `step` aside with one line saying why and how to put it back; where it
    cannot be moved (a bucket's error) it stays where it is, with a line."""
    kind = 'memory snapshot' if self.name == 'memory' else 'durable checkpoint'
    try:
      where = aside.set_aside(self.directory, step, problem)
    except OSError as err:
      log.warning('skipping %s %s: %s; it could not be set aside (%s): left where it is',
                  kind, self.step_dir(step), problem, err)
      return
    self._orbax.reload()
    self.set_aside_where.append(str(where))
    log.warning('skipping %s %s: %s; set aside as %s (not deleted; to restore it by hand: '
                '%s)', kind, self.step_dir(step), problem, where,
                aside.restore_hint(where, self.directory, step))

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._worker.shutdown()
      # Again: a save that failed inside Orbax's save() call can leave writes of it in flight
      # in threads nobody waits for (tensorstore's), which may make files after its discard.
      for step in sorted(self._discarded):
        self.discard_failed(step)
      error = self._close_orbax()
    if error is not None:  # a failed save no wait() saw: one line, its leftovers removed
      log.warning('%s snapshot in %s failed: %s', self.name, self.directory, error)
      if self._last_saved is not None:
        self.discard_failed(self._last_saved)
