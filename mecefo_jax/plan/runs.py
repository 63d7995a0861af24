"""The fault-log replay's runs: one fleet's draws, each approach charged, the seeds' means."""
# Every approach whose recovery is a process restart (the takeover policies, elastic restart) pays
# one set of charges (`charges`): the in-memory snapshots' tax, the steps since the last snapshot
# after a death, the same restart profile. Used by mecefo-plan (plan/cli.py) and
# benchmarks/trace_goodput.py.
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from mecefo_jax.config import ConfigError, load_config
from mecefo_jax.core import fault_log
from mecefo_jax.core.programs import RunPrograms
from mecefo_jax.core.roles import Role
from mecefo_jax.core.takeover import Planner
from mecefo_jax.plan import loss_equivalent, measured, node_log
from mecefo_jax.plan.cost_model import costs_from
from mecefo_jax.plan.fleet import Fleet, slice_events
from mecefo_jax.plan.log_replay import Outcome, Rejoin, batched, checkpoint_restart, takeover
from mecefo_jax.plan.simulate import PolicyModel

ELASTIC = 'elastic-restart'
# The fields of a failure_throughput measurement the replay reads (cost_model.costs_from).
COSTS_NEED = ('times', 'flops', 'roles', 'compile_s', 'move_s')
PEERS = '+peers'  # a what-if: the state from live peers (no snapshot tax, no steps since one)


@dataclasses.dataclass
class Setup:
  """What every replay of one fleet shares."""
  args: argparse.Namespace
  fleet: Fleet
  events: list  # per seed: the timed slice events
  horizon_s: float
  b: int  # rows per slice
  costs: object
  cfg: object
  granule: int
  snapshots: dict  # every, tax_pct, source: the charges of a process restart
  v: float  # a degraded row's worth in loss, relative to an exact row's (loss_equivalent.py)

  @property
  def n(self) -> int:
    return self.fleet.slices

  @property
  def fault_free(self) -> float:
    return self.n * self.b * self.horizon_s / self.args.step_s

  @property
  def hardware_fault_free(self) -> float:
    """Every server of the fleet training, spares included."""
    return self.fleet.servers * self.b / self.fleet.hosts * self.horizon_s / self.args.step_s


def read_log(path: str, days: str, unit: str = 'auto') -> tuple[list, tuple[float, float]]:
  """The log's events (JSON or CSV, plan/node_log.py) and the window 'A:B' in its days, or one
  ConfigError line."""
  faults = node_log.read(path, unit)
  first, last = fault_log.window(faults, days)
  if not last > first:
    raise ConfigError(f'{path}: the window {first:g}:{last:g} (days) holds no time; the log '
                      f'has {len(faults)} events')
  return faults, (first, last)


def snapshot_charges(a) -> dict:
  """The in-memory snapshots' interval and tax: measured on llama_60m (package data
  snapshot_tax) where not given; the tax at another interval is the measured cost of one
  snapshot over that interval."""
  m = measured.fields('snapshot_tax')
  every = a.snapshot_every or m['auto_every']
  at_every = 100.0 * m['auto_cost_s'] / (every * m['auto_idle_step_s'])
  tax = at_every if a.snapshot_overhead_pct is None else a.snapshot_overhead_pct
  return {'every': every, 'tax_pct': tax, 'source': (
      f"{measured.source('snapshot_tax')}: every {m['auto_every']} steps (the auto interval), "
      f"one snapshot {m['auto_cost_s']:.3f} s against a {m['auto_idle_step_s']:.2f} s step, "
      'measured'
      + ('' if a.snapshot_overhead_pct is None else f'; the tax given: {tax:g}%'))}


def setup(a, faults: list, window: tuple[float, float], fleet: Fleet) -> Setup:
  first, last = window
  events = [slice_events(faults, fleet, a.nodes, a.classes, window, seed, a.trace)[0]
            for seed in range(a.seeds)]
  step_costs = read_costs(a.costs)
  rows, b0 = fleet.hosts * (a.rows or step_costs['micro_batch']), step_costs['micro_batch']
  cfg = load_config(a.config, ['mesh.slice=1', 'mesh.fsdp=1', 'mesh.tensor=1',
                               f'train.micro_batch={rows}'])
  costs = costs_from(step_costs['measurement'], a.stat)
  # Other rows per slice: the fused step grows as the split path does (the affine role model).
  split = lambda b: costs.group(Role(b)) + costs.update_s
  normal = costs.normal_s * split(rows) / split(b0)
  scale = a.step_s / normal  # the costs, as shares of the stated step time
  costs = dataclasses.replace(
      costs, normal_s=a.step_s, update_s=costs.update_s * scale, refresh_s=costs.refresh_s * scale,
      group_s={r: s * scale for r, s in costs.group_s.items()},
      group_compile_s=dict.fromkeys(costs.group_s, 0.0), fused_compile_s=0.0,
      compile_s_by_kind=dict.fromkeys(costs.compile_s_by_kind, 0.0), move_s=0.0, rejoin_s=0.0)
  return Setup(a, fleet, events, (last - first) * fault_log.DAY_S, rows, costs, cfg,
               a.granule or step_costs.get('granule', 1), snapshot_charges(a), a.v)


