"""Multi-process runs: jax.distributed set-up, per-process batches, values and rejoin across hosts.

Every process runs the same controller on the same failure schedule, so all agree on the live
slices and the programs to run. A program runs on the processes that own devices of its mesh;
the others skip it. Each slice must lie inside one process (slices map to hosts, or to groups of
devices within a host), so every process that holds a live slice holds a whole replica.
"""
from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mecefo_jax.config import ConfigError

log = logging.getLogger('mecefo')

# What every step program returns (steps.finish_step); a process that skips a step fills zeros.
METRIC_KEYS = ('loss', 'grad_norm', 'exact_tokens', 'degraded_tokens')


def _on_tpu_pod() -> bool:
  """A multi-host TPU VM, where jax.distributed finds the coordinator by itself."""
  hosts = os.environ.get('TPU_WORKER_HOSTNAMES', '')
  return ',' in hosts or 'MEGASCALE_COORDINATOR_ADDRESS' in os.environ


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_s: int = 100) -> bool:
  """jax.distributed.initialize when asked (explicit coordinator) or on a TPU pod; True if done.

  Must run before anything touches a jax backend. On CPU the collectives go through gloo.
  `heartbeat_s`: how long the coordination service waits for a silent (dead) process before it
  tells the others to abort.
  """
  if coordinator is None and not _on_tpu_pod():
    if num_processes not in (None, 1) or process_id not in (None, 0):
      raise ConfigError('--num-processes/--process-id need --coordinator HOST:PORT')
    return False
  if coordinator is not None and (num_processes is None or process_id is None):
    raise ConfigError('--coordinator needs --num-processes and --process-id')
  if num_processes is not None and not 0 <= (process_id or 0) < num_processes:
    raise ConfigError(f'--process-id={process_id} must be in [0, {num_processes})')
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator, num_processes, process_id,
                             heartbeat_timeout_seconds=heartbeat_s)
  log.info('process %d of %d: %d local of %d devices', jax.process_index(), jax.process_count(),
           jax.local_device_count(), jax.device_count())
  return True


def is_multiprocess() -> bool:
  return jax.process_count() > 1


def is_chief() -> bool:
  return jax.process_index() == 0


def is_local(mesh: Mesh) -> bool:
  """True if this process owns devices of `mesh` (and so must run its programs)."""
  me = jax.process_index()
  return any(d.process_index == me for d in mesh.devices.flat)


def check_slices_within_processes(mesh: Mesh) -> None:
  """Each slice (a replica) must live in one process; a clear error suggests a mesh that does."""
  for s in range(mesh.shape['slice']):
    owners = {d.process_index for d in mesh.devices[s].flat}
    if len(owners) > 1:
      per_process = jax.local_device_count()
      raise ConfigError(
          f'slice {s} spans processes {sorted(owners)}: every slice must lie in one process; use '
          f'mesh.fsdp*mesh.tensor dividing the {per_process} devices per process (e.g. '
          f'mesh.slice={jax.device_count()} mesh.fsdp=1 mesh.tensor=1)')


def put_batch(rows_of_slices, shape: tuple[int, ...], batch_sharding: NamedSharding) -> jax.Array:
  """A global [slices, rows, L] batch where this process makes only the rows of its own devices.

  `rows_of_slices(ss)`: int32 [len(ss), rows, L] tokens of the slices `ss` of the batch's mesh,
  asked once for all of this process's slices (a corpus makes many rows at once far faster than
  one slice's at a time: its per-position loop runs once).
  """
  def slices_of(index) -> range:
    return range(*index[0].indices(shape[0]))
  mine = sorted({s for index in batch_sharding.addressable_devices_indices_map(shape).values()
                 for s in slices_of(index)})
  made = dict(zip(mine, rows_of_slices(mine)))

  def shard(index):
    rows = np.stack([made[s] for s in slices_of(index)])
    return rows[(slice(None),) + tuple(index[1:])]
  return jax.make_array_from_callback(shape, batch_sharding, shard, dtype=np.int32)


