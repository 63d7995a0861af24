"""Snapshot overhead: step time with every-step in-memory snapshots vs none; restore; parity rebuild.

Run: python -m benchmarks.snapshot_overhead --config configs/llama_60m.yaml --json OUT.json
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
--restores. Parity: the code a multi-process run executes (snapshot/host.py, HostSnapshots) for
4 hosts: the one-replica state packed into one zero-padded image of 4 equal parts (image.pack,
as maybe_save does), each host's parity block (parity.parity_block, computed by every host at
every save: parity_block_s is one host's), then one part and its block dropped and rebuilt by
parity.rebuild_part (as restore_latest does: parity_rebuild_s), checked bit-exact.
--only-parity measures the parity alone (no step is compiled or timed).
Then (--auto-steps N, default 120) a real Trainer run of N steps with snapshot.every=auto
reports the interval it picks (auto_every) from the costs it measures (auto_cost_s per
snapshot beside a auto_idle_step_s step; budget snapshot.overhead_budget).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.model import models, train_state
from mecefo_jax.model.train_state import params_sha256
from mecefo_jax.core.roles import Role
from mecefo_jax.snapshot import host, image, manifest, parity, recovery, manager
from mecefo_jax.step import slice_steps, train_step

N_HOSTS = 4


def dir_bytes(path: Path) -> int:
  return sum(p.stat().st_size for p in Path(path).rglob('*') if p.is_file())


class Bench:
  """One compiled step, two independent states (one per mode), one snapshot manager."""

  def __init__(self, cfg, root: Path):
    self.cfg, self.root = cfg, root
    self.mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    graphdef = models.spec(cfg.model).graphdef
    role = Role(exact=cfg.train.micro_batch)
    self.step = train_step.lower_step(cfg, self.mesh, role, graphdef).compile()
    self.schedule = train_state.schedule_on(cfg, self.mesh)
    self.states = {mode: train_state.create_sharded(cfg, self.mesh)
                   for mode in ('no_snapshot', 'snapshot')}
    rng = np.random.default_rng(0)
    self.tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size,
                                           train_step.batch_shape(cfg, 1, role)), jnp.int32)
    self.manager = manager.SnapshotManager(root / 'memory', every=1, keep=2)
    self.saves, self.save_block_s = 0, []

  def one_replica(self, state):
    return slice_steps.state_view(self.cfg, state, sharding.submesh(self.mesh, (0,)))

  def iteration(self, mode: str) -> None:
    state, metrics = self.step(self.states[mode], self.tokens, self.schedule)
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
    with manager.SnapshotManager(newest.parent, keep=2) as fresh:
      t0 = time.perf_counter()
      step, state, *_ = recovery.restore(fresh, bench.cfg, bench.mesh)
      jax.block_until_ready(state)
      restore_s.append(time.perf_counter() - t0)
    exact &= step == bench.saves and params_sha256(state.params) == want
  return {'restore_s': statistics.median(restore_s), 'verify_manifest_s': statistics.median(verify_s),
          'restore_bit_exact': bool(exact), 'restored_step_dir': str(newest)}


def time_parity(state, n: int = N_HOSTS, lost: int = 2, repeats: int = 3) -> dict:
  """HostSnapshots' parity over n hosts (see the module doc): the median seconds of one host's
  parity block and of rebuilding part `lost` from the others' parts and blocks."""
  image_len = image.nbytes(image.layout(state))
  part_len = host.part_len(image_len, n)  # as HostSnapshots: n parts of n-1 chunks
  packed = np.zeros(part_len * n, np.uint8)  # the packed state + zero padding
  image.pack(state, packed[:image_len])
  parts = [packed[p * part_len:(p + 1) * part_len] for p in range(n)]
  blocks, block_s = [], []
  for holder in range(n):  # each host computes its own block at every save
    t0 = time.perf_counter()
    blocks.append(parity.parity_block(parts, holder))
    block_s.append(time.perf_counter() - t0)
  survivors = [None if i == lost else p for i, p in enumerate(parts)]
  kept = [None if i == lost else b for i, b in enumerate(blocks)]  # the lost host's block is gone
  rebuild_s, exact = [], True
  for _ in range(repeats):
    t0 = time.perf_counter()
    rebuilt = parity.rebuild_part(survivors, kept, lost)
    rebuild_s.append(time.perf_counter() - t0)
    exact &= bool(np.array_equal(rebuilt, parts[lost]))
  return {'parity_block_s': statistics.median(block_s),
          'parity_rebuild_s': statistics.median(rebuild_s), 'parity_rebuild_bit_exact': exact,
          'parity_hosts': n, 'parity_part_bytes': part_len, 'parity_block_bytes': blocks[0].nbytes}


