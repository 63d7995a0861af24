"""Plots of runs: `python -m mecefo_jax.run.plot RUN_DIR [RUN_DIR ...] [--out PNG]`."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mecefo_jax import files, sections
from mecefo_jax.core.failures import AppliedEvent, apply_event
from mecefo_jax.records import history
from mecefo_jax.records.job import BAD_INPUT, command
from mecefo_jax.records.metrics import EvalRow, TrainRow
from mecefo_jax.run import restart
from mecefo_jax.run.metrics import read_metrics
from mecefo_jax.run.report_schema import Report
from mecefo_jax.run.rundir import METRICS_FILE

log = logging.getLogger('mecefo')
PLOT_FILE = 'training.png'
DOWN_COLOR = 'tab:red'
# The part of report.json a plot reads: Report's own keys, each of which a report may lack.
PlotReport = sections.part(Report, 'PlotReport', (
    'failure_events', 'entropy_floor', 'goodput', 'resumed_from_step', 'mesh', 'final_loss',
    'eval_loss', 'tokens_per_s', 'steps', 'failures', 'takeover'))


class Timed(NamedTuple):
  """A metrics row and its run-long wall time `t`."""
  t: float
  row: TrainRow | EvalRow


def read_rows(run_dir: str | Path) -> list[Timed]:
  """metrics.jsonl rows with a run-long wall time (resumed processes restart wall_s at 0;
  after a death the supervisor recorded, the time to the restarted loop counts too, where the
  rows hold their Unix `time`); a step trained again after a resume keeps its last row."""
  rows, offset, last = {}, 0.0, None
  died = restart.deaths(history.read(run_dir, warn=False))  # only its deaths count here
  for row in read_metrics(run_dir):
    if last is not None and row.wall_s < last.wall_s:  # a new process (resume): a new clock
      offset += last.wall_s + _restart_gap(last, row, died)
    last = row
    rows[row.kind, row.step] = Timed(offset + row.wall_s, row)
  return sorted(rows.values(), key=lambda r: (r.row.step, r.row.kind != 'train'))


def _restart_gap(last: TrainRow | EvalRow, first: TrainRow | EvalRow,
                 died: list[float]) -> float:
  """Seconds from a process's `last` row to the loop start of the next process (its `first`
  row) where a death lies between them; 0 for a stop and resume, or rows without `time`."""
  if last.time is None or first.time is None:
    return 0.0
  end, start = last.time, first.time - first.wall_s
  return max(0.0, start - end) if any(end <= t <= start for t in died) else 0.0


def read_report(run_dir: Path) -> PlotReport:
  """The part of report.json a plot reads (every key None without one); one that cannot be
  read (torn, another type, a key of another type) is left out of the plot with a warning: the
  curves need only metrics."""
  try:
    report = files.read_json(Path(run_dir) / 'report.json', PlotReport,
                             remedy='plotted without it')
  except files.FileError as err:
    log.warning('%s', err)
    return PlotReport()
  return report or PlotReport()


def _train_and_evals(run_dir: Path) -> tuple[list[Timed], list[Timed]]:
  """(train rows, eval rows) of the run in `run_dir`; a missing run, or one with no training
  rows, is a ValueError in one line."""
  if not run_dir.is_dir():
    raise ValueError(f'{run_dir}: no such run directory')
  if not (run_dir / METRICS_FILE).is_file():
    raise ValueError(f'{run_dir}: holds no {METRICS_FILE} (not a run directory, or a run that '
                     'has not logged a step yet)')
  rows = read_rows(run_dir)
  train = [r for r in rows if isinstance(r.row, TrainRow)]
  if not train:
    raise ValueError(f'{run_dir / METRICS_FILE} has no training rows to plot')
  return train, [r for r in rows if isinstance(r.row, EvalRow)]


def _save(fig, out: Path) -> Path:
  try:
    fig.savefig(out, dpi=100)
  except OSError as err:  # a missing or read-only directory: one line, not matplotlib's trace
    raise ValueError(f'cannot write {out}: {err.strerror or err}') from None
  return out


def failure_windows(events: list[AppliedEvent], last_step: int) -> list[dict]:
  """{slice, start, end (steps), start_s, end_s (wall, None if unknown)} per failure, from
  the report's failure_events; a slice still down at the end is back at last_step + 1."""
  failed, down, windows = set(), {}, []  # down: the failure event of each failed slice
  for e in events:
    if not apply_event(failed, e.kind, e.slice):
      continue
    if e.kind == 'fail':
      down[e.slice] = e
    else:
      fail = down.pop(e.slice)
      windows.append({'slice': e.slice, 'start': fail.step, 'end': e.step,
                      'start_s': fail.wall_s, 'end_s': e.wall_s})
  windows += [{'slice': s, 'start': e.step, 'end': last_step + 1, 'start_s': e.wall_s,
               'end_s': None} for s, e in down.items()]
  return sorted(windows, key=lambda w: (w['start'], w['slice']))


