"""How long the suite's two workers take under pytest-xdist's `--dist loadfile` for an order of
the test files, replayed from the per-test seconds of a run (--junitxml): xdist's own order (the
most tests first) against the heaviest first (tests/order.py, by tests/file_order.json).

  python -m benchmarks.suite_schedule --junit suite.xml [--order FILE] [--workers 2] [--json OUT]

A replay, not a run: each test takes the seconds it took in that run, whatever ran beside it.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.suite_schedule')

import argparse
import json
import sys
from pathlib import Path

from benchmarks.suite_table import durations, file_seconds, heaviest_first, read_order

ORDER = Path(__file__).resolve().parents[1] / 'tests' / 'file_order.json'
PENDING = 2  # xdist's loadscope: a worker is given its next file once <= 2 of its tests are left


def replay(tests_by_file: dict[str, list[float]], order: list[str], workers: int) -> list[float]:
  """Each worker's end (s) when the files are handed out in `order` as xdist's loadscope
  scheduler does: one to each worker, then the next to a worker with <= PENDING tests left."""
  queue, pending, clock = list(order), [[] for _ in range(workers)], [0.0] * workers

  def give(w: int) -> None:
    if queue:
      pending[w].extend(tests_by_file[queue.pop(0)])
  for w in range(workers):
    give(w)
  for w in range(workers):
    if len(pending[w]) <= PENDING:
      give(w)
  while any(pending):
    w = min((w for w in range(workers) if pending[w]), key=lambda w: clock[w] + pending[w][0])
    clock[w] += pending[w].pop(0)
    if len(pending[w]) <= PENDING:
      give(w)
  return clock


def compare(times: dict[str, float], workers: int, weights: dict[str, float]) -> dict:
  """{order name: each worker's end} for xdist's order and for the heaviest first (`weights`)."""
  by_file: dict[str, list[float]] = {}
  for test in sorted(times):
    by_file.setdefault(test.split('::')[0], []).append(times[test])
  files = list(by_file)
  most_tests = sorted(files, key=lambda f: -len(by_file[f]))  # xdist's reorder (stable)
  return {name: [round(t, 1) for t in replay(by_file, o, workers)] for name, o in (
      ('xdist: most tests first', most_tests),
      ('heaviest first: tests/file_order.json', heaviest_first(files, weights)),
      ("heaviest first: this run's seconds", heaviest_first(files, file_seconds(times))))}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--junit', type=Path, required=True, help="pytest's --junitxml file of a run")
  p.add_argument('--order', type=Path, default=ORDER,
                 help='the files\' seconds (default: tests/file_order.json)')
  p.add_argument('--workers', type=int, default=2)
  p.add_argument('--json', type=Path, default=None)
  args = p.parse_args(argv)
  times, wall_s = durations(args.junit)
  result = {'junit': str(args.junit), 'wall_s': wall_s, 'workers': args.workers,
            'ends': compare(times, args.workers, read_order(args.order))}
  print('| order | workers end (s) | last (s) |\n|---|---|---|')
  for name, ends in result['ends'].items():
    print(f"| {name} | {', '.join(f'{t:g}' for t in ends)} | {max(ends):g} |")
  if args.json:
    args.json.write_text(json.dumps(result, indent=2) + '\n')
  return 0


if __name__ == '__main__':
  sys.exit(main())