def fetch(metrics: dict | None, mesh: Mesh, keys=METRIC_KEYS,
          stop: bool | None = None) -> dict[str, float]:
  """Host floats of replicated scalars computed on `mesh`, on every process (multi-process: a
  collective; `metrics` is None where the program was skipped). With `stop` (this process was
  asked to stop), also 'stop': 1.0 if any process was, so that all stop after the same step."""
  flag = [] if stop is None else [float(stop)]
  if not is_multiprocess():
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    return {**values, **dict(zip(['stop'], flag))}
  source = first_process(mesh)
  mine = np.zeros(len(keys) + len(flag), np.float32)
  if jax.process_index() == source:
    mine[:len(keys)] = [np.asarray(metrics[k].addressable_shards[0].data) for k in keys]
  mine[len(keys):] = flag
  table = np.asarray(multihost_utils.process_allgather(mine))
  values = dict(zip(keys, map(float, table[source, :len(keys)])))
  return {**values, **({'stop': float(table[:, -1].max())} if flag else {})}


def _padded_length(n: int) -> int:
  """The length a payload of `n` bytes is sent at: a power of two from 64. Each length is a
  collective program of its own, traced and compiled in every process, again in each process a
  restart starts: so a few, not one per length of JSON sent (process 0 of a 3-process job
  restarted after a death: 43 -> 35 compiles besides its programs, ~0.3 s less XLA compile)."""
  return max(64, 1 << (n - 1).bit_length())


def broadcast_bytes(data: bytes | None, source: int) -> bytes:
  """`data` of process `source` on every process (all processes call it)."""
  is_source = jax.process_index() == source
  size = np.array([len(data) if is_source else 0], np.int64)
  size = int(np.asarray(multihost_utils.broadcast_one_to_all(size, is_source=is_source))[0])
  buf = np.zeros(_padded_length(size), np.uint8)
  if is_source:
    buf[:size] = np.frombuffer(data, np.uint8)
  return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=is_source))[:size])


def on_chief(fn):
  """fn() on process 0, its JSON-able result on every process; a ConfigError it raises is raised
  on every process (else the others would wait for it in the next collective)."""
  if not is_multiprocess():
    return fn()
  result = None
  if jax.process_index() == 0:
    try:
      result = {'value': fn()}
    except ConfigError as err:
      result = {'error': str(err)}
  result = json.loads(broadcast_bytes(json.dumps(result).encode() if result else None, 0))
  if 'error' in result:
    raise ConfigError(result['error'])
  return result['value']


def allgather_json(value) -> list:
  """Every process's JSON-able `value`, by process id (all processes call it)."""
  data = np.frombuffer(json.dumps(value).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([len(data)], np.int64))).ravel()
  padded = np.zeros(_padded_length(int(sizes.max())), np.uint8)
  padded[:len(data)] = data
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(bytes(row[:size])) for row, size in zip(rows, sizes)]


def local_replica_devices(tree) -> set | None:
  """The devices of this process's first slice of the mesh of `tree`'s leaves (replicated over
  slices), or None when this process holds none of it."""
  mesh = jax.tree.leaves(tree)[0].sharding.mesh
  me = jax.process_index()
  mine = [s for s in range(mesh.shape['slice']) if mesh.devices[s].flat[0].process_index == me]
  return set(mesh.devices[mine[0]].flat) if mine else None


def first_process(mesh: Mesh) -> int:
  return mesh.devices.flat[0].process_index


def rejoin_copy(target_shardings, source_index: int):
  """Program: per-slice stacked state -> the state of slice `source_index` on every slice.

  Copying the state to a repaired slice on another process goes through a collective, because
  the CPU runtime has no cross-host device_put. Indexing is a pure copy: bit-exact.
  """
  stacked = jax.tree.map(lambda sh: NamedSharding(sh.mesh, P('slice', *sh.spec)), target_shardings)
  return jax.jit(lambda tree: jax.tree.map(lambda x: x[source_index], tree),
                 in_shardings=(stacked,), out_shardings=target_shardings)


def stack_for_rejoin(state, target_shardings):
  """Per-slice stack of `state` over the target mesh: live slices give their shards, repaired
  ones zeros (their copy comes from the source slice)."""
  def one(x, sh):
    have = {s.device: s.data for s in x.addressable_shards}
    shape = (sh.mesh.shape['slice'], *x.shape)
    stacked_sh = NamedSharding(sh.mesh, P('slice', *sh.spec))
    arrays = []
    for device, index in stacked_sh.addressable_devices_indices_map(shape).items():
      data = have.get(device)
      if data is None:
        shard_shape = [len(range(*i.indices(n))) for i, n in zip(index[1:], x.shape)]
        data = jax.device_put(np.zeros(shard_shape, x.dtype), device)
      arrays.append(data[None])
    return jax.make_array_from_single_device_arrays(shape, stacked_sh, arrays, dtype=x.dtype)
  return jax.tree.map(one, state, target_shardings)
