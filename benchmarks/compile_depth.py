"""Compile time against depth: a 2-slice run with one failure at n_layers = 2 and 16, cold.

Run: python -m benchmarks.compile_depth --trees /path/to/base . --repeats 3 --json OUT.json
Each run is the command of docs/history.md "The scanned model", in a fresh HOME with no
compilation cache or program store; trees alternate run by run (a git worktree of the commit to
compare with, and this tree). Figures per run: programs (compiled + loaded + moved seconds),
report.json's `startup` where the tree writes one, the wall time and the CPU seconds.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import add_keep_xla_flags, emit, job_env, markdown_table, run_info


def command(out: Path, trace: Path, layers: int) -> list[str]:
  return ['python', 'train.py', '--out', str(out), '--host-devices', '2', 'mesh.slice=2',
          '--failures', f'trace:{trace}', '--takeover', 'spread', 'train.steps=6',
          f'model.n_layers={layers}',
          'train.eval_every=0', 'train.plot=false', 'train.compile_cache=', '-q']


def one_run(tree: Path, layers: int, keep_xla_flags: bool = False) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    trace = tmp / 'T'
    trace.write_text('3 1 fail\n')
    env = job_env(keep_xla_flags, HOME=str(tmp / 'home'))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # This interpreter, not whatever `python` is first on PATH (a virtualenv not activated).
    argv = [sys.executable, *command(tmp / 'D', trace, layers)[1:]]
    proc = subprocess.run(argv, cwd=tree, env=env,
                          capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
      raise RuntimeError(f'{tree} L={layers}: exit {proc.returncode}\n{proc.stderr[-2000:]}')
    report = json.loads((tmp / 'D' / 'report.json').read_text())
  p = report['programs']
  assert p['loaded'] == 0 and report['samples']['degraded'] > 0, (p, report['samples'])
  return {'programs_s': p['compiled_s'] + p['loaded_s'] + p['moved_s'],
          'compiled': p['compiled'], 'moved': p['moved'], 'startup': report.get('startup'),
          'wall_s': wall,
          'cpu_s': (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--trees', nargs='+', default=['.'], help='source trees (worktrees) to compare')
  ap.add_argument('--layers', type=int, nargs='+', default=[2, 16])
  ap.add_argument('--repeats', type=int, default=3)
  add_keep_xla_flags(ap)  # still cold: an empty HOME
  ap.add_argument('--json', default=None)
  args = ap.parse_args()
  runs = {(t, n): [] for t in args.trees for n in args.layers}
  for _ in range(args.repeats):
    for n in args.layers:
      for tree in args.trees:  # alternately, so that load drifts hit every tree alike
        runs[(tree, n)].append(one_run(Path(tree), n, args.keep_xla_flags))
        print(f'{tree} L={n}: {runs[(tree, n)][-1]}', flush=True)
  median = lambda xs: statistics.median(xs) if xs else None
  rows = []
  for (tree, n), rs in runs.items():
    first = [r['startup']['first_step_s'] for r in rs if r['startup']]
    rows.append({'tree': tree, 'n_layers': n, 'programs_s': median([r['programs_s'] for r in rs]),
                 'first_step_s': median(first), 'wall_s': median([r['wall_s'] for r in rs]),
                 'cpu_s': median([r['cpu_s'] for r in rs]), 'compiled': rs[0]['compiled'],
                 'moved': rs[0]['moved'], 'runs': rs})
  columns = ['tree', 'n_layers', 'programs_s', 'first_step_s', 'wall_s', 'cpu_s', 'compiled',
             'moved']
  emit({**run_info('benchmarks.compile_depth', None), 'rows': rows, 'load': os.getloadavg()},
       markdown_table(rows, columns), args.json)


if __name__ == '__main__':
  main()
