"""The machine's speed at the test suite's kind of work, against a reference: a fixed set of small
jax programs traced, lowered and compiled (the suite's XLA flags, one CPU device), in CPU seconds.

Run: python -m benchmarks.machine_speed [--rounds 5] [--json OUT]

The suite is CPU-bound and mostly compiles (docs/development.md), and the same suite took 725 s
to 1,348 s on one machine in one day, by the hour alone: `.ci/run` runs this before and after
the suite (one line), so that a suite's time can be read against its hour's speed.
`slowdown` is this machine's median CPU seconds a round over the reference machine's.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.machine_speed')

import argparse
import os
import statistics
import time

from mecefo_jax import spawn  # (it imports no jax)

# The suite's XLA flags (tests/procs.py SUITE_XLA_FLAGS): every run of this measures the same
# compiles, whatever the caller's environment (under pytest, the suite has set them already).
XLA_FLAGS = '--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false'
WIDTHS = (24, 40, 56, 72, 88, 104)  # one program each: no compile is a cache hit
# The median CPU seconds of a round on this project's 2-core AMD EPYC in the hour of
# docs/development.md's table run at 75e6ef7 (suite wall 725 s, fast tier 166 s): 13 runs of
# 3-6 rounds, 2026-12-03 18:27, medians 0.60-0.85 (a run's rounds spread as much: +-15%).
REFERENCE_CPU_S = 0.73
REFERENCE = 'the 2-core AMD EPYC of docs/development.md, 2026-12-03 18:27 (suite wall 725 s)'


def _compile(width: int) -> None:
  """A residual tanh MLP's value and gradient, traced, lowered and compiled for `width`."""
  import jax
  import jax.numpy as jnp
  def loss(w_DxD, x_BxD):
    h_BxD = x_BxD
    for _ in range(6):
      h_BxD = jnp.tanh(h_BxD @ w_DxD) + h_BxD
    return jnp.mean(h_BxD * h_BxD)
  shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((width, width), (16, width))]
  jax.jit(jax.value_and_grad(loss)).lower(*shapes).compile()


def round_cpu_s() -> float:
  """CPU seconds (every thread of this process) of one round: each width's program built anew."""
  import jax
  jax.clear_caches()
  start = time.process_time()
  for width in WIDTHS:
    _compile(width)
  return time.process_time() - start


def measure(rounds: int) -> dict:
  _compile(8)  # jax's own first-use costs, outside the rounds
  per_round = [round(round_cpu_s(), 3) for _ in range(rounds)]
  median = statistics.median(per_round)
  return {'rounds_cpu_s': per_round, 'median_cpu_s': median,
          'reference_cpu_s': REFERENCE_CPU_S, 'reference': REFERENCE,
          'slowdown': round(median / REFERENCE_CPU_S, 2), 'load': os.getloadavg()}


def line(result: dict) -> str:
  return (f"machine speed: {result['median_cpu_s']:.2f} CPU s a round, {result['slowdown']:.2f}x "
          f"the reference's {result['reference_cpu_s']:.2f} (load {result['load'][0]:.2f})")


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=5)
  p.add_argument('--json', default=None)
  args = p.parse_args(argv)
  if args.rounds < 1:
    p.error(f'--rounds must be >= 1, got {args.rounds}')
  if not spawn.jax_backend_up():
    os.environ.update(XLA_FLAGS=XLA_FLAGS, JAX_PLATFORMS='cpu')
  result = measure(args.rounds)
  if not args.json:  # .ci/run's line: no imports beyond jax's (common's take ~2 CPU s)
    print(line(result))
    return result
  from benchmarks import common  # (it imports the package's model and step modules)
  result = {**common.run_info(__spec__.name, argv), **result}
  common.emit(result, line(result), args.json)
  return result


if __name__ == '__main__':
  main()
