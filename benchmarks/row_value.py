"""What a degraded row is worth in loss: k of B rows degraded, dropped, or neither, paired by seed.

Run: python -m benchmarks.row_value [--config configs/tiny.yaml] [--rows 64] [--degraded 8,16,32]
     [--steps 300] [--extra 1.0] [--seeds 0,1,2,3,4] [--modes full,skip_attention,rank:4,gaussian]
     [--data 'pydoc?eval_fraction=0.05'] [--eval-every 25] [--eval-rows 2048] [--json OUT]
     [--figure PNG] [--reuse EARLIER.json] [--add-to EARLIER.json] [overrides...]
One device, the product's own step program with Role(exact=B-k, degraded=k) (as
benchmarks/ablation.py lowers its variants): per seed one init and one data order for every arm,
the last k rows of each step's batch degraded (arm `degraded`), left out (`dropped`, the mean
over the B-k rows trained), or trained exactly (`none`, the fault-free run). A constant learning
rate after warmup (optimizer.min_lr_ratio=1). m: the steps past `--steps` an arm needs to reach
the fault-free run's final eval loss (on one held-out set of --eval-rows sequences); v = 1 -
a_degraded / a_dropped, a the slope of m over p = k/B through the origin, fitted over every seed
and p, with a bootstrap interval over seeds (benchmarks/row_value_fit.py). A takeover beats
dropping the row iff v > d (`budget`, the step time kept) or v > d(1 + r)/r (`spread`,
r = B_noise/B), d the degraded row's cost against an exact row's (FLOPs, time).
--reuse takes each seed's fault-free and dropped arms from an earlier run of the same settings:
they do not depend on the mode (no row is degraded), and the first seed's fault-free arm is run
again and must equal the stored one to the last bit, else the run stops. --add-to keeps the
seeds an earlier run of the same settings finished (a long run in parts: the JSON is written
after every seed) and runs the others of --seeds; machine time adds up.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import argparse
import dataclasses
import json
import math
import time

import jax
import numpy as np

from benchmarks import common, row_value_fit
from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.core.roles import Role
from mecefo_jax.data.order import global_batch
from mecefo_jax.data.sources import load_corpus
from mecefo_jax.model import bases, models, train_state
from mecefo_jax.model.contract import FULL, Degrade
from mecefo_jax.step import train_step


def mode_of(name: str) -> tuple[list[str], Degrade]:
  """A mode's config overrides and the degraded rows' techniques."""
  if name == 'full':
    return [], FULL
  if name == 'skip_attention':
    return [], Degrade(skip_attention=True)
  if name == 'gaussian':
    return ['mecefo.basis=gaussian'], FULL
  if name.startswith('rank:'):
    return [f'mecefo.rank={int(name[5:])}'], FULL
  raise SystemExit(f'error: --modes: {name!r} is not full, skip_attention, gaussian or rank:R')


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--config', default='configs/tiny.yaml')
  p.add_argument('--rows', type=int, default=64, help='B: rows a step')
  p.add_argument('--degraded', default='8,16,32', help='k: rows degraded or dropped')
  p.add_argument('--steps', type=int, default=300, help="the fault-free run's steps")
  p.add_argument('--extra', type=float, default=1.0, help='an arm may run steps x (1 + extra) '
                 'to reach the fault-free loss')
  p.add_argument('--seeds', default='0,1,2,3,4')
  p.add_argument('--modes', default='full')
  p.add_argument('--data', default='pydoc?eval_fraction=0.05')
  p.add_argument('--eval-every', type=int, default=25)
  p.add_argument('--eval-rows', type=int, default=2048)
  p.add_argument('--time-repeats', type=int, default=5, help='interleaved timings for d_time')
  p.add_argument('--json', default=None)
  p.add_argument('--figure', default=None)
  p.add_argument('--reuse', default=None, help="an earlier run's JSON: its fault-free and dropped "
                 'arms, per seed')
  p.add_argument('--add-to', default=None, help="an earlier run's JSON of the same settings: "
                 'its seeds kept, the others of --seeds run, the fit redone over all')
  p.add_argument('overrides', nargs='*', help='dotted config overrides')
  return p.parse_args(argv)


class Mode:
  """One mode's config, mesh and compiled programs: the step of every arm, the refreshes, eval."""

  def __init__(self, a, name: str):
    extra, self.degrade = mode_of(name)
    self.a, self.ks = a, [int(k) for k in a.degraded.split(',')]
    self.cfg = load_config(a.config, [
        *a.overrides, *extra, 'mesh.slice=1', 'mesh.fsdp=1', 'mesh.tensor=1',
        f'train.micro_batch={a.rows}', f'train.steps={self.longest}',
        'optimizer.min_lr_ratio=1.0'])
    self.mesh = sharding.make_mesh(self.cfg.mesh, jax.devices()[:1])
    self.graphdef = models.spec(self.cfg.model).graphdef
    self.schedule = train_state.schedule_on(self.cfg, self.mesh)
    self.roles = {'none': Role(a.rows), **{f'degraded_{k}': Role(a.rows - k, k) for k in self.ks},
                  **{f'dropped_{k}': Role(a.rows - k) for k in self.ks}}
    self.programs = {arm: self.lower(role).compile() for arm, role in self.roles.items()}
    kind = bases.kind(self.cfg)
    self.refresh = None if kind.refresh is None else {
        warm: train_step.lower_refresh(self.cfg, self.mesh, warm).compile() for warm in (0, 1)}
    self.eval_chunk = min(256, a.eval_rows)
    self.evaluate = train_step.lower_eval(self.cfg, self.mesh, self.eval_chunk,
                                          self.graphdef).compile()

  @property
  def longest(self) -> int:
    return math.ceil(self.a.steps * (1.0 + self.a.extra))

  def state(self, seed: int):
    """The fresh state of `seed`: every arm of a seed starts from it."""
    seeded = dataclasses.replace(self.cfg, train=dataclasses.replace(self.cfg.train, seed=seed))
    return train_state.create_sharded(seeded, self.mesh)

  def lower(self, role: Role):
    return train_step.lower_step(self.cfg, self.mesh, role, self.graphdef, self.degrade)

  def run(self, arm: str, seed: int, corpus, eval_set, target: float | None) -> list:
    """The arm's eval curve [(step, loss)]: the fault-free `--steps`, a faulty arm until it
    reaches `target` or its longest run."""
    a, role = self.a, self.roles[arm]
    state, evals, refreshed = self.state(seed), [], None
    for t in range(a.steps if target is None else self.longest):
      due = refreshed is None or t - refreshed >= self.cfg.mecefo.tau
      if role.degraded and self.refresh and due:
        warm = refreshed is not None and self.cfg.mecefo.refresh == 'warm'
        state, refreshed = self.refresh[warm](state), t
      tokens = global_batch(corpus, t, 1, a.rows)[:, :role.rows]
      state, _ = self.programs[arm](state, tokens, self.schedule)
      if (t + 1) % a.eval_every == 0:
        evals.append((t + 1, self.eval_loss(state, eval_set)))
        if target is not None and evals[-1][1] <= target and t + 1 >= a.steps:
          break
    return evals

  def eval_loss(self, state, eval_set) -> float:
    sums = [self.evaluate(state.params, chunk) for chunk in eval_set]
    return float(sum(s['loss_sum'] for s in sums) / sum(s['tokens'] for s in sums))

  def costs(self) -> dict:
    """d per k: a degraded row's FLOPs and time against an exact row's."""
    flops = {arm: common.unrolled_flops(lambda r=role: self.lower(r))
             for arm, role in self.roles.items()}
    state = self.state(0)
    if self.refresh:
      state = self.refresh[0](state)
    states = {arm: jax.tree.map(lambda x: x.copy(), state) for arm in self.roles}
    times = common.interleaved_times(common.donating_runners(
        self.programs, states, common.random_tokens(self.cfg, self.roles), self.schedule),
        self.a.time_repeats)
    t = {arm: v['median_s'] for arm, v in times.items()}
    row = lambda c, k: (c['none'] - c[f'dropped_{k}']) / k  # an exact row
    return {k: {'d_flops': (flops[f'degraded_{k}'] - flops[f'dropped_{k}']) / k / row(flops, k),
                'd_time': (t[f'degraded_{k}'] - t[f'dropped_{k}']) / k / row(t, k)}
            for k in self.ks} | {'times_s': t}


