"""Throughput drop under the §5 failure presets: measured per-role step costs, simulated cluster.

Run: python -m benchmarks.failure_throughput --config configs/tiny.yaml --json OUT.json
     [--slices 8[,32,256]] [--policies neighbor,spread,exact,budget:1.0,budget:1.05,drop,naive]
     [--presets low,mid,high] [--hours 720] [--figure PNG [--figure-also EARLIER.json]]
     [--seeds 5] [--rate cluster|per_device] [--measure all|anchors] [--costs PREVIOUS.json]
     [--remeasure-restore] [--stat median|min|flops] [--checkpoint-every N] [--repeats 3]
     [--warmup 1] [overrides...]
Fake CPU slices share the same cores, so a simulated cluster's wall time is not its step time.
Each role's step is timed alone on one real device (interleaved, one process); the failure
presets are then replayed in simulated time, where a step lasts as long as its slowest slice.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks import common, simulate
from benchmarks.simulate import CHECKPOINT, ClusterCosts
from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.fault.failures import PRESETS, poisson_events, rate_scale
from mecefo_jax.model import bases, llama, train_state
from mecefo_jax.plan.roles import Role, split_passes
from mecefo_jax.plan.takeover import Planner
from mecefo_jax.snapshot import recovery, store
from mecefo_jax.step import slice_steps, train_step

NOTES = [
    'Role costs: each distinct per-slice program is compiled for a one-device mesh (slice=1) and '
    'timed alone, all interleaved round-robin in one process (median of --repeats, or min '
    'with --stat min; OPENBLAS_NUM_THREADS=1 unless set, see env). Under '
    'failure the controller runs one group program per role, then one update program, so a '
    'failure step costs max over live slices of group(role) + update (+ svd refresh / tau when '
    'degraded work runs). Fault-free steps, and drop steps (all live slices normal), cost the '
    'fused normal step. A uniform non-normal role (which the controller fuses) is costed as '
    'group + update too. Roles with modelled=true are predicted by a least-squares fit '
    'cost = a + b*exact_rows + c*degraded_passes + d*degraded_rows over the measured roles; '
    'their compile time is the mean measured group compile time.',
    'Failures: the FailureSchedule.preset Poisson process (same draws per seed, checked by '
    'tests/test_simulate.py) kept in continuous time rather than quantised to a cluster_step_s '
    'grid; the fault-free step count of the window is hours*3600/normal_s. A failure or repair '
    'takes effect at the next step boundary (Controller.step applies events before planning).',
    'rate=cluster: a failure every <preset> hours in the whole cluster whatever --slices is '
    '(docs/algorithm.md §5 literally). rate=per_device: the paper rates are for 32 GPUs, so the mean '
    'interval is scaled by 32/slices. Repair time is never scaled.',
    'Throughput = samples trained / window; drop_pct = 100*(1 - throughput/fault-free). All '
    'policies train the full global batch except drop, which loses the failed slices\' rows. With '
    'every slice down, time passes without progress until a repair.',
    'Overheads: a new live set pays the compile time of the programs the controller builds for '
    'it (one per role + update + refresh if svd and degraded; the fused step if all normal), '
    'once per run (cached); each repair pays one rejoin = device_put of the full train state '
    'from a host copy (on CPU a host-memory copy; on accelerators a host->device or peer '
    'transfer). Cross-slice all-reduce time is not modelled (absent from the fault-free cost too).',
    'checkpoint-restart (assumptions): every failure restarts the whole job: restore_s (a real '
    'Orbax restore of the one-replica train state from a durable checkpoint on local disk, '
    'manifest check included, median of 3; each slice restores its replica in parallel) + '
    'compile of the fused normal step (measured; no persistent compile cache) + the steps since '
    'the last durable checkpoint (every --checkpoint-every steps, default snapshot.durable_every; '
    'replayed, so on average half the interval; checkpoint writes assumed free, async). A spare '
    'replaces the failed slice, so after a restart the job runs at full speed on n slices, never '
    'waits for all-down time, and a repair costs nothing (the repaired slice becomes a spare). '
    'Process start-up, scheduler and data-loader warm-up are not counted: a lower bound.',
]


def role_name(r: Role) -> str:
  return f'e{r.exact}_d{r.degraded}_p{r.passes}'


def planner(spec: str, n: int, granule: int, cfg) -> Planner:
  """The planner of policy `spec` on n slices: a policy name, 'budget:T' (faults.time_budget
  T) or CHECKPOINT (a spare replaces the failed slice, nothing to plan)."""
  policy, budget = common.policy_spec(spec)
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


def _timed_compile(compile_s: dict, name: str, build):
  t0 = time.perf_counter()
  program = build()
  compile_s[name] = time.perf_counter() - t0
  return program


def measure(cfg, roles: set[Role], repeats: int, warmup: int) -> dict:
  """Times every role's group program, the fused normal step, update, refresh and rejoin."""
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  graphdef, _, _ = llama.abstract(cfg.model)
  b, svd, compile_s = cfg.train.micro_batch, bases.kind(cfg).refresh is not None, {}
  groups = {r: _timed_compile(compile_s, role_name(r),
                              lambda r=r: slice_steps.lower_group(cfg, mesh, r, graphdef).compile())
            for r in sorted(roles)}
  fused = _timed_compile(compile_s, 'fused_normal',
                         lambda: train_step.lower_step(cfg, mesh, Role(b), graphdef).compile())
  update = _timed_compile(compile_s, 'update', lambda: slice_steps.lower_update(cfg, mesh).compile())
  # 'refresh' is the one a run repeats every tau steps: warm (mecefo.refresh) after the first.
  warm = svd and cfg.mecefo.refresh == 'warm'
  full = svd and _timed_compile(compile_s, 'refresh_full' if warm else 'refresh',
                                lambda: train_step.lower_refresh(cfg, mesh).compile())
  refresh = full
  if warm:
    refresh = _timed_compile(compile_s, 'refresh',
                             lambda: train_step.lower_refresh(cfg, mesh, warm=True).compile())
  # Donating programs each need their own state; group programs only read theirs.
  states = {k: train_state.create_sharded(cfg, mesh)
            for k in ('group', 'fused', 'update', 'refresh', *(['refresh_full'] if warm else []))}
  if svd:  # real bases for the degraded programs and the warm refresh to start from
    states['group'], states['refresh'] = full(states['group']), full(states['refresh'])
  tokens = common.random_tokens(cfg, {r: r for r in {*roles, Role(b)}})
  sums = groups[Role(b)](states['group'], tokens[Role(b)])
  # A real host copy (device_get may alias device memory on CPU, docs/algorithm.md §8).
  host_state = jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(states['group']))

  def run_fused():
    states['fused'], metrics = fused(states['fused'], tokens[Role(b)])
    return metrics

  def run_update():
    states['update'], metrics = update(states['update'], sums)
    return metrics

  def run_refresh(name, program):
    states[name] = program(states[name])
    return states[name]

  fns = {'fused_normal': run_fused, 'update': run_update,
         'rejoin': lambda: jax.device_put(host_state, train_state.state_shardings(cfg, mesh),
                                           may_alias=False)}
  if svd:
    fns['refresh'] = lambda: run_refresh('refresh', refresh)
  if warm:
    fns['refresh_full'] = lambda: run_refresh('refresh_full', full)
  fns |= {role_name(r): (lambda r=r: groups[r](states['group'], tokens[r])) for r in sorted(roles)}
  times = common.interleaved_times(fns, repeats, warmup)
  restore_s = time_restore(cfg, mesh, states['group'])
  memory = {role_name(r): train_step.memory_summary(g).get('temp_bytes', 0) for r, g in groups.items()}
  programs = {'fused_normal': fused, 'update': update,
              **({'refresh': refresh} if svd else {}),
              **{role_name(r): g for r, g in groups.items()}}
  flops = {name: float(common.cost_analysis(p).get('flops', 0.0)) for name, p in programs.items()}
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(host_state))
  return {'times': times, 'compile_s': compile_s, 'roles': [role_name(r) for r in sorted(roles)],
          'flops': flops,
          'group_temp_bytes': memory, 'state_bytes': state_bytes, 'tau': cfg.mecefo.tau,
          'repeats': repeats, 'warmup': warmup, **restore_s}


