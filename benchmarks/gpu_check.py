"""benchmarks/gpu_check.sh's bookkeeping: versions, imports, wheels to add, each part's figures.

Run by the script (`python -m benchmarks.gpu_check COMMAND ...`), never imports jax itself (the
`imports` command does, in its own process): its JSON is written even where jax does not import.
Commands: `start JSON` (a new result: versions, nvidia-smi, commit), `imports JSON` (imports the
runtime packages, the device kind; exit 1 if one fails), `wheels DIR` (the wheels of DIR to add:
distributions this environment lacks or has at a version requirements.txt refuses, never jax,
jaxlib, a CUDA plugin or libtpu), `part JSON NAME KIND ...` (one part's status and figures).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import argparse
import datetime
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'numpy', 'jax-cuda12-plugin',
                 'jax-cuda12-pjrt', 'jax-cuda13-plugin', 'jax-cuda13-pjrt', 'libtpu', 'xxhash',
                 'pyyaml', 'tensorstore')
MODULES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax.checkpoint', 'numpy', 'yaml', 'xxhash', 'tqdm',
           'matplotlib', 'mecefo_jax.run.trainer')
# The image's accelerator stack: gpu_check never installs these, so it measures the image's.
PROTECTED = re.compile(r'^(jax|jaxlib|jax[-_]cuda\d+[-_](plugin|pjrt)|libtpu|nvidia[-_].*)$')
OOM = re.compile(r'RESOURCE_EXHAUSTED|[Oo]ut of memory|OOM')
START_LINE = re.compile(r'state \+ first programs [\d.]+s: init ([\d.]+)\+([\d.]+)\+([\d.]+)s '
                        r'\(lower\+compile\+run\)'
                        r'(?:, restore ([\d.]+)s)?(?:, first programs ([\d.]+)s)?')


def _load(path: Path) -> dict:
  return json.loads(path.read_text()) if path.exists() else {}


def _save(path: Path, result: dict) -> None:
  tmp = path.with_suffix('.tmp')
  tmp.write_text(json.dumps(result, indent=2))
  tmp.replace(path)  # a check killed mid-part still leaves a whole JSON


def _version(name: str) -> str | None:
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return None


def _run(argv: list[str]) -> str | None:
  try:
    return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def start(path: Path, limits: dict) -> None:
  smi = _run(['nvidia-smi', '--query-gpu=name,driver_version,memory.total',
              '--format=csv,noheader'])
  _save(path, {
      'check': 'benchmarks/gpu_check.sh',
      'commit': _run(['git', '-C', str(REPO), 'rev-parse', 'HEAD']),
      'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
      'python': sys.version.split()[0], 'versions': {d: _version(d) for d in DISTRIBUTIONS},
      'nvidia_smi': smi, 'limits_s': limits, 'device': None, 'wheels': None, 'parts': {}})


def imports(path: Path) -> int:
  """Imports MODULES one by one; the device kind where jax imports. 0 if all import."""
  failed = {}
  for module in MODULES:
    try:
      __import__(module)
    except Exception as err:  # noqa: BLE001 -- any import failure is the finding
      failed[module] = f'{type(err).__name__}: {err}'[:300]
  result = _load(path)
  if 'jax' not in failed:
    import jax
    d = jax.devices()[0]
    result['device'] = {'platform': d.platform, 'device_kind': d.device_kind,
                        'device_count': jax.device_count()}
  result['versions'] = {dist: _version(dist) for dist in DISTRIBUTIONS}
  result['import_errors'] = failed
  _save(path, result)
  for module, error in failed.items():
    print(f'import {module} failed: {error}')
  return 1 if failed else 0


def wheels(directory: Path) -> list[str]:
  """The wheel files of `directory` to install: their distribution is missing here or at a
  version requirements.txt refuses, and is not the image's accelerator stack."""
  from packaging.requirements import Requirement

  from mecefo_jax import install  # standard library and packaging only
  runtime, _ = install.sections((REPO / 'requirements.txt').read_text())
  unmet = {install.canonicalize_name(Requirement(r).name)
           for r in install.unmet(runtime, install.installed_version)}
  chosen = []
  for wheel in sorted(directory.glob('*.whl')):
    name = install.canonicalize_name(wheel.name.split('-')[0])
    if PROTECTED.match(name):
      continue
    if install.installed_version(name) is None or name in unmet:
      chosen.append(str(wheel))
  return chosen


def _train_figures(log: str, run_dir: Path | None) -> dict:
  report = _load(run_dir / 'report.json') if run_dir else {}
  if report:
    keys = ('steps', 'compile_s', 'wall_s', 'tokens_per_s', 'final_loss', 'eval_loss', 'device',
            'programs')
    return {'startup': report['startup'], **{k: report.get(k) for k in keys}}
  line = START_LINE.search(log)  # killed before its report: what the start line said
  names = ('init_lower_s', 'init_compile_s', 'init_run_s', 'restore_s', 'first_programs_s')
  return {'startup_from_start_line': line and dict(zip(names, map(_float, line.groups())))}


def _float(text):
  return None if text is None else float(text)


