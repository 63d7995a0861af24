"""Every Python line gets a jax/flax pair that imports, by construction of requirements.txt and
pyproject.toml (environment markers); the Colab install cell picks that line's pair.

No network: the released versions are a committed table. pip's `--python-version` does not
evaluate markers, so markers are evaluated here with `packaging` for each Python line.
"""
import itertools
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from mecefo_jax import install

ROOT = Path(__file__).resolve().parents[1]

# Released versions on PyPI (from jax 0.9, flax 0.12, orbax-checkpoint 0.12, optax 0.2.6 on) and
# the oldest Python line each installs on (Requires-Python), read on 2026-11-26 with
#   pip --isolated index versions NAME --python-version 3.10|3.11|3.12 --only-binary=:all:
# (a version first listed for 3.11 needs >= 3.11). No flax 0.12.11 was released.
_J = {'0.9.0': '3.11', '0.9.0.1': '3.11', '0.9.1': '3.11', '0.9.2': '3.11', '0.10.0': '3.11',
      '0.10.1': '3.11', '0.10.2': '3.11', '0.11.0': '3.12', '0.11.1': '3.12', '0.11.2': '3.12',
      '0.12.0': '3.12', '0.12.0.1': '3.12'}
RELEASED = {
    'jax': _J, 'jaxlib': dict(_J),
    'flax': {**{f'0.12.{i}': '3.11' for i in range(9)}, '0.12.9': '3.12', '0.12.10': '3.12',
             '0.12.12': '3.12'},
    'orbax-checkpoint': {f'0.12.{i}': '3.11' for i in range(9)},
    'optax': {'0.2.6': '3.10', '0.2.7': '3.10', '0.2.8': '3.10'},
}
# (flax, jax versions, why): release facts of the flax/jax changelogs and package metadata
# (issue 32), and what was seen.
KNOWN_BAD = [
    ('0.12.8', '>=0.11.1', 'jax 0.11.1 removed jax.experimental.hijax.MutableHiType; with jax '
     "0.11.2 seen failing at import on an H200 (Python 3.12): no attribute 'HiPrimitive'"),
    ('0.12.9', '!=0.11.1', 'flax 0.12.9 needs jax >= 0.11.1; jax 0.11.2 renamed HiPrimitive'),
    ('0.12.10', '<0.11.1', "flax 0.12.10's metadata: jax >= 0.11.1"),
]
KNOWN_GOOD = [
    ('0.12.8', '>=0.10.0,<0.11.1', 'flax 0.12.8 works with jax 0.10.x-0.11.0 (release notes); '
     "this repository's tests run on jax 0.10.2, Python 3.11"),
    ('0.12.9', '==0.11.1', 'flax 0.12.9 was released against jax 0.11.1'),
    ('0.12.10', '>=0.11.1,<0.11.3', 'works with jax 0.11.1 and 0.11.2 (release notes); jax '
     '0.11.2 seen importing and training on the H200 image, and `pip install -r '
     'requirements.txt` + `python train.py` on a CPU with Python 3.12.1 (2026-11-26)'),
]
PYTHON_LINES = ('3.11', '3.12', '3.13', '3.14')
PINNED = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint')


def _matches(table, jax: str, flax: str) -> str | None:
  return next((why for f, spec, why in table
               if f == flax and SpecifierSet(spec).contains(jax, prereleases=True)), None)


def admitted(requirements: list[str], name: str, python: str) -> list[str]:
  """Released versions of `name` that install on `python` and every requirement for it that
  applies there allows."""
  env = install.python_environment(python)
  reqs = [r for r in map(Requirement, requirements) if r.name == name and install.applies(r, env)]
  return [v for v, oldest in RELEASED[name].items()
          if Version(python) >= Version(oldest) and all(v in r.specifier for r in reqs)]


def pair_problems(requirements: list[str], python: str) -> list[str]:
  """What is wrong with the jax/flax pairs `requirements` admit on `python`: a known-bad pair, a
  pair not known to work, or none at all."""
  pairs = list(itertools.product(admitted(requirements, 'jax', python),
                                 admitted(requirements, 'flax', python)))
  problems = [f'jax {j} + flax {f}: {_matches(KNOWN_BAD, j, f)}' for j, f in pairs
              if _matches(KNOWN_BAD, j, f)]
  problems += [f'jax {j} + flax {f}: not known to work' for j, f in pairs
               if not _matches(KNOWN_BAD, j, f) and not _matches(KNOWN_GOOD, j, f)]
  return problems or ([] if pairs else [f'no released jax/flax pair on Python {python}'])


