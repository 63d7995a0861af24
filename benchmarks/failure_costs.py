"""The failure replay's costs, timed on one device: each per-slice program's step, compile and
move, the update, the svd refresh, the rejoin copy and a checkpoint restore."""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import common
from mecefo_jax import sharding
from mecefo_jax.model import bases, models, train_state
from mecefo_jax.core.roles import Role
from mecefo_jax.plan.cost_model import role_name
from mecefo_jax.snapshot import recovery, manager
from mecefo_jax.step import retarget, slice_steps, train_step


def _timed_compile(compile_s: dict, name: str, build):
  t0 = time.perf_counter()
  program = build()
  compile_s[name] = time.perf_counter() - t0
  return program


def _one_device(cfg):
  """(mesh of device 0, graphdef): where every program is compiled and timed."""
  return sharding.make_mesh(cfg.mesh, jax.devices()[:1]), models.spec(cfg.model).graphdef


def measure(cfg, roles: set[Role], repeats: int, warmup: int) -> dict:
  """Times every role's group program, the fused normal step, update, refresh and rejoin; the
  compile of each and of the eval program, and the move of each (time_moves)."""
  mesh, graphdef = _one_device(cfg)
  b, svd, compile_s = cfg.train.micro_batch, bases.kind(cfg).refresh is not None, {}
  groups = {r: _timed_compile(compile_s, role_name(r),
                              lambda r=r: slice_steps.lower_group(cfg, mesh, r, graphdef).compile())
            for r in sorted(roles)}
  fused = _timed_compile(compile_s, 'fused_normal',
                         lambda: train_step.lower_step(cfg, mesh, Role(b), graphdef).compile())
  update = _timed_compile(compile_s, 'update', lambda: slice_steps.lower_update(cfg, mesh).compile())
  # 'refresh' is the one a run repeats every tau steps: warm (mecefo.refresh) after the first.
  warm = svd and cfg.mecefo.refresh == 'warm'
  full = svd and _timed_compile(compile_s, 'refresh_full' if warm else 'refresh',
                                lambda: train_step.lower_refresh(cfg, mesh).compile())
  refresh = full
  if warm:
    refresh = _timed_compile(compile_s, 'refresh',
                             lambda: train_step.lower_refresh(cfg, mesh, warm=True).compile())
  evaluate = _timed_compile(compile_s, 'eval',
                            lambda: train_step.lower_eval(cfg, mesh, b, graphdef).compile())
  # Donating programs each need their own state; group programs only read theirs.
  states = {k: train_state.create_sharded(cfg, mesh)
            for k in ('group', 'fused', 'update', 'refresh', *(['refresh_full'] if warm else []))}
  if svd:  # real bases for the degraded programs and the warm refresh to start from
    states['group'], states['refresh'] = full(states['group']), full(states['refresh'])
  tokens = common.random_tokens(cfg, {r: r for r in {*roles, Role(b)}})
  sums = groups[Role(b)](states['group'], tokens[Role(b)])
  schedule = train_state.schedule_on(cfg, mesh)
  # A real host copy (device_get may alias device memory on CPU, docs/algorithm.md §8).
  host_state = jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(states['group']))

  def run_fused():
    states['fused'], metrics = fused(states['fused'], tokens[Role(b)], schedule)
    return metrics

  def run_update():
    states['update'], metrics = update(states['update'], sums, schedule)
    return metrics

  def run_refresh(name, program):
    states[name] = program(states[name])
    return states[name]

  fns = {'fused_normal': run_fused, 'update': run_update,
         'rejoin': lambda: jax.device_put(host_state, train_state.state_shardings(cfg, mesh),
                                           may_alias=False)}
  if svd:
    fns['refresh'] = lambda: run_refresh('refresh', refresh)
  if warm:
    fns['refresh_full'] = lambda: run_refresh('refresh_full', full)
  fns |= {role_name(r): (lambda r=r: groups[r](states['group'], tokens[r])) for r in sorted(roles)}
  times = common.interleaved_times(fns, repeats, warmup)
  restore_s = time_restore(cfg, mesh, states['group'])
  memory = {role_name(r): train_step.memory_summary(g).get('temp_bytes', 0) for r, g in groups.items()}
  programs = {'fused_normal': fused, 'update': update,
              **({'refresh': refresh} if svd else {}),
              **{role_name(r): g for r, g in groups.items()}}
  lowerers = {'fused_normal': lambda: train_step.lower_step(cfg, mesh, Role(b), graphdef),
              'update': lambda: slice_steps.lower_update(cfg, mesh),
              'refresh': lambda: train_step.lower_refresh(cfg, mesh, warm=warm),
              **{role_name(r): (lambda r=r: slice_steps.lower_group(cfg, mesh, r, graphdef))
                 for r in groups}}
  flops = {name: common.unrolled_flops(lowerers[name]) for name in programs}
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(host_state))
  moves = time_moves({**programs, 'eval': evaluate, **({'refresh_full': full} if warm else {})},
                     repeats)
  return {'times': times, 'compile_s': compile_s, 'roles': [role_name(r) for r in sorted(roles)],
          'flops': flops,
          'group_temp_bytes': memory, 'state_bytes': state_bytes, 'tau': cfg.mecefo.tau,
          'repeats': repeats, 'warmup': warmup, **restore_s, **moves}


