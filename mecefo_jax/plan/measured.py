"""The planner's measured inputs: fields of docs/results files shipped with their provenance."""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / 'data'
PROVENANCE = ('source', 'commit', 'command', 'date')  # the source's path, then its run's
REFRESH = 'python -m mecefo_jax.plan.measured'  # rewrites data/ from docs/results (a checkout)
ALL = None  # a field kept whole
# name -> (the docs/results file it is copied from, the fields kept: nested keys, ALL: whole).
SOURCES = {
    'step_costs': ('docs/results/failure_throughput_scale_llama_60m_median.json', {
        'micro_batch': ALL, 'granule': ALL,
        'measurement': dict.fromkeys(('times', 'flops', 'roles', 'compile_s', 'move_s',
                                      'restore_s'), ALL)}),
    'snapshot_tax': ('docs/results/snapshot_overhead_llama_60m_auto.json',
                     dict.fromkeys(('auto_every', 'auto_cost_s', 'auto_idle_step_s'), ALL)),
    'restart_phases': ('docs/results/restart_time_3proc_kill_at_40.json', {
        'median': dict.fromkeys(('detect_s', 'imports_s', 'distributed_s', 'programs_s'), ALL)}),
    'ray_node_lost': ('docs/results/restart_time_ray_node_killed_tiny.json',
                      {'median': {'seen_s': ALL}}),
    'row_value': ('docs/results/row_value_tiny.json', {
        'config': ALL, 'modes': {'full': dict.fromkeys(
            ('v', 'v_ci95', 'd_flops', 'thresholds_flops', 'steps', 'seeds'), ALL)}}),
}


@functools.cache
def _read(name: str) -> dict:
  return json.loads((DATA / f'{name}.json').read_text())


def fields(name: str) -> dict:
  """The measured fields of `name` (a key of SOURCES), nested as in its source."""
  return _read(name)['fields']


def provenance(name: str) -> dict:
  """Where `name`'s fields come from: the source file, its run's commit, command and date."""
  return {k: _read(name)[k] for k in PROVENANCE}


def source(name: str) -> str:
  return _read(name)['source']


def project(value, kept):
  """The parts of `value` that `kept` names (ALL: the whole value), nested alike."""
  if kept is ALL:
    return value
  return {key: project(value[key], inner) for key, inner in kept.items()}


def copied(name: str, root: Path) -> dict:
  """`name`'s package data as copied now from its source under `root` (a checkout)."""
  path, kept = SOURCES[name]
  measured = json.loads((root / path).read_text())
  return {'source': path, **{k: measured[k] for k in PROVENANCE[1:]}, 'refresh': REFRESH,
          'fields': project(measured, kept)}


def refresh(root: Path) -> list[Path]:
  """Rewrites every package data file from docs/results under `root`."""
  written = []
  for name in SOURCES:
    out = DATA / f'{name}.json'
    out.write_text(json.dumps(copied(name, root), indent=1) + '\n')
    written.append(out)
  return written


if __name__ == '__main__':
  for path in refresh(Path(sys.argv[1] if len(sys.argv) > 1 else '.')):
    print(f'wrote {path}')
