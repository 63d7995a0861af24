"""A real cluster's node fault log at its own scale: every approach's goodput, charged in full.

Run: python -m benchmarks.trace_goodput --trace FILE [--days A:B] [--slices N] [--json OUT]
     [--nodes 400] [--seeds 5] [--step-s 10] [--rows R] [--granule G] [--classes all]
     [--profile fast] [--policies spread,exact,budget:1.0,budget:1.05,neighbor]
     [--spares 0,4,8,16,32]
     [--checkpoint-min 30] [--sweep-restart-s ...] [--sweep-checkpoint-min ...]
     [--rejoin now] [--rejoin-levers every:24,count:4] [--costs MEASURED.json] [--stat flops]
     [--figure PNG]
Goodput: samples trained, as % of a fault-free run's on every node over the window. How each
approach is charged: benchmarks/trace_replay.py and docs/failures.md, "Real fault logs".
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import argparse
import dataclasses
import hashlib
import json
import subprocess
import time
from pathlib import Path

import numpy as np

from benchmarks import common, failure_costs, restart_profiles, trace_figure
from benchmarks.simulate import PolicyModel
from benchmarks.trace_replay import Outcome, Rejoin, batched, checkpoint_restart, takeover
from mecefo_jax.config import load_config
from mecefo_jax.core import fault_log
from mecefo_jax.core.programs import RunPrograms
from mecefo_jax.core.roles import Role
from mecefo_jax.core.takeover import Planner

ELASTIC = 'elastic-restart'
COSTS = 'docs/results/failure_throughput_scale_llama_60m_median.json'
FRONTIER = 'docs/results/frontier_32slices.json'
QUALITY = [f'docs/results/quality_frontier_tiny_pydoc_8slices_seed{s}.json' for s in range(3)]


def checkpoint_name(spares: int) -> str:
  return f'checkpoint-restart-{spares}-spares'


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--trace', required=True, help='a JSON node fault log (benchmarks/traces/)')
  p.add_argument('--days', default='', help="window A:B in the log's days (default: all of it)")
  p.add_argument('--nodes', type=int, default=400, help="the cluster's size (InfiniteHBD: 400)")
  p.add_argument('--slices', type=int, default=0, help='default: one per node')
  p.add_argument('--seeds', type=int, default=5, help='draws of nodes onto slices')
  p.add_argument('--step-s', type=float, default=10.0, help='the stated fault-free step time')
  p.add_argument('--rows', type=int, default=0, help="rows per slice (default: the measurement's; "
                 'others: costs from the affine role model)')
  p.add_argument('--granule', type=int, default=0, help="spread shares' granule (default: the "
                 "measurement's)")
  p.add_argument('--classes', default='all', help='fault classes that count (faults.trace_classes)')
  p.add_argument('--profile', default='fast', help='the headline restart profile')
  p.add_argument('--policies', default='spread,exact,budget:1.0,budget:1.05,neighbor')
  p.add_argument('--spares', default='0,4,8,16,32', help='checkpoint-restart spare pools')
  p.add_argument('--checkpoint-min', type=float, default=30.0, help='headline checkpoint interval')
  p.add_argument('--sweep-restart-s', default='15,300,1200,3600,7200',
                 help='restart costs swept besides the '
                 "profiles'")
  p.add_argument('--sweep-checkpoint-min', default='5,10,30,60,120')
  p.add_argument('--rejoin', default='now', help='now | every:HOURS | count:K')
  p.add_argument('--rejoin-levers', default='every:24,count:4', help='rejoin policies also '
                 'replayed for the default policy and the best one, at every profile')
  p.add_argument('--snapshot-every', type=int, default=7, help='steps between in-memory snapshots '
                 "(a death loses half of them and the step in flight); the product's auto interval "
                 'on llama_60m (docs/results/snapshot_overhead_llama_60m_auto.json)')
  p.add_argument('--snapshot-overhead-pct', type=float, default=1.0,
                 help="their cost, % of step time (snapshot.overhead_budget, every=auto's bound)")
  p.add_argument('--config', default='configs/llama_60m.yaml')
  p.add_argument('--costs', default=COSTS, help="a failure_throughput JSON's measurement")
  p.add_argument('--stat', default='flops', choices=('flops', 'median', 'min'))
  p.add_argument('--figure', default=None)
  p.add_argument('--json', default=None)
  return p.parse_args(argv)


@dataclasses.dataclass
class Setup:
  """What every replay shares."""
  args: argparse.Namespace
  events: list  # per seed: the timed slice events
  horizon_s: float
  n: int
  b: int
  costs: object
  cfg: object
  granule: int

  @property
  def fault_free(self) -> float:
    return self.n * self.b * self.horizon_s / self.args.step_s


def setup(a) -> tuple[Setup, dict]:
  text = Path(a.trace).read_text()
  faults = fault_log.parse(text, a.trace)
  first, last = fault_log.window(faults, a.days)
  n = a.slices or a.nodes
  events = [fault_log.slice_events(text, a.trace, n, fault_log.LogMapping(
      a.nodes, a.classes, first, 1.0, seed), last) for seed in range(a.seeds)]
  measured = json.loads(Path(a.costs).read_text())
  rows, b0 = a.rows or measured['micro_batch'], measured['micro_batch']
  cfg = load_config(a.config, ['mesh.slice=1', 'mesh.fsdp=1', 'mesh.tensor=1',
                               f'train.micro_batch={rows}'])
  costs = failure_costs.costs_from(measured['measurement'], a.stat)
  # Other rows per slice: the fused step grows as the split path does (the affine role model).
  split = lambda b: costs.group(Role(b)) + costs.update_s
  normal = costs.normal_s * split(rows) / split(b0)
  scale = a.step_s / normal  # the costs, as shares of the stated step time
  costs = dataclasses.replace(
      costs, normal_s=a.step_s, update_s=costs.update_s * scale, refresh_s=costs.refresh_s * scale,
      group_s={r: s * scale for r, s in costs.group_s.items()},
      group_compile_s=dict.fromkeys(costs.group_s, 0.0), fused_compile_s=0.0,
      compile_s_by_kind=dict.fromkeys(costs.compile_s_by_kind, 0.0), move_s=0.0, rejoin_s=0.0)
  s = Setup(a, events, (last - first) * fault_log.DAY_S, n, rows, costs, cfg,
            a.granule or measured.get('granule', 1))
  return s, log_stats(events[0], s.horizon_s, n, faults, first, last)


def log_stats(events, horizon_s: float, n: int, faults, first: float, last: float) -> dict:
  """The window's failures as the replay sees them (seed 0)."""
  down, t0, area, most = set(), 0.0, 0.0, 0
  for e in events:
    area += len(down) * (e.time_s - t0)
    t0 = e.time_s
    (down.add if e.kind == 'fail' else down.discard)(e.slice)
    most = max(most, len(down))
  area += len(down) * (horizon_s - t0)
  inside = [f for f in faults if first <= f.day < last]
  return {'days': [first, last], 'fault_starts': sum(f.start for f in inside),
          'nodes_failing': len({f.node for f in inside}),
          'slice_failures': sum(e.kind == 'fail' for e in events),
          'mean_down_pct': 100.0 * area / horizon_s / n, 'max_down': most}


