"""Quality at a real fault log's rates (benchmarks.quality --trace): per seed its own draw of the
cluster's nodes onto the slices, the log's window compressed into the run; the rule that picks
the default policy from these runs and the log's replay (docs/failures.md, "The default").

Imports no jax: benchmarks.results reads the rule from here.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from mecefo_jax.core import fault_log

LOSS_BOUND_PCT = 0.3  # issue 52: the default's eval-loss cost, mean over seeds (or within 1 SEM of 0)


def mapping(args, steps: int, cluster_step_s: float, seed: int) -> tuple[fault_log.LogMapping, dict]:
  """The log as train.py maps it (faults.trace_*), its window [first, last) compressed into
  `steps` steps of `cluster_step_s`: a run sees the log's down fraction and its outages as the
  same share of the run as of the window. With the settings that reproduce it in train.py."""
  text = Path(args.trace).read_text()
  first, last = fault_log.window(fault_log.parse(text, args.trace), args.days)
  compress = (last - first) * fault_log.DAY_S / (steps * cluster_step_s)
  log = fault_log.LogMapping(args.trace_nodes, args.classes, first, compress, seed)
  settings = [f'faults.trace_nodes={log.nodes}', f'faults.trace_classes={log.classes}',
              f'faults.trace_start_day={first:g}', f'faults.trace_compress={compress!r}',
              f'faults.cluster_step_s={cluster_step_s:g}', f'train.seed={seed}']
  return log, {'days': [first, last], 'log_s_per_step': compress * cluster_step_s,
               'train_py_settings': settings}


def schedule(args, n: int, steps: int, cluster_step_s: float, seed: int):
  """(the schedule every policy of seed `seed` trains through, its statistics): the log's
  events through FailureSchedule.from_trace, as `--failures trace:FILE` reads them; a step with
  every slice down is waited through (simulate.stall_all_down), so every run trains all steps."""
  from benchmarks import quality_runs
  from mecefo_jax.core.failures import FailureSchedule
  from mecefo_jax.plan import simulate
  from mecefo_jax.plan.runs import log_stats
  log, where = mapping(args, steps, cluster_step_s, seed)
  text = Path(args.trace).read_text()
  sched = FailureSchedule.from_trace(args.trace, n, text=text, log=log,
                                     cluster_step_s=cluster_step_s)
  stalled = simulate.stall_all_down(sched, n, steps)
  if stalled is None:
    raise SystemExit(f'seed {seed}: every slice stays down before step {steps}')
  # The drawn nodes' down fraction in log time (no rounding to steps), beside the run's.
  first, last = where['days']
  events = fault_log.slice_events(text, args.trace, n, log, last)
  in_log = log_stats(events, (last - first) * fault_log.DAY_S * 1.0 / log.compress, n,
                     fault_log.parse(text, args.trace), first, last)
  stats = quality_runs.schedule_stats(stalled, n, steps)
  return stalled, {**where, **stats, 'down_pct_in_steps': 100.0 * stats['mean_down_slices'] / n,
                   'down_pct_in_log': in_log['mean_down_pct'],
                   'all_down_steps_waited': sum(len(f) == n for f in sched.failed_sets(steps))}


def rows(samples: dict) -> dict:
  """A run's rows as % of all it trained or dropped."""
  total = sum(samples.values()) or 1
  return {f'{k}_pct': 100.0 * samples.get(k, 0) / total for k in ('degraded', 'dropped')}


def equal_samples(policy: str, fault_free: dict) -> tuple[str, ...]:
  """requeue trains later the rows of slices down, so at equal steps it has trained fewer samples:
  it trains on to the fault-free run's samples (train.samples), the same samples of the stream in
  the same order, compared at equal samples (issue 63). Other policies train every step's rows."""
  return (f"train.samples={sum(fault_free['samples'].values())}",) if policy == 'requeue' else ()