def time_moves(programs: dict, repeats: int) -> dict:
  """Seconds (median of `repeats`) to move each compiled one-device program as the program
  cache does at a shape's first move (step/retarget.py: serialize, then load under a device
  assignment of the new devices): from device 0 onto device 1, or back onto device 0 on a
  one-device host (one GPU: the same serialize and load)."""
  devices = jax.devices()
  old, new = devices[:1], devices[1:2] or devices[:1]

  def move(program) -> float:
    t0 = time.perf_counter()
    retarget.Serialized.of(program, old).load_onto(new)
    return time.perf_counter() - t0
  return {'move_s': {name: statistics.median([move(p) for _ in range(repeats)])
                     for name, p in programs.items()},
          'move_onto': f'device {new[0].id} from device {old[0].id}'}


def with_moves(cfg, measurement: dict, repeats: int) -> dict:
  """A measurement of a version that timed no moves, with what they need timed now: the eval
  program's compile, the moves of the normal role's group, the update and the eval programs."""
  mesh, graphdef = _one_device(cfg)
  b, compile_s = cfg.train.micro_batch, dict(measurement['compile_s'])
  programs = {
      role_name(Role(b)): slice_steps.lower_group(cfg, mesh, Role(b), graphdef).compile(),
      'update': slice_steps.lower_update(cfg, mesh).compile(),
      'eval': _timed_compile(compile_s, 'eval',
                             lambda: train_step.lower_eval(cfg, mesh, b, graphdef).compile())}
  return {**measurement, 'compile_s': compile_s, **time_moves(programs, repeats),
          'moves_timed_later': True}


def time_restore(cfg, mesh, state, repeats: int = 3) -> dict:
  """Seconds to restore the state from a durable Orbax checkpoint on local disk (restart cost)."""
  with tempfile.TemporaryDirectory(dir=os.environ.get('MECEFO_RESTORE_DIR')) as root:
    root = Path(root)
    # Memory tier never due (every=huge): the save and the restores go to the durable tier only.
    with manager.SnapshotManager(root / 'memory', every=1 << 40, durable_dir=root / 'durable',
                                  durable_every=1) as saver:
      saver.maybe_save(1, state, {'step': 1})
      saver.wait_until_finished()
    want, seconds = train_state.params_sha256(state.params), []
    for _ in range(repeats):
      with manager.SnapshotManager(root / 'memory2', every=1 << 40, durable_dir=root / 'durable',
                                    durable_every=1) as fresh:
        t0 = time.perf_counter()
        step, restored, *_ = recovery.restore(fresh, cfg, mesh)
        jax.block_until_ready(restored)
        seconds.append(time.perf_counter() - t0)
      assert step == 1 and train_state.params_sha256(restored.params) == want
    return {'restore_s': statistics.median(seconds), 'restore_s_all': seconds,
            'restore_dir_fs': _fs_type(root)}


def _fs_type(path: Path) -> str:
  """Filesystem type of `path` from /proc/mounts (longest matching mount point)."""
  try:
    mounts = [line.split()[1:3] for line in Path('/proc/mounts').read_text().splitlines()]
  except OSError:
    return 'unknown'
  best = max((m for m in mounts if str(path.resolve()).startswith(m[0])), key=lambda m: len(m[0]))
  return f'{best[1]} at {best[0]}'
