"""Throughput-quality frontier: each policy's throughput drop at scale against its eval-loss cost.

Run: python -m benchmarks.frontier --quality Q.json [Q2.json ...] --throughput T.json
     [--slices 32] [--preset high] [--recommend POLICY] [--figure F.png] [--json OUT.json]
Q.json: benchmarks.quality with --seeds (eval-loss increase vs fault-free per seed, at its own
--slices); several (e.g. one process per seed) are joined into one seed set. T.json:
benchmarks.failure_throughput with several --slices (drop_pct per slice count, policy and
preset). Reads both, writes no new measurement: x = throughput drop at
--slices, y = mean eval-loss increase +- SEM over the seeds. checkpoint-restart is not trained:
it retrains the lost steps exactly (same rows, same order, same programs), so its final state is
the fault-free one and y = 0 by construction. The targets (issue 18): drop <= 2% at --slices and
eval-loss increase <= +1% (mean over seeds).

To weigh one against the other, each seed's loss increase is converted into the extra
fault-free steps it is worth (the increase over the slope of the fault-free held-out loss, fitted
over the run's last MAKE_UP_WINDOW steps), and drop and extra steps into the time to reach the
fault-free loss: slowdown = 1 - (1 - drop) / (1 + extra). Without --recommend, the takeover
policy (checkpoint-restart needs a spare: not one) with the smallest slowdown among those that
meet both targets is recommended, or, when none does, among all. Never recommended: a policy
that drops samples (drop; the product's promise is that nothing is dropped) or one whose exact
rows per slice grow with the failures (MEMORY_GROWS: a slice's activation memory grows to
n/(n-d) or 2x a normal step's, what MeCeFO exists to avoid).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import argparse
import json
import math
import textwrap
from pathlib import Path

from benchmarks import quality as quality_benchmark

CHECKPOINT = 'checkpoint-restart'
TARGET_DROP_PCT, TARGET_LOSS_PCT = 2.0, 1.0
# One pass of all a slice's exact rows: exact takes n/(n-d) micro-batches, naive two.
MEMORY_GROWS = ('exact', 'naive')
MAKE_UP_WINDOW = 300  # steps at the end of the fault-free run whose held-out slope converts
# docs/algorithm.md §6 (32 A100s, C4, `high`): throughput loss %, perplexity no failure -> high.
PAPER = {'350M': (1.07, 18.74, 19.04), '1B': (2.98, 15.49, 15.83), '7B': (4.18, 14.92, 15.16)}


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--quality', required=True, nargs='+', help='benchmarks.quality --seeds JSONs')
  p.add_argument('--throughput', required=True, help='benchmarks.failure_throughput JSON')
  p.add_argument('--slices', type=int, default=32, help='x axis: the drop at this slice count')
  p.add_argument('--preset', default='high')
  p.add_argument('--recommend', default=None,
                 help='default: the fastest to the fault-free loss (see the module docstring)')
  p.add_argument('--figure', default=None)
  p.add_argument('--json', default=None)
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = _args(argv)
  quality = join_seeds([json.loads(Path(q).read_text()) for q in args.quality])
  throughput = json.loads(Path(args.throughput).read_text())
  result = frontier(quality, throughput, args.slices, args.preset, args.recommend)
  result['inputs'] = {'quality': args.quality, 'throughput': args.throughput}
  from benchmarks import common  # imports jax: only after the inputs are read
  result = {**common.run_info(__spec__.name, argv), **result}
  rows = table_rows(result)
  common.emit(result, common.markdown_table(rows, list(rows[0])), args.json)
  if args.figure:
    plot(result, quality, args.figure)
  return result


def join_seeds(parts: list[dict]) -> dict:
  """One quality --seeds result from several runs of the same study (e.g. one per seed)."""
  same = ('config', 'overrides', 'slices', 'data', 'mode')
  for part in parts[1:]:
    differ = [k for k in same if part.get(k) != parts[0].get(k)]
    if differ:
      raise ValueError(f'--quality files differ in {differ}: not one study')
  per_seed = {str(s): r for part in parts for s, r in part['per_seed'].items()}
  if len(per_seed) < sum(len(part['per_seed']) for part in parts):
    raise ValueError('--quality files repeat a seed')
  return {**parts[0], 'seeds': sorted(int(s) for s in per_seed), 'per_seed': per_seed,
          'summary': quality_benchmark.seed_summary(per_seed),
          'commits': [p['commit'] for p in parts]}


def paper_points() -> dict:
  """{size: (throughput loss %, eval-loss increase %)}: the perplexities as ln ppl (the loss)."""
  return {size: (x, 100.0 * (math.log(high) / math.log(free) - 1.0))
          for size, (x, free, high) in PAPER.items()}


def frontier(quality: dict, throughput: dict, slices: int, preset: str,
             recommend: str | None = None) -> dict:
  """Per policy: drop at `slices` and at the quality run's slice count, eval-loss increase."""
  if quality.get('mode') != 'seeds':
    raise ValueError('--quality must come from benchmarks.quality --seeds')
  by_slices = throughput['results_by_slices']
  q_slices = quality['slices']
  for n in (slices, q_slices):
    if str(n) not in by_slices:
      raise ValueError(f'--throughput has no {n}-slice results (has {sorted(by_slices, key=int)})')
  loss = dict(quality['summary'][preset])
  loss[CHECKPOINT] = {'mean': 0.0, 'sem': 0.0, 'per_seed': [], 'by_construction': True}
  policies = {}
  for policy, y in loss.items():
    if policy not in by_slices[str(slices)]:
      continue  # no throughput figure for it (e.g. a probe such as naive)
    at = {n: by_slices[str(n)][policy][preset] for n in (slices, q_slices)}
    x, x_q = at[slices]['drop_pct'], at[q_slices]['drop_pct']
    runs = [run['presets'][preset]['runs'][policy] for run in quality['per_seed'].values()
            if policy != CHECKPOINT]
    make_up_per_seed = ([make_up_steps_pct(run, r['eval_increase_pct'])
                         for run, r in zip(quality['per_seed'].values(), runs)] or [0.0])
    slowdown = quality_benchmark.mean_std_sem([slowdown_pct(x, m) for m in make_up_per_seed])
    make_up = quality_benchmark.mean_std_sem(make_up_per_seed)
    policies[policy] = {
        f'drop_pct_at_{slices}': x, f'drop_pct_at_{q_slices}': x_q,
        # programs: compiles of new shapes and moves onto new sets (older replays: compiles only)
        f'programs_pct_at_{slices}': 100.0 * (at[slices].get('compile_time_frac', math.nan)
                                              + at[slices].get('move_time_frac', 0.0)),
        'loss_increase_pct': y['mean'], 'loss_increase_sem': y['sem'],
        'loss_increase_per_seed': y['per_seed'], 'by_construction': bool(y.get('by_construction')),
        'samples_dropped': sum(r['samples']['dropped'] for r in runs),
        'make_up_steps_pct': make_up['mean'], 'make_up_steps_sem': make_up['sem'],
        f'time_to_loss_slowdown_pct_at_{slices}': slowdown['mean'],
        f'time_to_loss_slowdown_sem_at_{slices}': slowdown['sem'],
        'drop_excess_pct': x - TARGET_DROP_PCT, 'loss_excess_pct': y['mean'] - TARGET_LOSS_PCT,
        'targets_met': x <= TARGET_DROP_PCT and y['mean'] <= TARGET_LOSS_PCT}
  chosen = recommend or _recommend(policies, slices)
  if chosen not in policies:
    raise ValueError(f'--recommend {chosen!r}: no such policy in both inputs ({list(policies)})')
  return {'slices': slices, 'quality_slices': q_slices, 'preset': preset,
          'throughput_reading': throughput.get('args', {}).get('stat'),
          'seeds': quality['seeds'], 'targets': {'drop_pct': TARGET_DROP_PCT,
                                                 'loss_increase_pct': TARGET_LOSS_PCT},
          'make_up_window_steps': MAKE_UP_WINDOW,
          'recommended': chosen, 'recommended_by': 'argument' if recommend else 'time_to_loss',
          'policies': policies, 'paper': {k: {'drop_pct': x, 'loss_increase_pct': y}
                                          for k, (x, y) in paper_points().items()}}


