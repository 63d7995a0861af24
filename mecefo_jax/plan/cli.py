"""mecefo-plan: which fault-tolerance setting reaches a loss soonest on a cluster's fault log."""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
import time
from pathlib import Path

import mecefo_jax
from mecefo_jax.config import CONFIGS, ConfigError
from mecefo_jax.core import fault_log
from mecefo_jax.plan import loss_equivalent, measured, node_log, recommend, restart_profiles
from mecefo_jax.plan.fleet import Fleet
from mecefo_jax.plan.replay import quiet
from mecefo_jax.plan.runs import (ELASTIC, Setup, at_restarts, limit_pct, read_log,
                                  restarts_pct, setup)
from mecefo_jax.records.job import BAD_INPUT
from mecefo_jax.run.cli import OneLineParser, at_least

POLICIES = ('spread', 'exact', 'budget:1.0', 'budget:1.05', 'neighbor', 'requeue')
SEEDS = 5  # draws of servers onto slices of more than one server, by default
REPORTED_SPARES = (0, 4, 8, 16, 32, 64, 128)  # spare pools shown (not recommended) by default
# The replay's settings the planner does not ask for (benchmarks.trace_goodput's defaults).
FIXED = dict(classes='all', rows=0, granule=0, stat='flops', rejoin='now', snapshot_every=0,
             snapshot_overhead_pct=None, config=str(CONFIGS / 'llama_60m.yaml'), slices=0)
COLUMNS = ('approach', 'loss-eq r=inf %', 'loss-eq r=1 %', 'samples %', 'dropped %',
           'degraded %', 'restarts', 'rule')


def parser() -> argparse.ArgumentParser:
  p = OneLineParser(prog='mecefo-plan', description=__doc__.split(': ', 1)[1], epilog=(
      'example: mecefo-plan --trace faults.csv --nodes 400 --slice-hosts 8 --json plan.json'))
  p.add_argument('--trace', required=True, help='the node fault log: JSON (as benchmarks/traces/) '
                 'or CSV with the header node,start,end (one outage a row; an empty end: down '
                 'to the end of the log)')
  p.add_argument('--time-unit', default='auto', choices=node_log.UNITS, help="a CSV log's times: "
                 'days, epoch seconds (s) or ISO 8601 (iso, no zone: UTC); auto (default): from '
                 'the first row, a number >= 1e6 is epoch seconds, a smaller one days, else '
                 'ISO 8601. Epoch and ISO times count days from the earliest start')
  p.add_argument('--days', default='', help="the window A:B in the log's days (default: all)")
  p.add_argument('--nodes', type=at_least(1), default=None, help="the cluster's servers (a log "
                 'lists only those that failed; default: the nodes the log names)')
  p.add_argument('--slice-hosts', type=at_least(1), default=1, help='servers per slice: a slice '
                 'is down while any of its servers is')
  restart = p.add_mutually_exclusive_group()
  restart.add_argument('--profile', default='fast', help='a named restart cost: fast (this '
                       'product, measured phases), FlashRecovery (150 s), slow (660 s)')
  restart.add_argument('--restart-s', type=at_least(0, float), default=None,
                       help='seconds from a fault to the first step trained again')
  restart.add_argument('--restart-phases', default='', help="the restart by phase, e.g. "
                       "'detect_s=2,programs_s=30' (the others as in fast)")
  p.add_argument('--spares', default=None, help='spare servers k[,k...] held back for '
                 'checkpoint-restart: then those pools may be recommended (default: '
                 f"{','.join(map(str, REPORTED_SPARES))} reported, not recommended)")
  p.add_argument('--costs', default=None, help='a failure_throughput JSON of your model '
                 "(default: llama_60m's, shipped)")
  p.add_argument('--v', type=float, default=None, help="a degraded row's worth against an exact "
                 "row's in loss (default: measured, with its 95%% interval)")
  p.add_argument('--d', type=float, default=None, help="a degraded row's cost against an exact "
                 "row's (default: measured by FLOPs): the thresholds d and 2d")
  p.add_argument('--seeds', type=at_least(1), default=None, help='draws of servers onto slices '
                 '(default: 1 at one server a slice, where a draw only relabels the slices, '
                 f'else {SEEDS})')
  p.add_argument('--step-s', type=at_least(0.001, float), default=10.0,
                 help='the fault-free step time')
  p.add_argument('--checkpoint-min', type=at_least(0.01, float), default=30.0,
                 help="checkpoint-restart's interval between durable checkpoints")
  p.add_argument('--json', default=None, help='write the result here')
  return p


def _spares(a, fleet: Fleet) -> tuple[list[int], bool]:
  """(the spare pools replayed, whether they may be recommended): whole slices, at least one
  slice left to train."""
  fits = lambda k: k >= 0 and k % fleet.hosts == 0 and k < fleet.servers
  if a.spares is None:
    return [k for k in REPORTED_SPARES if fits(k)], False
  try:
    pools = sorted({int(k) for k in a.spares.split(',') if k.strip()})
  except ValueError:
    pools = []
  if not pools or not all(map(fits, pools)):
    raise ConfigError(f'--spares {a.spares}: expected servers k[,k...], each in whole slices of '
                      f'--slice-hosts {fleet.hosts} and fewer than the {fleet.servers} servers')
  return pools, True


def _restart(a) -> restart_profiles.Restart:
  if a.restart_s is not None or a.restart_phases:
    return restart_profiles.given(a.step_s, a.restart_s, a.restart_phases)
  profiles = restart_profiles.profiles(a.step_s)
  if a.profile not in profiles:
    raise ConfigError(f"--profile must be one of {', '.join(profiles)}, got {a.profile!r}")
  return profiles[a.profile]


