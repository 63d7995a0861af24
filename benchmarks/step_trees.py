"""Normal and degraded step time of two trees, alternated: before/after a change to the model.

Run: python -m benchmarks.step_trees --trees /path/to/base . --config configs/llama_60m.yaml
Each run is one process in a tree's root that compiles the normal step on one micro-batch and
the degraded step on two (as benchmarks.step_cost does), runs them interleaved `--steps` times
after one warm-up, and prints the median wall and process-CPU seconds per step and each
program's temp memory. Trees alternate run by run; the table holds the medians over runs.
Only APIs both the per-block tree (d33af66) and the scanned one have are used.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import add_keep_xla_flags, emit, job_env, markdown_table, run_info

# Run in the tree's root with its own package: argv = config, steps.
DRIVER = '''
import json, statistics, sys, time, jax
from benchmarks import common
from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.model import bases, llama, train_state
from mecefo_jax.core.roles import Role
from mecefo_jax.step import train_step
cfg = load_config(sys.argv[1], ['mesh.slice=1', 'mesh.fsdp=1', 'mesh.tensor=1'])
mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
graphdef, _, _ = llama.abstract(cfg.model)
b = cfg.train.micro_batch
roles = {'normal_1': Role(exact=b), 'degraded_2': Role(degraded=2 * b)}
compiled = {n: train_step.lower_step(cfg, mesh, r, graphdef).compile() for n, r in roles.items()}
states = {n: train_state.create_sharded(cfg, mesh) for n in roles}
if bases.kind(cfg).refresh is not None:
  states['degraded_2'] = train_step.lower_refresh(cfg, mesh).compile()(states['degraded_2'])
runners = common.donating_runners(compiled, states, common.random_tokens(cfg, roles),
                                  train_state.schedule_on(cfg, mesh))
res = {n: {'wall_s': [], 'cpu_s': []} for n in roles}
for i in range(int(sys.argv[2]) + 1):
  for n, run in runners.items():
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(run())
    if i:  # the first round warms up
      res[n]['wall_s'].append(time.perf_counter() - wall)
      res[n]['cpu_s'].append(time.process_time() - cpu)
out = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in res.items()}
for n, c in compiled.items():
  out[n]['temp_MiB'] = c.memory_analysis().temp_size_in_bytes / 2**20
print(json.dumps(out))
'''


def one_run(tree: Path, config: str, steps: int, keep_xla_flags: bool = False) -> dict:
  env = job_env(keep_xla_flags, keep_cache=True, PYTHONPATH='.')
  proc = subprocess.run([sys.executable, '-c', DRIVER, config, str(steps)], cwd=tree, env=env,
                        capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    raise RuntimeError(f'{tree}: exit {proc.returncode}\n{proc.stderr[-2000:]}')
  return {**json.loads(proc.stdout.strip().splitlines()[-1]), 'load': os.getloadavg()[0]}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--trees', nargs='+', default=['.'])
  ap.add_argument('--config', default='configs/llama_60m.yaml')
  ap.add_argument('--repeats', type=int, default=3, help='runs per tree, alternated')
  ap.add_argument('--steps', type=int, default=5, help='timed steps of each program per run')
  add_keep_xla_flags(ap)
  ap.add_argument('--json', default=None)
  args = ap.parse_args()
  runs = {t: [] for t in args.trees}
  for _ in range(args.repeats):
    for tree in args.trees:
      runs[tree].append(one_run(Path(tree), args.config, args.steps, args.keep_xla_flags))
      print(f'{tree}: {runs[tree][-1]}', flush=True)
  rows = []
  for tree, rs in runs.items():
    med = lambda prog, key: statistics.median(r[prog][key] for r in rs)
    rows.append({'tree': tree, 'normal_s': med('normal_1', 'wall_s'),
                 'normal_cpu_s': med('normal_1', 'cpu_s'),
                 'degraded_s': med('degraded_2', 'wall_s'),
                 'time_ratio': med('degraded_2', 'wall_s') / med('normal_1', 'wall_s'),
                 'normal_MiB': med('normal_1', 'temp_MiB'),
                 'memory_ratio': med('degraded_2', 'temp_MiB') / med('normal_1', 'temp_MiB'),
                 'runs': rs})
  emit({**run_info('benchmarks.step_trees', None), 'config': args.config, 'rows': rows},
       markdown_table(rows, [c for c in rows[0] if c != 'runs']), args.json)


if __name__ == '__main__':
  main()
