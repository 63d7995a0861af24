"""Test setup: 8 fake CPU devices (set before jax is imported anywhere), the process launcher,
and the tiers: a test that starts a process (it takes `launcher`) is marked `slow` here."""
import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import pytest  # noqa: E402

from procs import Launcher, sharing_programs  # noqa: E402

jax.config.update('jax_default_matmul_precision', 'highest')

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


@pytest.fixture(scope='session')
def devices():
  assert jax.device_count() == 8, 'tests need 8 fake CPU devices'
  return jax.devices()


@pytest.fixture(scope='session')
def _session_launcher(tmp_path_factory):
  launcher = Launcher(tmp_path_factory.mktemp('xla_cache'))
  yield launcher
  launcher.kill_all()


@pytest.fixture(scope='module')
def launcher(_session_launcher):
  """Starts processes for one test file's tests and fixtures; kills what is left after it."""
  first = len(_session_launcher.started)
  yield _session_launcher
  _session_launcher.kill_all(since=first)


@pytest.fixture(scope='module')
def shared_programs(devices):
  """In-process runs of one test file build each program once (procs.sharing_programs); the
  environment's XLA_FLAGS restored after (a resume adds the run's device count there)."""
  with pytest.MonkeyPatch.context() as m:
    m.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', ''))
    sharing_programs(m)
    yield
