"""Quality under failures: fault-free vs takeover policies, same data, seed and failures.

Run (scripted): python -m benchmarks.quality --config configs/tiny.yaml --json OUT.json
Run (§5 presets): python -m benchmarks.quality --presets low,mid,high [--data text:PATH]
    [--cluster-step-s 1800] [--rate per_device|cluster] [--figure OUT.png] [overrides...]
Run (seeds): add --seeds 0,1,2,3,4 to the presets run: mean, std and SEM over seeds
    (--figure: each seed's increase and the mean +- SEM per policy).
Policies: takeover names, or 'budget:T' (budget at faults.time_budget T), as failure_throughput.
Scripted: slice 1 is down from --fail-at to --repair-at (fractions of the run). Presets: the
FailureSchedule preset Poisson process (docs/algorithm.md §5), one cluster step = --cluster-step-s
simulated seconds; --rate per_device (default) scales the mean interval by 32/slices, so the
slices see the paper's per-GPU failure rate and the same fraction of them is down on average.
When every slice is down the cluster waits for the first repair (simulate.stall_all_down), as
the throughput replay does, so every run trains all its steps.
Run (a node fault log): python -m benchmarks.quality --trace FILE --seeds 0,1,2 [--days A:B]
    [--trace-nodes 400] [--classes all] [--replay TRACE_GOODPUT.json] [overrides...]: per seed its
    own draw of nodes onto slices, the window compressed into train.steps (benchmarks/quality_trace.py);
    each run's degraded rows beside the replay's at its own scale.
Every policy trains the same samples (drop skips the failed slices') from the same initial
state. Reports the final eval loss on one fixed held-out set, perplexity, and their increase
vs fault-free (the paper's table reports perplexity), plus wall time.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import argparse
from pathlib import Path

import benchmarks
from benchmarks.quality_runs import _cfg, _relative, mean_std_sem, schedule_stats, train
from mecefo_jax.config import PRESETS, RATES  # imports no jax (fake_cpu_devices must come first)


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--config', default='configs/tiny.yaml')
  p.add_argument('--json', default=None)
  p.add_argument('--slices', type=int, default=4)
  p.add_argument('--policies', default=None,
                 help='default: neighbor,spread,drop,naive (scripted), neighbor,spread,drop (presets)')
  p.add_argument('--fail-at', type=float, default=0.2, help='scripted: fraction of the run')
  p.add_argument('--repair-at', type=float, default=0.7, help='scripted: fraction of the run')
  p.add_argument('--presets', default='', help=f"e.g. {','.join(PRESETS)}: preset failures instead")
  # 300 steps x 1800 s = 150 h: at 'high' (per_device, 4 slices) ~39 failures of 4 steps each,
  # so a seed's share of degraded steps is near the preset's mean (0.40 +- 0.05 over 20 seeds).
  p.add_argument('--cluster-step-s', type=float, default=1800.0,
                 help='presets: simulated seconds per step')
  p.add_argument('--rate', choices=RATES, default='per_device')
  p.add_argument('--schedule-seed', type=int, default=None, help='default: train.seed')
  p.add_argument('--seeds', default='',
                 help='presets: e.g. 0,1,2,3,4: the whole comparison once per train.seed (init, '
                      'data order and failure draws), summarized as mean +- std over seeds')
  p.add_argument('--trace', default='', help='a JSON node fault log instead of presets (needs --seeds)')
  p.add_argument('--days', default='', help="trace: window A:B in the log's days (default: all)")
  p.add_argument('--trace-nodes', type=int, default=400, help="trace: the cluster's size")
  p.add_argument('--classes', default='all', help='trace: fault classes that count')
  p.add_argument('--replay', default=None, help="trace: the log's trace_goodput JSON (predictions)")
  p.add_argument('--data', default=None, help='train.data: synthetic | text:PATH | ...')
  p.add_argument('--eval-batches', type=int, default=8)
  p.add_argument('--figure', default=None,
                 help='presets: loss curves PNG; seeds: increase per seed, mean +- SEM')
  p.add_argument('overrides', nargs='*')
  args = p.parse_intermixed_args(argv)
  args.presets = [x for x in args.presets.split(',') if x]
  args.seeds = [int(x) for x in args.seeds.split(',') if x]
  if args.figure and not args.presets:
    p.error('--figure needs --presets')
  if args.seeds and (not (args.presets or args.trace) or args.schedule_seed is not None):
    p.error('--seeds needs --presets or --trace, and draws the schedules from each seed (no '
            '--schedule-seed)')
  if args.trace and (args.presets or not args.seeds):
    p.error('--trace needs --seeds and no --presets')
  args.policies = (args.policies or ('spread,budget:1.0,budget:1.05,exact,drop' if args.trace else
                                     'neighbor,spread,drop' if args.presets
                                     else 'neighbor,spread,drop,naive')).split(',')
  return args


def main(argv=None) -> dict:
  args = _args(argv)
  benchmarks.fake_cpu_devices(args.slices)  # one per slice; jax is imported only after this
  from benchmarks import common
  from mecefo_jax.plan.runs import policy_spec
  info = common.run_info(__spec__.name, argv)
  for spec in args.policies:  # a typo fails here, not after the fault-free run
    policy_spec(spec)
  if args.trace:
    from benchmarks import quality_trace
    result = quality_trace.run_trace(args)
  else:
    result = (run_seeds(args) if args.seeds else run_presets(args) if args.presets
              else run_scripted(args))
  result = {**info, **result, 'config': args.config, 'overrides': args.overrides,
            'slices': args.slices, 'data': args.data or 'synthetic'}
  rows = table_rows(result)
  common.emit(result, common.markdown_table(rows, list(rows[0])), args.json)
  if args.figure:
    (plot_seeds if result['mode'] == 'seeds' else plot)(result, args.figure)
  return result


# --- runs ---------------------------------------------------------------------------------------

def run_scripted(args) -> dict:
  from mecefo_jax.core.failures import FailureSchedule
  steps = _cfg(args, 'fault-free').train.steps
  runs = {}
  for policy in ['fault-free', *args.policies]:
    schedule = FailureSchedule(args.slices)
    if policy != 'fault-free':
      schedule.fail_at(1, int(args.fail_at * steps)).repair_at(1, int(args.repair_at * steps))
    runs[policy] = train(args, policy, schedule)
  _relative(runs, runs['fault-free'])
  return {'mode': 'scripted', 'down_fraction': args.repair_at - args.fail_at, 'runs': runs}


def run_presets(args) -> dict:
  from mecefo_jax.plan import simulate
  from mecefo_jax.core.failures import FailureSchedule, rate_scale
  cfg = _cfg(args, 'fault-free')
  n, steps = args.slices, cfg.train.steps
  seed = cfg.train.seed if args.schedule_seed is None else args.schedule_seed
  scale = rate_scale(args.rate, n)
  fault_free = train(args, 'fault-free', FailureSchedule(n))
  presets = {}
  for preset in args.presets:
    schedule = simulate.preset_schedule(preset, n, steps, args.cluster_step_s, seed, scale,
                                        stall=True)
    runs = {policy: train(args, policy, schedule) for policy in args.policies}
    _relative(runs, fault_free)
    presets[preset] = {'schedule': schedule_stats(schedule, n, steps), 'runs': runs}
  return {'mode': 'presets', 'cluster_step_s': args.cluster_step_s, 'rate': args.rate,
          'interval_scale': scale, 'schedule_seed': seed, 'steps': steps,
          'simulated_hours': steps * args.cluster_step_s / 3600.0, 'fault_free': fault_free,
          'presets': presets, 'floor_2pct_at_high': _floor(presets)}


def run_seeds(args) -> dict:
  """run_presets once per seed in --seeds; per preset and policy, the spread of the increase."""
  per_seed = {}
  for seed in args.seeds:
    one = argparse.Namespace(**{**vars(args), 'overrides': [*args.overrides, f'train.seed={seed}']})
    per_seed[seed] = run_presets(one)
  summary = seed_summary(per_seed)
  high = summary.get('high', {})
  return {'mode': 'seeds', 'seeds': args.seeds, 'summary': summary, 'per_seed': per_seed,
          'floor_2pct_at_high': {p: {'mean_eval_increase_pct': v['mean'], 'met': v['mean'] <= 2.0}
                                 for p, v in high.items()}}


def seed_summary(per_seed: dict) -> dict:
  """{preset: {policy: mean, std, sem, min, max, per_seed}} of the eval-loss increase."""
  import numpy as np
  first = next(iter(per_seed.values()))['presets']
  summary = {}
  for preset, v in first.items():
    for policy in v['runs']:
      x = np.array([r['presets'][preset]['runs'][policy]['eval_increase_pct']
                    for r in per_seed.values()])
      summary.setdefault(preset, {})[policy] = {
          **mean_std_sem(x), 'min': float(x.min()), 'max': float(x.max()), 'per_seed': x.tolist()}
  return summary


def _floor(presets: dict) -> dict:
  """The issue's floor: eval loss increase <= 2% at the high preset, per policy."""
  high = presets.get('high', {}).get('runs', {})
  return {p: {'eval_increase_pct': r['eval_increase_pct'], 'met': r['eval_increase_pct'] <= 2.0}
          for p, r in high.items()}


