"""report.json's keys are declared once, in their sections' dataclasses; the rest derives from them."""
import ast
import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

from mecefo_jax import sections
from mecefo_jax.run import report_schema
from mecefo_jax.sections import entry
from mecefo_jax.step.cache import BuildStats

ROOT = Path(__file__).resolve().parents[1]


def _example(tp) -> Any:
  """A valid JSON value of type `tp` (the first choice, empty lists and objects)."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if sections.is_section(tp):
    return {k: _example(t) for k, t, _, _ in sections.fields(tp)}
  if origin is Literal:
    return args[0]
  if origin is list:
    return [_example(args[0])]
  if origin is tuple:
    return [_example(a) for a in args]
  if tp is dict or origin is dict:
    return {}
  if sections.nullable(tp) is not None:
    return None
  return {int: 1, float: 0.5, str: 'x', bool: True}[tp]


def test_an_example_of_every_key_matches_the_schema():
  report = _example(report_schema.Report)
  assert report_schema.errors(report) == []
  assert report['snapshots']['durable_retained_steps'] == [1]  # nested sections filled too


# ---- (a) a key declared in one place is checked and documented -------------------------------

@dataclasses.dataclass
class _WithWidgets(report_schema.Report):
  """report.json with one more key, declared here and nowhere else."""
  widgets: int | None = entry('widgets', 'a dummy key of this test')


def test_a_key_declared_once_is_checked_and_documented():
  report = _example(report_schema.Report)
  assert sections.errors(_WithWidgets, report) == ['widgets: missing']
  assert sections.errors(_WithWidgets, {**report, 'widgets': 3}) == []
  assert sections.errors(_WithWidgets, {**report, 'widgets': None}) == []
  assert sections.errors(_WithWidgets, {**report, 'widgets': 'many'}) == [
      "widgets: expected int, got str 'many'"]
  assert report_schema.errors({**report, 'widgets': 3}) == [
      "widgets: not in the schema (declare it in its section's dataclass)"]
  assert list(report_schema.rows(_WithWidgets))[-1] == (
      'widgets', 'int \\| null', 'widgets', 'a dummy key of this test')
  assert report_schema.markdown(_WithWidgets).endswith(
      '| `widgets` | int \\| null | widgets | a dummy key of this test |')
  assert 'widgets' not in report_schema.markdown()


def test_a_nested_section_is_checked_and_documented_key_by_key():
  @dataclasses.dataclass
  class Gadgets:
    count: int = entry('', 'gadgets')
    kinds: list[Literal['a', 'b']] = entry('', 'their kinds')

  @dataclasses.dataclass
  class Outer:
    gadgets: list[Gadgets] = entry('', 'every gadget')

  assert [r[:2] for r in report_schema.rows(Outer)] == [
      ('gadgets', 'list of object'), ('gadgets[].count', 'int'),
      ('gadgets[].kinds', "list of 'a' \\| 'b'")]
  assert sections.errors(Outer, {'gadgets': [{'count': 1, 'kinds': ['c']}, {'kinds': []}]}) == [
      "gadgets[0].kinds[0]: expected one of ('a', 'b'), got 'c'", 'gadgets[1].count: missing']


def test_a_nullable_list_of_nullable_items_says_which_null_is_which():
  assert sections.name(list[str | None] | None) == 'list of (str \\| null) \\| null'
  assert sections.name(list[str] | None) == 'list of str \\| null'
  found: list[str] = []
  sections.check(list[str | None] | None, ['a', None, 3], 'x', found)
  assert [f.split(':')[0] for f in found] == ['x[2]'], found


def test_floats_are_finite_and_a_bool_is_no_int():
  found: list[str] = []
  sections.check(float, float('inf'), 'x', found)
  sections.check(int, True, 'y', found)
  sections.check(float, 3, 'z', found)  # a JSON integer is a float
  assert [f.split(':')[0] for f in found] == ['x', 'y'], found


def test_build_stats_books_each_source_in_its_own_counters():
  stats = BuildStats()
  for how, seconds in [('compiled', 1.0), ('moved', 2.0), ('moved_ahead', 2.0), ('loaded', 0.5)]:
    stats.book(how, seconds)
  assert dataclasses.asdict(stats) == {
      'compiled': 1, 'compiled_s': 1.0, 'loaded': 1, 'loaded_s': 0.5, 'moved': 1, 'moved_s': 2.0,
      'moved_ahead': 1, 'moved_ahead_s': 2.0}
  with pytest.raises(ValueError, match='borrowed'):
    stats.book('borrowed', 1.0)


# ---- (b) no report key spelled a second time where the report is assembled --------------------

def _section_classes(section: type, seen: dict | None = None) -> list[type]:
  seen = {} if seen is None else seen
  seen[section] = None
  for _, tp, _, _ in sections.fields(section):
    for t in (tp, *typing.get_args(tp)):
      if sections.is_section(t) and t not in seen:
        _section_classes(t, seen)
  return list(seen)


SECTIONS = _section_classes(report_schema.Report)
KEYS = {k for s in SECTIONS for k, *_ in sections.fields(s)}
NAMES = {s.__name__ for s in SECTIONS}
# Modules that return sections besides those that declare them, and the loop's hooks, whose
# `report` methods fill in the keys they own.
ASSEMBLERS = ['mecefo_jax/run/report.py', 'mecefo_jax/fault/controller.py',
              'mecefo_jax/snapshot/host.py', 'mecefo_jax/run/hooks.py',
              'mecefo_jax/run/saving.py', 'mecefo_jax/run/evaluation.py',
              'mecefo_jax/run/metric_rows.py']
HOOKS = ('run/hooks.py', 'run/saving.py', 'run/evaluation.py', 'run/metric_rows.py')
NOT_THE_REPORT = {'dry_run_info'}  # report.py's --dry-run printout has its own keys


def _spellings(node: ast.AST):
  """(line, key) of each report key written as a string where a dict is built or read: a dict
  display's key, a subscript, a dict()/update() keyword, a getattr/setattr name."""
  for n in ast.walk(node):
    candidates = []
    if isinstance(n, ast.Dict):
      candidates = n.keys
    elif isinstance(n, ast.Subscript):
      candidates = [n.slice]
    elif isinstance(n, ast.Call):
      f = n.func
      name = f.id if isinstance(f, ast.Name) else getattr(f, 'attr', '')
      if name in ('dict', 'update'):
        yield from ((n.lineno, kw.arg) for kw in n.keywords if kw.arg in KEYS)
      if name in ('getattr', 'setattr') and len(n.args) > 1:
        candidates = [n.args[1]]
    for c in candidates:
      if isinstance(c, ast.Constant) and c.value in KEYS:
        yield c.lineno, c.value


