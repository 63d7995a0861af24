"""Pools the paired seeds of several `--trace --policies requeue` quality runs into one interval.

Run: python -m benchmarks.requeue_pool A.json B.json ... --json OUT.json
Each file is a `python -m benchmarks.quality --trace ... --policies requeue` result (issue 63:
requeue's eval loss minus the fault-free run's, at equal samples, per seed). The files must
share every setting but their seeds. A seed in two files (trained again, e.g. at a later commit)
counts once, with its first file's value; the two must agree within AGREE_PCT, or the pool is
refused. The interval is Student's t over all the seeds' paired differences
(`benchmarks/quality_runs.py` `t_interval`).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.requeue_pool')

import argparse
import json
from pathlib import Path

# What a pooled file must share: everything that shapes a seed's pair of runs but the seeds.
SAME = ('mode', 'trace', 'days', 'nodes', 'classes', 'steps', 'config', 'overrides', 'slices',
        'data', 'loss_bound_pct')
# How far a seed trained again may land from its first run, in points of eval-loss increase:
# 1/30 of the ±0.3 bound. Not to the bit: seed 9 trained alone (at 2a7ee5e and at db4121c alike,
# bit for bit) differs from seed 9 trained fifth in one process after seeds 5-8, from step 50 on,
# by ~1e-6 of the loss (a float-level effect of the process's history; its cause is not found).
AGREE_PCT = 0.01


def pool(files: dict[str, dict]) -> dict:
  """{'settings', 'per_seed': {seed: increase %}, 'reproduced': [seeds again], ...} of
  `files` (name -> a quality --trace result of the requeue policy)."""
  from benchmarks.quality_runs import mean_std_sem
  settings, by_seed, reproduced, sources = None, {}, [], []
  for name, d in files.items():
    if d.get('mode') != 'trace' or set(d['summary']) - {'down_pct_per_seed'} != {'requeue'}:
      raise ValueError(f'{name}: not a --trace --policies requeue result of benchmarks.quality')
    mine = {k: d.get(k) for k in SAME}
    if settings is not None and mine != settings:
      differ = [k for k in SAME if mine[k] != settings[k]]
      raise ValueError(f'{name}: its {", ".join(differ)} differ from the first file\'s')
    settings = mine
    for seed, value in zip(d['seeds'], d['summary']['requeue']['eval_increase_pct']['per_seed']):
      if seed in by_seed:
        if abs(by_seed[seed] - value) > AGREE_PCT:
          raise ValueError(f'{name}: seed {seed} gives {value:+.4f}%, an earlier file '
                           f'{by_seed[seed]:+.4f}% (more than {AGREE_PCT} points apart)')
        reproduced.append({'seed': seed, 'file': name, 'value': value, 'kept': by_seed[seed]})
      else:
        by_seed[seed] = value
    sources.append({'file': name, **{k: d[k] for k in ('commit', 'command', 'date', 'seeds')}})
  if not by_seed:
    raise ValueError('no files to pool')
  increase = mean_std_sem([by_seed[s] for s in sorted(by_seed)])
  bound, ci95 = settings['loss_bound_pct'], increase['ci95']
  return {'settings': settings, 'seeds': sorted(by_seed),
          'per_seed': {str(s): by_seed[s] for s in sorted(by_seed)}, 'reproduced': reproduced,
          'eval_increase_pct': increase,
          'within_bound': ci95 is not None and -bound <= ci95[0] and ci95[1] <= bound,
          'sources': sources}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('files', nargs='+', help='quality --trace --policies requeue result JSONs')
  p.add_argument('--json', default=None)
  args = p.parse_args(argv)
  from benchmarks import common
  info = common.run_info(__spec__.name, argv)
  result = {**info, **pool({Path(f).name: json.loads(Path(f).read_text()) for f in args.files})}
  e, ci = result['eval_increase_pct'], result['eval_increase_pct']['ci95']
  row = {'seeds': len(result['seeds']), 'mean %': e['mean'], 'std %': e['std'],
         '95% interval %': f'[{ci[0]:+.3f}, {ci[1]:+.3f}]' if ci else 'none (one seed)',
         f"within ±{result['settings']['loss_bound_pct']}%": result['within_bound']}
  common.emit(result, common.markdown_table([row], list(row)), args.json)
  return result


if __name__ == '__main__':
  main()