def default_policy(cfg) -> str:
  """The config's takeover as a policy spec: 'budget:T' names its time budget."""
  f = cfg.faults
  return f'budget:{f.time_budget:g}' if f.takeover == 'budget' else f.takeover


def planner(s: Setup, spec: str, kind: type[Planner] = Planner) -> Planner:
  policy, budget = common.policy_spec(spec)
  return kind.from_config(s.cfg, s.n, s.granule, policy, budget)


class MemoPlanner(Planner):
  """A planner that keeps its plans: the replays of one draw at every restart cost meet the same
  live sets (planning 400 slices is most of a replay's time)."""

  def plan(self, live):
    memo = self.__dict__.setdefault('_plans', {})
    key = tuple(live)
    if key not in memo:
      memo[key] = super().plan(live)
    return memo[key]


def replay(s: Setup, name: str, restart_s: float, seed: int, checkpoint_min: float,
           rejoin: Rejoin, plan: Planner | None = None) -> dict:
  """One approach, one restart cost, one draw: goodput and its parts, % of the fault-free run;
  `plan`: the planner to use (default a new one)."""
  a, events = s.args, s.events[seed]
  if name.startswith('checkpoint-restart'):
    spares = int(name.split('-')[2])
    out = checkpoint_restart(events, s.n, spares, s.horizon_s, a.step_s, s.b, restart_s,
                             checkpoint_min * 60.0)
    return summary(s, out, 0.0)
  spec = 'drop' if name == ELASTIC else name
  # RunPrograms.of(.., True): the svd bases (the default) are refreshed while rows are degraded.
  model = PolicyModel(plan or planner(s, spec), s.costs, RunPrograms.of(s.cfg, True),
                      s.cfg.mecefo.tau)
  # A death loses the step in flight and the steps since the last in-memory snapshot (takeover:
  # snapshot.every; elastic restart takes the state from live peers: the step in flight only).
  lost_steps = 1 if name == ELASTIC else 1 + (a.snapshot_every - 1) / 2
  overhead = 0.0 if name == ELASTIC else a.snapshot_overhead_pct
  out, _ = takeover(batched(events, rejoin), s.horizon_s, model, restart_s,
                    lost_steps * a.step_s)
  return summary(s, out, overhead)


