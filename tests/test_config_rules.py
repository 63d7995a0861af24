"""Config rules are declared once, on their field: checks, overrides and docs/config.md follow."""
import ast
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mecefo_jax import config
from mecefo_jax.config import Config, ConfigError, load_config
from mecefo_jax.overrides import apply_updates, parse_override
from mecefo_jax.run import rundir
from mecefo_jax.settings import MAY_CHANGE, MAY_GROW, leaves, setting

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class DummyConfig:
  level: str = setting('low', 'a dummy choice', choices=('low', 'high'))
  ratio: float = setting(0.5, 'a dummy fraction', within='(0, 1)', hint='a share')
  every: int | str = setting(2, 'a dummy count, or auto', within='>= 1', also=('auto',),
                             on_resume=MAY_CHANGE)
  source: str = setting('none', 'a dummy spec', choices=('none',), forms=('file:PATH',))
  size: int = setting(1, 'a dummy size', within='>= 1', on_resume=MAY_GROW)


@dataclass(frozen=True)
class WiderConfig(Config):
  dummy: DummyConfig = field(default_factory=DummyConfig)


def _refusal(overrides, path=None) -> str:
  with pytest.raises(ConfigError) as err:
    load_config(path, overrides)
  return str(err.value)


def test_overrides_coerce_each_value_to_its_fields_type_on_any_frozen_config():
  """overrides.py knows no section of ours: a dotted override becomes a nested mapping, a
  union field takes the first arm that fits, a float may be written as '3e-3' (PyYAML reads a
  string), a bool is never an int, and an unknown key names what is allowed."""
  assert parse_override('dummy.every=auto') == {'dummy': {'every': 'auto'}}
  assert parse_override('dummy.ratio=3e-3') == {'dummy': {'ratio': '3e-3'}}
  d = apply_updates(DummyConfig(), {'every': 'auto', 'ratio': '3e-3', 'size': 4})
  assert (d.every, d.ratio, d.size) == ('auto', 0.003, 4)
  assert apply_updates(DummyConfig(), {'every': 7}).every == 7
  with pytest.raises(ConfigError, match="config key 'size' must be int, got True"):
    apply_updates(DummyConfig(), {'size': True})
  with pytest.raises(ConfigError, match="unknown config key 'x.levels'; allowed: x.level, "):
    apply_updates(DummyConfig(), {'levels': 'low'}, prefix='x.')
  with pytest.raises(ConfigError, match='must look like section.key=value'):
    parse_override('dummy.every')


def test_a_rule_declared_on_its_field_is_parsed_checked_and_documented(monkeypatch, tmp_path):
  """The dummy section is declared above and nowhere else: no other edit makes it work."""
  monkeypatch.setattr(config, 'Config', WiderConfig)
  cfg = load_config(None, ['dummy.level=high', 'dummy.ratio=25e-2', 'dummy.every=auto',
                           'dummy.source=file:x.txt'])
  assert cfg.dummy == DummyConfig('high', 0.25, 'auto', 'file:x.txt', 1)
  assert load_config(None, ['dummy.every=3']).dummy.every == 3
  (tmp_path / 'c.yaml').write_text('dummy: {ratio: 3e-1}\n')  # PyYAML reads 3e-1 as a string
  assert load_config(tmp_path / 'c.yaml').dummy.ratio == 0.3
  (tmp_path / 'c.yaml').write_text('dummy: {level: medium}\n')
  assert _refusal([], tmp_path / 'c.yaml') == (
      "config key 'dummy.level' must be one of low, high, got 'medium'")
  refusals = {
      'dummy.level=mid': "config key 'dummy.level' must be one of low, high, got 'mid'",
      'dummy.ratio=1': "config key 'dummy.ratio' must be in (0, 1) (a share), got 1.0",
      'dummy.ratio=.nan': "config key 'dummy.ratio' must be in (0, 1) (a share), got nan",
      'dummy.ratio=half': "config key 'dummy.ratio' must be float, got 'half'",
      'dummy.every=0': "config key 'dummy.every' must be >= 1 or 'auto', got 0",
      'dummy.every=soon': "config key 'dummy.every' must be >= 1 or 'auto', got 'soon'",
      "dummy.source='file:'": "config key 'dummy.source' must be one of none, file:PATH, got 'file:'",
  }
  for override, message in refusals.items():
    assert _refusal([override]) == message
  assert _refusal(['dummy.nope=1']).startswith("unknown config key 'dummy.nope'; allowed: ")
  assert ("| `dummy.every` | int \\| str | `2` | >= 1 or 'auto' | may change | a dummy count, "
          "or auto |" in config.markdown().splitlines())


