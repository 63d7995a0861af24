"""How long until the first step, cold, seen from outside: any tree, with or without a start-up clock.

Run: python -m benchmarks.first_step --trees /path/to/base . --config configs/llama_350m.yaml
Each run is `python train.py --config C train.steps=3 train.eval_every=0 train.log_every=1
train.compile_cache= train.plot=false` in a fresh HOME. The clock runs from the process start to
the moment metrics.jsonl holds step 0's row (polled every 50 ms), so a tree without
report.json's `startup` is timed the same way; the first step's own compute is the median of
steps 1-2 (metrics.jsonl wall_s). Where the tree writes `startup`, its figures are kept too.
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
import tempfile
import time
from pathlib import Path

from benchmarks.common import emit, markdown_table, run_info


def _step0_row(metrics: Path) -> bool:
  try:
    return any(json.loads(line).get('step') == 0 for line in metrics.read_text().splitlines()
               if line.strip().endswith('}'))
  except (OSError, ValueError):
    return False


def one_run(tree: Path, config: str, overrides: list[str]) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    env = {k: v for k, v in os.environ.items()
           if k not in ('XLA_FLAGS', 'JAX_COMPILATION_CACHE_DIR')}
    env['HOME'] = str(tmp / 'home')
    cmd = ['python', 'train.py', '--out', str(tmp / 'D'), '--config', config, 'train.steps=3',
           'train.eval_every=0', 'train.log_every=1', 'train.compile_cache=', 'train.plot=false',
           '-q', *overrides]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None:
      if first is None and _step0_row(tmp / 'D' / 'metrics.jsonl'):
        first = time.perf_counter() - t0
      time.sleep(0.05)
    err = proc.stderr.read()
    if proc.returncode != 0:
      raise RuntimeError(f'{tree}: exit {proc.returncode}\n{err[-2000:]}')
    rows = [json.loads(line) for line in (tmp / 'D' / 'metrics.jsonl').read_text().splitlines()]
    walls = {r['step']: r['wall_s'] for r in rows if r.get('kind') == 'train'}
    report = json.loads((tmp / 'D' / 'report.json').read_text())
  compute = statistics.median([walls[1] - walls[0], walls[2] - walls[1]])
  return {'first_step_seen_s': first, 'step_compute_s': compute,
          'wait_s': first - compute if first is not None else None,
          'startup': report.get('startup'), 'programs': report.get('programs')}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--trees', nargs='+', default=['.'])
  ap.add_argument('--config', default='configs/llama_350m.yaml')
  ap.add_argument('--repeats', type=int, default=1)
  ap.add_argument('--json', default=None)
  ap.add_argument('overrides', nargs='*')
  args = ap.parse_args()
  runs = {t: [] for t in args.trees}
  for _ in range(args.repeats):
    for tree in args.trees:  # alternately
      runs[tree].append(one_run(Path(tree), args.config, args.overrides))
      print(f'{tree}: {runs[tree][-1]}', flush=True)
  median = lambda xs: statistics.median(xs) if xs else None
  rows = [{'tree': t, 'first_step_seen_s': median([r['first_step_seen_s'] for r in rs]),
           'step_compute_s': median([r['step_compute_s'] for r in rs]),
           'wait_s': median([r['wait_s'] for r in rs]),
           'init_compile_s': median([r['startup']['init_compile_s'] for r in rs
                                     if r['startup']]), 'runs': rs}
          for t, rs in runs.items()]
  columns = ['tree', 'first_step_seen_s', 'step_compute_s', 'wait_s', 'init_compile_s']
  emit({**run_info('benchmarks.first_step', None), 'rows': rows, 'load': os.getloadavg()},
       markdown_table(rows, columns), args.json)


if __name__ == '__main__':
  main()
