"""Command line of train.py: config + dotted overrides, one clear line on bad input."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      prog='train.py', description='MeCeFO fault-tolerant LLM training (JAX/Flax).',
      epilog='example: python train.py --config configs/tiny.yaml train.steps=50 model.n_layers=4')
  p.add_argument('--config', default='configs/tiny.yaml', help='YAML file overriding the defaults')
  p.add_argument('--out', default=None, help='run directory (default: train.out_dir)')
  p.add_argument('--print-config', action='store_true', help='print the resolved config and exit')
  p.add_argument('overrides', nargs='*', help='dotted overrides: section.key=value')
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  logging.basicConfig(level=logging.WARNING, format='%(asctime)s %(message)s', datefmt='%H:%M:%S')
  logging.getLogger('mecefo').setLevel(logging.INFO)
  from mecefo_jax.config import ConfigError, load_config, to_dict
  try:
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
      import yaml
      print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
      return 0
    from mecefo_jax import trainer
    run = trainer.Trainer(cfg)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  log = logging.getLogger('mecefo')
  log.info('%s', run.describe())
  log.info('data: %s', run.corpus.describe())
  out_dir = Path(args.out or cfg.train.out_dir)
  report = run.run(out_dir)
  log.info('done: loss %.4f -> %.4f (entropy floor %.4f) in %.1fs, %.0f tok/s; report %s',
           report['first_loss'], report['final_loss'], report['entropy_floor'], report['wall_s'],
           report['tokens_per_s'], out_dir / 'report.json')
  return 0
