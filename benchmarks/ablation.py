"""Ablation of the degraded step: one slice carrying two micro-batches, adding §2's techniques in turn.

Run: python -m benchmarks.ablation --config configs/tiny.yaml [--model gpt2] --json OUT.json [--figure OUT.png]
     python -m benchmarks.ablation --from-json A.json,B.json --figure OUT.png  (re-plot only)
Variants (as the paper's ablation): (a) naive Neighbor-Do-Both = the exact step on 2
micro-batches, (b) + skip-MHA (attention branch cut in backward), (c) + FFN recompute
(jax.checkpoint), (d) + low-rank FFN Wgrad = the full MeCeFO degraded step; reference: the
normal step on 1 micro-batch. One CPU device, AOT-compiled; memory is XLA's compiled
memory analysis, time the median of interleaved repeats in one process, FLOPs XLA's cost
analysis.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import json
import os
from pathlib import Path

import jax
import numpy as np

from benchmarks import common
from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.model import bases, models, train_state
from mecefo_jax.model.contract import FULL, NONE, Degrade
from mecefo_jax.core.roles import Role
from mecefo_jax.step import train_step

# name -> (label, role in units of micro-batches: (exact, degraded), techniques)
VARIANTS = {
    'normal_1': ('normal step, 1 micro-batch (reference)', (1, 0), NONE),
    'naive_2': ('(a) naive Neighbor-Do-Both, 2 exact', (2, 0), NONE),
    'skip_2': ('(b) + skip-MHA', (0, 2), Degrade(skip_attention=True)),
    'skip_remat_2': ('(c) + FFN recompute', (0, 2), Degrade(skip_attention=True, remat_ffn=True)),
    'mecefo_2': ('(d) + low-rank FFN Wgrad = MeCeFO', (0, 2), FULL),
}


def peak_bytes(mem: dict) -> int:
  """Live bytes of one step: arguments + temporaries + outputs not aliased onto (donated) inputs."""
  return mem['argument_bytes'] + mem['temp_bytes'] + mem['output_bytes'] - mem['alias_bytes']


def compile_variants(cfg, mesh, graphdef) -> tuple[dict, dict]:
  """(compiled program, role) of every variant."""
  b, programs, roles = cfg.train.micro_batch, {}, {}
  for name, (_, (e, d), degrade) in VARIANTS.items():
    roles[name] = Role(exact=e * b, degraded=d * b)
    programs[name] = train_step.lower_step(cfg, mesh, roles[name], graphdef, degrade).compile()
  return programs, roles


def measure(cfg, repeats: int, warmup: int) -> dict:
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  graphdef = models.spec(cfg.model).graphdef
  programs, roles = compile_variants(cfg, mesh, graphdef)
  # Each donating program needs its own copy of the state; real svd bases for the low-rank one.
  state = train_state.create_sharded(cfg, mesh)
  if bases.kind(cfg).refresh is not None:
    state = train_step.lower_refresh(cfg, mesh).compile()(state)
  states = {n: jax.tree.map(lambda x: x.copy(), state) for n in VARIANTS}
  runners = common.donating_runners(programs, states, common.random_tokens(cfg, roles),
                                    train_state.schedule_on(cfg, mesh))
  times = common.interleaved_times(runners, repeats, warmup)
  memory = {n: train_step.memory_summary(p) for n, p in programs.items()}
  flops = {n: common.unrolled_flops(lambda n=n: train_step.lower_step(
      cfg, mesh, roles[n], graphdef, VARIANTS[n][2])) for n in programs}
  return {'times': times, 'memory': memory, 'flops': flops,
          'roles': {n: vars(r) for n, r in roles.items()}}


def rows(result: dict) -> list[dict]:
  """One table row per variant, ratios against the normal step of the same run."""
  t = {n: v['median_s'] for n, v in result['times'].items()}
  t_min = {n: v['min_s'] for n, v in result['times'].items()}
  mem, flops = result['memory'], result['flops']
  ref = 'normal_1'
  out = []
  for n, (label, _, _) in VARIANTS.items():
    out.append({'variant': label, 'median_ms': 1e3 * t[n], 'time_x': t[n] / t[ref],
                'time_x_min': t_min[n] / t_min[ref],
                'temp_MiB': mem[n]['temp_bytes'] / 2**20,
                'temp_x': mem[n]['temp_bytes'] / max(mem[ref]['temp_bytes'], 1),
                'peak_MiB': peak_bytes(mem[n]) / 2**20,
                'peak_x': peak_bytes(mem[n]) / peak_bytes(mem[ref]),
                'flops_x': flops[n] / flops[ref] if flops[ref] else float('nan')})
  return out


def plot(results: list[dict], path: str) -> None:
  """Bar chart per config: time, temp memory and FLOPs of each variant relative to normal."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.2), squeeze=False)
  metrics = [('time_x', 'time'), ('temp_x', 'temp memory'), ('flops_x', 'FLOPs')]
  for ax, result in zip(axes[0], results):
    table = rows(result)
    x = np.arange(len(table))
    for k, (key, label) in enumerate(metrics):
      ax.bar(x + (k - 1) * 0.27, [r[key] for r in table], 0.27, label=label)
    ax.axhline(1.0, color='k', ls='--', lw=0.8)
    ax.set_xticks(x, ['normal\n1 mb', '(a) naive\n2 mb', '(b) +skip\nMHA', '(c) +FFN\nremat',
                      '(d) +low-rank\n= MeCeFO'], fontsize=8)
    ax.set_ylabel('× normal step (1 micro-batch)')
    name = ' '.join([Path(result['config']).stem, result.get('model', 'llama'), *result['overrides']])
    ax.set_title(f"{name}: {result['micro_batch']}×{result['seq_len']} tokens per micro-batch",
                 fontsize=9)
    ax.legend(fontsize=8)
  fig.suptitle(f"Degraded-step ablation, one slice carrying 2 micro-batches "
               f"({results[0]['device']['device_kind']}, jax {results[0]['device']['jax']})",
               fontsize=10)
  fig.tight_layout()
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  print(f'wrote {path}')


def main(argv=None):
  p = common.with_model(common.parser(__doc__.splitlines()[0]))
  p.add_argument('--repeats', type=int, default=10)
  p.add_argument('--warmup', type=int, default=2)
  p.add_argument('--figure', default=None, help='write a PNG bar chart here')
  p.add_argument('--from-json', default=None, help='comma-separated results to re-plot (no timing)')
  args = p.parse_args(argv)
  if args.from_json:
    results = [json.loads(Path(f).read_text()) for f in args.from_json.split(',')]
    for r in results:
      print(common.markdown_table(rows(r), list(rows(r)[0])))
    if args.figure:
      plot(results, args.figure)
    return results
  cfg = load_config(args.config, ['mesh.slice=1', 'mesh.fsdp=1', 'mesh.tensor=1',
                                 *common.model_overrides(args)])
  result = {**common.run_info(__spec__.name, argv), 'config': args.config, 'model': cfg.model.kind,
            'overrides': args.overrides, 'micro_batch': cfg.train.micro_batch, 'seq_len': cfg.model.seq_len,
            'mecefo': vars(cfg.mecefo), 'repeats': args.repeats,
            'env': {'OPENBLAS_NUM_THREADS': os.environ.get('OPENBLAS_NUM_THREADS')},
            **measure(cfg, args.repeats, args.warmup)}
  table = rows(result)
  result['table'] = table
  common.emit(result, common.markdown_table(table, list(table[0])), args.json)
  if args.figure:
    plot([result], args.figure)
  return result


if __name__ == '__main__':
  main()