def summary(s: Setup, out: Outcome, overhead_pct: float) -> dict:
  ff = s.fault_free
  keep = 1.0 - overhead_pct / 100.0  # steps slowed by the snapshots' share
  goodput = 100.0 * out.samples * keep / ff
  lost = {k: 100.0 * v / s.horizon_s for k, v in out.lost_s.items()}
  lost['snapshots'] = overhead_pct * (out.samples / ff)
  lost['dropped_rows'] = 100.0 * out.dropped / ff * keep
  lost['other'] = 100.0 - goodput - sum(lost.values())  # slower steps (policies), idle spares
  return {'goodput_pct': goodput, 'dropped_pct': 100.0 * out.dropped / ff,
          'degraded_pct': 100.0 * out.degraded / ff, 'restarts': out.restarts,
          'lost_pct_by_cause': lost}


def mean_over_seeds(runs: list[dict]) -> dict:
  """The seeds' mean of every figure, with the goodput's spread (max - min) and per seed."""
  goodput = [r['goodput_pct'] for r in runs]
  mean = lambda key: float(np.mean([r[key] for r in runs]))
  return {'goodput_pct': float(np.mean(goodput)), 'goodput_pct_std': float(np.std(goodput)),
          'goodput_pct_spread': float(max(goodput) - min(goodput)),
          'goodput_pct_per_seed': goodput, 'dropped_pct': mean('dropped_pct'),
          'degraded_pct': mean('degraded_pct'), 'restarts': mean('restarts'),
          'lost_pct_by_cause': {k: float(np.mean([r['lost_pct_by_cause'][k] for r in runs]))
                                for k in runs[0]['lost_pct_by_cause']}}


def loss_weights() -> dict[str, float]:
  """Extra fault-free steps (as a share of the run) per unit share of degraded rows, by policy:
  the frontier's make-up steps at `high` over the degraded share of its quality runs (8 slices,
  tiny, seeds 0-2)."""
  frontier = json.loads(Path(FRONTIER).read_text())['policies']
  shares: dict[str, list[float]] = {}
  for path in QUALITY:
    for run in json.loads(Path(path).read_text())['per_seed'].values():
      for policy, r in run['presets']['high']['runs'].items():
        rows = r['samples']
        shares.setdefault(policy, []).append(rows['degraded'] / sum(rows.values()))
  return {p: frontier[p]['make_up_steps_pct'] / 100.0 / float(np.mean(sh))
          for p, sh in shares.items() if p in frontier and np.mean(sh) > 0}


def discounted(name: str, result: dict, weights: dict) -> float | None:
  """Goodput with the degraded rows' loss cost taken off: the time to the same loss (None: no
  frontier reading of the policy). Dropped rows are already out of the goodput."""
  if name.startswith('checkpoint-restart') or name == ELASTIC or not result['degraded_pct']:
    return result['goodput_pct']
  w = weights.get(name)
  if w is None:
    return None
  return result['goodput_pct'] / (1.0 + w * result['degraded_pct'] / 100.0)


