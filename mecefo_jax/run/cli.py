"""Command line of train.py: config + dotted overrides, one clear line on bad input."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from mecefo_jax.config import POLICIES  # no jax import: XLA_FLAGS are still settable


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog='train.py', description='MeCeFO fault-tolerant LLM training (JAX/Flax).',
      epilog='example: python train.py --config configs/tiny.yaml train.steps=50 model.n_layers=4')
  p.add_argument('--config', default='configs/tiny.yaml', help='YAML file overriding the defaults')
  p.add_argument('--out', default=None, help='run directory (default: train.out_dir)')
  p.add_argument('--print-config', action='store_true', help='print the resolved config and exit')
  p.add_argument('--data', default=None,
                 help='synthetic (built in) | text:PATH | tokens:PATH[?dtype=uint16] | hf:NAME (= train.data)')
  p.add_argument('--dry-run', action='store_true',
                 help='build, compile the step, print parameters, mesh and memory; no training')
  p.add_argument('--failures', default=None,
                 help='none | low | mid | high (docs/algorithm.md §5 presets) | trace:PATH (= faults.failures)')
  p.add_argument('--takeover', default=None, choices=POLICIES,
                 help='who processes a failed slice\'s micro-batch (= faults.takeover)')
  p.add_argument('--resume', action='store_true',
                 help='continue from the newest intact snapshot / checkpoint of --out')
  p.add_argument('--fresh', action='store_true',
                 help='start from step 0 even if --out holds an unfinished run')
  p.add_argument('--no-snapshots', action='store_true', help='no in-memory snapshots (= snapshot.enabled=false)')
  p.add_argument('--quiet', '-q', action='store_true',
                 help='only warnings, errors (failures, repairs) and the final summary line')
  p.add_argument('--host-devices', type=int, default=None,
                 help='CPU only: simulate this many devices (XLA host platform), e.g. 8 slices')
  p.add_argument('--coordinator', default=None,
                 help='multi-process run: HOST:PORT of process 0 (automatic on TPU pods)')
  p.add_argument('--num-processes', type=int, default=None, help='multi-process run: how many')
  p.add_argument('--process-id', type=int, default=None, help='multi-process run: this one (0..n-1)')
  p.add_argument('--heartbeat-s', type=int, default=100,
                 help='multi-process run: seconds of silence after which a process counts as dead '
                      'and the others abort (then restart them with --resume)')
  p.add_argument('overrides', nargs='*', help='dotted overrides: section.key=value')
  return p.parse_intermixed_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  # jaxlib's QR/SVD (the svd-basis refresh) use OpenBLAS, whose threads fight XLA's own on
  # CPU hosts: measured 5.2 s vs 1.15 s per llama_60m refresh on 2 cores.
  os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')
  if args.host_devices:
    # Must happen before jax is imported anywhere.
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                               f' --xla_force_host_platform_device_count={args.host_devices}')
  overrides = list(args.overrides)
  overrides += [f'train.data={args.data}'] if args.data else []
  overrides += [f'faults.failures={args.failures}'] if args.failures else []
  overrides += [f'faults.takeover={args.takeover}'] if args.takeover else []
  overrides += ['snapshot.enabled=false'] if args.no_snapshots else []
  logging.basicConfig(level=logging.WARNING, format='%(asctime)s %(message)s', datefmt='%H:%M:%S')
  logging.getLogger('mecefo').setLevel(logging.WARNING if args.quiet else logging.INFO)
  from mecefo_jax.config import ConfigError, load_config, to_dict
  from mecefo_jax.data.sources import DataError
  from mecefo_jax.snapshot.store import SnapshotError
  try:
    cfg = load_config(args.config, overrides)
    if args.print_config:
      import yaml
      print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
      return 0
    from mecefo_jax import multihost
    multihost.initialize(args.coordinator, args.num_processes, args.process_id, args.heartbeat_s)
    from mecefo_jax.run import trainer
    from mecefo_jax.snapshot import recovery
    out_dir = Path(args.out or cfg.train.out_dir)
    resume = args.resume or (not args.fresh and recovery.unfinished(out_dir))
    run = trainer.Trainer(cfg, out_dir, resume=resume, progress='quiet' if args.quiet else 'auto')
  except (ConfigError, DataError, SnapshotError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if run.snapshots:  # preemption: checkpoint and stop at the end of the step
    from mecefo_jax.snapshot.store import install_sigterm_handler
    install_sigterm_handler(run.snapshots, defer=True)
  log = logging.getLogger('mecefo')
  log.info('%s', run.describe())
  log.info('data: %s', run.corpus.describe())
  if args.dry_run:
    print(json.dumps(run.dry_run_info(), indent=2))
    run.close()
    return 0
  try:
    report = run.run()
  finally:
    run.close()
  summary = _summary(report, out_dir)
  if args.quiet:
    print(summary, file=sys.stderr)
  else:
    log.info('%s', summary)
    log.info('goodput (s): %s; samples %s', {k: round(v, 2) for k, v in report['goodput'].items()},
             report['samples'])
  if report['preempted']:
    return 128 + signal.SIGTERM
  return 3 if report['stopped'] else 0


def _num(x) -> str:
  return 'n/a' if x is None else f'{x:.4f}'


def _summary(report: dict, out_dir: Path) -> str:
  """The one line a run ends with (also under --quiet)."""
  ppl = report['eval_perplexity']
  return (f"done: {report['steps']} steps, loss {_num(report['first_loss'])} -> "
          f"{_num(report['final_loss'])}, eval {_num(report['eval_loss'])} (perplexity "
          f"{'n/a' if ppl is None else f'{ppl:.3f}'}; entropy floor {_num(report['entropy_floor'])})"
          f" in {report['wall_s']:.1f}s, {report['tokens_per_s']:.0f} tok/s; outputs in {out_dir}")
