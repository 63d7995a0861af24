"""Throughput drop under the §5 failure presets: measured per-role step costs, simulated cluster.

Run: python -m benchmarks.failure_throughput --config configs/tiny.yaml --json OUT.json
     [--slices 8[,32,256]] [--policies neighbor,spread,exact,budget:1.0,budget:1.05,drop,naive]
     [--presets low,mid,high] [--hours 720] [--figure PNG [--figure-also EARLIER.json]]
     [--seeds 5] [--rate cluster|per_device] [--measure all|anchors] [--costs PREVIOUS.json]
     [--remeasure-restore] [--stat median|min|flops] [--checkpoint-every N] [--repeats 3]
     [--warmup 1] [--move on|off] [--premove on|off] [--premove-cap 64] [overrides...]
Fake CPU slices share the same cores, so a simulated cluster's wall time is not its step time.
Each role's step is timed alone on one real device (interleaved, one process); the failure
presets are then replayed in simulated time, where a step lasts as long as its slowest slice.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import benchmarks

# Before jax is imported: a second CPU device, for failure_costs.time_moves to move programs to.
benchmarks.fake_cpu_devices(2)

import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from benchmarks import common, failure_costs  # noqa: E402
from mecefo_jax import sharding  # noqa: E402
from mecefo_jax.config import RATES, load_config  # noqa: E402
from mecefo_jax.core.failures import (  # noqa: E402
    PRESETS, FailureEvent, poisson_events, rate_scale)
from mecefo_jax.core.programs import RunPrograms  # noqa: E402
from mecefo_jax.core.roles import Role, split_passes  # noqa: E402
from mecefo_jax.core.takeover import Planner  # noqa: E402
from mecefo_jax.model import bases, train_state  # noqa: E402
from mecefo_jax.plan import simulate  # noqa: E402
from mecefo_jax.plan.cost_model import costs_from, role_name  # noqa: E402
from mecefo_jax.plan.runs import policy_spec  # noqa: E402
from mecefo_jax.plan.simulate import CHECKPOINT, ClusterCosts  # noqa: E402

# What the replay models and assumes: docs/history.md, "Throughput under failures".
NOTES = 'docs/history.md#throughput-under-failures-controller'


def planner(spec: str, n: int, granule: int, cfg) -> Planner:
  """The planner of policy `spec` on n slices: a policy name, 'budget:T' (faults.time_budget
  T) or CHECKPOINT (a spare replaces the failed slice, nothing to plan)."""
  policy, budget = policy_spec(spec)
  return Planner.from_config(cfg, n, granule, policy, budget)


def anchor_roles(b: int, planners: list[Planner]) -> set[Role]:
  """Roles timed in --measure anchors: shapes that pin the affine cost model (normal, exact
  and degraded multiples, multi-pass, mixed), and every role of the commonest failure state,
  one slice down, under each policy at each slice count."""
  split = lambda rows: split_passes(rows, planners[0].max_rows)
  anchors = {Role(b), Role(2 * b), Role(0, 2 * b, split(2 * b)), Role(0, 3 * b, split(3 * b)),
             Role(b // 2, b // 2), Role(b, b // 2)}
  for p in planners:
    if p.policy != CHECKPOINT:
      anchors |= set(p.plan(tuple(range(1, p.n_slices))).roles.values())
  return anchors


def model_check(costs: ClusterCosts) -> dict:
  """How well the affine model explains the measured roles: the relative residual of each
  role under the fit of all, and under the fit of the others (leave-one-out: a prediction)."""
  measured = {r: s for r, s in costs.group_s.items() if r not in costs.modelled}
  coef = simulate.fit(measured)
  rel = {role_name(r): simulate.predict(coef, r) / s - 1.0 for r, s in measured.items()}
  loo = {role_name(r): simulate.predict(simulate.fit({q: t for q, t in measured.items()
                                                      if q != r}), r) / s - 1.0
         for r, s in measured.items()} if len(measured) > 4 else {}
  return {'coef': dict(zip(('overhead_s', 'per_exact_row_s', 'per_degraded_pass_s',
                            'per_degraded_row_s'), map(float, coef))),
          'rel_residual': rel, 'max_abs_rel_residual': max(map(abs, rel.values())),
          'loo_rel_residual': loo,
          'max_abs_loo_rel_residual': max(map(abs, loo.values())) if loo else None}


def failure_model(args, n: int) -> dict:
  """Mean hours between failures in the n-slice cluster, and repair hours, of each preset."""
  scale = rate_scale(args.rate, n)
  return {p: {'mean_interval_h': PRESETS[p][0] * scale, 'repair_h': PRESETS[p][1]}
          for p in args.presets}


def run_programs(cfg) -> RunPrograms:
  """The programs `cfg`'s steps request besides the roles (its basis kind keeps and refreshes
  bases or not)."""
  return RunPrograms.of(cfg, bases.kind(cfg).refresh is not None)


def policy_model(plan: Planner, costs: ClusterCosts, cfg, args) -> simulate.PolicyModel:
  """The replay's model of `plan`: the programs `cfg` runs, moved unless --move off, the next
  live sets' moved in the background unless --premove off."""
  cap = args.premove_cap if args.premove == 'on' else 0
  return simulate.PolicyModel(plan, costs, run_programs(cfg), cfg.mecefo.tau, args.move == 'on',
                              cap)