def eval_set(cfg, a, seed: int):
  corpus = load_corpus(a.data, seq_len=cfg.model.seq_len, seed=seed,
                       vocab_size=cfg.model.vocab_size)
  n = a.eval_rows // min(256, a.eval_rows)
  return corpus, [global_batch(corpus, j, 1, min(256, a.eval_rows), 'eval') for j in range(n)]


SETTINGS = ('config', 'rows', 'degraded', 'steps', 'extra', 'data', 'eval_every', 'eval_rows',
            'overrides')


def _earlier(a, flag: str, path: str) -> dict:
  """An earlier run's JSON, of the same settings (else a one-line error)."""
  with open(path) as f:
    earlier = json.load(f)
  differ = [k for k in SETTINGS if earlier.get(k) != getattr(a, k)]
  if differ:
    raise SystemExit(f'error: {flag} {path}: other settings ({", ".join(differ)})')
  return earlier


def seeds_done(a, path: str | None, mode: str) -> tuple[dict[int, dict], float]:
  """(seed -> every arm, machine seconds) of `mode` in an earlier run of the same settings."""
  if path is None:
    return {}, 0.0
  earlier = _earlier(a, '--add-to', path)
  done = earlier['modes'].get(mode, {}).get('per_seed', {})
  return {int(s): run for s, run in done.items()}, float(earlier.get('machine_time_s', 0.0))