def _files() -> dict[str, list[str]]:
  tomllib = pytest.importorskip('tomllib')  # Python >= 3.11
  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
  runtime, _ = install.sections((ROOT / 'requirements.txt').read_text())
  return {'requirements.txt': runtime, 'pyproject.toml': project['dependencies']}


@pytest.mark.parametrize('python', PYTHON_LINES)
@pytest.mark.parametrize('source', ['requirements.txt', 'pyproject.toml'])
def test_each_python_line_admits_only_known_good_jax_flax_pairs(source, python):
  requirements = _files()[source]
  assert pair_problems(requirements, python) == []
  assert any(_matches(KNOWN_GOOD, j, f) for j in admitted(requirements, 'jax', python)
             for f in admitted(requirements, 'flax', python))


@pytest.mark.parametrize('python', PYTHON_LINES)
def test_every_pin_has_a_release_on_each_line_and_jaxlib_matches_jax(python):
  requirements = _files()['requirements.txt']
  for name in PINNED:
    assert admitted(requirements, name, python), f'{name}: no release on Python {python}'
  jaxlibs = admitted(requirements, 'jaxlib', python)
  assert all(j in jaxlibs for j in admitted(requirements, 'jax', python))


def test_requires_python_names_the_lines_that_install():
  tomllib = pytest.importorskip('tomllib')
  requires = SpecifierSet(tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
                          ['requires-python'])
  assert '3.10' not in requires and all(line in requires for line in PYTHON_LINES)
  assert not admitted(_files()['requirements.txt'], 'jax', '3.10')  # nothing installs there


def test_the_checker_finds_the_pins_that_broke_python_3_12():
  """Before issue 32: jax>=0.10,<0.12 with flax==0.12.8 for every Python."""
  old = ['jax>=0.10,<0.12', 'flax==0.12.8']
  assert pair_problems(old, '3.11') == []
  problems = pair_problems(old, '3.12')
  assert any('jax 0.11.2 + flax 0.12.8' in p and 'HiPrimitive' in p for p in problems)
  assert pair_problems(['jax>=0.11.1', 'flax==0.12.10'], '3.12') == [
      'jax 0.12.0 + flax 0.12.10: not known to work',
      'jax 0.12.0.1 + flax 0.12.10: not known to work']
  assert pair_problems(['jax==0.11.2', 'flax==0.12.9'], '3.11') == [
      'no released jax/flax pair on Python 3.11']


def test_colab_cell_on_python_3_12_with_jax_0_11_2_and_flax_0_12_8_installs_flax_0_12_10():
  """The runtime of the failure: the install cell (install.to_install) on Python 3.12."""
  installed = {'jax': '0.11.2', 'jaxlib': '0.11.2', 'flax': '0.12.8', 'optax': '0.2.8',
               'orbax-checkpoint': '0.12.8', 'numpy': '2.1.0', 'ml-dtypes': '0.5.1',
               'pyyaml': '6.0.1', 'xxhash': '3.5.0', 'tqdm': '4.67.0', 'matplotlib': '3.9.0',
               'tensorboardx': '2.6.2', 'jax-cuda12-plugin': '0.11.2'}
  text = (ROOT / 'requirements.txt').read_text()
  assert install.to_install(text, installed.get, install.python_environment('3.12')) == [
      'flax==0.12.10']
  # The same runtime on Python 3.11 (no such jax there, but what the lines ask): jax 0.10.2 with
  # the plugin's extra, its jaxlib, flax 0.12.8 kept.
  assert install.to_install(text, installed.get, install.python_environment('3.11.9')) == [
      'jax[cuda12]==0.10.2', 'jaxlib==0.10.2']
  nothing = install.to_install(text, {}.get, install.python_environment('3.12'))
  asked = {(r.name, r.specifier) for r in map(Requirement, nothing)}
  assert {('jax', SpecifierSet('>=0.11.1,<0.12')), ('jaxlib', SpecifierSet('>=0.11.1,<0.12')),
          ('flax', SpecifierSet('==0.12.10'))} <= asked
  assert not any(r.marker for r in map(Requirement, nothing))  # evaluated for 3.12, dropped


# ---- the install lines of the docs follow the files -------------------------------------------
INSTALL_DOCS = ('README.md', 'docs/tpu.md', 'docs/history.md', 'docs/install.md', 'colab/README.md',
                'deploy/Dockerfile')


