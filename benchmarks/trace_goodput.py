"""A real cluster's node fault log at its own scale: every approach's goodput, charged in full.

Run: python -m benchmarks.trace_goodput --trace FILE [--days A:B] [--slices N] [--json OUT]
     [--nodes 400] [--slice-hosts 1] [--hot-spares K,...] [--swap-min 10]
     [--seeds 5] [--step-s 10] [--rows R] [--granule G] [--classes all]
     [--profile fast] [--policies spread,exact,budget:1.0,budget:1.05,neighbor]
     [--spares 0,4,8,16,32,64,128]
     [--checkpoint-min 30] [--sweep-restart-s ...] [--sweep-checkpoint-min ...]
     [--rejoin now] [--rejoin-levers every:24,count:4] [--costs MEASURED.json] [--stat flops]
     [--figure PNG]
Goodput: samples trained, as % of a fault-free run's on every node over the window. Every
approach whose recovery is a process restart (the takeover policies, elastic restart) pays the
same charges: the in-memory snapshots' tax, the steps since the last snapshot after a death, the
same restart profile. How each approach is charged: mecefo_jax/plan/log_replay.py and
docs/failures.md, "Real fault logs"; the replay's modules live in mecefo_jax/plan (mecefo-plan is
its installed command).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import argparse
import hashlib
import subprocess
import time
from pathlib import Path

import numpy as np

from benchmarks import common, trace_figure, trace_scenarios
from mecefo_jax.config import ConfigError
from mecefo_jax.plan import loss_equivalent, measured, restart_profiles
from mecefo_jax.plan.fleet import Fleet
from mecefo_jax.plan.log_replay import Rejoin
from mecefo_jax.plan.runs import (ELASTIC, MemoPlanner, Setup, at_restarts, limit_pct,
                                  log_stats, planner, read_log, replay, restarts_pct,
                                  servers_down, setup)

COSTS = 'docs/results/failure_throughput_scale_llama_60m_median.json'


def checkpoint_name(spares: int) -> str:
  return f'checkpoint-restart-{spares}-spares'


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--trace', required=True, help='a JSON node fault log (benchmarks/traces/)')
  p.add_argument('--days', default='', help="window A:B in the log's days (default: all of it)")
  p.add_argument('--nodes', type=int, default=400, help="the cluster's size (InfiniteHBD: 400)")
  p.add_argument('--slices', type=int, default=0, help='default: every node in a slice')
  p.add_argument('--slice-hosts', type=int, default=1, help='hosts per slice: a slice is down '
                 'while any of its hosts is; rows per slice = hosts x --rows')
  p.add_argument('--hot-spares', default='', help='hot-spare scenarios: spare servers (of the '
                 '--nodes) swapped into a slice that lost a host, e.g. 8,32')
  p.add_argument('--swap-min', type=float, default=10.0, help='minutes from a host\'s fault to '
                 'its hot spare training in the slice (assumed)')
  p.add_argument('--seeds', type=int, default=5, help='draws of nodes onto slices')
  p.add_argument('--step-s', type=float, default=10.0, help='the stated fault-free step time')
  p.add_argument('--rows', type=int, default=0, help="rows per host (default: the measurement's; "
                 'others: costs from the affine role model)')
  p.add_argument('--granule', type=int, default=0, help="spread shares' granule (default: the "
                 "measurement's)")
  p.add_argument('--classes', default='all', help='fault classes that count (faults.trace_classes)')
  p.add_argument('--profile', default='fast', help='the headline restart profile')
  p.add_argument('--policies', default='spread,exact,budget:1.0,budget:1.05,neighbor,requeue')
  p.add_argument('--spares', default='0,4,8,16,32,64,128', help='checkpoint-restart spare pools '
                 '(servers; whole slices of them)')
  p.add_argument('--checkpoint-min', type=float, default=30.0, help='headline checkpoint interval')
  p.add_argument('--sweep-restart-s', default='15,60,300,1200,3600,7200',
                 help='restart costs swept besides the '
                 "profiles'")
  p.add_argument('--sweep-checkpoint-min', default='5,10,30,60,120')
  p.add_argument('--rejoin', default='now', help='now | every:HOURS | count:K')
  p.add_argument('--rejoin-levers', default='every:24,count:4', help='rejoin policies also '
                 'replayed for the default policy and the best one, at every profile')
  p.add_argument('--snapshot-every', type=int, default=0, help='steps between in-memory snapshots '
                 "(a death loses half of them and the step in flight); default: the product's "
                 f"auto interval measured on llama_60m ({measured.source('snapshot_tax')})")
  p.add_argument('--snapshot-overhead-pct', type=float, default=None,
                 help='their tax, %% of step time; default: measured at that interval (the auto '
                 "interval's bound, snapshot.overhead_budget, is 1%%)")
  p.add_argument('--config', default='configs/llama_60m.yaml')
  p.add_argument('--costs', default=COSTS, help="a failure_throughput JSON's measurement")
  p.add_argument('--stat', default='flops', choices=('flops', 'median', 'min'))
  p.add_argument('--v', type=float, default=None, help="a degraded row's worth in loss relative "
                 "to an exact row's (default: the full mode's, measured: "
                 f"{measured.source('row_value')})")
  p.add_argument('--figure', default=None)
  p.add_argument('--json', default=None)
  return p.parse_args(argv)


def default_policy(cfg) -> str:
  """The config's takeover as a policy spec: 'budget:T' names its time budget."""
  f = cfg.faults
  return f'budget:{f.time_budget:g}' if f.takeover == 'budget' else f.takeover