def reusable(a, path: str | None) -> dict:
  """seed -> an earlier run's arms that no degraded row touches (fault-free, dropped)."""
  if path is None:
    return {}
  earlier = _earlier(a, '--reuse', path)
  return {int(seed): {'fault_free': run['fault_free'],
                      'arms': {n: arm for n, arm in run['arms'].items() if n.startswith('dropped')}}
          for m in reversed(earlier['modes'].values()) for seed, run in m['per_seed'].items()}


def one_seed(mode: Mode, seed: int, reused: dict | None, check: bool) -> dict:
  """Every arm of one seed: the fault-free curve and each faulty arm's make-up steps."""
  corpus, evals = eval_set(mode.cfg, mode.a, seed)
  if reused is None or check:
    fault_free = mode.run('none', seed, corpus, evals, None)
    if reused is not None and [list(e) for e in fault_free] != reused['fault_free']:
      raise SystemExit(f'error: --reuse: seed {seed} fault-free arm differs from the stored one')
  fault_free = reused['fault_free'] if reused else fault_free
  target, out = fault_free[-1][1], {'fault_free': fault_free, 'arms': {}}
  for arm in mode.roles:
    if arm == 'none':
      continue
    if reused and arm in reused['arms']:
      out['arms'][arm] = reused['arms'][arm]
      continue
    curve = mode.run(arm, seed, corpus, evals, target)
    m = row_value_fit.make_up_steps(curve, target, mode.a.steps)
    out['arms'][arm] = {'evals': curve, 'make_up_steps': m}
    print(f'  seed {seed} {arm}: make-up steps {m}', flush=True)
  return out


def summarize(per_seed: dict, a, costs: dict) -> dict:
  points = {s: {kind: [(k / a.rows, r['arms'][f'{kind}_{k}']['make_up_steps'])
                       for k in (int(x) for x in a.degraded.split(','))]
                for kind in ('degraded', 'dropped')} for s, r in per_seed.items()}
  censored = [(s, kind, p) for s, kinds in points.items() for kind, pm in kinds.items()
              for p, m in pm if m is None]
  d_flops = float(np.mean([c['d_flops'] for k, c in costs.items() if k != 'times_s']))
  d_time = float(np.mean([c['d_time'] for k, c in costs.items() if k != 'times_s']))
  out = {'points': points, 'censored': censored, 'd_flops': d_flops, 'd_time': d_time,
         'thresholds_flops': row_value_fit.thresholds(d_flops),
         'thresholds_time': row_value_fit.thresholds(d_time), 'costs_by_k': costs}
  if censored:
    return out | {'v': None, 'v_ci95': None}
  v = row_value_fit.row_value(points)
  return out | {'v': v, 'v_ci95': row_value_fit.bootstrap(points)}