def run_trace(args) -> dict:
  """Per seed: the fault-free run and every policy through that seed's draw of the log."""
  from benchmarks import quality_runs
  from mecefo_jax.core.failures import FailureSchedule
  per_seed = {}
  for seed in args.seeds:
    one = argparse.Namespace(**{**vars(args), 'overrides': [*args.overrides, f'train.seed={seed}']})
    cfg = quality_runs._cfg(one, 'fault-free')
    sched, stats = schedule(one, args.slices, cfg.train.steps, cfg.faults.cluster_step_s, seed)
    fault_free = quality_runs.train(one, 'fault-free', FailureSchedule(args.slices))
    runs = {p: quality_runs.train(one, p, sched, equal_samples(p, fault_free))
            for p in args.policies}
    quality_runs._relative(runs, fault_free)
    for r in runs.values():
      r.update(rows(r['samples']))
    per_seed[seed] = {'schedule': stats, 'fault_free': fault_free, 'runs': runs}
    print(f'seed {seed}: ' + ', '.join(f"{p} {r['eval_increase_pct']:+.3f}% "
                                        f"({r['degraded_pct']:.1f}% degraded)"
                                        for p, r in runs.items()), flush=True)
  replay = json.loads(Path(args.replay).read_text()) if args.replay else None
  return {'mode': 'trace', 'trace': args.trace, 'days': args.days, 'nodes': args.trace_nodes,
          'classes': args.classes, 'seeds': args.seeds, 'steps': cfg.train.steps,
          'replay': args.replay, 'summary': summary(per_seed, replay), 'per_seed': per_seed,
          'loss_bound_pct': LOSS_BOUND_PCT}


def summary(per_seed: dict, replay: dict | None) -> dict:
  """Per policy: the eval-loss increase over seeds (mean, std, SEM, per seed), the rows each
  run degraded or dropped, whether the loss bound holds, and what the replay at its own scale
  predicts (its degraded and dropped rows, its goodput at its headline profile)."""
  from benchmarks.quality_runs import mean_std_sem
  out = {}
  for policy in next(iter(per_seed.values()))['runs']:
    runs = [v['runs'][policy] for v in per_seed.values()]
    loss = mean_std_sem([r['eval_increase_pct'] for r in runs])
    out[policy] = {'eval_increase_pct': {**loss, 'per_seed': [r['eval_increase_pct'] for r in runs]},
                   'degraded_pct_per_seed': [r['degraded_pct'] for r in runs],
                   'dropped_pct_per_seed': [r['dropped_pct'] for r in runs],
                   'degraded_pct': mean_std_sem([r['degraded_pct'] for r in runs])['mean'],
                   'dropped_pct': mean_std_sem([r['dropped_pct'] for r in runs])['mean'],
                   'within_bound': within_bound(loss), 'replay': predicted(replay, policy)}
  out['down_pct_per_seed'] = {'in_steps': [v['schedule']['down_pct_in_steps']
                                           for v in per_seed.values()],
                              'in_log': [v['schedule']['down_pct_in_log']
                                         for v in per_seed.values()]}
  return out


def within_bound(loss: dict, bound: float = LOSS_BOUND_PCT) -> bool:
  """Issue 52's loss rule: the mean increase <= bound, or within one SEM of 0."""
  return loss['mean'] <= bound or loss['mean'] - loss['sem'] <= 0.0


def replayed_as(policy: str) -> str:
  """The replay's approach whose samples a policy trains as: drop is elastic restart's."""
  return 'elastic-restart' if policy == 'drop' else policy


def predicted(replay: dict | None, policy: str) -> dict | None:
  """The replay's figures for `policy` at its headline profile (None: not replayed)."""
  if replay is None:
    return None
  a = replay['approaches'].get(policy) or replay['approaches'].get(replayed_as(policy))
  if a is None:
    return None
  return {'approach': policy if policy in replay['approaches'] else replayed_as(policy),
          'slices': replay['slices'], 'profile': replay['profile'],
          'goodput_pct': a['goodput_pct'], 'goodput_pct_spread': a['goodput_pct_spread'],
          'degraded_pct': a['degraded_pct'], 'dropped_pct': a['dropped_pct'],
          'log_down_pct': replay['log']['mean_down_pct']}


def trained(result: dict) -> list[str]:
  """The policies a trace-mode result trained."""
  return [p for p in result['summary'] if p != 'down_pct_per_seed']


