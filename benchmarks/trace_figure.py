"""benchmarks.trace_goodput's figure: goodput per approach at the headline profile, against the
restart cost, and checkpoint-restart's against its checkpoint interval."""
from __future__ import annotations


def figure(result: dict, path: str) -> None:
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(18, 5.2))
  bars, left, right = (fig.add_subplot(1, 3, i) for i in (1, 2, 3))
  _bars(bars, result)
  _by_restart(left, result)
  _by_interval(right, result)
  FigureCanvasAgg(fig).print_figure(path, dpi=100, bbox_inches='tight')


def _bars(ax, result: dict) -> None:
  """Goodput (± the seeds' std) and the loss-equivalent progress (r -> inf) of every approach."""
  names = list(result['approaches'])
  rows = [result['approaches'][n] for n in names]
  y = range(len(names))
  ax.barh([i + 0.2 for i in y], [r['goodput_pct'] for r in rows], 0.4,
          xerr=[r['goodput_pct_std'] for r in rows], label='goodput (samples)')
  ax.barh([i - 0.2 for i in y], [r['loss_equivalent_pct'] for r in rows], 0.4,
          label=f"progress in loss (a degraded row worth v = {result['loss_model']['v']:.2f})")
  ax.axvline(result['limit_pct']['r_inf'], color='k', lw=0.8, ls='--',
             label='limit: every live slice at full pace')
  ax.set_yticks(list(y), labels=names, fontsize=8)
  ax.invert_yaxis()
  log = result['log']
  ax.set(xlabel='% of the fault-free run', xlim=(0, 100), title=(
      f"{result['profile']} restart, days {log['days'][0]:g}-{log['days'][1]:g}, "
      f"{result['slices']} slices, {result['micro_batch']} rows/slice, "
      f"granule {result['granule']}"))
  ax.axvline(99, color='gray', lw=0.6, ls=':')
  ax.legend(fontsize=7, loc='upper center', bbox_to_anchor=(0.5, -0.12))


def _by_restart(ax, result: dict) -> None:
  sweep, head = result['sweep'], f"{result['checkpoint_min']:g}"
  minutes = [r / 60.0 for r in sweep['restart_s']]
  for name, goodput in sweep['goodput_pct'].items():
    ax.plot(minutes, goodput, marker='o', label=name)
  ax.plot(minutes, sweep['best_checkpoint_goodput_pct'][head], marker='s', ls='--', color='k',
          label=f'checkpoint-restart, best spare pool, every {head} min')
  for name, prof in result['profiles'].items():
    ax.axvline(prof['total_s'] / 60.0, color='gray', lw=0.6, ls=':')
    ax.text(prof['total_s'] / 60.0, 0.02, f' {name}', transform=ax.get_xaxis_transform(),
            fontsize=8, rotation=90)
  ax.set(xscale='log', xlabel='restart cost R (minutes, fault to the first step again)',
         ylabel='goodput (% of the fault-free run)', title='goodput against the restart cost')
  ax.legend(fontsize=7)


def _by_interval(ax, result: dict) -> None:
  sweep, prof = result['sweep'], result['profile']
  i = sweep['restart_s'].index(result['profiles'][prof]['total_s'])
  for name, by_c in sweep['checkpoint_goodput_pct'].items():
    ax.plot(sweep['checkpoint_min'], [by_c[c][i] for c in by_c], marker='o', label=name)
  for name, style in ((result['targets']['best_policy'], '-'), (result['default'], '--'),
                      ('elastic-restart', ':')):
    ax.axhline(result['approaches'][name]['goodput_pct'], color='k', ls=style, lw=0.9,
               label=name)
  ax.set(xscale='log', xlabel='checkpoint interval C (minutes)', ylabel='goodput (%)',
         title=f'checkpoint-restart (spares taken from the nodes) at the {prof} profile')
  ax.legend(fontsize=7)
