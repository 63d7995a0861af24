"""The degraded step's compile with XLA's autotune cache empty, warm, or autotuning off (GPU).

Run: python -m benchmarks.compile_autotune --config configs/llama_350m.yaml --cache DIR \
       --mode empty|warm|off --json OUT.json
One compile per process (XLA also keeps autotune results in memory): `empty` compiles with an
empty per-fusion autotune cache in DIR (removed first), `warm` with what `empty` left there, `off`
with `xla_gpu_autotune_level=0` (and no cache). On CPU the options do nothing (a smoke run).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import shutil
import time
from pathlib import Path

import jax

from benchmarks.common import emit, markdown_table, parser, run_info
from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.model import models
from mecefo_jax.core.roles import Role
from mecefo_jax.step import program_store, train_step


def main(argv=None) -> None:
  ap = parser(__doc__.splitlines()[0])
  ap.add_argument('--cache', required=True, help='the autotune cache directory')
  ap.add_argument('--mode', choices=('empty', 'warm', 'off'), required=True)
  args = ap.parse_args(argv)
  cfg = load_config(args.config, ['mesh.slice=1', 'mesh.fsdp=1', 'mesh.tensor=1', *args.overrides])
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  cache = Path(args.cache)
  if args.mode == 'empty':
    shutil.rmtree(cache, ignore_errors=True)
  cache.mkdir(parents=True, exist_ok=True)
  options = ({'xla_gpu_autotune_level': 0} if args.mode == 'off'
             else {program_store.AUTOTUNE_OPTION: str(cache)})
  role = Role(degraded=2 * cfg.train.micro_batch)
  t0 = time.perf_counter()
  lowered = train_step.lower_step(cfg, mesh, role, models.spec(cfg.model).graphdef)
  t1 = time.perf_counter()
  compiled = lowered.compile(options)
  t2 = time.perf_counter()
  row = {'mode': args.mode, 'lower_s': round(t1 - t0, 2), 'compile_s': round(t2 - t1, 2),
         'cache_files': sum(1 for _ in cache.rglob('*') if _.is_file()),
         'temp_bytes': train_step.memory_summary(compiled).get('temp_bytes')}
  emit({**run_info('benchmarks.compile_autotune', argv), 'rows': [row]},
       markdown_table([row], list(row)), args.json)


if __name__ == '__main__':
  main()
