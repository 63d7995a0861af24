"""Test setup: 8 fake CPU devices (set before jax is imported anywhere), the process launcher,
and the tiers: a test that starts a process (it takes `launcher`) is marked `slow` here."""
import os
import signal
from pathlib import Path

import order
from procs import SUITE_XLA_FLAGS, Launcher, pin_blas_kernels  # (procs imports no jax)

pin_blas_kernels()
# A suite started as a shell's background job (`pytest &`, nohup) inherits SIGINT ignored, and
# so would every process its tests start anew (a fork server's children get Python's handler
# whatever their parent's: spawn.become); its tests then depended on which test ran first in
# a worker. Every pytest process handles SIGINT as one started from a terminal does.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           f' --xla_force_host_platform_device_count=8 {SUITE_XLA_FLAGS}').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update('jax_default_matmul_precision', 'highest')

import costs  # noqa: E402  (it imports jax)

LAUNCHER = 'launcher'
# What the collection saw: every test file, and those holding a fast test (tests/test_layout.py).
COLLECTED_FILES = pytest.StashKey[set]()
FAST_FILES = pytest.StashKey[set]()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be there by then
def pytest_collection_modifyitems(config, items):
  for item in items:
    if LAUNCHER in getattr(item, 'fixturenames', ()):
      item.add_marker(pytest.mark.slow)
  config.stash[COLLECTED_FILES] = {item.path for item in items}
  config.stash[FAST_FILES] = {item.path for item in items if not item.get_closest_marker('slow')}
  # The heaviest files first (tests/order.py); a file's tests keep their order.
  by_file: dict[str, list] = {}
  for item in items:
    by_file.setdefault(order.name(item.path), []).append(item)
  items[:] = [item for f in order.heaviest_first(list(by_file), order.file_seconds())
              for item in by_file[f]]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Each test's costs (tests/costs.py), where $MECEFO_TEST_COSTS asks for them."""
  since = costs.mark()
  yield
  costs.write(item.nodeid, since)


@pytest.fixture(scope='session')
def devices():
  assert jax.device_count() == 8, 'tests need 8 fake CPU devices'
  return jax.devices()


@pytest.fixture(scope='session')
def suite_cache(tmp_path_factory) -> Path:
  """The suite's one compilation cache directory: processes take it as their
  $JAX_COMPILATION_CACHE_DIR (procs.Launcher) and in-process runs open its program store
  (`programs/`) as train.py does, or take it from procs.suite_store() to hand to a Trainer or
  Controller as a user would. Entries are keyed by the lowered program, its argument trees, the
  backend and the devices (step/program_store.py: fingerprint), so a test only ever gets the program it
  would have compiled itself; tests about compiling opt out (`cold_programs`). One for all
  pytest-xdist workers: the store is safe for concurrent processes."""
  root = tmp_path_factory.getbasetemp()
  path = (root.parent if os.environ.get('PYTEST_XDIST_WORKER') else root) / 'xla_cache'
  path.mkdir(exist_ok=True)
  return path


@pytest.fixture(scope='session', autouse=True)
def _train_opens_the_suite_store(suite_cache):
  """In-process `cli.main` runs open the suite's program store ($JAX_COMPILATION_CACHE_DIR
  comes before train.compile_cache: step/program_store.py open_store)."""
  with pytest.MonkeyPatch.context() as m:
    m.setenv('JAX_COMPILATION_CACHE_DIR', str(suite_cache))
    yield


@pytest.fixture(autouse=True)
def _xla_flags_restored(monkeypatch):
  """XLA_FLAGS as the suite set them after each test (an in-process resume sets the run's
  device count there; processes are started without them: procs.Launcher)."""
  monkeypatch.setenv('XLA_FLAGS', os.environ['XLA_FLAGS'])


@pytest.fixture
def cold_programs(monkeypatch):
  """A test about compiling: its in-process runs open no program store (JAX's own cache is off
  in train.py), so every program they need is compiled."""
  monkeypatch.delenv('JAX_COMPILATION_CACHE_DIR')


@pytest.fixture(scope='session')
def _session_launcher(suite_cache, tmp_path_factory):
  launcher = Launcher(suite_cache, tmp_path_factory.mktemp('cold'))
  yield launcher
  launcher.kill_all()


@pytest.fixture(scope='module')
def launcher(_session_launcher):
  """Starts processes for one test file's tests and fixtures; kills what is left after it."""
  first = len(_session_launcher.started)
  yield _session_launcher
  _session_launcher.kill_all(since=first)


@pytest.fixture
def hf_datasets(monkeypatch):
  """tests/stand_in/datasets.py imported afresh as `datasets` (the package and the Hub are not
  here; its HUB and LOADS start empty): hf: sources run their real loading code against it."""
  import sys
  monkeypatch.syspath_prepend(str(Path(__file__).parent / 'stand_in'))
  monkeypatch.delitem(sys.modules, 'datasets', raising=False)
  import datasets
  assert datasets.__file__.startswith(str(Path(__file__).parent)), datasets.__file__
  yield datasets
  sys.modules.pop('datasets', None)