def main(argv=None) -> dict:
  t0, a = time.perf_counter(), _args(argv)
  result = {**common.run_info(__spec__.name, argv), 'config': a.config, 'rows': a.rows,
            'degraded': a.degraded, 'steps': a.steps, 'extra': a.extra, 'data': a.data,
            'eval_every': a.eval_every, 'eval_rows': a.eval_rows, 'overrides': a.overrides,
            'modes': {}}
  reuse = reusable(a, a.reuse)
  result['reused_from'], result['added_to'] = a.reuse, a.add_to
  for name in a.modes.split(','):
    mode = Mode(a, name)
    per_seed, earlier_s = seeds_done(a, a.add_to, name)
    seeds = [int(s) for s in a.seeds.split(',') if int(s) not in per_seed]
    if not seeds:
      raise SystemExit(f'error: --add-to {a.add_to}: it has every seed of --seeds already')
    checked = next((s for s in seeds if s in reuse), None)  # one seed's fault-free arm, rerun
    costs = mode.costs()  # timed first, before the arms' long runs, while the machine is quiet
    params = sum(x.size for x in jax.tree.leaves(train_state.abstract_state(mode.cfg).params))
    for seed in seeds:
      per_seed[seed] = one_seed(mode, seed, reuse.get(seed), check=seed == checked)
      result['modes'][name] = {**summarize(per_seed, a, costs), 'steps': a.steps,
                               'seeds': list(per_seed), 'params': int(params),
                               'per_seed': per_seed}
      result['machine_time_s'] = earlier_s + time.perf_counter() - t0
      # Kept after every seed: a run cut short leaves the seeds it finished, named in `seeds`.
      common.emit(result, table(result), a.json)
  if a.figure:
    figure(result, a.figure)
  return result


def table(result: dict) -> str:
  rows = [{'mode': n, 'v': 'censored' if m['v'] is None else f"{m['v']:.3f}",
           'v 95%': 'n/a' if m['v_ci95'] is None else '[{:.2f}, {:.2f}]'.format(*m['v_ci95']),
           'd (FLOPs)': f"{m['d_flops']:.3f}", 'd (time)': f"{m['d_time']:.3f}",
           'seeds': len(m['seeds']), 'steps': m['steps']} for n, m in result['modes'].items()]
  return common.markdown_table(rows, list(rows[0]))


def figure(result: dict, path: str) -> None:
  """Make-up steps against p, per mode: each seed's points and the fitted slopes."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(6 * len(result['modes']), 4.5))
  for i, (name, m) in enumerate(result['modes'].items()):
    ax = fig.add_subplot(1, len(result['modes']), i + 1)
    for kind, color in (('degraded', 'tab:orange'), ('dropped', 'tab:blue')):
      pm = [(p, y) for s in m['points'].values() for p, y in s[kind] if y is not None]
      ax.scatter(*zip(*pm), color=color, label=kind, s=14)
      if pm:
        a_ = row_value_fit.slope(*zip(*pm))
        ax.plot([0, 0.5], [0, 0.5 * a_], color=color)
    ax.axhline(0, color='gray', lw=0.6)
    ax.set(xlabel='p = k / B', ylabel='make-up steps', title=f"{name}: v = "
           + ('censored' if m['v'] is None else f"{m['v']:.2f}"))
    ax.legend(fontsize=8)
  FigureCanvasAgg(fig).print_figure(path, dpi=100, bbox_inches='tight')


if __name__ == '__main__':
  main()