def time_restore(cfg, mesh, state, repeats: int = 3) -> dict:
  """Seconds to restore the state from a durable Orbax checkpoint on local disk (restart cost)."""
  with tempfile.TemporaryDirectory(dir=os.environ.get('MECEFO_RESTORE_DIR')) as root:
    root = Path(root)
    # Memory tier never due (every=huge): the save and the restores go to the durable tier only.
    with store.SnapshotManager(root / 'memory', every=1 << 40, durable_dir=root / 'durable',
                                  durable_every=1) as saver:
      saver.maybe_save(1, state, {'step': 1})
      saver.wait_until_finished()
    want, seconds = train_state.params_sha256(state.params), []
    for _ in range(repeats):
      with store.SnapshotManager(root / 'memory2', every=1 << 40, durable_dir=root / 'durable',
                                    durable_every=1) as fresh:
        t0 = time.perf_counter()
        step, restored, _ = recovery.restore(fresh, cfg, mesh)
        jax.block_until_ready(restored)
        seconds.append(time.perf_counter() - t0)
      assert step == 1 and train_state.params_sha256(restored.params) == want
    return {'restore_s': statistics.median(seconds), 'restore_s_all': seconds,
            'restore_dir_fs': _fs_type(root)}


def _fs_type(path: Path) -> str:
  """Filesystem type of `path` from /proc/mounts (longest matching mount point)."""
  try:
    mounts = [line.split()[1:3] for line in Path('/proc/mounts').read_text().splitlines()]
  except OSError:
    return 'unknown'
  best = max((m for m in mounts if str(path.resolve()).startswith(m[0])), key=lambda m: len(m[0]))
  return f'{best[1]} at {best[0]}'


