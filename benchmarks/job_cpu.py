"""What one supervised job costs the machine's CPUs from start to end, for trees side by side.

Run: python -m benchmarks.job_cpu --trees /path/to/base,. [--runs 3] [--processes 3]
    [--steps 30] [--json OUT] [overrides...]

Each run is the process tests' typical job: `python -m mecefo_jax.launch -n P
--devices-per-process 1 -- mesh.slice=P snapshot.every=1 train.log_every=1 train.eval_every=0
train.plot=false train.steps=S` with a tiny model, started from the tree (its code, cwd
and PYTHONPATH), with the tree's own program store warmed by one run first (not counted): the
suite shares one store (tests/conftest.py), so its jobs start warm. The trees take turns, run
by run, so that the machine's noise falls on each alike. Each run records its wall seconds and
the CPU seconds of the supervisor and every process it waited for (RUSAGE_CHILDREN); medians
per tree, and each tree's median against the first's.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common

TINY = ('model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=48', 'model.seq_len=16',
        'model.n_layers=1', 'train.micro_batch=4')


def _args(argv):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--trees', default='.', help='comma-separated source trees (the first: the base)')
  p.add_argument('--runs', type=int, default=3, help='counted runs per tree')
  p.add_argument('--processes', type=int, default=3)
  p.add_argument('--steps', type=int, default=30)
  return p.parse_intermixed_args(argv)


def _children_cpu() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def one_job(tree: Path, home: Path, args) -> dict:
  """One job from `tree`: {'wall_s', 'cpu_s'}; raises with its output's tail where it fails."""
  n = args.processes
  with tempfile.TemporaryDirectory(prefix='mecefo-jobcpu-') as out:
    cmd = [sys.executable, '-m', 'mecefo_jax.launch', '-n', str(n), '--devices-per-process', '1',
           '--', '--out', out, f'mesh.slice={n}', 'snapshot.every=1', 'train.log_every=1',
           'train.eval_every=0', 'train.plot=false', f'train.steps={args.steps}', *TINY,
           *args.overrides]
    env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}
    env.update(HOME=str(home), PYTHONPATH=str(tree))
    cpu0, t0 = _children_cpu(), time.perf_counter()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
  if done.returncode != 0:
    raise RuntimeError(f'{tree}: exit {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}')
  return {'wall_s': wall, 'cpu_s': cpu}


def main(argv=None) -> dict:
  args = _args(argv)
  info = common.run_info(__spec__.name, argv)
  trees = [Path(t).resolve() for t in args.trees.split(',')]
  load_before = os.getloadavg()
  runs: dict[str, list[dict]] = {str(t): [] for t in trees}
  with tempfile.TemporaryDirectory(prefix='mecefo-jobcpu-home-') as homes:
    home = {t: Path(homes) / str(i) for i, t in enumerate(trees)}  # a program store per tree
    for t in trees:
      one_job(t, home[t], args)  # warms its store
    for _ in range(args.runs):
      for t in trees:
        runs[str(t)].append(one_job(t, home[t], args))
  median = {t: {k: statistics.median(r[k] for r in rs) for k in ('wall_s', 'cpu_s')}
            for t, rs in runs.items()}
  base = median[str(trees[0])]
  rows = [{'tree': t, 'commit': _commit(Path(t)), 'wall_s': m['wall_s'], 'cpu_s': m['cpu_s'],
           'cpu_vs_first': m['cpu_s'] / base['cpu_s'],
           'wall_vs_first': m['wall_s'] / base['wall_s']}
          for t, m in median.items()]
  result = {**info, 'processes': args.processes, 'steps': args.steps, 'overrides': args.overrides,
            'load_before': load_before, 'load_after': os.getloadavg(), 'runs': runs, 'trees': rows}
  common.emit(result, common.markdown_table(rows, list(rows[0])), args.json)
  return result


def _commit(tree: Path) -> str:
  done = subprocess.run(['git', '--no-optional-locks', 'rev-parse', '--short', 'HEAD'], cwd=tree,
                        capture_output=True, text=True)
  dirty = subprocess.run(['git', '--no-optional-locks', 'status', '--porcelain', '--', '.',
                          ':!docs/results'], cwd=tree, capture_output=True, text=True).stdout
  return done.stdout.strip() + ('-dirty' if dirty.strip() else '')


if __name__ == '__main__':
  main()
