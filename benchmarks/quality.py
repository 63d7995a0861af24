"""Quality under failures: fault-free vs MeCeFO takeover policies, same data and seed.

Run: python benchmarks/quality.py --config configs/tiny.yaml --json OUT.json
A scripted trace keeps slice 1 down from --fail-at to --repair-at (default: a third of the
run or more); every policy trains the same samples (drop skips the failed slice's) from
the same initial state. Reports final eval loss, its increase vs fault-free (like the
paper's perplexity table), perplexity and wall time.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--config', default='configs/tiny.yaml')
  p.add_argument('--json', default=None)
  p.add_argument('--slices', type=int, default=4)
  p.add_argument('--policies', default='neighbor,spread,drop,naive')
  p.add_argument('--fail-at', type=float, default=0.2, help='fraction of the run')
  p.add_argument('--repair-at', type=float, default=0.7, help='fraction of the run')
  p.add_argument('overrides', nargs='*')
  return p.parse_intermixed_args(argv)


def main(argv=None) -> dict:
  args = _args(argv)
  if 'jax' not in sys.modules:  # fake CPU devices for the slices, before jax is imported
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                               f' --xla_force_host_platform_device_count={args.slices}')
  import numpy as np
  from benchmarks import common
  from mecefo_jax.config import load_config
  from mecefo_jax.failures import FailureSchedule
  from mecefo_jax.trainer import Trainer
  import tempfile

  runs = {}
  for policy in ['fault-free', *args.policies.split(',')]:
    cfg = load_config(args.config, [f'mesh.slice={args.slices}', 'mesh.fsdp=1', 'mesh.tensor=1',
                                    'snapshot.enabled=false',
                                    f'faults.takeover={"neighbor" if policy == "fault-free" else policy}',
                                    *args.overrides])
    steps = cfg.train.steps
    schedule = FailureSchedule(args.slices)
    if policy != 'fault-free':
      schedule.fail_at(1, int(args.fail_at * steps)).repair_at(1, int(args.repair_at * steps))
    with tempfile.TemporaryDirectory() as out:
      report = Trainer(cfg, Path(out), schedule).run()
    runs[policy] = {k: report[k] for k in ('eval_loss', 'final_loss', 'wall_s', 'samples', 'goodput',
                                            'params_sha256')}
  base = runs['fault-free']['eval_loss']
  for r in runs.values():
    r['eval_increase_pct'] = 100.0 * (r['eval_loss'] / base - 1.0)
    r['perplexity'] = float(np.exp(r['eval_loss']))
  result = {'config': args.config, 'overrides': args.overrides, 'slices': args.slices,
            'down_fraction': args.repair_at - args.fail_at, 'device': common.device_info(),
            'runs': runs}
  rows = [{'policy': p, 'eval_loss': r['eval_loss'], 'ppl': r['perplexity'],
           'increase_pct': r['eval_increase_pct'], 'dropped': r['samples'].get('dropped', 0),
           'wall_s': r['wall_s']} for p, r in runs.items()]
  common.emit(result, common.markdown_table(rows, list(rows[0])), args.json)
  return result


if __name__ == '__main__':
  main()