def decide(quality: list[dict], replay: dict, frontier: dict | None = None) -> dict:
  """Issue 52's rule: of the takeover policies trained in every `quality` result that keep
  every sample (not `drop`: elastic restart's samples, its rival), those within the loss bound
  in each; of those, the one the `replay` credits with the most goodput at its headline profile
  (a policy the replay lacks is out). None within the bound: the rule picks none, and the
  `frontier`'s recommendation stands (the time to the fault-free loss at `high`)."""
  policies = [p for p in trained(quality[0]) if all(p in q['summary'] for q in quality)]
  ok = {p: all(q['summary'][p]['within_bound'] for q in quality) for p in policies}
  goodput = {p: replay['by_profile'][p][replay['profile']]['goodput_pct']
             for p in policies if p in replay['by_profile']}
  keeps = [p for p in goodput if p != 'drop']
  eligible = [p for p in keeps if ok[p]]
  # The highest mean increase of a policy over the slice counts trained.
  worst = {p: max(q['summary'][p]['eval_increase_pct']['mean'] for q in quality) for p in keeps}
  default = (max(eligible, key=goodput.get) if eligible else
              frontier['recommended'] if frontier else None)
  return {'within_bound': ok, 'goodput_pct': goodput, 'worst_mean_increase_pct': worst,
          'default': default, 'by': 'goodput within the loss bound' if eligible else
          "none within the loss bound: the frontier's recommendation",
          'best_goodput': max(goodput, key=goodput.get) if goodput else None}


# --- docs/failures.md's block (benchmarks.results writes it) --------------------------------

def _loss(v: dict | None) -> str:
  if v is None:
    return 'not trained'
  e = v['eval_increase_pct']
  seeds = ', '.join(f'{x:+.2f}' for x in e['per_seed'])
  rows = ', '.join(f'{x:.1f}' for x in v['degraded_pct_per_seed' if v['degraded_pct'] or not
                                          v['dropped_pct'] else 'dropped_pct_per_seed'])
  kind = 'dropped' if v['dropped_pct'] and not v['degraded_pct'] else 'degraded'
  return f"{e['mean']:+.2f} ± {e['sem']:.2f}% ({seeds}); {kind} {rows}%"


def default_table(quality: dict[str, dict], replay_name: str, replay: dict,
                  frontier: dict | None) -> list[str]:
  """The rows and notes of docs/failures.md's 'default' block: each policy's progress at the
  replay's scale and its loss at the log's rates, per trained slice count; the decision."""
  files = sorted(quality, key=lambda n: quality[n]['slices'])
  prof = replay['profile']
  head = ['approach', f"progress at {replay['slices']} slices, `{prof}` (degraded / dropped rows)",
          *(f"[{quality[n]['slices']} slices](results/{n}): eval loss vs fault-free, mean ± SEM "
            '(per seed); rows per seed' for n in files), f'loss within +{LOSS_BOUND_PCT:g}%']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  names = list(dict.fromkeys([*trained(quality[files[0]]), 'elastic-restart',
                              replay['targets']['best_checkpoint']]))
  d = decide([quality[n] for n in files], replay, frontier)
  for name in names:
    a = replay['approaches'].get(name)
    progress = ('not replayed' if a is None else f"{a['goodput_pct']:.2f}% ({a['degraded_pct']:.1f}"
                f" / {a['dropped_pct']:.1f}%)")
    cells = [_loss(quality[n]['summary'].get(name)) if name in trained(quality[n]) else 'n/a'
             for n in files]
    ok = d['within_bound'].get(name)
    label = f'**{name}** (its pick)' if name == d['default'] else f'`{name}`'
    lines.append(f"| {label} | {progress} | " + ' | '.join(cells)
                 + f" | {'n/a' if ok is None else 'yes' if ok else 'no'} |")
  return [*lines, '', *notes(quality, files, replay_name, replay, frontier, d)]


