"""The order test files reach pytest-xdist's workers in: heaviest first (tests/file_order.json,
written by benchmarks/suite_table.py --order from a suite run's durations).

With `--dist loadfile` each file goes whole to one worker, in the order the workers ask; xdist's
own order (most tests first: `--no-loadscope-reorder` turns it off) leaves a process-heavy file of
one or two tests for last, and one worker alone with it. Longest first keeps both busy to the end.
A file not in the table (new since) goes first: its cost is not known, and a heavy one last is
what stretches the run.
"""
from __future__ import annotations

from pathlib import Path

from benchmarks import suite_table

ORDER = Path(__file__).with_name('file_order.json')
ROOT = ORDER.parents[1]


def name(path: Path) -> str:
  """A test file's name in the table: from the repository root (else its whole path)."""
  return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def file_seconds(path: Path = ORDER) -> dict[str, float]:
  """{test file (from the repository root): seconds} of the table; {} without one."""
  return suite_table.read_order(path)


heaviest_first = suite_table.heaviest_first  # conftest.py's order of the files
