"""The package layout: imports point only downward, and the public API lives where docs say."""
import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / 'mecefo_jax'
# Lowest first: a module may import its own group and the groups below it, never above.
LAYERS = ['config overrides settings sections install files', 'core', 'records',
          'sharding multihost',
          'ops', 'layers', 'model', 'data', 'step', 'fault', 'snapshot', 'run',
          'launch supervisor watch job_rules ray_host ray_driver __main__ plan spawn']
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


# ---- the loop's floors: the run layer asks the controller, which owns building ------------------

# What the run layer may ask of the controller (fault/controller.py's docstring lists it).
CONTROLLER_INTERFACE = {'start', 'step', 'last_plan', 'last_built', 'fetch', 'evaluate',
                        'wait_for_steps', 'state', 'state_mesh', 'live', 'events', 'samples',
                        'goodput', 'tokens_trained', 'step_memory', 'first_programs_s',
                        'first_programs', 'programs_report', 'dump_meta', 'book',
                        'exclude_from_steps', 'settle', 'close', 'stream_position'}
CONTROLLER = {'self.controller', 'run.controller', 'controller', 'c', 'p.controller',
              'parts.controller', 'self.parts.controller'}  # how run/ names it


def _controller_reads(source: str) -> list[str]:
  """`line .name` of every read through the controller of a name outside its interface."""
  return sorted(f'{node.lineno} .{node.attr}' for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
                and ast.unparse(node.value) in CONTROLLER and node.attr not in CONTROLLER_INTERFACE)


def test_the_run_layer_builds_no_program_and_asks_the_controller_through_its_interface():
  paths = [p for p in sorted((PACKAGE / 'run').glob('*.py')) if 'controller' in p.read_text()]
  assert len(paths) >= 6  # trainer, report, loop_hooks, evaluation, restart, ...: not vacuous
  found = [f'{path.name}:{hit}' for path in paths for hit in _controller_reads(path.read_text())]
  assert not found, found
  # (their report sections are types the report schema names, not builders)
  builders = {'mecefo_jax.step.lowering', 'mecefo_jax.step.cache.ProgramCache',
              'mecefo_jax.step.precompile.Precompiler', 'mecefo_jax.step.train_step'}
  imports = {m for path in (PACKAGE / 'run').glob('*.py') for m in _imports(path)}
  assert not imports & builders
  # The scan finds what it looks for: a reach through the controller, a build.
  assert _controller_reads('x = self.controller.decider.eval_due(3)\nc.program(k)\n'
                           'c.step(3)\nc.failed = {1}\n') == ['1 .decider', '2 .program']


def _declared(name: ast.expr) -> bool:
  """A string literal, or a declared field's name (`field.name`, `fields[key].name`): not a
  name put together from strings at run time."""
  literal = isinstance(name, ast.Constant) and isinstance(name.value, str)
  return literal or (isinstance(name, ast.Attribute) and name.attr == 'name')


def _dynamic_attribute_names(source: str) -> list[str]:
  """`line` of every getattr / setattr / delattr whose name is not declared (_declared)."""
  return sorted(str(node.lineno) for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ('getattr', 'setattr', 'delattr') and len(node.args) > 1
                and not _declared(node.args[1]))


def test_no_attribute_is_named_by_a_string_built_at_run_time():
  found = [f'{path.relative_to(PACKAGE.parent)}:{line}' for path in sorted(PACKAGE.rglob('*.py'))
           for line in _dynamic_attribute_names(path.read_text())]
  assert not found, found
  assert _dynamic_attribute_names(
      "getattr(x, 'shape', None)\ngetattr(self, f'_after_{n}')\nsetattr(s, how, 1)\n"
      "getattr(cfg, f.name)\n") == ['2', '3']


def test_snapshot_every_auto_is_resolved_in_one_function_and_the_interval_has_one_owner():
  """'auto' meets `every` only in interval.Interval.of; `.every` is assigned in interval.py
  only (the tuner's proposal, and the Interval that the snapshot tiers and the report read)."""
  resolved, assigned = [], []
  for path in sorted(PACKAGE.rglob('*.py')):
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
      if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        for node in ast.walk(fn):
          if (isinstance(node, ast.Compare) and 'every' in ast.unparse(node)
              and any(isinstance(c, ast.Constant) and c.value == 'auto'
                      for c in ast.walk(node))):
            resolved.append(f'{path.name}:{fn.name}')
    for node in ast.walk(tree):
      targets = (node.targets if isinstance(node, ast.Assign) else
                 [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
      for target in targets:
        for t in ast.walk(target):
          if isinstance(t, ast.Attribute) and t.attr == 'every':
            assigned.append(path.name)
  assert sorted(set(resolved)) == ['interval.py:of'], resolved
  assert set(assigned) == {'interval.py'}, assigned
