"""Per-slice step cost: normal step on one micro-batch vs degraded and naive exact steps on two.

Run: python -m benchmarks.step_cost --config configs/tiny.yaml [--model gpt2] --json OUT.json
Time is the median over interleaved repeats in one process; memory is XLA's compiled
temp memory (activations, gradients, optimizer temporaries) of each program.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import jax

from benchmarks import common
from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.model import bases, models, train_state
from mecefo_jax.core.roles import Role
from mecefo_jax.step import train_step


def main(argv=None):
  p = common.with_model(common.parser(__doc__.splitlines()[0]))
  p.add_argument('--repeats', type=int, default=10)
  args = p.parse_args(argv)
  cfg = load_config(args.config, ['mesh.slice=1', 'mesh.fsdp=1', 'mesh.tensor=1',
                                 *common.model_overrides(args)])
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  graphdef = models.spec(cfg.model).graphdef
  b = cfg.train.micro_batch
  roles = {'normal_1': Role(exact=b), 'degraded_2': Role(degraded=2 * b),
           'naive_2': Role(exact=2 * b)}
  compiled = {n: train_step.lower_step(cfg, mesh, r, graphdef).compile() for n, r in roles.items()}
  states = {n: train_state.create_sharded(cfg, mesh) for n in roles}
  if bases.kind(cfg).refresh is not None:
    states['degraded_2'] = train_step.lower_refresh(cfg, mesh).compile()(states['degraded_2'])
  runners = common.donating_runners(compiled, states, common.random_tokens(cfg, roles),
                                    train_state.schedule_on(cfg, mesh))
  times = common.interleaved_times(runners, args.repeats)
  mem = {n: train_step.memory_summary(c) for n, c in compiled.items()}
  temp = {n: m.get('temp_bytes', 0) for n, m in mem.items()}
  t = {n: v['median_s'] for n, v in times.items()}
  result = {
      **common.run_info(__spec__.name, argv), 'config': args.config, 'overrides': args.overrides,
      'model': cfg.model.kind,
      'micro_batch': b, 'seq_len': cfg.model.seq_len, 'mecefo': vars(cfg.mecefo),
      'times': times, 'memory': mem,
      'time_ratio': t['degraded_2'] / t['normal_1'],
      'memory_ratio': temp['degraded_2'] / max(temp['normal_1'], 1),
      'naive_time_ratio': t['naive_2'] / t['normal_1'],
      'naive_memory_ratio': temp['naive_2'] / max(temp['normal_1'], 1),
  }
  rows = [{'step': n, 'median_ms': 1e3 * t[n], 'temp_MiB': temp[n] / 2**20,
           'time_vs_normal': t[n] / t['normal_1'], 'mem_vs_normal': temp[n] / max(temp['normal_1'], 1)}
          for n in roles]
  common.emit(result, common.markdown_table(rows, list(rows[0])), args.json)
  return result


if __name__ == '__main__':
  main()
