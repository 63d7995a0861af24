"""One home per idea: each shared helper, table and type is defined once in the repository."""
import ast
import collections
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Each of these was once written in two to four places, which then had to be kept in step.
ONE_HOME = ['Role', 'split_passes', 'Planner', 'balanced', 'part_len', 'rate_scale',
            'apply_event', 'free_port', 'OneLineParser', 'JOB_EXITS', 'BAD_INPUT', 'STOPPED',
            'METRICS_FILE', 'read_metrics', 'last_logged_step', 'check_text', 'read_json',
            'read_jsonl', 'append_line', 'replace_text', 'problem']


def _targets(target: ast.expr) -> Iterator[str]:
  """The names an assignment binds: `x = ...` and `x, y = ...`, not `a.x` or `a[x]`."""
  if isinstance(target, ast.Name):
    yield target.id
  elif isinstance(target, (ast.Tuple, ast.List)):
    for element in target.elts:
      yield from _targets(element)


def _defined(node: ast.AST) -> Iterator[str]:
  """Names defined at module or class level (defs, classes, assignments), also under an if, try
  or with there; not inside a function, whose names are its own."""
  for child in ast.iter_child_nodes(node):
    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
      yield child.name
    elif isinstance(child, ast.ClassDef):
      yield child.name
      yield from _defined(child)
    elif isinstance(child, ast.Assign):
      yield from (name for target in child.targets for name in _targets(target))
    elif isinstance(child, ast.AnnAssign):
      yield from _targets(child.target)
    elif isinstance(child, (ast.stmt, ast.excepthandler)):
      yield from _defined(child)


@pytest.fixture(scope='module')
def homes() -> dict[str, list[str]]:
  """Every name defined in mecefo_jax/, benchmarks/, deploy/, tests/ and train.py -> where."""
  paths = [ROOT / 'train.py',
           *(p for folder in ('mecefo_jax', 'benchmarks', 'deploy', 'tests')
             for p in sorted((ROOT / folder).rglob('*.py')))]
  where = collections.defaultdict(list)
  for path in paths:
    for name in _defined(ast.parse(path.read_text(), str(path))):
      where[name].append(str(path.relative_to(ROOT)))
  return where


@pytest.mark.parametrize('name', ONE_HOME)
def test_defined_exactly_once(homes, name):
  assert len(homes[name]) == 1, f'{name} is defined {len(homes[name])} times: {homes[name]}'


def test_a_second_definition_is_seen():
  source = ('def free_port():\n  pass\n\nclass A:\n  free_port = 1\n\n'
            'if True:\n  free_port, b = 2, 3\n\ndef f():\n  free_port = 4\n')
  assert list(_defined(ast.parse(source))).count('free_port') == 3
