"""The suite's slowest tests and what each pays for, from pytest's own durations (--junitxml) and
tests/costs.py's lines; written into docs/development.md (`--write`) so that growth shows.

  MECEFO_TEST_COSTS=costs.jsonl python -m pytest -q --junitxml=suite.xml
  python -m benchmarks.suite_table --junit suite.xml --costs costs.jsonl \
      --write docs/development.md --order tests/file_order.json

`--order` also writes each test file's seconds, which tests/conftest.py reads to hand the heaviest
files to pytest-xdist first (tests/order.py).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import argparse
import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

BEGIN, END = '<!-- suite-table: begin -->', '<!-- suite-table: end -->'


def durations(junit: Path) -> tuple[dict[str, float], float]:
  """({test id: seconds (setup + call + teardown)}, the run's wall) of a --junitxml file."""
  root = ET.parse(junit).getroot()
  suite = root if root.tag == 'testsuite' else root.find('testsuite')
  times = {}
  for case in suite.iter('testcase'):
    module = case.get('classname', '').replace('.', '/')
    times[f'{module}.py::{case.get("name")}'] = float(case.get('time', 0))
  return times, float(suite.get('time', 0))


def costs(path: Path | None) -> dict[str, dict]:
  """tests/costs.py's lines by test id (the last of a test's, were it run twice)."""
  if path is None or not path.exists():
    return {}
  lines = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
  return {line['test']: line for line in lines}


def table(times: dict[str, float], wall_s: float, paid: dict[str, dict], top: int) -> dict:
  """The summary, the `top` slowest tests and the slowest files, as JSON."""
  slowest = sorted(times.items(), key=lambda kv: -kv[1])[:top]
  return {
      'tests': len(times), 'test_s_total': round(sum(times.values()), 1), 'wall_s': wall_s,
      'cpu_s_total': round(sum(line.get('cpu_s', 0) for line in paid.values()), 1) or None,
      'slowest': [{'test': t, 's': round(s, 1), **{k: paid.get(t, {}).get(k) for k in
                                                   ('cpu_s', 'processes', 'compiles', 'compile_s')}}
                  for t, s in slowest],
      'files': [{'file': f, 's': s} for f, s in list(file_seconds(times).items())[:10]]}


def markdown(result: dict) -> str:
  def cell(value):
    return '' if value is None else f'{value:g}' if isinstance(value, float) else str(value)
  lines = [f"{result['tests']} tests, {result['test_s_total']:,.0f} s of test time in "
           f"{result['wall_s']:,.0f} s wall"
           + (f"; {result['cpu_s_total']:,.0f} CPU s (tests/costs.py)." if result.get('cpu_s_total')
              else '.'), '',
           '| # | test | s | CPU s (with the processes it waited for) | processes it started '
           '(not their children) | compiles in pytest | their s |',
           '|---|---|---|---|---|---|---|']
  for i, row in enumerate(result['slowest'], 1):
    cpu_s = row.get('cpu_s')
    lines.append(f"| {i} | `{row['test']}` | {row['s']:g} | "
                 f"{'' if cpu_s is None else f'{cpu_s:.1f}'} | "
                 f"{cell(row['processes'])} | "
                 f"{cell(row['compiles'])} | {cell(row['compile_s'])} |")
  lines += ['', '| file | s (its tests together) |', '|---|---|']
  lines += [f"| `{row['file']}` | {row['s']:g} |" for row in result['files']]
  return '\n'.join(lines)


def file_seconds(times: dict[str, float]) -> dict[str, float]:
  """{test file: its tests' seconds together}, heaviest first."""
  files = collections.Counter()
  for test, seconds in times.items():
    files[test.split('::')[0]] += seconds
  return {f: round(s, 1) for f, s in files.most_common()}


def heaviest_first(files: list[str], seconds: dict[str, float]) -> list[str]:
  """`files` (each once) by their seconds, most first; those not in `seconds` before all (a new
  file's cost is unknown, and a heavy one last stretches the run), ties in their given order."""
  unknown = max(seconds.values(), default=0.0) + 1.0
  return sorted(files, key=lambda f: -seconds.get(f, unknown))  # (sorted is stable)


def read_order(path: Path) -> dict[str, float]:
  """{test file: seconds} of an `--order` file; {} where there is none."""
  return json.loads(path.read_text())['seconds'] if path.exists() else {}


def write_into(doc: Path, text: str, source: str) -> None:
  """`text` between doc's BEGIN and END lines (which must be there), with its source."""
  content = doc.read_text()
  if BEGIN not in content or END not in content:
    sys.exit(f'error: {doc} has no {BEGIN} ... {END} lines to write the table between')
  head, rest = content.split(BEGIN, 1)
  tail = rest.split(END, 1)[1]
  doc.write_text(f'{head}{BEGIN}\n{source}\n\n{text}\n{END}{tail}')


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--junit', type=Path, required=True, help="pytest's --junitxml file")
  p.add_argument('--costs', type=Path, default=None, help="tests/costs.py's lines")
  p.add_argument('--top', type=int, default=30)
  p.add_argument('--source', default='', help='where the figures come from (a line above them)')
  p.add_argument('--write', type=Path, default=None, help='the doc to write the table into')
  p.add_argument('--json', type=Path, default=None)
  p.add_argument('--order', type=Path, default=None,
                 help="each test file's seconds, for the suite's order (tests/file_order.json)")
  args = p.parse_args(argv)
  times, wall_s = durations(args.junit)
  result = table(times, wall_s, costs(args.costs), args.top)
  text = markdown(result)
  print(text)
  if args.json:
    args.json.write_text(json.dumps(result, indent=2) + '\n')
  if args.write:
    write_into(args.write, text, args.source)
  if args.order:
    args.order.write_text(json.dumps({'source': args.source, 'seconds': file_seconds(times)},
                                     indent=1) + '\n')
  return 0


if __name__ == '__main__':
  sys.exit(main())