def live_slices(events: list[AppliedEvent], n_slices: int,
                last_step: int) -> tuple[list, list]:
  """(steps, live slice count) over [0, last_step] as a step function of the report's
  failure_events (each holds the live count after it), so that a change shows at its own step,
  logged or not."""
  steps, live = [0], [n_slices]
  for e in events:
    if e.step != steps[-1]:
      steps.append(e.step)
      live.append(live[-1])
    live[-1] = e.live
  return steps + [last_step], live + [live[-1]]


def _shade(ax, spans, label='slice down') -> None:
  """One translucent band per failure window: overlapping failures show darker."""
  for i, (lo, hi) in enumerate(spans):
    ax.axvspan(lo, hi, color=DOWN_COLOR, alpha=0.12, lw=0, label=label if i == 0 else None)


def _steps(rows: list[Timed]) -> list[int]:
  return [r.row.step for r in rows]


def _losses(rows: list[Timed]) -> list[float]:
  """The rows' losses, NaN where metrics.jsonl holds null (a non-finite loss)."""
  return [np.nan if r.row.loss is None else r.row.loss for r in rows]


def _loss_panel(ax, x_train, train, x_eval, evals, xlabel, floor=None) -> None:
  ax.plot(x_train, _losses(train), lw=1.2, label='train loss')
  if evals:
    ax.plot(x_eval, _losses(evals), 'o', ms=5, color='tab:orange', label='eval loss')
  if floor is not None:
    ax.axhline(floor, ls='--', lw=0.8, color='gray', label=f'entropy floor {floor:.3f}')
  ax.set_xlabel(xlabel)
  ax.set_ylabel('loss (nats/token)')


def _throughput_panel(ax, train, events, n_slices):
  ax.plot(_steps(train), [r.row.tokens_per_s for r in train], lw=1.2, color='tab:green',
          label='tokens/s')
  ax.set_xlabel('step')
  ax.set_ylabel('tokens/s (since the previous log line)')
  if not n_slices:
    return None
  from matplotlib.ticker import MaxNLocator
  live = ax.twinx()
  live.plot(*live_slices(events, n_slices, train[-1].row.step), drawstyle='steps-post', lw=0.8,
            color='gray', label='live slices (right)')
  live.set_ylabel('live slices')
  live.yaxis.set_major_locator(MaxNLocator(integer=True))
  live.set_ylim(0, n_slices + 0.5)
  return live


def _goodput_panel(ax, goodput: dict) -> None:
  if not goodput:
    ax.text(0.5, 0.5, 'no report.json', ha='center', va='center', transform=ax.transAxes)
    ax.set_axis_off()
    return
  names, seconds = list(goodput), [float(v) for v in goodput.values()]
  total = sum(seconds) or 1.0
  bars = ax.barh(names, seconds, color=['tab:blue', 'tab:cyan', 'tab:purple', 'tab:olive',
                                        DOWN_COLOR, 'tab:brown'][:len(names)])
  for bar, s in zip(bars, seconds):
    ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f' {s:.2f}s ({100 * s / total:.0f}%)',
            va='center', fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel('seconds')
  ax.set_xlim(0, max(seconds + [1e-9]) * 1.35)
  ax.set_title('goodput breakdown', fontsize=10)


def _deaths(events: list[AppliedEvent]) -> str:
  """'slices 2, 3 at step 12; slice 1 at step 40': the slices a start found absent ('absent'
  events: a supervised job restarted without a dead process, or fewer devices)."""
  by_step: dict[int, list[str]] = {}
  for e in events:
    if e.kind == 'fail' and e.source == 'absent':
      by_step.setdefault(e.step, []).append(str(e.slice))
  return '; '.join(f"slice{'s' if len(ids) > 1 else ''} {', '.join(ids)} at step {step}"
                   for step, ids in by_step.items())


def _title(report: PlotReport) -> str:
  if report == PlotReport():  # none read
    return 'training run'
  def num(loss):
    return 'n/a' if loss is None else f'{loss:.4f}'
  deaths = _deaths(report.failure_events or [])
  return (f'{report.steps} steps | failures {report.failures}, takeover {report.takeover} | '
          f'final train loss {num(report.final_loss)}, eval {num(report.eval_loss)} | '
          f'{report.tokens_per_s or 0:.0f} tokens/s'
          + (f'\ndeaths (absent at a restart): {deaths}' if deaths else ''))