def pip_commands(text: str) -> list[str]:
  """Every `pip install ...`: a line of a code block or Dockerfile, or an inline code span
  (wrapped or not)."""
  lines = [line for line in text.splitlines() if 'pip install' in line and '`' not in line]
  spans = re.findall(r'`([^`]*pip install[^`]*)`', ' '.join(text.splitlines()))
  return lines + spans


def test_every_install_line_installs_jax_beside_the_requirements():
  """An extra installed apart from requirements.txt resolves its own jax release: the CUDA plugin
  or libtpu of one release beside the jax of another (issue 32)."""
  for name in INSTALL_DOCS:
    for command in pip_commands((ROOT / name).read_text()):
      if re.search(r'(?<![\w-])jax\[', command):  # jax's extras, not mecefo-jax[ray]
        assert '-r requirements.txt' in command, f'{name}: {command}'
  assert pip_commands('a\n`pip install\n"jax[tpu]"` b\npip install -r requirements.txt x\n') == [
      'pip install -r requirements.txt x', 'pip install "jax[tpu]"']


def test_docs_and_image_name_a_python_that_installs():
  tomllib = pytest.importorskip('tomllib')
  oldest = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['requires-python']
  assert oldest == '>=3.11' and 'Python ≥ 3.11' in (ROOT / 'README.md').read_text()
  base = re.search(r'^FROM python:(\d+\.\d+)-', (ROOT / 'deploy/Dockerfile').read_text(), re.M)
  assert base and base.group(1) in PYTHON_LINES


# ---- every install line names something pip can find ------------------------------------------
# Packages the docs install by name, beyond the requirements and extras: each listed on PyPI
# (`pip --isolated index versions NAME`, 2026-11-29). mecefo-jax itself is not on the index: it
# installs from its checkout (`pip install .`, `".[ray]"`).
NAMED_ON_INDEX = {'pyyaml', 'tokenizers', 'datasets', 'ray'}
_VALUED = {'-r', '--requirement', '-c', '--constraint', '-t', '--target', '--report',
           '--python-version', '-i', '--index-url'}


def _on_index() -> set[str]:
  tomllib = pytest.importorskip('tomllib')
  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
  listed = [*(ROOT / 'requirements.txt').read_text().splitlines(), *project['dependencies'],
            *itertools.chain(*project['optional-dependencies'].values())]
  return NAMED_ON_INDEX | {Requirement(r.split('#')[0]).name.lower() for r in listed
                           if r.split('#')[0].strip()}


def install_targets(command: str) -> list[tuple[str, str]]:
  """(kind, word) of one `pip install` command: ('file', F) of each -r F, ('target', T) of each
  thing it installs; up to the command's end (&&, ;, #)."""
  words = re.split(r'\s+', command.split('pip install', 1)[1].strip())
  out, i = [], 0
  while i < len(words) and words[i] not in ('&&', ';', '|', '#', '\\'):
    word = words[i].strip('"\'')
    if word in _VALUED:
      if word in ('-r', '--requirement'):
        out.append(('file', words[i + 1].strip('"\'')))
      i += 2
      continue
    if word and not word.startswith('-'):
      out.append(('target', word))
    i += 1
  return out


def test_every_install_line_names_a_path_a_requirements_file_or_a_package_on_the_index():
  on_index, files = _on_index(), [ROOT / 'README.md', ROOT / 'colab' / 'README.md',
                                  *sorted((ROOT / 'docs').rglob('*.md')),
                                  *sorted(p for p in (ROOT / 'deploy').iterdir() if p.is_file())]
  seen = 0
  for path in files:
    for command in pip_commands(path.read_text()):
      for kind, word in install_targets(command):
        seen += 1
        where = f'{path.relative_to(ROOT)}: {command!r}'
        if kind == 'file':
          assert (ROOT / word).is_file(), f'{where}: no {word} in the checkout'
        elif not re.match(r'[./<~]|\w+/', word):  # not a path: a requirement on the index
          assert Requirement(word).name.lower() in on_index, f'{where}: {word} is not on PyPI'
  assert seen > 20
  assert install_targets('pip install -r requirements.txt "jax[tpu]" && pip install .') == [
      ('file', 'requirements.txt'), ('target', 'jax[tpu]')]
  assert 'mecefo-jax' not in on_index  # what the README named before: not on the index
