"""Per-host in-memory snapshots of a multi-process run: 1/n of the state and a parity block each.

REFT with data parallelism: every host that trains holds a whole replica, so host p can cut the
state's byte image into n equal parts, keep part p and compute its own XOR parity block (parity.py
layout) without talking to anyone. Losing any one host's snapshot memory (a dead host, a
replacement with empty tmpfs) is repaired at restore from the others' parts and blocks. Memory
per host: (1/n + 1/(n(n-1))) of the state instead of a whole copy.

The n hosts of a snapshot are the logical hosts present when it was saved (its `layout`, kept in
its meta): a job restarted on the survivors of a death codes its next snapshots over the
survivors, so a second death is survived as well.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mecefo_jax import multihost
from mecefo_jax.model.train_state import abstract_state
from mecefo_jax.snapshot import image, parity
from mecefo_jax.snapshot.capacity import SnapshotError, check_capacity
from mecefo_jax.snapshot.durable import DurableGuard
from mecefo_jax.snapshot.interval import Interval
from mecefo_jax.snapshot.manifest import verify_manifest
from mecefo_jax.snapshot.manager import Snapshots, rolled_back, tiers_report
from mecefo_jax.snapshot.tier import Tier, is_per_block, private_copy

log = logging.getLogger('mecefo')
MIN_KEEP = 3  # in-memory parts kept per host at least (see HostSnapshots.__init__)
_LAYOUT = 'host_layout'  # meta key: the logical hosts holding the snapshot's parts, in order


def part_len(image_len: int, n: int) -> int:
  """Bytes of each of n parts: n-1 chunks each, together at least the image."""
  return -(-image_len // (n * (n - 1))) * (n - 1)


class HostSnapshots:
  """The snapshot tiers of a multi-process run, with SnapshotManager's interface (maybe_save,
  due, restore_latest, where, wait_until_finished, close, report): per-host in-memory parts with
  parity, and a durable Orbax checkpoint that all processes write together into `durable_dir`
  (a directory every process reaches: any local one on one machine, a bucket on a pod).

  `slots`: the logical host of each process (by process id); this process keeps its parts in
  `directory`/host<slot>, so they stay its own when the job restarts with fewer processes."""

  def __init__(self, directory: str | Path, cfg, interval: Interval, *, slots=None,
               durable_dir: str | None = None):
    sn = cfg.snapshot
    # The hosts' saves finish out of step: one host can hold its parts of steps N and N+1 while
    # another's newest finished part is N-1 (each waits for its previous save only at its next
    # one, and steps are in lockstep). Keeping MIN_KEEP parts leaves every pair of hosts a step
    # in common, so a death never finds the in-memory tier without a restorable snapshot.
    self.cfg, keep, self.durable_every = cfg, max(sn.keep, MIN_KEEP), sn.durable_every
    self.interval = interval
    self.slots = tuple(slots if slots is not None else range(jax.process_count()))
    self.slot = self.slots[jax.process_index()]
    self.layout = tuple(sorted(self.slots))  # the hosts of the snapshots saved from now on
    n = len(self.layout)
    self.image_len = image.nbytes(image.layout(abstract_state(cfg)))
    self.part_len = part_len(self.image_len, n)
    check_capacity(directory, self.part_len * n // (n - 1), keep, factor=1.1)
    self.directory = Path(directory) / f'host{self.slot}'
    self._tier = Tier('memory', self.directory, keep, compress=False, local=True)
    self._durable = (Tier('durable', durable_dir, sn.durable_keep)
                     if durable_dir and sn.durable_every else None)
    self.durable = (DurableGuard(self._durable, agree=multihost.allgather_json)
                    if self._durable else None)
    self.saved = self.durable_saved = 0  # by this process
    self.skipped = 0  # this host's parts lost to write errors (tmpfs full), a warning each
    self.per_block: list[str] = []  # in-memory parts of the per-block layout passed over
    self.discarded: list[str] = []  # snapshots newer than a rollback's, taken out of the run
    # Hosts of the restored snapshot's layout absent from this job (dead): their parts go once
    # a snapshot of this job's layout is complete on every host (free_stale).
    self.stale: tuple[int, ...] = ()
    self._complete: int | None = None  # the newest step of this layout whose part is written
    self._pending: int | None = None  # the step of this layout whose part is being written
    self._image = np.zeros(self.part_len * n, np.uint8)  # packed state + zero padding
    # Orbax saves no array that one process holds whole in a multi-process run, so a part is
    # saved as row 0 of a [processes, len] array of which this process holds only that row
    # (the others' rows are not its to save); restored by itself, whatever the job is then.
    me = jax.process_index()
    others = [next(d for d in jax.devices() if d.process_index == p)
              for p in range(jax.process_count()) if p != me]
    self._device = jax.local_devices()[0]
    self._sharding = NamedSharding(Mesh(np.array([self._device, *others]), ('host',)), P('host'))

  def _global(self, row: np.ndarray) -> jax.Array:
    shape = (jax.process_count(), len(row))
    return jax.make_array_from_single_device_arrays(
        shape, self._sharding, [jax.device_put(row[None], self._device)])

  @property
  def every(self) -> int:
    return self.interval.every

  def due(self, step: int) -> bool:
    return self.interval.due(step) or bool(self._durable and step % self.durable_every == 0)

  def maybe_save(self, step: int, state, meta: dict, *, stop: bool = False) -> tuple[str, ...]:
    """Saves this host's part and parity block of `state` (the live state) when `step` is due,
    and the durable checkpoint when that is due (all processes call it); `stop`: both, due or
    not. Returns the tiers it started."""
    meta = json.loads(json.dumps(meta))
    started = ()
    if self.stale and (stop or self.interval.due(step)):
      self._free_stale()
    if (stop or self.interval.due(step)) and self._save_part(step, state, meta):
      started += ('memory',)
    if self._durable and (stop or step % self.durable_every == 0):
      self.durable.settle()  # every process, at the same step: they agree on its outcome
    if self._durable and (stop or step % self.durable_every == 0) and not self.durable.failing:
      # A private copy (one replica) that no train step donates, written in the background.
      copy = jax.block_until_ready(private_copy(state))
      if self.durable.save(step, copy, meta):  # Orbax's D2H copy here, its writes async
        self.durable_saved += 1
        started += ('durable',)
    return started

  def where(self, step: int, tiers: tuple[str, ...]) -> list[str]:
    """Where the snapshots of `step` that maybe_save started are, in words."""
    parts = (f'in-memory snapshot parts with parity in {self.directory.parent}/host*/{step}'
             if 'memory' in tiers else None)
    return [p for p in (parts, 'durable' in tiers and self._durable.describe(step)) if p]

  def written(self, step: int, tiers: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `tiers` whose snapshot of `step` was written (after wait_until_finished with
    `agree`): this host's part; the durable checkpoint as every process found it."""
    done = {'memory': self._tier.last_written == step,
            'durable': bool(self._durable) and self._durable.last_written == step and
            self.durable.last_ok}
    return tuple(t for t in tiers if done.get(t))

  def _save_part(self, step: int, state, meta: dict) -> bool:
    devices = multihost.local_replica_devices(state)
    if devices is None:
      return False  # every slice of this host is down: its part stays at an older step
    self._wait_part()  # the previous save may still read the image buffer
    # The state's bytes, packed into the reused, zero-padded image: a real host copy that
    # donation cannot touch.
    image.pack(state, self._image[:self.image_len], devices=devices)
    parts = [self._image[p * self.part_len:(p + 1) * self.part_len]
             for p in range(len(self.layout))]
    me = self.layout.index(self.slot)
    tree = {'part': self._global(parts[me]), 'parity': self._global(parity.parity_block(parts, me))}
    try:
      saved = self._tier.save(step, tree, {**meta, _LAYOUT: list(self.layout)}, background=True)
    except (SnapshotError, OSError) as err:
      self._skip(err)
      return False
    self.saved += saved
    self._pending = step if saved else None
    return saved

  def _wait_part(self) -> None:
    try:
      self._tier.wait()
    except SnapshotError as err:  # the previous part failed while being written
      self.saved -= 1  # not written after all
      self._skip(err)

  def _skip(self, err: BaseException) -> None:
    """A part that cannot be written (tmpfs full, I/O) is skipped with a warning, as one
    process's in-memory snapshot is: the other hosts' parts and blocks rebuild it (parity),
    the durable tier goes on, and so does training."""
    if self._tier._last_saved is not None:  # no save in flight: its leftovers go
      self._tier.discard_failed(self._tier._last_saved)
    self.skipped += 1
    log.warning('in-memory snapshot part skipped (%d so far), training goes on: %s',
                self.skipped, err)

  def _free_stale(self) -> None:
    """Frees the dead hosts' parts (self.stale) once every host of this job holds its part of
    one snapshot of this job's layout, written: that snapshot is then the newest usable, with
    this job's parity, so the dead hosts' parts can serve no restore. All processes call it."""
    self._wait_part()
    if self._pending is not None and self._pending in self._tier.steps():
      self._complete = self._pending
    steps = multihost.allgather_json(self._complete)
    if steps[0] is None or any(s != steps[0] for s in steps):
      return
    for host in self.stale:
      gone = self.directory.parent / f'host{host}'
      if gone.is_dir():
        shutil.rmtree(gone, ignore_errors=True)
        log.info('in-memory snapshot part of host %d freed (%s): snapshot %d of hosts %s is '
                 'complete without it', host, gone, steps[0], list(self.layout))
    self.stale = ()

  def report(self) -> Snapshots:
    """report.json's `snapshots` section: this host's part, and the durable tier."""
    return tiers_report(self._tier, self.every, self.saved, self.skipped, self._durable,
                        self.durable_every,
                        self.durable_saved, self.durable.failed if self.durable else 0)

  def _held(self) -> dict[int, tuple[int, ...]]:
    """{step: layout} of the intact snapshot parts in this host's directory; parts of the
    per-block parameter layout are passed over (kept on disk, said once)."""
    held = {}
    for step in self._tier.steps():
      meta = self._tier.read_meta(step) if self._tier.verified(step) else None
      if meta is not None and is_per_block(meta):
        where = f'in-memory snapshot part {self._tier.step_dir(step)}'
        log.warning('%s has the per-block parameter layout of mecefo-jax before the scanned '
                    'model; it is kept, not restored', where)
        self.per_block.append(where)
      elif meta is not None:
        held[step] = tuple(meta[_LAYOUT])
    return held

  def restore_latest(self, target, at_most: int | None = None):
    """(step, state on `target`'s shardings, meta, where) from the newest usable snapshot: the
    in-memory snapshot (of any host layout) that all hosts of its layout but at most one hold
    intact (the missing part rebuilt from parity), or the durable checkpoint, whichever is newer
    (in-memory on a tie); None if there is none. All processes call it. `at_most`: of a step
    <= it only (a rollback), the newer ones taken out of the run (`discarded`)."""
    self.wait_until_finished()
    mine = self._held()
    held = multihost.allgather_json({str(s): list(l) for s, l in mine.items()
                                     if at_most is None or s <= at_most})
    held = [{int(s): tuple(l) for s, l in h.items()} for h in held]
    durable = [s for s in self._durable_steps() if at_most is None or s <= at_most]
    choice = choose(held, self.slots, durable)
    if choice is not None and at_most is not None:
      why = rolled_back(choice[0])
      self.discarded = [where for tier in (self._tier, self._durable) if tier
                        for where in tier.discard_after(choice[0], why)]
      if self._durable:
        self._reload_after_aside()
    if choice is None:
      if any(held):  # parts exist, just not enough of one snapshot: never start over silently
        found = {f'host{self.slots[p]}': sorted(h) for p, h in enumerate(held)}
        raise SnapshotError(f'no snapshot has all parts but one among the hosts present '
                            f'(parts by host and step: {found}) and there is no durable '
                            f'checkpoint: a wrong --host-slot, or more than one host\'s '
                            f'snapshot memory lost{self._set_aside_note()}; --fresh starts over')
      return None
    step, layout = choice
    if layout is not None:
      self.stale = tuple(h for h in layout if h not in self.layout)
    if layout is None:
      state, meta = self._durable.restore(step, target)
      return step, state, meta, self._durable.describe(step)
    return step, *self._restore_parts(step, layout, mine, target), self.where(step, ('memory',))[0]

  def _durable_steps(self) -> list[int]:
    """The intact durable checkpoints, as process 0 checks them; a bad one is set aside by
    process 0 (Tier.verified), then every process reloads the tier's steps."""
    if not self._durable:
      return []
    problems = ({str(s): verify_manifest(self._durable.step_dir(s))
                 for s in self._durable.steps()} if jax.process_index() == 0 else None)
    problems = multihost.allgather_json(problems)[0]
    intact = [int(s) for s, problem in problems.items()
              if self._durable.verified(int(s), problem, check=False)]
    self._reload_after_aside()
    return intact

  def _reload_after_aside(self) -> None:
    """Every process reloads the durable tier's steps once process 0 has set its own aside (it
    alone moves them): a process that still listed one would skip that step's next save
    (Orbax's `should_save`) while the others wait for it in the save's barrier."""
    moved = multihost.allgather_json(self._durable.set_aside_where)[0]  # after process 0's moves
    self._durable.set_aside_where = list(moved)
    self._durable.steps()  # reloaded: the steps set aside are gone

  def _set_aside_note(self) -> str:
    where = self.set_aside
    return f' (set aside, not deleted, as they failed their checks: {", ".join(where)})' * bool(where)

  @property
  def set_aside(self) -> list[str]:
    """Where the snapshots this start set aside are: this host's parts and the durable ones."""
    return self._tier.set_aside_where + (self._durable.set_aside_where if self._durable else [])

  def _restore_parts(self, step: int, layout: tuple[int, ...], mine: dict, target):
    """(state, meta) of in-memory snapshot `step` from its hosts' parts (all processes)."""
    n, length = len(layout), part_len(self.image_len, len(layout))
    have = self.slot in layout and mine.get(step) == layout
    part, block, meta = np.zeros(length, np.uint8), np.zeros(length // (n - 1), np.uint8), None
    if have:
      tree, meta = self._tier.restore_first_rows(
          step, {'part': len(part), 'parity': len(block)}, self._device)
      part, block = tree['part'], tree['parity']
    holders = np.asarray(multihost_utils.process_allgather(np.array([have])))[:, 0]
    parts_by_process = list(np.asarray(multihost_utils.process_allgather(part)))
    blocks_by_process = list(np.asarray(multihost_utils.process_allgather(block)))
    where = {self.slots[p]: p for p in np.flatnonzero(holders)}
    parts = [parts_by_process[where[h]] if h in where else None for h in layout]
    blocks = [blocks_by_process[where[h]] if h in where else None for h in layout]
    for lost in [i for i, h in enumerate(layout) if h not in where]:  # at most one
      parts[lost] = parity.rebuild_part(parts, blocks, lost)
      log.warning('snapshot %d: part of host %d rebuilt from the parity of the others', step,
                  layout[lost])
    source = int(np.flatnonzero(holders)[0])
    meta = json.loads(multihost.broadcast_bytes(json.dumps(meta).encode() if have else None,
                                                source))
    meta.pop(_LAYOUT)
    return image.unpack(np.concatenate(parts)[:self.image_len], target), meta

  def busy(self) -> bool:
    """Whether this host's part is still being written in the background."""
    return self._tier.busy()

  def wait_until_finished(self, agree: bool = False) -> None:
    """`agree`: every process calls it now, and they agree on the durable save's outcome."""
    self._wait_part()
    if self._durable:
      self.durable.settle(agree=agree)

  def close(self) -> None:
    self._wait_part()
    self._tier.close()
    if self._durable:
      self.durable.settle(agree=False)
      self._durable.close()


def choose(held: list[dict[int, tuple[int, ...]]], slots: tuple[int, ...],
           durable: list[int] = ()) -> tuple[int, tuple[int, ...] | None] | None:
  """(step, layout) of the snapshot to resume from: the newest of the usable in-memory ones
  (newest_usable) and the durable checkpoints (layout None), in-memory on a tie; None if none."""
  memory = newest_usable(held, slots)
  newest_durable = max(durable, default=None)
  if newest_durable is not None and (memory is None or newest_durable > memory[0]):
    return newest_durable, None
  return memory


def newest_usable(held: list[dict[int, tuple[int, ...]]],
                  slots: tuple[int, ...]) -> tuple[int, tuple[int, ...]] | None:
  """(step, layout) of the newest snapshot whose layout's hosts hold all of its parts but at
  most one, given what each process (of logical host slots[p]) holds; None if there is none."""
  holders: dict[tuple[int, tuple[int, ...]], set[int]] = {}
  for p, steps in enumerate(held):
    for step, layout in steps.items():
      if slots[p] in layout:
        holders.setdefault((step, layout), set()).add(slots[p])
  usable = [(step, len(hosts), layout) for (step, layout), hosts in holders.items()
            if len(hosts) >= len(layout) - 1]
  if not usable:
    return None
  step, _, layout = max(usable)
  return step, layout
