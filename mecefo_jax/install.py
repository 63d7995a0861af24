"""What requirements.txt asks that this environment lacks: the Colab notebook's install check."""
from __future__ import annotations

# Only the standard library and packaging: the notebook imports this before anything it checks.
import sys
from importlib import metadata
from typing import Callable, Iterable, Mapping

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

TESTS_HEADER = '# tests'  # requirements.txt's test tools follow this line
# The jax plugin an accelerator runtime ships (Colab's GPU and TPU runtimes: one of these) and
# the jax extra that pins it: jax installed without it would leave the plugin at the old version.
JAX_PLUGINS = (('jax-cuda12-plugin', 'cuda12'), ('jax-cuda13-plugin', 'cuda13'), ('libtpu', 'tpu'))
Version = Callable[[str], 'str | None']


def python_environment(python: str) -> dict[str, str]:
  """The marker variables of another Python line, e.g. '3.12' (the others: this interpreter's)."""
  major_minor = '.'.join(python.split('.')[:2])
  full = python if python.count('.') >= 2 else f'{python}.0'
  return {'python_version': major_minor, 'python_full_version': full}


def sections(text: str) -> tuple[list[str], list[str]]:
  """(runtime, test) requirements of a requirements.txt text, comments and spaces removed: the
  test ones follow the `# Tests` line."""
  runtime: list[str] = []
  test: list[str] = []
  current = runtime
  for line in text.splitlines():
    if line.strip().lower() == TESTS_HEADER:
      current = test
    requirement = line.split('#', 1)[0].replace(' ', '')
    if requirement:
      current.append(requirement)
  return runtime, test


def installed_version(name: str) -> str | None:
  """The installed version of distribution `name`; None if it is not installed."""
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return None


def applies(req: Requirement, environment: Mapping[str, str] | None = None) -> bool:
  """Whether `req` is for `environment` (marker variables; None: this interpreter's): it has no
  marker, or its marker holds there."""
  return req.marker is None or req.marker.evaluate(dict(environment) if environment else None)


def unmet(requirements: Iterable[str], version: Version = installed_version,
          environment: Mapping[str, str] | None = None) -> list[str]:
  """The requirements not installed, or installed at a version their specifier does not allow
  (an installed pre-release is compared as any version: packaging would refuse it by default);
  those whose marker excludes `environment` (default: this interpreter) are met."""
  missing = []
  for text in requirements:
    req = Requirement(text)
    if not applies(req, environment):
      continue
    have = version(canonicalize_name(req.name))
    if have is None or not req.specifier.contains(have, prereleases=True):
      missing.append(text)
  return missing


def pip_args(requirements: Iterable[str], version: Version = installed_version) -> list[str]:
  """`requirements` (those unmet() kept: their markers already evaluated) as pip arguments,
  markers dropped: jax with the extra of the accelerator plugin installed."""
  extra = next((extra for plugin, extra in JAX_PLUGINS if version(plugin)), None)
  args = []
  for text in requirements:
    req = Requirement(text)
    req.marker = None
    if canonicalize_name(req.name) == 'jax' and extra and not req.extras:
      req.extras = {extra}
    args.append(str(req))
  return args


def to_install(requirements_txt: str, version: Version = installed_version,
               environment: Mapping[str, str] | None = None) -> list[str]:
  """The pip arguments that bring this environment to requirements.txt's runtime section: the
  Colab install cell runs `pip install` with them when there are any."""
  runtime, _ = sections(requirements_txt)
  return pip_args(unmet(runtime, version, environment), version)


def imported(requirements: Iterable[str]) -> list[str]:
  """Modules of the requirements' distributions already imported: a running kernel keeps their
  old version until it restarts."""
  names = {canonicalize_name(Requirement(text).name) for text in requirements}
  return sorted(module for module, dists in metadata.packages_distributions().items()
                if module in sys.modules and names & {canonicalize_name(d) for d in dists})