def log_stats(events, horizon_s: float, n: int, faults, first: float, last: float) -> dict:
  """The window's failures as the replay sees them (seed 0's slices)."""
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


def limit_pct(s: Setup, restarts_pct: float) -> dict:
  """The loss-equivalent progress of every live slice training exact rows at full pace, less
  `restarts_pct` (the restarts' share of the time): at r -> inf 1 - f - restarts, at r = 1 the
  time-mean of (1 - f)(1 + r)/(1 - f + r) - restarts; the seeds' mean."""
  live = lambda r: 100.0 * float(np.mean([loss_equivalent.mean_progress_of_live(
      events, s.n, s.horizon_s, r) for events in s.events]))
  return {'r_inf': live(math.inf) - restarts_pct, 'r1': live(1.0) - restarts_pct,
          'restarts_pct': restarts_pct}


def restarts_pct(elastic: dict) -> float:
  """The share of the time elastic restart loses to its restarts (the restart and the steps
  lost at a death): every live-set change is one, as for any approach that restarts."""
  lost = elastic['lost_pct_by_cause']
  return lost['restart'] + lost['step_in_flight']


def servers_down(faults, a, window: tuple[float, float]) -> dict:
  """The log's servers down in the window, whatever the slices: mean (% of --nodes), most."""
  first, last = window
  down = fault_log.down_intervals(fault_log.counted(faults, a.classes, a.trace), a.trace)
  edges = sorted((t, d) for spans in down.values() for lo, hi in spans
                 for t, d in ((max(lo, first), 1), (min(hi, last), -1)) if min(hi, last) > max(lo, first))
  now, most, area, t0 = 0, 0, 0.0, first
  for t, d in edges:  # at one time the ends (-1) come first
    area, t0, now = area + now * (t - t0), t, now + d
    most = max(most, now)
  return {'mean_down_pct': 100.0 * area / (last - first) / a.nodes, 'max_down': most}


def read_costs(path: str | None) -> dict:
  """A failure_throughput measurement: the file at `path` (its JSON), or the one shipped
  (package data step_costs) where None."""
  if path is None:
    return measured.fields('step_costs')
  try:
    found = json.loads(Path(path).read_text())
  except (OSError, ValueError) as err:
    raise ConfigError(f'{path}: cannot read the step costs: {err}') from None
  top = found if isinstance(found, dict) else {}
  inner = top.get('measurement') if isinstance(top.get('measurement'), dict) else {}
  missing = [*(['micro_batch'] if 'micro_batch' not in top else []),
             *(f'measurement.{k}' for k in COSTS_NEED if k not in inner)]
  if missing:
    raise ConfigError(f"{path}: not a failure_throughput JSON: it lacks {', '.join(missing)}")
  return found


def policy_spec(spec: str) -> tuple[str, float | None]:
  """A benchmark's policy spec: 'budget:T' -> ('budget', T) (faults.time_budget T); a plain
  name -> (name, None), the config's time budget."""
  policy, colon, budget = spec.partition(':')
  if not colon:
    return policy, None
  try:
    return policy, float(budget)
  except ValueError:
    raise ValueError(f'policy spec {spec!r}: the part after ":" must be a time budget, e.g. '
                     f'budget:1.05') from None


def planner(s: Setup, spec: str, kind: type[Planner] = Planner) -> Planner:
  policy, budget = policy_spec(spec)
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


def spec_of(name: str) -> str:
  """The decider's policy an approach replays (elastic restart: drop)."""
  base = name.removesuffix(PEERS)
  return 'drop' if base == ELASTIC else base