def costs_from(measurement: dict, stat: str) -> ClusterCosts:
  """Cluster costs from the timed programs: `stat` ('median' or 'min') of the repeats, or
  'flops': a compute-bound device, each program's XLA FLOP count x the measured median seconds
  per FLOP of the fused normal step (rejoin, restore and compiles stay measured). XLA counts a
  loop body once, so multi-pass roles are left to the cost model there."""
  t = {k: v['min_s' if stat == 'min' else 'median_s'] for k, v in measurement['times'].items()}
  if stat == 'flops':
    if 'flops' not in measurement:
      raise SystemExit('--stat flops needs a measurement with FLOP counts (this version)')
    flops = measurement['flops']
    per_flop = t['fused_normal'] / flops['fused_normal']
    t |= {name: f * per_flop for name, f in flops.items()}
  compile_s = measurement['compile_s']
  roles = {Role(*map(int, re.fullmatch(r'e(\d+)_d(\d+)_p(\d+)', name).groups())): name
           for name in measurement['roles']}
  if stat == 'flops':
    roles = {r: name for r, name in roles.items() if r.passes == 1}
  return ClusterCosts(
      normal_s=t['fused_normal'], update_s=t['update'],
      group_s={r: t[name] for r, name in roles.items()},
      group_compile_s={r: compile_s[name] for r, name in roles.items()},
      fused_compile_s=compile_s['fused_normal'], update_compile_s=compile_s['update'],
      refresh_s=t.get('refresh', 0.0), refresh_compile_s=compile_s.get('refresh', 0.0),
      tau=measurement['tau'], rejoin_s=t['rejoin'],
      # Older measurements have no durable restore: the rejoin copy, a lower bound, stands in.
      restore_s=measurement.get('restore_s', t['rejoin']))


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