def _benchmark_figures(kind: str, data: dict) -> dict:
  if kind == 'step_cost':
    return {'times': data['times'], 'temp_bytes': {k: v.get('temp_bytes') for k, v in
                                                    data['memory'].items()},
            **{k: data[k] for k in ('time_ratio', 'memory_ratio', 'naive_time_ratio',
                                    'naive_memory_ratio', 'micro_batch', 'seq_len')}}
  if kind == 'compile':
    return data['rows'][0]
  if kind == 'notebook':
    return data
  if kind == 'mfu':
    return {'rows': data['rows'], 'peak_tflops': data['peak_tflops'],
            'compute_dtype': data['compute_dtype'], 'best_mfu': data['best_mfu']}
  keys = ('overhead_pct', 'overhead_pct_median', 'maybe_save_blocking_s', 'times', 'restore_s',
          'state_bytes', 'snapshot_bytes')
  return {k: data.get(k) for k in keys}


def part(path: Path, name: str, kind: str, args) -> None:
  """Records one part: status (ok, timeout, oom, failed, skipped), time, figures, log tail."""
  log = Path(args.log).read_text(errors='replace') if args.log and Path(args.log).exists() else ''
  if args.rc is None:
    status = 'skipped'
  elif args.rc in (0, args.expect):
    status = 'ok'
  elif args.rc in (124, 137):
    status = 'timeout'
  else:
    status = 'oom' if OOM.search(log) else 'failed'
  entry = {'status': status, 'rc': args.rc, 'seconds': args.seconds, 'limit_s': args.limit,
           'command': args.cmd, 'log_tail': log.splitlines()[-8:]}
  try:
    if kind == 'train':
      entry['figures'] = _train_figures(log, Path(args.run_dir) if args.run_dir else None)
    elif kind == 'imports':
      pass
    elif args.json and Path(args.json).exists():
      entry['figures'] = _benchmark_figures(kind, json.loads(Path(args.json).read_text()))
  except (KeyError, ValueError) as err:  # a result of another shape: kept as the finding
    entry['figures_error'] = f'{type(err).__name__}: {err}'
  result = _load(path)
  result.setdefault('parts', {})[name] = entry
  _save(path, result)
  print(f'== {name}: {status} in {args.seconds:.0f}s (limit {args.limit}s)')


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog='python -m benchmarks.gpu_check', description=__doc__)
  p.add_argument('command', choices=('start', 'imports', 'wheels', 'part', 'finish'))
  p.add_argument('path', help='the result JSON (wheels: the wheel folder)')
  p.add_argument('name', nargs='?')
  p.add_argument('kind', nargs='?', choices=('imports', 'train', 'step_cost', 'compile', 'mfu',
                                             'snapshot', 'notebook'))
  p.add_argument('--expect', type=int, default=0, help='part: the exit code that also means done')
  p.add_argument('--rc', type=int, default=None)
  p.add_argument('--seconds', type=float, default=0.0)
  p.add_argument('--limit', type=int, default=0)
  p.add_argument('--cmd', default='', help='part: the command it ran')
  p.add_argument('--log', default=None)
  p.add_argument('--json', default=None)
  p.add_argument('--run-dir', default=None)
  p.add_argument('--limits', default='{}', help='start: the part limits, as JSON')
  p.add_argument('--total', type=float, default=None, help='finish: the whole check, seconds')
  p.add_argument('--wheels', default=None, help='finish: the wheels installed and where, JSON')
  args = p.parse_args(argv)
  path = Path(args.path)
  if args.command == 'start':
    start(path, json.loads(args.limits))
  elif args.command == 'imports':
    return imports(path)
  elif args.command == 'wheels':
    print('\n'.join(wheels(path)))
  elif args.command == 'part':
    part(path, args.name, args.kind or 'train', args)
  else:  # finish
    result = _load(path)
    result['total_s'] = args.total
    result['wheels'] = json.loads(args.wheels) if args.wheels else None
    _save(path, result)
    for name, entry in result['parts'].items():
      print(f"{name:<20} {entry['status']:<8} {entry['seconds']:>4.0f}s  {headline(entry)}")
  return 0


def headline(entry: dict) -> str:
  """A part's main figure, for the summary the check ends with."""
  f = entry.get('figures') or {}
  if 'startup' in f:
    s = f['startup']
    return f"first_step_s {s['first_step_s']} (the step itself {s['first_step_run_s']})"
  if f.get('startup_from_start_line'):
    return f"no first step; start line: {f['startup_from_start_line']}"
  if 'rows' in f:
    row = f['rows'][0]
    return (f"mfu {row['mfu']}, model {row['model_tflops_per_s']:.3g} / XLA "
            f"{row['xla_tflops_per_s']} TFLOP/s")
  if 'time_ratio' in f:
    return f"degraded/normal time {f['time_ratio']:.3f}, temp memory {f['memory_ratio']:.3f}"
  if 'one_device' in f:
    device = f['one_device']
    return f"notebook in {f['seconds']:.0f}s" + (
        f"; on one device degraded/normal time {device['time_ratio']:.3f}, temp memory "
        f"{device['memory_ratio']:.3f}" if device else '') + (f"; error: {f['error']}"
                                                             if f['error'] else '')
  if 'overhead_pct' in f:
    return f"every-step snapshot overhead {f['overhead_pct']}%"
  return ''


if __name__ == '__main__':
  sys.exit(main())
