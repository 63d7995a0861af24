"""Snapshot overhead: step time with every-step in-memory snapshots vs none; restore; parity rebuild.

Run: python benchmarks/snapshot_overhead.py --config configs/llama_60m.yaml --json OUT.json
The real per-step path on one device: the AOT-compiled fused step, then (snapshot mode) what
Trainer._snapshot does, SnapshotManager.maybe_save of one replica (slice_steps.state_view) with every=1.
Blocks of --block steps alternate between the modes (ABBA order over --rounds); a block's first
iteration is not timed, so every timed snapshot iteration is steady state: one step, the wait
for the previous save, the private copy and the start of the next save. The last save of a
block is drained, untimed, before the next block starts. overhead_pct compares mean iteration
times. On CPU the copy and the background write (Orbax, tensorstore, the manifest's XXH3)
run on the same cores as the step, so the overhead is bounded by that CPU work, not by I/O:
snapshot_cpu_s is the extra process CPU time per step with snapshots (all threads, from
time.process_time over whole blocks), cpu_bound_overhead_pct that time over the CPU time of a
plain step, i.e. the overhead expected when the step keeps every core busy.
Restore: restore_latest of a fresh SnapshotManager (manifest check + Orbax restore), median of
--restores. Parity: the one-replica state's leaves are dealt to 4 'hosts' (size-balanced), each
saved as its own snapshot dir; write_group_parity over the 4, then one host (its snapshot and
its parity block) is deleted and rebuild_host recreates it; both checked bit-exact.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from mecefo_jax import sharding  # noqa: E402
from mecefo_jax.model import train_state  # noqa: E402
from mecefo_jax.snapshot import manifest
from mecefo_jax.model import llama
from mecefo_jax.snapshot import parity
from mecefo_jax.snapshot import recovery
from mecefo_jax.step import slice_steps
from mecefo_jax.snapshot import store
from mecefo_jax.step import train_step
from mecefo_jax.config import load_config  # noqa: E402
from mecefo_jax.model.train_state import params_sha256  # noqa: E402

N_HOSTS = 4


def dir_bytes(path: Path) -> int:
  return sum(p.stat().st_size for p in Path(path).rglob('*') if p.is_file())


class Bench:
  """One compiled step, two independent states (one per mode), one snapshot manager."""

  def __init__(self, cfg, root: Path):
    self.cfg, self.root = cfg, root
    self.mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    graphdef, _, _ = llama.abstract(cfg.model)
    role = train_step.Role(exact=cfg.train.micro_batch)
    self.step = train_step.compile_step(cfg, self.mesh, role, graphdef)
    self.states = {mode: train_state.create_sharded(cfg, self.mesh)
                   for mode in ('no_snapshot', 'snapshot')}
    rng = np.random.default_rng(0)
    self.tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size,
                                           train_step.batch_shape(cfg, 1, role)), jnp.int32)
    self.manager = store.SnapshotManager(root / 'memory', every=1, keep=2)
    self.saves, self.save_block_s = 0, []

  def one_replica(self, state):
    return slice_steps.state_view(self.cfg, state, self.mesh, (0,))

  def iteration(self, mode: str) -> None:
    state, metrics = self.step(self.states[mode], self.tokens)
    self.states[mode] = state
    jax.block_until_ready(metrics)  # as a logged step
    if mode == 'snapshot':
      self.saves += 1
      t0 = time.perf_counter()
      self.manager.maybe_save(self.saves, self.one_replica(state), {'step': self.saves})
      self.save_block_s.append(time.perf_counter() - t0)

  def block(self, mode: str, n: int) -> tuple[list[float], float]:
    """Seconds of iterations 2..n (steady state; the trailing save is drained, untimed) and the
    process CPU seconds per step of the whole block, drain included (all threads)."""
    cpu0 = time.process_time()
    self.iteration(mode)
    times = []
    for _ in range(n - 1):
      t0 = time.perf_counter()
      self.iteration(mode)
      times.append(time.perf_counter() - t0)
    jax.block_until_ready(self.states[mode])
    self.manager.wait_until_finished()
    return times, (time.process_time() - cpu0) / n


def time_modes(bench: Bench, block: int, rounds: int) -> dict:
  modes = ('no_snapshot', 'snapshot')
  for mode in modes:  # warm-up: first saves create dirs and metadata
    bench.block(mode, 2)
  bench.save_block_s.clear()
  samples, cpu = {m: [] for m in modes}, {m: [] for m in modes}
  for r in range(rounds):
    for mode in (modes if r % 2 == 0 else modes[::-1]):
      times, cpu_per_step = bench.block(mode, block)
      samples[mode] += times
      cpu[mode].append(cpu_per_step)
  return {m: {'mean_s': statistics.fmean(v), 'median_s': statistics.median(v), 'min_s': min(v),
              'n': len(v), 'cpu_s_per_step': statistics.fmean(cpu[m])} for m, v in samples.items()}


def time_restore(bench: Bench, repeats: int) -> dict:
  """Restore of the newest snapshot by a fresh manager (as after a crash), checked bit-exact."""
  want = params_sha256(bench.states['snapshot'].params)  # the last block ended with its save
  newest = Path(bench.manager.tiers[0].step_dir(bench.saves))
  verify_s, restore_s, exact = [], [], True
  for _ in range(repeats):
    t0 = time.perf_counter()
    assert manifest.verify_manifest(newest) is None
    verify_s.append(time.perf_counter() - t0)
    with store.SnapshotManager(newest.parent, keep=2) as fresh:
      t0 = time.perf_counter()
      step, state, _ = recovery.restore(fresh, bench.cfg, bench.mesh)
      jax.block_until_ready(state)
      restore_s.append(time.perf_counter() - t0)
    exact &= step == bench.saves and params_sha256(state.params) == want
  return {'restore_s': statistics.median(restore_s), 'verify_manifest_s': statistics.median(verify_s),
          'restore_bit_exact': bool(exact), 'restored_step_dir': str(newest)}


def host_shares(state, n: int) -> list[dict]:
  """The leaves of `state` dealt to n hosts, largest first to the least loaded host."""
  leaves = sorted(jax.tree_util.tree_leaves_with_path(state), key=lambda kv: -kv[1].size)
  shares, loads = [{} for _ in range(n)], [0] * n
  for path, leaf in leaves:
    host = loads.index(min(loads))
    shares[host][jax.tree_util.keystr(path)] = leaf
    loads[host] += leaf.nbytes
  return shares


def time_parity(bench: Bench, lost: int = 2) -> dict:
  hosts = [bench.root / f'host{i}' for i in range(N_HOSTS)]
  snap_dirs, parity_dirs = [h / 'snap' for h in hosts], [h / 'parity' for h in hosts]
  for snap_dir, share in zip(snap_dirs, host_shares(bench.one_replica(bench.states['snapshot']),
                                                    N_HOSTS)):
    snap_dir.parent.mkdir()
    with store.SnapshotManager(snap_dir) as manager:
      manager.maybe_save(0, share, {'host': str(snap_dir)})
  t0 = time.perf_counter()
  parity.write_group_parity(snap_dirs, parity_dirs)
  write_s = time.perf_counter() - t0
  image = parity.pack_tree(snap_dirs[lost])
  shutil.rmtree(hosts[lost])  # the whole host: its snapshot and the parity block it kept
  t0 = time.perf_counter()
  parity.rebuild_host(snap_dirs, parity_dirs, lost)
  rebuild_s = time.perf_counter() - t0
  exact = (parity.pack_tree(snap_dirs[lost]) == image
           and manifest.verify_manifest(snap_dirs[lost] / '0') is None)
  return {'parity_write_s': write_s, 'parity_rebuild_s': rebuild_s, 'parity_rebuild_bit_exact': exact,
          'parity_hosts': N_HOSTS, 'host_snapshot_bytes': [dir_bytes(d) for d in snap_dirs],
          'parity_block_bytes': dir_bytes(parity_dirs[lost])}


def main(argv=None):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--block', type=int, default=None,
                 help='steps per timed block (default: 21 tiny-ish, 4 for steps over 1 s)')
  p.add_argument('--rounds', type=int, default=2, help='ABBA rounds of one block per mode')
  p.add_argument('--restores', type=int, default=3)
  p.add_argument('--dir', default=None, help='snapshot root (default: a fresh dir in /dev/shm)')
  args = p.parse_args(argv)
  cfg = load_config(args.config, ['mesh.slice=1', 'mesh.fsdp=1', 'mesh.tensor=1', *args.overrides])
  base = args.dir or ('/dev/shm' if os.path.isdir('/dev/shm') else None)
  root = Path(tempfile.mkdtemp(prefix='mecefo-snapbench-', dir=base))
  try:
    result, rows = run(cfg, root, args)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  common.emit(result, common.markdown_table(rows, list(rows[0])), args.json)
  return result


def run(cfg, root: Path, args) -> tuple[dict, list[dict]]:
  bench = Bench(cfg, root)
  t0 = time.perf_counter()
  bench.iteration('no_snapshot')
  block = args.block or (4 if time.perf_counter() - t0 > 1.0 else 21)
  times = time_modes(bench, block, args.rounds)
  plain, snap = times['no_snapshot'], times['snapshot']
  newest = Path(bench.manager.tiers[0].step_dir(bench.saves))
  result = {
      'config': args.config, 'overrides': args.overrides, 'device': common.device_info(),
      'micro_batch': cfg.train.micro_batch, 'seq_len': cfg.model.seq_len,
      'block': block, 'rounds': args.rounds, 'times': times,
      'overhead_pct': 100.0 * (snap['mean_s'] / plain['mean_s'] - 1.0),
      'overhead_pct_median': 100.0 * (snap['median_s'] / plain['median_s'] - 1.0),
      'maybe_save_blocking_s': statistics.fmean(bench.save_block_s),
      'snapshot_cpu_s': snap['cpu_s_per_step'] - plain['cpu_s_per_step'],
      'cpu_cores': os.cpu_count(),
      'snapshot_bytes': dir_bytes(newest),
      'state_bytes': store.state_nbytes(bench.one_replica(bench.states['snapshot'])),
      'snapshot_files': sum(1 for p in newest.rglob('*') if p.is_file()),
  }
  result.update(time_restore(bench, args.restores))
  bench.manager.close()
  result.update(time_parity(bench))
  # On CPU the step keeps every core busy: each CPU second a snapshot takes is taken from it.
  result['cpu_bound_overhead_pct'] = 100.0 * result['snapshot_cpu_s'] / plain['cpu_s_per_step']
  rows = [{'quantity': k, 'value': result[k]} for k in (
      'overhead_pct', 'overhead_pct_median', 'snapshot_cpu_s', 'cpu_bound_overhead_pct',
      'maybe_save_blocking_s', 'snapshot_bytes',
      'state_bytes', 'snapshot_files', 'restore_s', 'verify_manifest_s', 'restore_bit_exact',
      'parity_write_s', 'parity_rebuild_s', 'parity_rebuild_bit_exact', 'parity_block_bytes')]
  rows = [{'quantity': f'step_s ({m}, mean)', 'value': t['mean_s']} for m, t in times.items()] + rows
  return result, rows


if __name__ == '__main__':
  main()