def replay_all(costs: ClusterCosts, args, planners: dict[str, Planner]) -> dict:
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
    pm = simulate.PolicyModel(plan, costs)
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
            common.markdown_table(fail, list(fail[0]))]
  c = result['costs']
  roles = [{'role': role_name(Role(r['exact'], r['degraded'], r['passes'])),
            'step_s': r['step_s'], 'vs_normal': r['step_s'] / c['normal_s'],
            'modelled': r['modelled']} for r in c['roles']]
  scalars = {k: c[k] for k in ('normal_s', 'update_s', 'refresh_s', 'rejoin_s', 'restore_s',
                               'fused_compile_s')}
  check = result['cost_model']
  loo = check['max_abs_loo_rel_residual']
  return '\n\n'.join([
      *out, 'costs: ' + ', '.join(f'{k}={v:.4g}' for k, v in scalars.items()),
      f"affine cost model over {len(check['rel_residual'])} measured roles: max |relative "
      f"residual| {check['max_abs_rel_residual']:.3f}, leave-one-out {_fmt(loo)}",
      common.markdown_table(roles, list(roles[0]))])


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


def main(argv=None):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--slices', default='8', help='slice counts, comma-separated (e.g. 8,32,256)')
  p.add_argument('--policies', default='neighbor,spread,exact,budget:1.0,budget:1.05,drop,naive')
  p.add_argument('--figure', default=None, help='PNG: throughput drop vs slice count at high')
  p.add_argument('--figure-also', default=[], action='append', metavar='JSON',
                 help='an earlier result of this benchmark drawn as a further panel of --figure')
  p.add_argument('--presets', default='low,mid,high')
  p.add_argument('--hours', type=float, default=720.0)
  p.add_argument('--seeds', type=int, default=5)
  p.add_argument('--rate', choices=('cluster', 'per_device'), default='cluster')
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
  if args.costs:
    measurement = json.loads(Path(args.costs).read_text())['measurement']
    if args.remeasure_restore or 'restore_s' not in measurement:
      mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
      measurement = {**measurement, **time_restore(cfg, mesh, train_state.create_sharded(cfg, mesh))}
  else:
    if args.measure == 'all' and max(slice_counts) > 10:
      raise SystemExit('--measure all enumerates every live set: use --measure anchors above 10 '
                       'slices (the affine cost model covers the other roles)')
    timed = (simulate.needed_roles(carriers) | {Role(b)} if args.measure == 'all' else
             anchor_roles(b, carriers))
    measurement = measure(cfg, timed, args.repeats, args.warmup)
  costs = costs_from(measurement, args.stat)
  cost_model = model_check(costs)
  result = {**common.run_info(__spec__.name, argv), 'config': args.config,
            'overrides': args.overrides, 'args': vars(args), 'slices': slice_counts,
            'micro_batch': b, 'seq_len': cfg.model.seq_len, 'mecefo': vars(cfg.mecefo),
            'granule': granule, 'max_degraded_rows': carriers[0].max_rows if carriers else 2 * b,
            'measurement': measurement, 'cost_model': cost_model, 'notes': NOTES,
            'env': {'OPENBLAS_NUM_THREADS': os.environ.get('OPENBLAS_NUM_THREADS')}}
  result['failure_model'] = {n: failure_model(args, n) for n in slice_counts}
  result['compile_one_failure_s'] = {
      n: {s: simulate.PolicyModel(p, costs).compile_s(tuple(range(1, n))) for s, p in ps.items()}
      for n, ps in planners.items()}
  result['split_path_vs_fused'] = (costs.group(Role(b)) + costs.update_s) / costs.normal_s
  result['results_by_slices'] = {n: replay_all(costs, args, ps) for n, ps in planners.items()}
  result['results'] = result['results_by_slices'][slice_counts[-1]]
  result['costs'] = costs.to_json()  # with every role the replays met (modelled ones marked)
  common.emit(result, tables(result), args.json)
  if args.figure:
    figure([result, *(json.loads(Path(f).read_text()) for f in args.figure_also)], args.figure)
  return result


if __name__ == '__main__':
  main()
