"""benchmarks.trace_goodput's figure: goodput against restart cost, and checkpoint-restart's
against its checkpoint interval."""
from __future__ import annotations


def figure(result: dict, path: str) -> None:
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(13, 4.6))
  sweep, head = result['sweep'], f"{result['checkpoint_min']:g}"
  log = result['log']
  left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
  minutes = [r / 60.0 for r in sweep['restart_s']]
  for name, goodput in sweep['goodput_pct'].items():
    left.plot(minutes, goodput, marker='o', label=name)
  left.plot(minutes, sweep['best_checkpoint_goodput_pct'][head], marker='s', ls='--',
            label=f'checkpoint-restart, best spare pool, every {head} min')
  for name, prof in result['profiles'].items():
    left.axvline(prof['total_s'] / 60.0, color='gray', lw=0.6, ls=':')
    left.text(prof['total_s'] / 60.0, 1.0, f' {name}', transform=left.get_xaxis_transform(),
              fontsize=8, va='top', rotation=90)
  left.set(xscale='log', xlabel='restart cost R (minutes, fault to the first step again)',
           ylabel='goodput (% of the fault-free run)',
           title=(f"days {log['days'][0]:g}-{log['days'][1]:g}, {result['slices']} slices, "
                  f"{result['micro_batch']} rows/slice, granule {result['granule']}"))
  left.legend(fontsize=7)
  prof = result['profile']
  for name, by_c in sweep['checkpoint_goodput_pct'].items():
    i = sweep['restart_s'].index(result['profiles'][prof]['total_s'])
    right.plot(sweep['checkpoint_min'], [by_c[c][i] for c in by_c], marker='o', label=name)
  for name in (result['targets']['best_policy'], result['default'], 'elastic-restart'):
    right.axhline(result['approaches'][name]['goodput_pct'], ls='--', lw=0.8, label=name)
  right.set(xscale='log', xlabel='checkpoint interval C (minutes)', ylabel='goodput (%)',
            title=f'checkpoint-restart at the {prof} profile')
  right.legend(fontsize=7)
  FigureCanvasAgg(fig).print_figure(path, dpi=110, bbox_inches='tight')
