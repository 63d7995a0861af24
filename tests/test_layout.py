"""The package layout: imports point only downward, and the public API lives where docs say."""
import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / 'mecefo_jax'
# Lowest first: a module may import its own group and the groups below it, never above.
LAYERS = ['config install files sections', 'core', 'sharding multihost', 'ops', 'layers', 'model', 'data', 'step',
          'fault', 'snapshot', 'run', 'launch']
LEVEL = {group: i for i, names in enumerate(LAYERS) for group in names.split()}


def _group(module: str) -> str | None:
  """'mecefo_jax.fault.controller' -> 'fault'; None for the package root itself."""
  parts = module.split('.')
  return parts[1] if len(parts) > 1 and parts[0] == 'mecefo_jax' else None


def _imports(path: Path):
  """Every module a file imports; `from pkg import name` gives pkg and pkg.name (a module or
  not: callers intersect with what exists)."""
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      yield node.module
      yield from (f'{node.module}.{a.name}' for a in node.names)
    elif isinstance(node, ast.Import):
      yield from (a.name for a in node.names)


def test_every_group_is_layered():
  groups = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == '.py' or (p / '__init__.py').is_file()) and p.name != '__init__.py'}
  assert groups == set(LEVEL), 'a new module or folder needs its place in LAYERS'


def test_no_import_points_upward():
  upward = []
  for path in PACKAGE.rglob('*.py'):
    importer = _group('.'.join(path.relative_to(PACKAGE.parent).with_suffix('').parts))
    if importer is None:
      continue
    for module in _imports(path):
      target = _group(module)
      if target is not None and LEVEL[target] > LEVEL[importer]:
        upward.append(f'{path.relative_to(PACKAGE.parent)} imports {module}')
  assert not upward, upward


@pytest.mark.parametrize('module, name', [
    ('mecefo_jax.ops', 'lowrank_matmul'), ('mecefo_jax.ops', 'svd_basis'),
    ('mecefo_jax.ops', 'gaussian_basis'), ('mecefo_jax.layers', 'MeCeFOLinear'),
    ('mecefo_jax.layers', 'MeCeFODense')])
def test_public_api_importable_from_its_documented_place(module, name):
  assert callable(getattr(importlib.import_module(module), name))


def test_every_folder_says_what_lives_there():
  for init in PACKAGE.glob('*/__init__.py'):
    assert ast.get_docstring(ast.parse(init.read_text())), f'{init} has no docstring'


def _modules() -> set[str]:
  return {'.'.join(p.relative_to(PACKAGE.parent).with_suffix('').parts).removesuffix('.__init__')
          for p in PACKAGE.rglob('*.py')}


def test_every_module_is_imported_by_a_fast_test(request):
  from conftest import COLLECTED_FILES, FAST_FILES
  tests = set(Path(__file__).parent.glob('test_*.py'))
  if not tests <= request.config.stash[COLLECTED_FILES]:
    pytest.skip('needs the whole tests/ collection (either tier), not a selection of files')
  modules = _modules()
  imported = set().union(*(_imports(p) for p in request.config.stash[FAST_FILES])) & modules
  missing = sorted(m for m in modules if m not in imported and m != 'mecefo_jax')
  assert not missing, f'no fast test imports {missing}'
