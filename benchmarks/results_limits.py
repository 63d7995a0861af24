"""docs/limitations.md's measured figures: each marked span is a sentence read from its
docs/results JSON files (python -m benchmarks.results writes them; tests/test_results.py checks)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

LIMITATIONS = Path(__file__).resolve().parents[1] / 'docs' / 'limitations.md'
END = '<!-- /figures -->'

SNAPSHOT = 'snapshot_overhead_llama_60m_auto.json'
SCALE = 'failure_throughput_scale_llama_60m_flops.json'
FRONTIER = 'frontier_32slices.json'
TRACE = 'trace_goodput_infinitehbd_days0-174.5_400slices_flops.json'
SEEDS = 'quality_seeds_tiny_text_lr3e-3.json'
SHAPED = ('quality_presets_llama_60m_shaped_lr1e-3.json',
          'quality_presets_llama_60m_shaped_lr1e-3_seed1.json')
VIM = tuple(f'quality_seeds_tiny_vimdoc_{n}steps.json' for n in (300, 1200, 2400))
QUALITY = ('quality_trace_infinitehbd_tiny_pydoc_8slices.json',
           'quality_trace_infinitehbd_tiny_pydoc_32slices.json')
REQUEUE = 'requeue_pool_infinitehbd_tiny_pydoc_32slices.json'


def _link(name: str) -> str:
  return f'[{name}](results/{name})'


def _snapshot(r: dict) -> str:
  d = r[SNAPSHOT]
  return (f"{d['snapshot_cpu_s']:.2f} CPU-s per snapshot, {d['overhead_pct']:.1f}% of a "
          f"{d['times']['no_snapshot']['mean_s']:.1f} s step (mean; "
          f"{d['overhead_pct_median']:.1f}% median) on {d['date'][:10]}, and "
          f"`snapshot.every=auto` snapshotted every {d['auto_every']} steps to stay within "
          f"{d['auto_budget']:.0%} ({_link(SNAPSHOT)})")


def _scale(r: dict) -> str:
  by, f = r[SCALE]['results_by_slices'], r[FRONTIER]['policies']
  drops = lambda p: ' / '.join(f"{v[p]['high']['drop_pct']:.1f}" for v in by.values()) + '%'
  last = by[max(by, key=int)]['budget:1.0']['high']
  return (f"at the `high` preset on llama_60m with {' / '.join(by)} slices, by FLOP count, the "
          f"paper's neighbour loses {drops('neighbor')}; `--takeover budget` loses "
          f"{drops('budget:1.0')} (at {max(by, key=int)} slices "
          f"{100 * last['move_time_frac']:.1f} points of it are programs moved onto never-seen "
          f"live sets), but it costs {f['budget:1.0']['loss_increase_pct']:+.1f}% eval loss on "
          f"tiny; `spread` (the default until requeue) loses {drops('spread')} at "
          f"{f['spread']['loss_increase_pct']:+.1f}% ({_link(SCALE)}, {_link(FRONTIER)})")


def _real_cluster(r: dict) -> str:
  from benchmarks import quality_trace
  t = r[TRACE]
  keep = lambda p: t['approaches'][p]['goodput_pct']
  quality = [r[n] for n in QUALITY]
  loss = ' and '.join(
      f"{q['summary'][t['default']]['eval_increase_pct']['mean']:+.2f} ± "
      f"{q['summary'][t['default']]['eval_increase_pct']['sem']:.2f}% at {q['slices']} slices"
      for q in quality)
  verdict = quality_trace.decide(quality, t, r.get(FRONTIER))
  none_ok = not any(verdict['within_bound'][p] for p in verdict['goodput_pct'] if p != 'drop')
  return (f"the InfiniteHBD log, {t['nodes']} servers, {t['log']['mean_down_pct']:.1f}% down on "
          f"average: `{t['default']}` (the default then) keeps {keep(t['default']):.1f}% of "
          f"fault-free "
          f"progress at {t['slices']} slices with a {t['profiles'][t['profile']]['total_s']:.0f} s "
          f"restart ({keep(t['default']) - keep('elastic-restart'):+.1f} points against elastic "
          f"restart's {keep('elastic-restart'):.1f}%; `budget:1.0` keeps "
          f"{keep('budget:1.0'):.1f}%). "
          f"Its eval-loss cost at the log's rates ({quality[0]['steps']} steps, "
          f"{len(quality[0]['seeds'])} seeds) is {loss}, against a "
          f"+{quality_trace.LOSS_BOUND_PCT:g}% bound; "
          + ('no policy that keeps every sample meets it at every slice count' if none_ok else
             f"the rule picks `{verdict['default']}`")
          + f" ({_link(TRACE)}, {', '.join(map(_link, QUALITY))})")


def _requeue(r: dict) -> str:
  d = r[REQUEUE]
  e, s = d['eval_increase_pct'], d['settings']
  return (f"`requeue`'s own loss at the log's rates, at equal samples ({s['slices']} slices, "
          f"{s['steps']} fault-free steps, {len(d['seeds'])} seeds paired), is "
          f"{e['mean']:+.2f}% against fault-free, 95% interval [{e['ci95'][0]:+.2f}, "
          f"{e['ci95'][1]:+.2f}]%: " + ('within' if d['within_bound'] else 'not within')
          + f" the ±{s['loss_bound_pct']:g}% that would call it free ({_link(REQUEUE)})")


def _steps(d: dict) -> str:
  steps = {run['steps'] for run in d['per_seed'].values()} if 'per_seed' in d else {d['steps']}
  return '/'.join(map(str, sorted(steps)))


def _short_runs(r: dict) -> str:
  d = r[SEEDS]
  high = d['summary']['high']
  loss = lambda p: f"{high[p]['mean']:+.1f} ± {high[p]['sem']:.1f}%"
  shaped = [r[n]['floor_2pct_at_high'] for n in SHAPED]
  through = list(dict.fromkeys(k for s in shaped for k in s if k != 'naive'))
  losses = [s[k]['eval_increase_pct'] for s in shaped for k in through if k in s]
  naive = [s['naive']['eval_increase_pct'] for s in shaped if 'naive' in s]
  lr = next(o.split('=')[1] for o in r[SHAPED[0]]['overrides'] if o.startswith('optimizer.lr='))
  vim = {_steps(r[n]): r[n]['summary']['high'] for n in VIM}
  path = lambda p: ' → '.join(f"{v[p]['mean']:+.1f}%" for v in vim.values())
  return (f"at `high`, tiny on real text ({len(d['seeds'])} seeds, {d['slices']} slices, "
          f"{_steps(d)} steps) loses {loss('neighbor')} eval loss with neighbor and "
          f"{loss('spread')} with spread ({_link(SEEDS)}); {_steps(r[SHAPED[0]])}-step "
          f"llama_60m-shaped runs (lr {lr}, {len(SHAPED)} seeds) lose {min(losses):.1f}–"
          f"{max(losses):.1f}% with {', '.join(through)}, "
          + (f"{naive[0]:+.1f}% with naive (exact) " if naive else '')
          + f"({', '.join(map(_link, SHAPED))}); on the Vim help folder "
          f"({len(r[VIM[0]]['seeds'])} seeds, {' / '.join(vim)} steps) neighbor's cost goes "
          f"{path('neighbor')} and spread's {path('spread')} ({', '.join(map(_link, VIM))})")


FIGURES: dict[str, Callable[[dict], str]] = {
    'snapshot': _snapshot, 'scale': _scale, 'real cluster': _real_cluster,
    'requeue': _requeue, 'short runs': _short_runs}


def begin(key: str) -> str:
  return f'<!-- figures: {key}, generated by python -m benchmarks.results -->'


def limitations(text: str, results: dict[str, dict]) -> str:
  """docs/limitations.md with each marked span rewritten from the JSON."""
  for key, sentence in FIGURES.items():
    head, sep, rest = text.partition(begin(key))
    if not sep or END not in rest:
      raise ValueError(f'docs/limitations.md has no span {begin(key)} ... {END}')
    text = head + begin(key) + sentence(results) + END + rest.partition(END)[2]
  return text
