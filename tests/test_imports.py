"""No import cycle among the modules of mecefo_jax/ and benchmarks/, read statically: every
import counts, under TYPE_CHECKING and inside functions too."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ('mecefo_jax', 'benchmarks')


def modules(root: Path) -> dict[str, Path]:
  """{dotted module name: file} of the packages under `root` (a package by its __init__)."""
  return {'.'.join(p.relative_to(root).with_suffix('').parts).removesuffix('.__init__'): p
          for package in PACKAGES for p in (root / package).rglob('*.py')}


def _target(name: str, known) -> str | None:
  """The known module `name` names, or holds it (`a.b.c` where c is a class: a.b)."""
  while name and name not in known:
    name = name.rpartition('.')[0]
  return name or None


def imports(path: Path, name: str, known) -> set[str]:
  """The known modules that the module `name` (in `path`) imports anywhere in it. `from p
  import x` imports p.x where that is a module, else p; a module's parent packages, which
  Python imports first, are left out (their __init__ files import no module of theirs)."""
  package = name if path.name == '__init__.py' else name.rpartition('.')[0]
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      named = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:  # relative: from the importer's package, `level - 1` up
        parts = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(parts + ([node.module] if node.module else []))
      named = [f'{base}.{a.name}' if f'{base}.{a.name}' in known else base for a in node.names]
    else:
      continue
    out |= {t for t in (_target(n, known) for n in named) if t and t != name}
  return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(found)


def import_graph(root: Path) -> dict[str, set[str]]:
  known = modules(root)
  return {name: imports(path, name, known) for name, path in known.items()}


def test_no_import_cycle():
  assert cycles(import_graph(ROOT)) == []


def test_the_graph_sees_the_imports_of_this_tree():
  graph = import_graph(ROOT)
  assert 'mecefo_jax.plan.cost_model' in graph['mecefo_jax.plan.replay']
  assert 'mecefo_jax.plan.replay' in graph['mecefo_jax.plan.simulate']
  assert 'mecefo_jax.core.programs' in graph['mecefo_jax.step.cache']


def test_a_cycle_through_a_type_checking_or_a_local_import_is_found(tmp_path):
  """As benchmarks/replay.py and simulate.py were at c849826: replay imported simulate under
  TYPE_CHECKING, simulate imported replay; and a cycle closed by an import inside a function."""
  bench, core = tmp_path / 'benchmarks', tmp_path / 'mecefo_jax' / 'core'
  bench.mkdir()
  core.mkdir(parents=True)
  for init in (bench, tmp_path / 'mecefo_jax', core):
    (init / '__init__.py').write_text('"""A package."""\n')
  (bench / 'replay.py').write_text('from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n'
                                   '  from benchmarks.simulate import ClusterCosts\n')
  (bench / 'simulate.py').write_text('from benchmarks.replay import Replay\n')
  (core / 'a.py').write_text('from . import b\n')
  (core / 'b.py').write_text('def f():\n  from mecefo_jax.core.a import g\n')
  assert cycles(import_graph(tmp_path)) == [['benchmarks.replay', 'benchmarks.simulate'],
                                           ['mecefo_jax.core.a', 'mecefo_jax.core.b']]