def test_a_resume_may_change_only_the_keys_whose_setting_says_so(monkeypatch):
  """on_resume, declared on the dummy fields above, is what the resume check reads."""
  monkeypatch.setattr(config, 'Config', WiderConfig)
  config._rules.cache_clear()  # the declarations are read once
  try:
    run = config.to_dict(load_config(None, []))
    changed = config.to_dict(load_config(None, ['dummy.every=5', 'dummy.size=3',
                                                'optimizer.lr=1e-4']))
    assert rundir._check_same_config(run, changed) == {
        'dummy.every': [2, 5], 'dummy.size': [1, 3], 'optimizer.lr': [3e-3, 1e-4]}
    refused = ((run, 'dummy.level=high', "dummy.level ('low' -> 'high')"),
               (run, 'optimizer.b1=0.8', 'optimizer.b1 (0.9 -> 0.8)'),
               (changed, 'dummy.size=2', 'dummy.size (3 -> 2)'))  # grows only
    for recorded, override, diff in refused:
      given = config.to_dict(load_config(None, ['dummy.every=5', override]))
      with pytest.raises(ConfigError, match=re.escape(f'resume with a changed config: {diff};')):
        rundir._check_same_config(recorded, given)
  finally:
    config._rules.cache_clear()


def test_on_resume_takes_one_of_its_three_values():
  with pytest.raises(ValueError, match='on_resume must be one of'):
    setting(1, 'a count', on_resume='sometimes')


def test_every_key_has_a_doc_and_a_default_its_rule_admits():
  for key, value, _, rule in leaves(Config()):
    assert rule.doc, f'{key} has no doc: declare it with setting()'
    assert rule.refusal(key, value) is None, key
  with pytest.raises(ValueError, match='breaks its own rule'):
    setting(0, 'a count', within='>= 1')


def test_field_rules_are_checked_before_the_rules_between_fields():
  assert _refusal(['model.n_heads=0']) == "config key 'model.n_heads' must be >= 1, got 0"
  assert _refusal(['model.n_heads=3']) == 'model.n_heads=3 must divide model.d_model=64'
  assert _refusal(['mecefo.rank=-1']) == "config key 'mecefo.rank' must be >= 0 (0 = auto), got -1"
  assert _refusal(['mecefo.rank=65']) == 'mecefo.rank must be in [0, 64] (0 = auto), got 65'
  assert _refusal(['mesh.slice=0']) == "config key 'mesh.slice' must be >= 1 or -1 (all devices), got 0"
  assert math.isinf(load_config(None, ['faults.time_budget=.inf']).faults.time_budget)


def test_docs_config_md_is_the_rendered_table():
  text = (ROOT / 'docs' / 'config.md').read_text()
  assert text.partition('\n## Keys\n\n')[2] == config.markdown() + '\n', \
      "docs/config.md is stale: put `python -m mecefo_jax.config`'s output under '## Keys'"


# ---- a rule spelled a second time ---------------------------------------------------------------

SCANNED = [ROOT / 'train.py', *(p for folder in ('mecefo_jax', 'benchmarks', 'deploy')
                                for p in sorted((ROOT / folder).rglob('*.py')))]
HOME = 'mecefo_jax/config.py'
# model/bases.py's BASES is the registry the basis names come from; test_train_cli keeps them equal.
REGISTRY = {'mecefo_jax/model/bases.py': frozenset(config.BASIS_NAMES),
            'mecefo_jax/model/models.py': frozenset(config.MODELS)}


def _value_sets() -> dict[frozenset, str]:
  """Every declared set of allowed strings (a choice key's, or a named set of config.py) -> a name."""
  named = {frozenset(value): name for name, value in vars(config).items()
           if name.isupper() and isinstance(value, (tuple, dict)) and len(value) > 1
           and all(isinstance(v, str) for v in value)}
  return named | {frozenset(rule.choices): key for key, _, _, rule in leaves(Config())
                  if len(rule.choices) > 1}


def _bounds_by_name() -> dict[str, set]:
  """Field name -> its finite declared bounds (and numbers allowed besides them)."""
  found: dict[str, set] = {}
  for key, _, _, rule in leaves(Config()):
    if rule.bounds:
      numbers = {rule.bounds.low, rule.bounds.high, *rule.also}
      found.setdefault(key.rpartition('.')[2], set()).update(
          n for n in numbers if not isinstance(n, str) and math.isfinite(n))
  return found


def _docstrings(tree: ast.AST) -> set[int]:
  kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
  return {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, kinds)
          and node.body and isinstance(node.body[0], ast.Expr)
          and isinstance(node.body[0].value, ast.Constant)}