def run_all(s: Setup, names: list[str], restarts: list[float], profiles: dict
            ) -> tuple[dict, dict]:
  """(name -> restart cost -> the seeds' mean; name -> profile -> the same), checkpoint-restart
  at the headline interval."""
  every = {name: at_restarts(s, name, restarts, s.args.checkpoint_min) for name in names}
  by_profile = {name: {prof: every[name][p.total_s] for prof, p in profiles.items()}
                for name in names}
  return every, by_profile


def sweep(s: Setup, names: list[str], restarts: list[float], every: dict) -> dict:
  """Goodput at every restart cost R (and checkpoint interval C for checkpoint-restart), the
  seeds' mean."""
  a, rejoin = s.args, Rejoin.parse(s.args.rejoin)
  cs = sorted({a.checkpoint_min, *(float(c) for c in a.sweep_checkpoint_min.split(',') if c)})
  live = {name: [every[name][r]['goodput_pct'] for r in restarts]
          for name in names if not name.startswith('checkpoint-restart')}
  ckpt = {name: {f'{c:g}': [float(np.mean([replay(s, name, r, seed, c, rejoin)['goodput_pct']
                                            for seed in range(a.seeds)])) for r in restarts]
                 for c in cs} for name in names if name.startswith('checkpoint-restart')}
  best_ckpt = {f'{c:g}': [max(ckpt[n][f'{c:g}'][i] for n in ckpt) for i in range(len(restarts))]
               for c in cs}
  winner = {f'{c:g}': [max([*((n, v[i]) for n, v in live.items()),
                            *((n, ckpt[n][f'{c:g}'][i]) for n in ckpt)], key=lambda x: x[1])[0]
                       for i in range(len(restarts))] for c in cs}
  return {'restart_s': restarts, 'checkpoint_min': cs, 'goodput_pct': live,
          'checkpoint_goodput_pct': ckpt, 'best_checkpoint_goodput_pct': best_ckpt,
          'winner': winner}


def levers(s: Setup, policies: list[str], profiles: dict) -> dict:
  """The rejoin policy as a lever: goodput of `policies` under each, at every profile (seed 0)."""
  a = s.args
  specs = ['now', *[x for x in a.rejoin_levers.split(',') if x]]
  plans = {p: planner(s, p, MemoPlanner) for p in policies}
  return {p: {spec: {prof: replay(s, p, r.total_s, 0, a.checkpoint_min, Rejoin.parse(spec),
                                  plans[p])['goodput_pct'] for prof, r in profiles.items()}
              for spec in specs} for p in policies}


