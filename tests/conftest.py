"""Test setup: 8 fake CPU devices, set before jax is imported anywhere."""
import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update('jax_default_matmul_precision', 'highest')


def pytest_configure(config):
  config.addinivalue_line('markers', 'slow: end-to-end tests (run in CI too)')


@pytest.fixture(scope='session')
def devices():
  assert jax.device_count() == 8, 'tests need 8 fake CPU devices'
  return jax.devices()
