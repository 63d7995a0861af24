"""The fault-log replay's scenarios beside the fixed fleet: what-ifs, hot spares, and where the
ordering of the approaches flips with the snapshot tax and the restart cost."""
from __future__ import annotations

from mecefo_jax.plan.fleet import Fleet
from mecefo_jax.plan.runs import PEERS, at_restarts, log_stats, setup

TAX_PCT = (0.0, 0.5, 1.0, 2.0)
RESTART_S = (15.0, 660.0)  # the sensitivity's range of restart costs


def sensitivity(every: dict, names: list[str], restarts: list[float], focus: list[str]) -> dict:
  """Each approach's goodput at each snapshot tax and restart cost in RESTART_S (the seeds'
  mean), the winner of each cell, and where two of `focus` change places: a process restart's
  samples pay the tax, checkpoint-restart's none (its durable checkpoints are taken as free)."""
  costs = [r for r in restarts if RESTART_S[0] <= r <= RESTART_S[1]]
  taxed = lambda name, r, tax: every[name][r]['samples_pct'] * (
      1.0 if name.startswith('checkpoint-restart') else 1.0 - tax / 100.0)
  goodput = {n: [[taxed(n, r, tax) for r in costs] for tax in TAX_PCT] for n in names}
  winner = [[max(names, key=lambda n: goodput[n][t][i]) for i in range(len(costs))]
            for t in range(len(TAX_PCT))]
  return {'tax_pct': list(TAX_PCT), 'restart_s': costs, 'goodput_pct': goodput,
          'winner': winner, 'flips': _flips(goodput, list(dict.fromkeys(focus)), costs)}


def _flips(goodput: dict, focus: list[str], costs: list[float]) -> list[str]:
  """Each pair of `focus` whose order is not the same in every cell: where the first leads."""
  out = []
  for i, a in enumerate(focus):
    for b in focus[i + 1:]:
      ahead = [[goodput[a][t][j] > goodput[b][t][j] for j in range(len(costs))]
               for t in range(len(TAX_PCT))]
      cells = sum(map(sum, ahead))
      if 0 < cells < len(TAX_PCT) * len(costs):
        where = '; '.join(f'tax {tax:g}%: R = ' + ', '.join(f'{costs[j]:g}' for j in
                                                           range(len(costs)) if ahead[t][j]) + ' s'
                          for t, tax in enumerate(TAX_PCT) if any(ahead[t]))
        out.append(f'{a} ahead of {b} only at {where}')
  return out


def what_if(s, names: list[str], profiles: dict, checkpoint_min: float) -> dict:
  """`names` with the state from live peers (a what-if: no snapshot tax, a death loses only the
  step in flight), at every profile."""
  restarts = [p.total_s for p in profiles.values()]
  out = {}
  for name in dict.fromkeys(names):
    by_cost = at_restarts(s, name + PEERS, restarts, checkpoint_min)
    out[name + PEERS] = {prof: by_cost[p.total_s] for prof, p in profiles.items()}
  return out


def hot_spares(a, faults: list, window: tuple[float, float], fleet: Fleet, names: list[str],
               profile) -> dict:
  """`names` on `fleet` (fewer slices, its spares swapped into a slice that lost a host) at the
  headline profile: goodput of the training fleet and of all the hardware, spares counted."""
  s = setup(a, faults, window, fleet)
  down = log_stats(s.events[0], s.horizon_s, s.n, [], *window)['mean_down_pct']  # seed 0
  approaches = {}
  for name in names:
    r = at_restarts(s, name, [profile.total_s], a.checkpoint_min)[profile.total_s]
    approaches[name] = {'goodput_pct': r['goodput_pct'],
                        'of_hardware_pct': r['goodput_pct'] * s.fault_free / s.hardware_fault_free,
                        'goodput_pct_std': r['goodput_pct_std'], 'degraded_pct': r['degraded_pct'],
                        'dropped_pct': r['dropped_pct'], 'restarts': r['restarts']}
  return {'servers': fleet.servers, 'slices': fleet.slices, 'slice_hosts': fleet.hosts,
          'spares': fleet.spares, 'swap_min': fleet.swap_days * 1440.0, 'swap_basis': 'assumed',
          'slice_mean_down_pct': down, 'approaches': approaches}