def pick_interval(cfg, root: Path, steps: int) -> dict:
  """The interval snapshot.every=auto picks in a real training run of `steps` steps (in-memory
  tier only: the durable tier's saves would land in its measurements)."""
  from mecefo_jax.run.trainer import Trainer
  auto = dataclasses.replace(cfg, train=dataclasses.replace(
      cfg.train, steps=steps, eval_every=0, plot=False, log_every=10), snapshot=dataclasses.replace(
      cfg.snapshot, every='auto', dir=str(root / 'auto_shm'), durable_every=0))
  trainer = Trainer(auto, root / 'auto_run', progress='quiet')
  try:
    interval = trainer.run()['snapshot_interval']
  finally:
    trainer.close()
  return {'auto_steps': steps, 'auto_every': interval['every'], 'auto_cost_s': interval['cost_s'],
          'auto_idle_step_s': interval['idle_step_s'], 'auto_changes': interval['changes'],
          'auto_budget': interval['budget']}


def main(argv=None):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--block', type=int, default=None,
                 help='steps per timed block (default: 21 tiny-ish, 4 for steps over 1 s)')
  p.add_argument('--rounds', type=int, default=2, help='ABBA rounds of one block per mode')
  p.add_argument('--restores', type=int, default=3)
  p.add_argument('--dir', default=None, help='snapshot root (default: a fresh dir in /dev/shm)')
  p.add_argument('--auto-steps', type=int, default=120,
                 help='then train this many steps with snapshot.every=auto and report the '
                      'interval it picks (0: skip)')
  p.add_argument('--only-parity', action='store_true',
                 help='measure only the parity block and rebuild (no step timing, no snapshots)')
  args = p.parse_args(argv)
  cfg = load_config(args.config, ['mesh.slice=1', 'mesh.fsdp=1', 'mesh.tensor=1', *args.overrides])
  info = common.run_info(__spec__.name, argv)
  if args.only_parity:
    state = train_state.create_sharded(cfg, sharding.make_mesh(cfg.mesh, jax.devices()[:1]))
    result = {**info, 'config': args.config, 'overrides': args.overrides,
              'state_bytes': manager.state_nbytes(state), **time_parity(state)}
    rows = [{'quantity': k, 'value': v} for k, v in result.items() if k.startswith('parity_')]
    common.emit(result, common.markdown_table(rows, list(rows[0])), args.json)
    return result
  base = args.dir or ('/dev/shm' if os.path.isdir('/dev/shm') else None)
  root = Path(tempfile.mkdtemp(prefix='mecefo-snapbench-', dir=base))
  try:
    result, rows = run(cfg, root, args, info)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  common.emit(result, common.markdown_table(rows, list(rows[0])), args.json)
  return result


def run(cfg, root: Path, args, info: dict) -> tuple[dict, list[dict]]:
  bench = Bench(cfg, root)
  t0 = time.perf_counter()
  bench.iteration('no_snapshot')
  block = args.block or (4 if time.perf_counter() - t0 > 1.0 else 21)
  times = time_modes(bench, block, args.rounds)
  plain, snap = times['no_snapshot'], times['snapshot']
  newest = Path(bench.manager.tiers[0].step_dir(bench.saves))
  result = {
      **info, 'config': args.config, 'overrides': args.overrides, 'micro_batch': cfg.train.micro_batch, 'seq_len': cfg.model.seq_len,
      'block': block, 'rounds': args.rounds, 'times': times,
      'overhead_pct': 100.0 * (snap['mean_s'] / plain['mean_s'] - 1.0),
      'overhead_pct_median': 100.0 * (snap['median_s'] / plain['median_s'] - 1.0),
      'maybe_save_blocking_s': statistics.fmean(bench.save_block_s),
      'snapshot_cpu_s': snap['cpu_s_per_step'] - plain['cpu_s_per_step'],
      'cpu_cores': os.cpu_count(),
      'snapshot_bytes': dir_bytes(newest),
      'state_bytes': manager.state_nbytes(bench.one_replica(bench.states['snapshot'])),
      'snapshot_files': sum(1 for p in newest.rglob('*') if p.is_file()),
  }
  result.update(time_restore(bench, args.restores))
  bench.manager.close()
  result.update(time_parity(bench.one_replica(bench.states['snapshot'])))
  if args.auto_steps:
    result.update(pick_interval(cfg, root, args.auto_steps))
  # On CPU the step keeps every core busy: each CPU second a snapshot takes is taken from it.
  result['cpu_bound_overhead_pct'] = 100.0 * result['snapshot_cpu_s'] / plain['cpu_s_per_step']
  rows = [{'quantity': k, 'value': result[k]} for k in (
      'overhead_pct', 'overhead_pct_median', 'snapshot_cpu_s', 'cpu_bound_overhead_pct',
      'maybe_save_blocking_s', 'snapshot_bytes',
      'state_bytes', 'snapshot_files', 'restore_s', 'verify_manifest_s', 'restore_bit_exact',
      'parity_block_s', 'parity_rebuild_s', 'parity_rebuild_bit_exact', 'parity_block_bytes',
      *(['auto_every', 'auto_cost_s', 'auto_idle_step_s'] if args.auto_steps else []))]
  rows = [{'quantity': f'step_s ({m}, mean)', 'value': t['mean_s']} for m, t in times.items()] + rows
  return result, rows


if __name__ == '__main__':
  main()