def notes(quality, files, replay_name, replay, frontier, d) -> list[str]:
  """The decision and the alternatives, each figure read from the JSON."""
  a, t, prof = replay['approaches'], replay['targets'], replay['profile']
  best = d['default']
  ckpt, el = t['best_checkpoint'], 'elastic-restart'
  spread = lambda *ns: max(a[n]['goodput_pct_spread'] for n in ns)
  out = []
  if best is not None and not d['within_bound'][best]:
    w = d['worst_mean_increase_pct']
    out.append(
        f"* **No policy that keeps every sample meets the loss bound** (+{LOSS_BOUND_PCT:g}%, or "
        'within 1 SEM of 0) at every slice count: the highest mean increase of each, '
        + ', '.join(f'`{p}` {v:+.2f}%' for p, v in w.items())
        + f". This rule picked none, so the frontier's recommendation stood (the least slowdown "
        f"to the fault-free loss at `{frontier['preset']}`, a stress test): `{best}`, "
        f"{a[best]['goodput_pct']:.2f}% of fault-free progress at `{prof}` (≥ 99%: "
        f"{'yes' if a[best]['goodput_pct'] >= 99 else 'no'}); "
        f"{a[best]['goodput_pct'] - a[ckpt]['goodput_pct']:+.2f} points over {ckpt} and "
        f"{a[best]['goodput_pct'] - a[el]['goodput_pct']:+.2f} over elastic restart (the draws' "
        f"spread {spread(best, ckpt, el):.2f}).")
  elif best is not None:
    g = a[best]['goodput_pct']
    out.append(
        f"* **The default by the rule** (most progress at `{prof}` among the policies that keep "
        f"every sample with the loss within +{LOSS_BOUND_PCT:g}%, or within 1 SEM of 0, at every "
        f"slice count): `{best}`, {g:.2f}% of fault-free progress (≥ 99%: "
        f"{'yes' if g >= 99 else 'no'}); {g - a[ckpt]['goodput_pct']:+.2f} points over {ckpt} and "
        f"{g - a[el]['goodput_pct']:+.2f} over elastic restart (the draws' spread "
        f"{spread(best, ckpt, el):.2f}).")
  if d['best_goodput'] not in (None, best):
    out.append(f"* `{d['best_goodput']}` keeps more ({d['goodput_pct'][d['best_goodput']]:.2f}%) "
               'but its loss is over the bound: a run that trains past its loss anyway, or a '
               'throughput-bound one, may take it.')
  down = '; '.join(
      f"{quality[n]['slices']} slices: " + ', '.join(
          f'{x:.1f}' for x in quality[n]['summary']['down_pct_per_seed']['in_log']) + '% in the log, '
      + ', '.join(f'{x:.1f}' for x in quality[n]['summary']['down_pct_per_seed']['in_steps'])
      + f"% of the run's slice-steps ({quality[n]['steps']} steps)" for n in files)
  out.append(f"* **Rates**: {replay['log']['mean_down_pct']:.1f}% of the {replay['nodes']} nodes "
             f"down on average over days {replay['log']['days'][0]:g}-{replay['log']['days'][1]:g} "
             f"({replay_name}); the seeds' draws of nodes: {down}.")
  slow = 'slow'
  if slow in replay['profiles'] and best is not None:
    r = lambda n: replay['by_profile'][n][slow]['goodput_pct']
    out.append(f"* **A slow restart** (`{slow}`, {replay['profiles'][slow]['total_s']:.0f} s): "
               f"`{best}` {r(best):.2f}%, elastic restart {r(el):.2f}%, {ckpt} {r(ckpt):.2f}%.")
  levers = replay.get('rejoin_levers', {}).get(best)
  if levers:
    cell = lambda spec: ' / '.join(f'{v:.2f}' for v in levers[spec].values())
    out.append(f"* **Rejoin** (`{best}`, {' / '.join(next(iter(levers.values())))}): a repaired "
               f"node rejoining at once (`now`, what the product does) {cell('now')}%; "
               + '; '.join(f'`{k}` {cell(k)}%' for k in levers if k != 'now') + '.')
  if frontier is not None:
    p = frontier['policies']
    out.append(f"* **A harsher cluster** (the `{frontier['preset']}` preset, a stress test: "
               f"{frontier['slices']} slices, the paper's rate): throughput drop / eval loss: "
               + '; '.join(f"`{k}` {p[k]['drop_pct_at_32']:.1f}% / {p[k]['loss_increase_pct']:+.2f}%"
                           for k in p if k in d['within_bound'])
               + ' ([frontier_32slices.json](results/frontier_32slices.json)).')
  return out
