"""Shared benchmark harness: config loading, interleaved timing, JSON + markdown table output."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mecefo_jax.step import train_step


def parser(description: str) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=description)
  p.add_argument('--config', default='configs/tiny.yaml', help='YAML config (configs/*.yaml)')
  p.add_argument('--json', default=None, help='write results to this JSON file')
  p.add_argument('overrides', nargs='*', help='dotted overrides, e.g. model.n_layers=4')
  return p


def device_info() -> dict:
  d = jax.devices()[0]
  return {'backend': jax.default_backend(), 'device': d.device_kind, 'n_devices': jax.device_count(),
          'jax': jax.__version__, 'host': platform.node(), 'python': platform.python_version()}


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict:
  """Median seconds per call of each fn, calls interleaved round-robin so machine noise is shared."""
  for _ in range(warmup):
    for fn in fns.values():
      jax.block_until_ready(fn())
  samples = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      samples[name].append(time.perf_counter() - t0)
  return {name: {'median_s': statistics.median(v), 'min_s': min(v), 'n': len(v)}
          for name, v in samples.items()}


def markdown_table(rows: list[dict], columns: list[str]) -> str:
  fmt = lambda v: f'{v:.4g}' if isinstance(v, float) else str(v)
  lines = ['| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
  lines += ['| ' + ' | '.join(fmt(r.get(c, '')) for c in columns) + ' |' for r in rows]
  return '\n'.join(lines)


def emit(result: dict, table: str, json_path: str | None) -> None:
  print(table)
  if json_path:
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(result, indent=2))
    print(f'wrote {json_path}')


def cost_analysis(compiled) -> dict:
  """XLA's cost analysis of a compiled program as one dict ({} where the backend has none)."""
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}


def random_tokens(cfg, roles: dict) -> dict:
  """Seeded random int32 tokens in each role's one-slice batch shape, keyed like `roles`."""
  rng = np.random.default_rng(0)
  return {k: jnp.asarray(rng.integers(0, cfg.model.vocab_size, train_step.batch_shape(cfg, 1, r)),
                         jnp.int32) for k, r in roles.items()}


def donating_runners(programs: dict, states: dict, tokens: dict,
                     state_of: Callable[[object], object] = lambda name: name) -> dict:
  """name -> one call of programs[name] on states[state_of(name)] and tokens[name]; the programs
  donate their state, so each call stores the new one in its place."""
  def runner(name):
    def run():
      key = state_of(name)
      states[key], metrics = programs[name](states[key], tokens[name])
      return metrics
    return run
  return {name: runner(name) for name in programs}