def targets(approaches: dict, sweep_: dict, policies: list[str], default: str) -> dict:
  """The issue's targets at the headline profile: the best policy of the product keeps >= 99%
  and beats the best checkpoint-restart and elastic restart by more than the seeds' spread;
  where it does not, the restart costs where it stops."""
  best = max(policies, key=lambda p: approaches[p]['goodput_pct'])
  ckpt = max((n for n in approaches if n.startswith('checkpoint-restart')),
             key=lambda n: approaches[n]['goodput_pct'])
  margin = lambda other: (approaches[best]['goodput_pct'] - approaches[other]['goodput_pct']
                          - approaches[best]['goodput_pct_spread']
                          - approaches[other]['goodput_pct_spread'])
  best_at = lambda i: max(sweep_['goodput_pct'][p][i] for p in policies)
  in_loss = lambda key: max(approaches, key=lambda n: approaches[n][key])
  wins = {}
  for c, names in sweep_['winner'].items():
    ours = [i for i, n in enumerate(names) if n in policies]
    wins[c] = {'product_wins_at_restart_s': [sweep_['restart_s'][i] for i in ours],
               'winners': names}
  return {'best_policy': best, 'default': default,
          'best_goodput_pct': approaches[best]['goodput_pct'],
          'default_goodput_pct': approaches[default]['goodput_pct'],
          'keeps_99_pct': approaches[best]['goodput_pct'] >= 99.0,
          'keeps_99_pct_at_restart_s': [r for i, r in enumerate(sweep_['restart_s'])
                                        if best_at(i) >= 99.0],
          'best_loss_equivalent': in_loss('loss_equivalent_pct'),
          'best_loss_equivalent_r1': in_loss('loss_equivalent_r1_pct'),
          'best_checkpoint': ckpt, 'margin_over_checkpoint_pct': margin(ckpt),
          'margin_over_elastic_pct': margin(ELASTIC),
          'beats_checkpoint': margin(ckpt) > 0, 'beats_elastic': margin(ELASTIC) > 0,
          'by_checkpoint_min': wins}


def uptime() -> str:
  return subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()


def table(result: dict) -> str:
  rows = []
  for name, by in result['by_profile'].items():
    row = {'approach': name}
    for prof, r in by.items():
      row[prof] = f"{r['goodput_pct']:.2f} ± {r['goodput_pct_std']:.2f}"
    f = by[result['profile']]
    row |= {'loss-eq r=inf': f"{f['loss_equivalent_pct']:.2f}",
            'loss-eq r=1': f"{f['loss_equivalent_r1_pct']:.2f}",
            'dropped_%': f"{f['dropped_pct']:.2f}", 'degraded_%': f"{f['degraded_pct']:.2f}",
            'restarts': f"{f['restarts']:.0f}"}
    rows.append(row)
  return common.markdown_table(rows, list(rows[0]))


def approach_names(a, default: str) -> tuple[list[str], list[str]]:
  """(the takeover policies replayed, every approach): the default always among them;
  checkpoint-restart's spare servers only in whole slices."""
  policies = list(dict.fromkeys([*a.policies.split(','), default]))
  spares = [int(k) for k in a.spares.split(',') if k and int(k) % a.slice_hosts == 0]
  return policies, [*policies, ELASTIC, *(checkpoint_name(k) for k in spares)]


def _loss_model(a) -> dict:
  """v (given, or the default mode's measured) and r: the inputs of progress counted in loss;
  sets a.v for the replay."""
  v = loss_equivalent.read_v() if a.v is None else {'v': a.v, 'v_ci95': None,
                                                    'source': 'given (--v)'}
  a.v = v['v']
  return {**v, 'r': ['inf', 1.0], 'r_source': loss_equivalent.R_SOURCE}