def make_up_steps_pct(run: dict, increase_pct: float, window: int = MAKE_UP_WINDOW) -> float:
  """The extra fault-free steps (% of the run's) an eval-loss increase is worth at the run's end:
  the increase over the fault-free held-out loss's slope, fitted over its last `window` steps."""
  import numpy as np
  ff = run['fault_free']
  end = ff['evals'][-1]['step']
  tail = [(e['step'], e['loss']) for e in ff['evals'] if e['step'] >= end - window]
  if len(tail) < 2:
    raise ValueError(f'the fault-free run has {len(tail)} evals in its last {window} steps: '
                     'no slope (evaluate more often)')
  slope = float(np.polyfit(*np.asarray(tail).T, 1)[0])
  if slope >= 0:
    raise ValueError(f'the fault-free held-out loss rises over the last {window} steps '
                     f'({slope:+.2e}/step): an increase has no step equivalent')
  return 100.0 * (increase_pct / 100.0 * ff['eval_loss']) / -slope / run['steps']


def slowdown_pct(drop_pct: float, make_up_pct: float) -> float:
  """% of the fault-free speed lost on the way to the fault-free loss."""
  return 100.0 * (1.0 - (1.0 - drop_pct / 100.0) / (1.0 + make_up_pct / 100.0))


def _recommend(policies: dict, slices: int) -> str:
  takeover = {p: v for p, v in policies.items()
              if p not in (CHECKPOINT, *MEMORY_GROWS) and not v['samples_dropped']}
  pool = {p: v for p, v in takeover.items() if v['targets_met']} or takeover
  return min(pool, key=lambda p: pool[p][f'time_to_loss_slowdown_pct_at_{slices}'])