def replay_all(costs: ClusterCosts, cfg, args, planners: dict[str, Planner]) -> dict:
  """results[policy][preset] averaged over seeds; the same failure draws for every policy."""
  first = next(iter(planners.values()))
  n, b = first.n_slices, first.micro_batch
  horizon_s = args.hours * 3600.0
  events = {p: [poisson_events(f['mean_interval_h'] * 3600, f['repair_h'] * 3600, n, horizon_s,
                               seed) for seed in range(args.seeds)]
            for p, f in failure_model(args, n).items()}
  fault_free = n * b / costs.normal_s
  results = {}
  for policy, plan in planners.items():
    pm = policy_model(plan, costs, cfg, args)
    results[policy] = {
        p: simulate.summarize([simulate.replay(ev, n, horizon_s, pm, args.checkpoint_every)
                               for ev in events[p]], horizon_s, fault_free)
        for p in args.presets}
  return results


def tables(result: dict) -> str:
  a = result['args']
  presets = a['presets']
  out = []
  for n, res in result['results_by_slices'].items():
    drop = [{'policy': pol, **{p: f"{r[p]['drop_pct']:.2f} ± {r[p]['drop_pct_std']:.2f}"
                               for p in presets}} for pol, r in res.items()]
    first = next(iter(res.values()))
    fail = [{'preset': p, 'mean_live_slices': first[p]['mean_live_slices'],
             'time_with_failure': first[p]['failure_time_frac'],
             'time_all_down': first[p]['all_down_time_frac']} for p in presets]
    out += [f"throughput drop % (mean ± std over {a['seeds']} seeds), rate={a['rate']}, "
            f"stat={a['stat']}, {n} slices, {a['hours']} h",
            common.markdown_table(drop, ['policy', *presets]),
            common.markdown_table(fail, list(fail[0])), _programs(res, presets[-1], a)]
  c = result['costs']
  roles = [{'role': role_name(Role(r['exact'], r['degraded'], r['passes'])),
            'step_s': r['step_s'], 'vs_normal': r['step_s'] / c['normal_s'],
            'modelled': r['modelled']} for r in c['roles']]
  scalars = {k: c[k] for k in ('normal_s', 'update_s', 'refresh_s', 'rejoin_s', 'restore_s',
                               'fused_compile_s', 'move_s')}
  check = result['cost_model']
  loo = check['max_abs_loo_rel_residual']
  return '\n\n'.join([
      *out, 'costs: ' + ', '.join(f'{k}={v:.4g}' for k, v in scalars.items()),
      f"affine cost model over {len(check['rel_residual'])} measured roles: max |relative "
      f"residual| {check['max_abs_rel_residual']:.3f}, leave-one-out {_fmt(loo)}",
      common.markdown_table(roles, list(roles[0]))])