def _listed(text: str, values: frozenset) -> bool:
  """Whether `text` lists all of `values` in a row: 'a, b', "'a' or 'b'", 'a | b', 'a,b'."""
  word = '|'.join(map(re.escape, values))
  item = rf"'?(?:{word})'?"
  for run in re.finditer(rf'(?<![\w-]){item}(?:\s*(?:,|\||/|\bor\b)\s*{item})+(?![\w-])', text):
    if set(re.findall(word, run.group())) == values:
      return True
  return False


def _numbers(nodes) -> set:
  found = set()
  for node in nodes:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
      node, sign = node.operand, -1
    else:
      sign = 1
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
      found.add(sign * node.value)
  return found


def _restated_bounds(tree: ast.AST, bounds: dict[str, set]):
  """(line, source) of comparisons that refuse a field's value against its declared bound."""
  order = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
  for node in ast.walk(tree):
    if not (isinstance(node, ast.If) and any(isinstance(s, ast.Raise) for s in node.body)):
      continue
    for test in ast.walk(node.test):
      if isinstance(test, ast.Compare) and any(isinstance(op, order) for op in test.ops):
        sides = [test.left, *test.comparators]
        names = {s.id if isinstance(s, ast.Name) else s.attr for s in sides
                 if isinstance(s, (ast.Name, ast.Attribute))}
        if any(_numbers(sides) & bounds[name] for name in names & bounds.keys()):
          yield test.lineno, ast.unparse(test)


def _spellings(source: str, where: str):
  """(where:line, what) of every spelling in `source` of a declared value set or bound."""
  tree = ast.parse(source)
  docstrings, sets = _docstrings(tree), _value_sets()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
      items = node.keys if isinstance(node, ast.Dict) else node.elts
      strings = frozenset(i.value for i in items if isinstance(i, ast.Constant)
                          and isinstance(i.value, str))
      if strings in sets and REGISTRY.get(where) != strings:
        yield f'{where}:{node.lineno}', sets[strings]
    elif (where != HOME and isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in docstrings):
      yield from ((f'{where}:{node.lineno}', sets[s]) for s in sets if _listed(node.value, s))
  if where != HOME:
    yield from ((f'{where}:{line}', text) for line, text in _restated_bounds(tree, _bounds_by_name()))


def test_no_rule_is_spelled_outside_its_declaration():
  found = [hit for path in SCANNED
           for hit in _spellings(path.read_text(), str(path.relative_to(ROOT)))]
  outside = [hit for hit in found if not hit[0].startswith(f'{HOME}:')]
  assert not outside, f'import the declared value set or call config.check_setting: {outside}'
  inside = [what for _, what in found]
  twice = sorted({what for what in inside if inside.count(what) > 1})
  assert not twice, f'{HOME} spells these value sets more than once: {twice}'


def test_a_restated_rule_is_seen():
  source = ("RATE = ('cluster', 'per_device')\n"
            "HELP = \"remat policy must be 'full' or 'dots'\"\n"
            "def f(keep, rank):\n"
            "  if keep < 1 or rank == 0:\n"
            "    raise ValueError('keep')\n")
  hits = dict(_spellings(source, 'mecefo_jax/x.py'))
  assert hits == {'mecefo_jax/x.py:1': 'faults.rate', 'mecefo_jax/x.py:2': 'mecefo.ffn_remat',
                  'mecefo_jax/x.py:4': 'keep < 1'}, hits
  assert dict(_spellings("A = ('warm', 'full')\nB = ['full', 'warm']\n", HOME)) == {
      f'{HOME}:1': 'mecefo.refresh', f'{HOME}:2': 'mecefo.refresh'}


def test_a_sample_budget_in_samples_or_tokens_ends_the_run_and_not_both():
  tokens = load_config(None, ['train.tokens=1000', 'model.seq_len=64'])
  assert config.sample_budget(tokens) == 16  # ceil(1000 / 64): whole samples
  assert config.sample_budget(load_config(None, ['train.samples=7'])) == 7
  assert not config.trained_to_end(tokens, steps_done=10**6, samples_done=15)  # steps: no end
  assert config.trained_to_end(tokens, steps_done=1, samples_done=16)
  plain = load_config(None, ['train.steps=5'])
  assert config.sample_budget(plain) == 0 and config.trained_to_end(plain, 5, 0)
  assert not config.trained_to_end(plain, 4, 10**6)
  with pytest.raises(ConfigError, match=re.escape(
      'train.samples=3 and train.tokens=5: give one budget (tokens are samples x model.seq_len)')):
    load_config(None, ['train.samples=3', 'train.tokens=5'])