def at_restarts(s: Setup, name: str, restarts: list[float], checkpoint_min: float) -> dict:
  """restart cost -> the seeds' mean of `name` there (draw by draw, one planner each)."""
  a, rejoin = s.args, Rejoin.parse(s.args.rejoin)
  runs: dict[float, list] = {r: [] for r in restarts}
  for seed in range(a.seeds):
    plan = planner(s, 'drop' if name == ELASTIC else name, MemoPlanner)
    for r in restarts:
      runs[r].append(replay(s, name, r, seed, checkpoint_min, rejoin, plan))
  return {r: mean_over_seeds(v) for r, v in runs.items()}


def run_all(s: Setup, names: list[str], restarts: list[float], profiles: dict,
            weights: dict) -> tuple[dict, dict]:
  """(name -> restart cost -> the seeds' mean; name -> profile -> the same, with the
  loss-discounted goodput), checkpoint-restart at the headline interval."""
  every = {name: at_restarts(s, name, restarts, s.args.checkpoint_min) for name in names}
  by_profile = {name: {prof: {**every[name][p.total_s], 'goodput_loss_discounted_pct':
                              discounted(name, every[name][p.total_s], weights)}
                       for prof, p in profiles.items()} for name in names}
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
  discounted_best = max(approaches, key=lambda n: approaches[n]['goodput_loss_discounted_pct']
                        if approaches[n]['goodput_loss_discounted_pct'] is not None else -1.0)
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
          'best_loss_discounted': discounted_best,
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
    disc = f['goodput_loss_discounted_pct']
    row |= {'loss-discounted': 'n/a' if disc is None else f'{disc:.2f}',
            'dropped_%': f"{f['dropped_pct']:.2f}", 'degraded_%': f"{f['degraded_pct']:.2f}",
            'restarts': f"{f['restarts']:.0f}"}
    rows.append(row)
  return common.markdown_table(rows, list(rows[0]))


def main(argv=None) -> dict:
  t0, load_before = time.perf_counter(), uptime()
  a = _args(argv)
  s, stats = setup(a)
  profiles = restart_profiles.profiles(a.step_s)
  if a.profile not in profiles:
    raise SystemExit(f'--profile must be one of {", ".join(profiles)}, got {a.profile!r}')
  default = default_policy(s.cfg)
  policies = list(dict.fromkeys([*a.policies.split(','), default]))  # the default always replayed
  names = [*policies, ELASTIC, *(checkpoint_name(int(k)) for k in a.spares.split(','))]
  weights = loss_weights()
  restarts = sorted({*(p.total_s for p in profiles.values()),
                     *(float(r) for r in a.sweep_restart_s.split(',') if r)})
  every, by_profile = run_all(s, names, restarts, profiles, weights)
  sweep_ = sweep(s, names, restarts, every)
  approaches = {n: by_profile[n][a.profile] for n in names}
  best = max(policies, key=lambda p: approaches[p]['goodput_pct'])
  result = {
      **common.run_info(__spec__.name, argv), 'trace': a.trace,
      'trace_sha256': hashlib.sha256(Path(a.trace).read_bytes()).hexdigest(), 'log': stats,
      'nodes': a.nodes, 'slices': s.n, 'seeds': a.seeds, 'step_s': a.step_s,
      'micro_batch': s.b, 'granule': s.granule,
      'max_degraded_rows': planner(s, policies[0]).max_rows, 'classes': a.classes,
      'costs_from': f'{a.costs} (stat {a.stat}), scaled to the stated step time',
      'split_path_vs_fused': (s.costs.group(planner(s, 'spread').plan(range(s.n)).roles[0])
                              + s.costs.update_s) / s.costs.normal_s,
      'snapshot_every': a.snapshot_every, 'snapshot_overhead_pct': a.snapshot_overhead_pct,
      'rejoin': a.rejoin, 'checkpoint_min': a.checkpoint_min, 'profile': a.profile,
      'profiles': {k: p.to_json() for k, p in profiles.items()},
      'loss_weights': weights, 'default': default, 'approaches': approaches,
      'by_profile': by_profile, 'sweep': sweep_,
      'rejoin_levers': levers(s, list(dict.fromkeys([default, best])), profiles),
      'targets': targets(approaches, sweep_, policies, default)}
  result |= {'runtime_s': time.perf_counter() - t0, 'load_before': load_before,
             'load_after': uptime()}
  common.emit(result, table(result), a.json)
  if a.figure:
    trace_figure.figure(result, a.figure)
  return result


if __name__ == '__main__':
  main()
