"""Benchmarks, run as modules from the repository root: `python -m benchmarks.NAME --help`.

The one place for process settings that must precede `import jax`: `python -m benchmarks.NAME`
imports this package before the benchmark module, so the defaults below are in the environment
before any benchmark imports jax. A setting already in the environment is kept.
"""
from __future__ import annotations

import os
import re

from mecefo_jax import spawn  # (it imports no jax)

# jaxlib's CPU QR/SVD (the svd refresh) call a threaded OpenBLAS whose threads spin against XLA's
# own pool on a small shared CPU: the llama_60m refresh measured 5.2 s threaded vs 1.15 s single.
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')

_DEVICE_COUNT = re.compile(r'\s*--xla_force_host_platform_device_count=\S+')


def fake_cpu_devices(n: int) -> None:
  """n fake CPU devices (one per simulated slice), for a benchmark that knows n only after
  parsing its arguments; it must call this before jax starts its backend (XLA reads the flag
  then). No effect once it has (under pytest, the test setup has already chosen the count)."""
  if spawn.jax_backend_up():
    return
  flags = _DEVICE_COUNT.sub('', os.environ.get('XLA_FLAGS', ''))
  os.environ['XLA_FLAGS'] = f'{flags} --xla_force_host_platform_device_count={n}'.strip()