# --- output -------------------------------------------------------------------------------------

def table_rows(result: dict) -> list[dict]:
  def row(preset, policy, r, sched=None):
    return {'preset': preset, 'policy': policy, 'eval_loss': r['eval_loss'],
            'ppl': r['perplexity'], 'loss_increase_pct': r.get('eval_increase_pct', 0.0),
            'ppl_increase_pct': r.get('ppl_increase_pct', 0.0),
            'failures': sched['failures'] if sched else '',
            'steps_with_failure': sched['steps_with_failure_frac'] if sched else '',
            'degraded': r['samples'].get('degraded', 0), 'dropped': r['samples'].get('dropped', 0),
            'wall_s': r['wall_s']}
  if result['mode'] == 'trace':
    return [{'policy': policy, 'seeds': len(result['seeds']),
             'mean_loss_increase_pct': v['eval_increase_pct']['mean'],
             'sem': v['eval_increase_pct']['sem'], 'degraded_pct': v['degraded_pct'],
             'dropped_pct': v['dropped_pct'], 'within_bound': v['within_bound']}
            for policy, v in result['summary'].items() if policy != 'down_pct_per_seed']
  if result['mode'] == 'seeds':
    return [{'preset': preset, 'policy': policy, 'seeds': len(result['seeds']),
             'mean_loss_increase_pct': v['mean'], 'std': v['std'], 'sem': v['sem'],
             'min': v['min'], 'max': v['max']}
            for preset, by_policy in result['summary'].items() for policy, v in by_policy.items()]
  if result['mode'] == 'scripted':
    return [row('scripted', p, r) for p, r in result['runs'].items()]
  rows = [row('none', 'fault-free', result['fault_free'])]
  for preset, v in result['presets'].items():
    rows += [row(preset, p, r, v['schedule']) for p, r in v['runs'].items()]
  return rows