def charges(s: Setup, name: str) -> tuple[float, float]:
  """(the snapshot tax in %, the steps a death loses) of an approach whose recovery is a
  process restart: one charge for all of them (takeover, elastic restart); the `+peers` what-if
  takes the state from live peers: no tax, only the step in flight."""
  if name.endswith(PEERS):
    return 0.0, 1.0
  return s.snapshots['tax_pct'], 1.0 + (s.snapshots['every'] - 1) / 2.0


def replay(s: Setup, name: str, restart_s: float, seed: int, checkpoint_min: float,
           rejoin: Rejoin, plan: Planner | None = None) -> dict:
  """One approach, one restart cost, one draw: goodput and its parts, % of the fault-free run;
  `plan`: the planner to use (default a new one)."""
  a, events = s.args, s.events[seed]
  if name.startswith('checkpoint-restart'):  # spare servers, whole slices of them
    spares = int(name.split('-')[2]) // s.fleet.hosts
    out = checkpoint_restart(events, s.n, spares, s.horizon_s, a.step_s, s.b, restart_s,
                             checkpoint_min * 60.0)
    return summary(s, out, 0.0)
  # RunPrograms.of(.., True): the svd bases (the default) are refreshed while rows are degraded.
  model = PolicyModel(plan or planner(s, spec_of(name)), s.costs, RunPrograms.of(s.cfg, True),
                      s.cfg.mecefo.tau)
  tax_pct, lost_steps = charges(s, name)
  out, _ = takeover(batched(events, rejoin), s.horizon_s, model, restart_s,
                    lost_steps * a.step_s)
  return summary(s, out, tax_pct)


def summary(s: Setup, out: Outcome, overhead_pct: float) -> dict:
  ff = s.fault_free
  keep = 1.0 - overhead_pct / 100.0  # steps slowed by the snapshots' share
  goodput = 100.0 * out.samples * keep / ff
  lost = {k: 100.0 * v / s.horizon_s for k, v in out.lost_s.items()}
  lost['snapshots'] = overhead_pct * (out.samples / ff)
  lost['dropped_rows'] = 100.0 * out.dropped / ff * keep
  lost['other'] = 100.0 - goodput - sum(lost.values())  # slower steps (policies), idle spares
  steps = s.horizon_s / s.args.step_s  # the fault-free run's
  in_loss = lambda r: loss_equivalent.percent(out.mix, s.n * s.b, steps, s.v, r, keep)
  return {'goodput_pct': goodput, 'samples_pct': 100.0 * out.samples / ff,
          'loss_equivalent_pct': in_loss(math.inf), 'loss_equivalent_r1_pct': in_loss(1.0),
          'tax_pct': overhead_pct, 'dropped_pct': 100.0 * out.dropped / ff,
          'degraded_pct': 100.0 * out.degraded / ff, 'restarts': out.restarts,
          'lost_pct_by_cause': lost}


def mean_over_seeds(runs: list[dict]) -> dict:
  """The seeds' mean of every figure, with the goodput's spread (max - min) and per seed."""
  goodput = [r['goodput_pct'] for r in runs]
  mean = lambda key: float(np.mean([r[key] for r in runs]))
  return {'goodput_pct': float(np.mean(goodput)), 'goodput_pct_std': float(np.std(goodput)),
          'goodput_pct_spread': float(max(goodput) - min(goodput)),
          'goodput_pct_per_seed': goodput, 'samples_pct': mean('samples_pct'),
          'loss_equivalent_pct': mean('loss_equivalent_pct'),
          'loss_equivalent_r1_pct': mean('loss_equivalent_r1_pct'),
          'tax_pct': runs[0]['tax_pct'], 'dropped_pct': mean('dropped_pct'),
          'degraded_pct': mean('degraded_pct'), 'restarts': mean('restarts'),
          'lost_pct_by_cause': {k: float(np.mean([r['lost_pct_by_cause'][k] for r in runs]))
                                for k in runs[0]['lost_pct_by_cause']}}


def at_restarts(s: Setup, name: str, restarts: list[float], checkpoint_min: float) -> dict:
  """restart cost -> the seeds' mean of `name` there (draw by draw, one planner each)."""
  a, rejoin = s.args, Rejoin.parse(s.args.rejoin)
  runs: dict[float, list] = {r: [] for r in restarts}
  for seed in range(a.seeds):
    plan = planner(s, spec_of(name), MemoPlanner)
    for r in restarts:
      runs[r].append(replay(s, name, r, seed, checkpoint_min, rejoin, plan))
  return {r: mean_over_seeds(v) for r, v in runs.items()}