def main(argv=None) -> dict:
  t0, load_before = time.perf_counter(), uptime()
  a = _args(argv)
  loss_model = _loss_model(a)
  try:
    faults, window = read_log(a.trace, a.days)
    fleet = Fleet(a.slices, a.slice_hosts) if a.slices else Fleet.of(a.nodes, a.slice_hosts)
    hot = [Fleet.of(fleet.servers, a.slice_hosts, int(k), a.swap_min / 1440.0)
           for k in a.hot_spares.split(',') if k]  # the same servers, k of them spares
    s = setup(a, faults, window, fleet)
  except ConfigError as err:
    raise SystemExit(f'error: {err}') from None
  profiles = restart_profiles.profiles(a.step_s)
  if a.profile not in profiles:
    raise SystemExit(f'--profile must be one of {", ".join(profiles)}, got {a.profile!r}')
  default = default_policy(s.cfg)
  policies, names = approach_names(a, default)
  restarts = sorted({*(p.total_s for p in profiles.values()),
                     *(float(r) for r in a.sweep_restart_s.split(',') if r)})
  every, by_profile = run_all(s, names, restarts, profiles)
  sweep_ = sweep(s, names, restarts, every)
  approaches = {n: by_profile[n][a.profile] for n in names}
  best = max(policies, key=lambda p: approaches[p]['goodput_pct'])
  restarters = [n for n in names if not n.startswith('checkpoint-restart')]
  targets_ = targets(approaches, sweep_, policies, default)
  slices = log_stats(s.events[0], s.horizon_s, s.n, faults, *window)
  stats = {**slices, **servers_down(faults, a, window),  # the log's servers; seed 0's slices:
           'slice_mean_down_pct': slices['mean_down_pct'], 'slice_max_down': slices['max_down']}
  result = {
      **common.run_info(__spec__.name, argv), 'trace': a.trace,
      'trace_sha256': hashlib.sha256(Path(a.trace).read_bytes()).hexdigest(), 'log': stats,
      'nodes': a.nodes, 'slice_hosts': a.slice_hosts, 'slices': s.n, 'seeds': a.seeds,
      'step_s': a.step_s, 'micro_batch': s.b, 'rows_per_host': s.b // a.slice_hosts,
      'granule': s.granule, 'max_degraded_rows': planner(s, policies[0]).max_rows,
      'classes': a.classes, 'reading': a.stat,
      'costs_from': f'{a.costs} (stat {a.stat}), scaled to the stated step time',
      'split_path_vs_fused': (s.costs.group(planner(s, 'spread').plan(range(s.n)).roles[0])
                              + s.costs.update_s) / s.costs.normal_s,
      'snapshot_every': s.snapshots['every'], 'snapshot_overhead_pct': s.snapshots['tax_pct'],
      'snapshots_from': s.snapshots['source'],
      'charges': 'the same for every approach whose recovery is a process restart ('
                 + ', '.join(restarters) + '): the snapshot tax, the step in flight and half a '
                 'snapshot interval lost at a death, the restart profile; checkpoint-restart: '
                 'no tax, the work since its durable checkpoint lost at a death, the same profile',
      'rejoin': a.rejoin, 'checkpoint_min': a.checkpoint_min, 'profile': a.profile,
      'profiles': {k: p.to_json() for k, p in profiles.items()},
      'loss_model': loss_model, 'limit_pct': limit_pct(s, restarts_pct(approaches[ELASTIC])),
      'default': default, 'approaches': approaches,
      'by_profile': by_profile, 'sweep': sweep_,
      'sensitivity': trace_scenarios.sensitivity(
          every, names, restarts, [default, best, ELASTIC, targets_['best_checkpoint']]),
      'what_if': trace_scenarios.what_if(s, [default, ELASTIC], profiles, a.checkpoint_min),
      'hot_spares': {str(f.spares): trace_scenarios.hot_spares(a, faults, window, f, restarters,
                                                               profiles[a.profile])
                     for f in hot},
      'rejoin_levers': levers(s, list(dict.fromkeys([default, best])), profiles),
      'targets': targets_}
  result |= {'runtime_s': time.perf_counter() - t0, 'load_before': load_before,
             'load_after': uptime()}
  common.emit(result, table(result), a.json)
  if a.figure:
    trace_figure.figure(result, a.figure)
  return result


if __name__ == '__main__':
  main()