def plot_or_warn(run_dir: Path) -> None:
  """plot_run, a failure a warning: a missing plot is never worth a failed run."""
  try:
    plot_run(run_dir)
  except Exception as err:  # noqa: BLE001
    log.warning('could not write %s: %s: %s', Path(run_dir) / PLOT_FILE, type(err).__name__, err)


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
  """Writes the 4-panel figure of the run in `run_dir` to `out` (default RUN_DIR/training.png)."""
  # Figure + Agg canvas, not pyplot: no global backend switch inside a notebook's process.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  run_dir = Path(run_dir)
  out = Path(out) if out else run_dir / PLOT_FILE
  report = read_report(run_dir)  # first: a damaged one is a warning even without rows
  train, evals = _train_and_evals(run_dir)
  steps, times = _steps(train), [r.t for r in train]
  events = report.failure_events or []
  windows = failure_windows(events, steps[-1])
  step_spans = [(w['start'], w['end']) for w in windows]
  to_time = lambda s: float(np.interp(s, steps, times))  # step -> run-long wall time
  # Events carry the wall time of their process: exact unless the run was resumed.
  exact = report.resumed_from_step is None
  time_spans = [(w['start_s'] if exact and w['start_s'] is not None else to_time(w['start']),
                 w['end_s'] if exact and w['end_s'] is not None else to_time(w['end']))
                for w in windows]

  fig = Figure(figsize=(13, 8.5), layout='constrained')
  FigureCanvasAgg(fig)
  (a, b), (c, d) = fig.subplots(2, 2)
  _loss_panel(a, steps, train, _steps(evals), evals, 'step', report.entropy_floor)
  _shade(a, step_spans)
  a.set_title('loss vs step', fontsize=10)
  _loss_panel(b, times, train, [to_time(s) for s in _steps(evals)], evals, 'wall time (s)')
  _shade(b, time_spans)
  b.set_title('loss vs wall time', fontsize=10)
  # The run's slices: all live before its first event, a fail (the mesh of a resumed run holds
  # only the slices present).
  n_slices = events[0].live + 1 if events else (report.mesh or {}).get('slice')
  live = _throughput_panel(c, train, events, n_slices)
  _shade(c, step_spans)
  c.set_title('throughput', fontsize=10)
  _goodput_panel(d, sections.to_json(report.goodput) if report.goodput else {})
  for ax in (a, b, c):
    ax.grid(alpha=0.3)
  a.legend(fontsize=8, loc='upper right')
  b.legend(fontsize=8, loc='upper right')
  handles = [h for axis in (c, live) if axis for h in axis.get_legend_handles_labels()[0]]
  c.legend(handles=handles, fontsize=8, loc='lower left')
  fig.suptitle(_title(report), fontsize=11)
  return _save(fig, out)


def _labels(run_dirs: list[Path]) -> list[str]:
  """Each run's directory name, or its path where two runs share a name."""
  names = [d.name or str(d) for d in run_dirs]
  return [n if names.count(n) == 1 else str(d) for n, d in zip(names, run_dirs)]


def plot_compare(run_dirs, out: str | Path) -> Path:
  """Writes one figure to `out`: loss vs step of every run in `run_dirs` (a line each, eval
  losses as dots of its colour), labelled by directory name."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  run_dirs = [Path(d) for d in run_dirs]
  fig = Figure(figsize=(9, 5.5), layout='constrained')
  FigureCanvasAgg(fig)
  ax = fig.subplots()
  for run_dir, label in zip(run_dirs, _labels(run_dirs)):
    train, evals = _train_and_evals(run_dir)
    line, = ax.plot(_steps(train), _losses(train), lw=1.2, label=label)
    ax.plot(_steps(evals), _losses(evals), 'o', ms=5, color=line.get_color())
  ax.set_xlabel('step')
  ax.set_ylabel('loss (nats/token); dots: eval loss')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8, loc='upper right')
  ax.set_title(f'training loss of {len(run_dirs)} runs', fontsize=11)
  return _save(fig, Path(out))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
      prog=command('mecefo_jax.run.plot'),  # as typed: mecefo-plot or python -m ...
      description='Plot loss, throughput, failures and goodput of a run, or compare the loss '
                  'of several runs on one figure.')
  p.add_argument('run_dirs', nargs='+', metavar='RUN_DIR',
                 help='run directory (holds metrics.jsonl and report.json); several: compare')
  p.add_argument('--out', default=None,
                 help=f'PNG to write (default RUN_DIR/{PLOT_FILE}; needed with several runs)')
  args = p.parse_args(argv)
  try:
    if len(args.run_dirs) == 1:
      out = plot_run(args.run_dirs[0], args.out)
    elif args.out is None:
      raise ValueError(f'comparing {len(args.run_dirs)} runs needs --out PNG')
    else:
      out = plot_compare(args.run_dirs, args.out)
  except (OSError, ValueError) as err:
    print(f'error: {err}', file=sys.stderr)
    return BAD_INPUT
  print(out)
  return 0


if __name__ == '__main__':
  sys.exit(main())
