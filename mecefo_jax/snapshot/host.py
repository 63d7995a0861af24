"""Per-host in-memory snapshots of a multi-process run: 1/n of the state and a parity block each.

REFT with data parallelism: every host that trains holds a whole replica, so host p can cut the
state's byte image into n equal parts, keep part p and compute its own XOR parity block (parity.py
layout) without talking to anyone. Losing any one host's snapshot memory (a dead host, a
replacement with empty tmpfs) is repaired at restore from the others' parts and blocks. Memory
per host: (1/n + 1/(n(n-1))) of the state instead of a whole copy.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mecefo_jax import multihost
from mecefo_jax.model.train_state import abstract_state
from mecefo_jax.snapshot import image, parity
from mecefo_jax.snapshot.capacity import check_capacity
from mecefo_jax.snapshot.store import OFF_DURABLE, Tier

log = logging.getLogger('mecefo')
_MAX_STEPS = 16  # snapshot steps compared across hosts at restore


class HostSnapshots:
  """The in-memory tier of a multi-process run, with SnapshotManager's interface (maybe_save,
  due, restore_latest, wait_until_finished, close, report, preempted)."""

  def __init__(self, directory: str | Path, cfg, *, every: int = 1, keep: int = 2):
    self.cfg, self.every, self.preempted = cfg, every, False
    self.host, self.n_hosts = jax.process_index(), jax.process_count()
    n = self.n_hosts
    self.image_len = image.nbytes(image.layout(abstract_state(cfg)))
    self.part_len = -(-self.image_len // (n * (n - 1))) * (n - 1)  # n parts of n-1 chunks each
    check_capacity(directory, self.part_len * n // (n - 1), keep, factor=1.1)
    self.directory = Path(directory) / f'host{self.host}'
    self._tier = Tier('memory', self.directory, keep, compress=False, local=True)
    self.saved = 0  # parts saved by this process
    self._image = np.zeros(self.part_len * n, np.uint8)  # packed state + zero padding
    first_devices = [next(d for d in jax.devices() if d.process_index == p) for p in range(n)]
    self._sharding = NamedSharding(Mesh(np.array(first_devices), ('host',)), P('host'))

  def _global(self, row: np.ndarray) -> jax.Array:
    """[n_hosts, len] array of which this process holds (and saves) only its own row."""
    device = self._sharding.mesh.devices[self.host]
    return jax.make_array_from_single_device_arrays(
        (self.n_hosts, len(row)), self._sharding, [jax.device_put(row[None], device)])

  def due(self, step: int) -> bool:
    return step % self.every == 0

  def maybe_save(self, step: int, state, meta: dict, *,
                 force_durable: bool = False) -> tuple[str, ...]:
    """Saves this host's part and parity block of `state` (the live state) when `step` is due;
    returns the tiers it started (('memory',) or ())."""
    del force_durable  # no durable tier in multi-process runs (see docs/tpu.md)
    if not self.due(step):
      return ()
    devices = multihost.local_replica_devices(state)
    if devices is None:
      return ()  # every slice of this host is down: its part stays at an older step
    self._tier.wait()  # the previous save may still read the image buffer
    # The state's bytes, packed into the reused, zero-padded image: a real host copy that
    # donation cannot touch.
    image.pack(state, self._image[:self.image_len], devices=devices)
    parts = [self._image[p * self.part_len:(p + 1) * self.part_len] for p in range(self.n_hosts)]
    tree = {'part': self._global(parts[self.host]),
            'parity': self._global(parity.parity_block(parts, self.host))}
    self._tier.save(step, tree, json.loads(json.dumps(meta)), background=True)
    self.saved += 1
    return ('memory',)

  def report(self) -> dict:
    """report.json's `snapshots` section: this host's part; no durable tier."""
    return {'enabled': True, **self._tier.report('', self.every, self.saved), 'skipped': 0,
            **OFF_DURABLE}

  def restore_latest(self, target):
    """(step, state on `target`'s shardings, meta) from the newest step that all hosts but at
    most one hold intact (the missing part rebuilt from parity), else None. All processes
    call it."""
    self.wait_until_finished()
    mine = [s for s in self._tier.steps() if self._tier.verified(s)][:_MAX_STEPS]
    table = np.asarray(multihost_utils.process_allgather(
        np.array(mine + [-1] * (_MAX_STEPS - len(mine)), np.int64)))
    counts = {s: int((table == s).any(axis=1).sum()) for s in set(table.flat) - {-1}}
    usable = [s for s, c in counts.items() if c >= self.n_hosts - 1]
    if not usable:
      return None
    step = int(max(usable))
    have = step in mine
    part = np.zeros(self.part_len, np.uint8)
    block = np.zeros(self.part_len // (self.n_hosts - 1), np.uint8)
    meta = None
    if have:
      rows = {k: jax.ShapeDtypeStruct((self.n_hosts, len(v)), np.uint8, sharding=self._sharding)
                for k, v in (('part', part), ('parity', block))}
      tree, meta = self._tier.restore(step, rows)
      part, block = (np.asarray(tree[k].addressable_shards[0].data)[0] for k in ('part', 'parity'))
    holders = np.asarray(multihost_utils.process_allgather(np.array([have])))[:, 0]
    parts = list(np.asarray(multihost_utils.process_allgather(part)))
    blocks = list(np.asarray(multihost_utils.process_allgather(block)))
    for lost in np.flatnonzero(~holders):  # at most one
      parts[lost] = parity.rebuild_part([None if i == lost else p for i, p in enumerate(parts)],
                                        blocks, int(lost))
      log.warning('snapshot %d: part of host %d rebuilt from the parity of the others', step, lost)
    source = int(np.flatnonzero(holders)[0])
    meta = json.loads(multihost.broadcast_bytes(json.dumps(meta).encode() if have else None,
                                                source))
    return step, image.unpack(np.concatenate(parts)[:self.image_len], target), meta

  def wait_until_finished(self) -> None:
    self._tier.wait()

  def close(self) -> None:
    self._tier.close()