def table_rows(result: dict) -> list[dict]:
  n, q = result['slices'], result['quality_slices']
  def y(v):
    if v['by_construction']:
      return '0 (by construction)'
    seeds = ', '.join(f'{s:+.2f}' for s in v['loss_increase_per_seed'])
    return f"{v['loss_increase_pct']:+.2f} ± {v['loss_increase_sem']:.2f} ({seeds})"
  return [{'policy': p + (' (recommended)' if p == result['recommended'] else ''),
           f'drop_at_{n}_pct': v[f'drop_pct_at_{n}'],
           f'of_which_programs_at_{n}_pct': round(v[f'programs_pct_at_{n}'], 2),
           f'drop_at_{q}_pct': v[f'drop_pct_at_{q}'], f'loss_increase_at_{q}_pct': y(v),
           'make_up_steps_pct': f"{v['make_up_steps_pct']:+.1f} ± {v['make_up_steps_sem']:.1f}",
           f'time_to_loss_slowdown_at_{n}_pct': f"{v[f'time_to_loss_slowdown_pct_at_{n}']:.1f} ± "
                                                 f"{v[f'time_to_loss_slowdown_sem_at_{n}']:.1f}",
           'targets_met': v['targets_met']}
          for p, v in result['policies'].items()]


def plot(result: dict, quality: dict, path: str) -> None:
  """Left: the frontier (policies, the paper's points, the target box). Right: the fault-free
  runs' train and held-out loss per seed, to show they have left the fast descent."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, (ax, curves) = plt.subplots(1, 2, figsize=(12.5, 6.2), width_ratios=[1.3, 1.0])
  n, q = result['slices'], result['quality_slices']
  ax.fill_between([0, TARGET_DROP_PCT], -100, TARGET_LOSS_PCT, color='C2', alpha=0.12,
                  label=f'targets: drop ≤ {TARGET_DROP_PCT:g}%, loss ≤ +{TARGET_LOSS_PCT:g}%')
  for k, (policy, v) in enumerate(result['policies'].items()):
    x, y, e = v[f'drop_pct_at_{n}'], v['loss_increase_pct'], v['loss_increase_sem']
    hollow = v['by_construction']
    ax.errorbar(x, y, yerr=e, fmt='o', color=f'C{k}', capsize=4, ms=7,
                mfc='white' if hollow else f'C{k}',
                label=policy + (' (y = 0 by construction, not run)' if hollow else ''))
    ax.annotate(policy, (x, y), fontsize=7, xytext=(-30, 7) if hollow else (5, -10),
                textcoords='offset points', color=f'C{k}')
    if policy == result['recommended']:
      ax.plot(x, y, '*', ms=22, mfc='none', mec='k', mew=1.4, label=f'recommended: {policy}')
  for size, v in result['paper'].items():
    ax.plot(v['drop_pct'], v['loss_increase_pct'], 'D', color='0.45', ms=6)
    ax.annotate(f'paper {size}', (v['drop_pct'], v['loss_increase_pct']), fontsize=7,
                xytext=(4, -10 if size == '7B' else 4), textcoords='offset points', color='0.35')
  ax.plot([], [], 'D', color='0.45', label='paper, MeCeFO (32 A100s, LLaMA 350M-7B on C4)')
  ys = [v['loss_increase_pct'] + v['loss_increase_sem'] for v in result['policies'].values()]
  lows = [v['loss_increase_pct'] - v['loss_increase_sem'] for v in result['policies'].values()]
  ax.set_ylim(min(-0.5, min(lows) - 0.3), max(ys) + 0.5)
  ax.set_xlim(0, max(v[f'drop_pct_at_{n}'] for v in result['policies'].values()) * 1.08)
  ax.axhline(0.0, color='k', lw=0.6)
  reading = f', {result["throughput_reading"]} reading' if result.get('throughput_reading') else ''
  ax.set_xlabel(f'throughput drop at {n} slices, {result["preset"]}{reading} (%)')
  ax.set_ylabel(f'eval-loss increase at {q} slices vs fault-free (%, mean ± SEM)')
  ax.set_title(f'{result["preset"]}, per-device rate; seeds {result["seeds"]}', fontsize=9)
  ax.legend(fontsize=7, loc='upper center', bbox_to_anchor=(0.5, -0.13), ncol=2)
  _fault_free_curves(curves, quality)
  names = ', '.join(Path(q).name for q in result['inputs']['quality'])
  title = (f'throughput: {Path(result["inputs"]["throughput"]).name}; quality: {names} '
           f'(data {quality["data"]})')
  fig.suptitle(textwrap.fill(title, 160), fontsize=8)
  fig.tight_layout()
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  print(f'wrote {path}')


def _fault_free_curves(ax, quality: dict, window: int = 5) -> None:
  import numpy as np
  for k, (seed, run) in enumerate(quality['per_seed'].items()):
    ff = run['fault_free']
    steps, train = np.asarray(ff['losses']).T
    smooth = np.convolve(train, np.ones(window) / window, mode='valid')
    ax.plot(steps[window - 1:], smooth, color=f'C{k}', lw=0.8, alpha=0.6,
            label=f'seed {seed}: train ({window}-point mean)')
    evals = ff.get('evals') or []
    if evals:
      ax.plot([e['step'] for e in evals], [e['loss'] for e in evals], 'o-', color=f'C{k}',
              ms=3, lw=1.2, label=f'seed {seed}: held-out')
  ax.set_xlabel('step')
  ax.set_ylabel('loss (nats/token)')
  ax.set_title('fault-free runs', fontsize=9)
  ax.legend(fontsize=7)


if __name__ == '__main__':
  main()