def _assembling(path: str, tree: ast.Module):
  """The functions that assemble the report: every one of report.py but --dry-run's, and
  elsewhere those whose return annotation names a section."""
  for n in ast.walk(tree):
    if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    returns = ast.unparse(n.returns) if n.returns else ''
    if (path.endswith('run/report.py') and n.name not in NOT_THE_REPORT or
        path.endswith(HOOKS) and n.name == 'report' or
        any(name in returns.replace('.', ' ').replace(',', ' ').replace('[', ' ').split()
            for name in NAMES)):
      yield n


def _owner_paths() -> list[str]:
  paths = {str(Path(sys.modules[s.__module__].__file__).relative_to(ROOT)) for s in SECTIONS}
  return sorted(paths | set(ASSEMBLERS))


def _scan(sources: dict[str, str]) -> tuple[list[str], list[str]]:
  """(the functions scanned, 'path:line key' of each second spelling)."""
  scanned, found = [], []
  for path, text in sources.items():
    for fn in _assembling(path, ast.parse(text)):
      scanned.append(f'{path}:{fn.name}')
      found += [f'{path}:{line} {key!r}' for line, key in _spellings(fn)]
  return scanned, found


def _sources() -> dict[str, str]:
  return {p: (ROOT / p).read_text() for p in _owner_paths()}


def test_no_report_key_is_spelled_where_the_report_is_assembled():
  scanned, found = _scan(_sources())
  for fn in ['run/report.py:build', 'run/hooks.py:report', 'run/saving.py:report',
             'run/evaluation.py:report', 'run/metric_rows.py:report',
             'snapshot/manager.py:tiers_report', 'snapshot/manager.py:report',
             'snapshot/host.py:report', 'snapshot/interval.py:report',
             'fault/controller.py:programs_report', 'fault/controller.py:summary',
             'step/precompile.py:summary', 'run/startup.py:report', 'core/goodput.py:report']:
    assert f'mecefo_jax/{fn}' in scanned, (fn, scanned)  # the scan is not vacuous
  assert not found, f'report keys spelled outside their dataclasses: {found}'


def test_the_scan_catches_a_planted_second_spelling():
  sources = _sources()
  path = 'mecefo_jax/run/report.py'
  planted = sources[path].replace('r.stopped = end.stopped',
                                  "r.stopped = {'stopped': end.stopped}['stopped']")
  assert planted != sources[path]
  line = _line(planted, 'stopped')
  assert _scan({path: planted})[1] == [f"{path}:{line} 'stopped'"] * 2
  path = 'mecefo_jax/run/evaluation.py'
  planted = sources[path].replace('report.eval_loss, report.eval_perplexity =',
                                  "report.__dict__['eval_loss'], report.eval_perplexity =")
  assert planted != sources[path] and len(_scan({path: planted})[1]) == 1
  path = 'mecefo_jax/step/precompile.py'
  planted = sources[path].replace('live_sets=self.compiled', "**dict(live_sets=self.compiled)")
  assert planted != sources[path] and len(_scan({path: planted})[1]) == 1
  planted = sources[path].replace('seconds=self.seconds)', "seconds=self.__dict__['seconds'])")
  assert planted != sources[path] and len(_scan({path: planted})[1]) == 1


def _line(text: str, needle: str) -> int:
  return next(i for i, line in enumerate(text.splitlines(), 1) if f"'{needle}'" in line)