def _programs(res: dict, preset: str, a: dict) -> str:
  """Programs built per run at `preset`: compiled and moved in the foreground, moved in the
  background; the foreground's seconds as a share of the window."""
  rows = [{'policy': pol, 'compiled': r[preset]['compiled'], 'moved': r[preset]['moved'],
           'premoved': r[preset]['premoved'], 'compile_%': 100 * r[preset]['compile_time_frac'],
           'move_%': 100 * r[preset]['move_time_frac'],
           'premove_wait_%': 100 * r[preset]['premove_wait_time_frac']} for pol, r in res.items()]
  premove = f"on, cap {a['premove_cap']}" if a['premove'] == 'on' else 'off'
  return (f"programs built per run at {preset} (mean over seeds), moves {a['move']}, background "
          f'moves {premove}\n\n' + common.markdown_table(rows, list(rows[0])))


def _fmt(x) -> str:
  return 'n/a' if x is None else f'{x:.3f}'


def figure(results: list[dict], path: str) -> None:
  """Throughput drop against slice count at `high` (else the first preset), one line per
  policy, one panel per result (e.g. the FLOP and the CPU-timed reading of the same costs)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(6 * len(results), 4.2))
  for i, result in enumerate(results):
    ax, a = fig.add_subplot(1, len(results), i + 1), result['args']
    preset = 'high' if 'high' in a['presets'] else a['presets'][0]
    by_n = result['results_by_slices']
    slices = sorted(by_n, key=int)
    for policy in next(iter(by_n.values())):
      ax.plot([int(n) for n in slices], [by_n[n][policy][preset]['drop_pct'] for n in slices],
              marker='o', label=policy)
    ax.set(xscale='log', xlabel='slices', ylabel='throughput drop (%)',
           title=f"{preset}, rate={a['rate']}, stat={a['stat']}")
    ax.set_xticks([int(n) for n in slices], labels=[str(n) for n in slices])
    ax.axhline(0, color='gray', lw=0.5)
    ax.legend(fontsize=8)
  FigureCanvasAgg(fig).print_figure(path, dpi=120, bbox_inches='tight')


def get_measurement(args, cfg, carriers: list[Planner], max_slices: int) -> dict:
  """The program costs: timed now, or those of --costs with what they lack timed now (the
  durable restore, the moves)."""
  b = cfg.train.micro_batch
  if not args.costs:
    if args.measure == 'all' and max_slices > 10:
      raise SystemExit('--measure all enumerates every live set: use --measure anchors above 10 '
                       'slices (the affine cost model covers the other roles)')
    timed = (simulate.needed_roles(carriers) | {Role(b)} if args.measure == 'all' else
             anchor_roles(b, carriers))
    return failure_costs.measure(cfg, timed, args.repeats, args.warmup)
  measurement = json.loads(Path(args.costs).read_text())['measurement']
  if args.remeasure_restore or 'restore_s' not in measurement:
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    state = train_state.create_sharded(cfg, mesh)
    measurement = {**measurement, **failure_costs.time_restore(cfg, mesh, state)}
  if 'move_s' not in measurement:
    measurement = failure_costs.with_moves(cfg, measurement, args.repeats)
  return measurement


def first_failure_s(model: simulate.PolicyModel) -> float:
  """Seconds to build the programs of the first failure (slice 0 down; checkpoint-restart: the
  restart's), all compiled, less the fault-free run's."""
  ledger = model.ledger()
  if model.policy == CHECKPOINT:
    ledger.forget()
    return sum(ledger.build(key)[1] for key in model.fault_free())
  decider = model.decider()
  with simulate.quiet():
    decider.apply(FailureEvent(0, 0, 'fail', 'first failure'))
    return sum(ledger.build(key)[1] for key in decider.programs_for(decider.live()))


def main(argv=None):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--slices', default='8', help='slice counts, comma-separated (e.g. 8,32,256)')
  p.add_argument('--policies', default='neighbor,spread,exact,budget:1.0,budget:1.05,drop,naive')
  p.add_argument('--figure', default=None, help='PNG: throughput drop vs slice count at high')
  p.add_argument('--figure-also', default=[], action='append', metavar='JSON',
                 help='an earlier result of this benchmark drawn as a further panel of --figure')
  p.add_argument('--presets', default=','.join(PRESETS))
  p.add_argument('--hours', type=float, default=720.0)
  p.add_argument('--seeds', type=int, default=5)
  p.add_argument('--rate', choices=RATES, default='cluster')
  p.add_argument('--checkpoint-every', type=int, default=-1,
                 help='durable checkpoint interval of checkpoint-restart (-1: '
                      'snapshot.durable_every); 0: no checkpoint-restart row')
  p.add_argument('--measure', choices=('all', 'anchors'), default='all',
                 help='time every needed role, or a few and model the rest')
  p.add_argument('--costs', default=None, help="reuse a previous JSON's 'measurement' (no timing)")
  p.add_argument('--remeasure-restore', action='store_true',
                 help='with --costs: time the durable restore now (done anyway if it lacks one)')
  p.add_argument('--stat', choices=('median', 'min', 'flops'), default='median',
                 help='statistic of the repeats used as cost (min: least disturbed by other load; '
                 'flops: FLOP counts scaled to the normal step, a compute-bound device)')
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--warmup', type=int, default=1)
  p.add_argument('--move', choices=('on', 'off'), default='on',
                 help='programs move between sets of slices of one shape (train.move_programs); '
                 'off: every new set of slices compiles its programs')
  p.add_argument('--premove', choices=('on', 'off'), default='on',
                 help='a background thread moves the programs of the live sets one event away '
                 'after each change (with --move on)')
  p.add_argument('--premove-cap', type=int, default=64,
                 help='programs the background thread moves per change of live set (0: none)')
  args = p.parse_args(argv)
  args.policies, args.presets = args.policies.split(','), args.presets.split(',')
  slice_counts = [int(s) for s in args.slices.split(',')]
  cluster_cfg = load_config(args.config, args.overrides)
  cfg = load_config(args.config, ['mesh.slice=1', 'mesh.fsdp=1', 'mesh.tensor=1', *args.overrides])
  b, granule = cfg.train.micro_batch, cluster_cfg.mesh.fsdp
  if args.checkpoint_every < 0:
    args.checkpoint_every = cfg.snapshot.durable_every
  specs = [*args.policies, *([CHECKPOINT] if args.checkpoint_every else [])]
  planners = {n: {s: planner(s, n, granule, cfg) for s in specs} for n in slice_counts}
  carriers = [p for ps in planners.values() for p in ps.values()
              if p.policy not in ('drop', CHECKPOINT)]
  measurement = get_measurement(args, cfg, carriers, max(slice_counts))
  costs = costs_from(measurement, args.stat)
  cost_model = model_check(costs)
  result = {**common.run_info(__spec__.name, argv), 'config': args.config,
            'overrides': args.overrides, 'args': vars(args), 'slices': slice_counts,
            'micro_batch': b, 'seq_len': cfg.model.seq_len, 'mecefo': vars(cfg.mecefo),
            'granule': granule, 'max_degraded_rows': carriers[0].max_rows if carriers else 2 * b,
            'measurement': measurement, 'cost_model': cost_model, 'notes': NOTES,
            'programs': {'move': args.move == 'on', **dataclasses.asdict(run_programs(cfg))},
            'premove': {'on': args.premove == 'on', 'cap': args.premove_cap},
            'env': {'OPENBLAS_NUM_THREADS': os.environ.get('OPENBLAS_NUM_THREADS')}}
  result['failure_model'] = {n: failure_model(args, n) for n in slice_counts}
  result['compile_one_failure_s'] = {
      n: {s: first_failure_s(policy_model(p, costs, cfg, args)) for s, p in ps.items()}
      for n, ps in planners.items()}
  result['split_path_vs_fused'] = (costs.group(Role(b)) + costs.update_s) / costs.normal_s
  result['results_by_slices'] = {n: replay_all(costs, cfg, args, ps) for n, ps in planners.items()}
  result['results'] = result['results_by_slices'][slice_counts[-1]]
  result['costs'] = costs.to_json()  # with every role the replays met (modelled ones marked)
  common.emit(result, tables(result), args.json)
  if args.figure:
    figure([result, *(json.loads(Path(f).read_text()) for f in args.figure_also)], args.figure)
  return result


if __name__ == '__main__':
  main()