def plot(result: dict, path: str, window: int = 10) -> None:
  """Per preset: train loss curves (top) and their moving-average gap to fault-free (bottom),
  with the steps that have a slice down shaded."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import numpy as np
  presets = result['presets']
  fig, axes = plt.subplots(2, len(presets), figsize=(max(5.2 * len(presets), 7.0), 6.6), squeeze=False,
                           sharex=True)
  base = np.asarray(result['fault_free']['losses'])
  smooth = lambda y: np.convolve(y, np.ones(window) / window, mode='valid')
  for k, (preset, v) in enumerate(presets.items()):
    top, bottom = axes[0][k], axes[1][k]
    live = np.asarray(v['schedule']['live_per_step'])
    for ax in (top, bottom):
      ax.fill_between(np.arange(len(live)), 0, 1, where=live < result['slices'], step='post',
                      color='0.85', transform=ax.get_xaxis_transform(), label='slice(s) down')
    top.plot(base[:, 0], base[:, 1], 'k-', lw=1, label='fault-free')
    for policy, r in v['runs'].items():
      curve = np.asarray(r['losses'])
      top.plot(curve[:, 0], curve[:, 1], lw=0.8, label=f"{policy} ({r['eval_increase_pct']:+.2f}%)")
      gap = smooth(curve[:, 1] - base[:, 1])
      bottom.plot(curve[window - 1:, 0], gap, lw=1, label=policy)
    top.set_title(f"{preset}: {v['schedule']['failures']} failures, "
                  f"{100 * v['schedule']['steps_with_failure_frac']:.0f}% of steps degraded",
                  fontsize=9)
    top.set_ylabel('train loss')
    bottom.axhline(0.0, color='k', lw=0.6)
    bottom.set_ylabel(f'loss − fault-free ({window}-point mean)')
    bottom.set_xlabel('step')
    top.legend(fontsize=7)
  _finish(fig, result, f"{result['cluster_step_s']:g} s/step ({result['simulated_hours']:.0f} h), "
                      f"rate {result['rate']}", path)


def plot_seeds(result: dict, path: str) -> None:
  """Per preset: each policy's eval-loss increase per seed (dots), mean +- SEM, the 2% floor."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  summary = result['summary']
  fig, axes = plt.subplots(1, len(summary), figsize=(max(4.5 * len(summary), 6.0), 4.2),
                           squeeze=False)
  for ax, (preset, by_policy) in zip(axes[0], summary.items()):
    for x, (policy, v) in enumerate(by_policy.items()):
      ax.plot([x] * len(v['per_seed']), v['per_seed'], 'o', color='0.6', ms=4)
      ax.errorbar(x, v['mean'], yerr=v['sem'], fmt='s', color='C0', capsize=4)
    ax.set_xticks(range(len(by_policy)), list(by_policy))
    ax.axhline(0.0, color='k', lw=0.6)
    ax.axhline(2.0, color='C3', lw=0.8, ls='--', label='2% floor')
    ax.set_title(f'{preset}: seeds {result["seeds"]} (grey), mean ± SEM (blue)', fontsize=9)
    ax.set_ylabel('eval loss vs fault-free (%)')
    ax.legend(fontsize=7)
  _finish(fig, result, f"{len(result['seeds'])} seeds", path)


def _finish(fig, result: dict, detail: str, path: str) -> None:
  """Title (config, overrides, data, slices, `detail`), layout, write the PNG."""
  import textwrap
  name = textwrap.fill(' '.join([Path(result['config']).stem, *result['overrides']]), 120)
  fig.suptitle(f"{name}\ndata {result['data']}, {result['slices']} slices, {detail}", fontsize=8)
  fig.tight_layout()
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