def _loss_inputs(a) -> dict:
  """v, the low end of its 95% interval and the thresholds the rule reads: measured (package
  data row_value) unless given; sets a.v for the replay."""
  v = loss_equivalent.read_v() if a.v is None else {
      'v': a.v, 'v_ci95': None, 'source': 'given (--v): no interval, its low end is v'}
  d = loss_equivalent.read_thresholds() if a.d is None else {
      'd': a.d, 'budget': a.d, 'spread_r1': 2.0 * a.d}
  a.v = v['v']
  return {**v, 'v_low': v['v_ci95'][0] if v['v_ci95'] else v['v'], 'thresholds': d,
          'thresholds_source': 'given (--d)' if a.d is not None else (
              f"{measured.source('row_value')}: d by FLOPs, as the replay's step costs")}


def _fleet(a, faults) -> Fleet:
  nodes = a.nodes or len({f.node for f in faults})
  a.nodes = nodes
  return Fleet.of(nodes, a.slice_hosts)


def _approaches(s: Setup, pools: list[int], restart_s: float) -> dict[str, dict]:
  """Every approach replayed at `restart_s`, the seeds' mean."""
  names = [*POLICIES, ELASTIC, *(f'checkpoint-restart-{k}-spares' for k in pools)]
  return {n: at_restarts(s, n, [restart_s], s.args.checkpoint_min)[restart_s] for n in names}


def _row(name: str, r: dict, verdict: dict) -> list[str]:
  rule = ('recommended' if name == verdict['recommended']
          else verdict['excluded'].get(name, 'tied' if name in verdict['tied'] else ''))
  return [name, f"{r['loss_equivalent_pct']:.2f}", f"{r['loss_equivalent_r1_pct']:.2f}",
          f"{r['samples_pct']:.2f}", f"{r['dropped_pct']:.2f}", f"{r['degraded_pct']:.2f}",
          f"{r['restarts']:.0f}", rule]


def table(result: dict) -> str:
  rows = [COLUMNS, *(_row(n, r, result['rule']) for n, r in result['approaches'].items())]
  widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
  lines = ['  '.join(c.ljust(w) for c, w in zip(r, widths)) + '  ' + r[-1] for r in rows]
  limit = result['limit_pct']
  return '\n'.join([*lines, '', f"limit (every live slice at full pace, less the restarts): "
                    f"{limit['r_inf']:.2f}% at r -> inf, {limit['r1']:.2f}% at r = 1",
                    f"recommended: {result['recommended']}"])


def _inputs(a, s: Setup, window: tuple[float, float], restart, pools: list[int],
            offered: bool, loss: dict) -> dict:
  """What the replay was given: the fleet, the window, the charges and the loss model."""
  return {'days': list(window), 'time_unit': a.time_unit, 'nodes': a.nodes,
          'slice_hosts': a.slice_hosts, 'slices': s.n, 'micro_batch': s.b, 'seeds': a.seeds,
          'step_s': a.step_s, 'checkpoint_min': a.checkpoint_min, 'restart': restart.to_json(),
          'spares': pools, 'spares_offered': offered,
          'costs_from': f"{a.costs or measured.source('step_costs')} (stat flops), scaled to the "
                        'stated step time',
          'snapshot_every': s.snapshots['every'], 'snapshot_tax_pct': s.snapshots['tax_pct'],
          'snapshots_from': s.snapshots['source'], 'loss_model': loss}


def plan(a: argparse.Namespace, argv: list[str]) -> dict:
  """The planner's result on the parsed arguments `a` (main prints and writes it)."""
  t0 = time.perf_counter()
  vars(a).update(FIXED)
  a.seeds = a.seeds or (1 if a.slice_hosts == 1 else SEEDS)
  loss = _loss_inputs(a)
  faults, window = read_log(a.trace, a.days, a.time_unit)
  fleet = _fleet(a, faults)
  pools, offered = _spares(a, fleet)
  restart = _restart(a)
  fault_log.down_intervals(faults, a.trace)  # the log's warnings, once
  with quiet():  # not again for each draw
    s = setup(a, faults, window, fleet)
  approaches = _approaches(s, pools, restart.total_s)
  verdict = recommend.recommend(approaches, loss['v_low'], loss['thresholds'], offered)
  return {
      'tool': 'mecefo-plan', 'version': mecefo_jax.__version__, 'argv': argv,
      'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
      'trace': a.trace, 'trace_sha256': hashlib.sha256(Path(a.trace).read_bytes()).hexdigest(),
      'inputs': _inputs(a, s, window, restart, pools, offered, loss),
      'provenance': {name: measured.provenance(name) for name in measured.SOURCES},
      'approaches': approaches, 'recommended': verdict['recommended'],
      'rule': {'statement': recommend.RULE, **verdict},
      'limit_pct': limit_pct(s, restarts_pct(approaches[ELASTIC])),
      'runtime_s': time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
  """The command: the table on stdout, the JSON at --json; a bad input is one `error:` line on
  stderr and exit 2."""
  argv = list(sys.argv[1:] if argv is None else argv)
  a = parser().parse_args(argv)
  try:
    result = plan(a, argv)
  except ConfigError as err:
    print(f'error: {err}', file=sys.stderr)
    return BAD_INPUT
  print(table(result))
  print(f"({result['runtime_s']:.0f} s)")
  if a.json:
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=2))
    print(f'wrote {a.json}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
