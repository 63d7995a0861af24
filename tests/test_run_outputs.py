"""Outputs of a run: evals every N steps, metrics.jsonl + TensorBoard, report.json schema, plots
(the terminal's progress: tests/test_progress_output.py)."""
import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest

from mecefo_jax import sections
from mecefo_jax.config import load_config
from mecefo_jax.core.failures import AppliedEvent
from mecefo_jax.records.metrics import EvalRow, TrainRow
from mecefo_jax.run import plot, report_schema
from mecefo_jax.run.parts import StartMode
from procs import suite_store

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVAL_EVERY, LOG_EVERY = 20, 5, 4


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """One short real run (2 slices, snapshots on), shared by the tests of this file."""
  from mecefo_jax.run.trainer import Trainer
  out = tmp_path_factory.mktemp('run')
  cfg = load_config(ROOT / 'configs' / 'tiny.yaml', [
      f'train.steps={STEPS}', f'train.log_every={LOG_EVERY}', f'train.eval_every={EVAL_EVERY}',
      'train.eval_batches=1', 'mesh.slice=2', f'snapshot.dir={out}/shm', 'snapshot.every=5',
      'snapshot.durable_every=10'])
  rows = []
  with Trainer(cfg, out, progress='plain', on_log=rows.append,
               start=StartMode(program_store=suite_store())) as trainer:
    report = trainer.run()
  # Closed on the way out: the finished run's in-memory snapshots are gone, the run unlocked.
  assert not list((out / 'shm').glob('*/*/*')) and (out / '.lock').read_text() == ''
  return out, report, rows


def test_eval_every_n_steps_in_metrics_and_report(run):
  out, report, rows = run
  evals = [r for r in rows if r['kind'] == 'eval']
  assert [r['step'] for r in evals] == [4, 9, 14, 19]
  for r in evals:
    assert r['perplexity'] == pytest.approx(math.exp(r['loss'])) and r['eval_s'] >= 0
  assert report['evals'] == [{k: r[k] for k in ('step', 'loss', 'perplexity')} for r in evals]
  assert report['eval_loss'] == evals[-1]['loss']
  assert report['eval_perplexity'] == pytest.approx(math.exp(report['eval_loss']))
  assert evals[-1]['loss'] < evals[0]['loss']


def test_on_log_gets_every_row_written_to_metrics_jsonl(run):
  out, _, rows = run
  lines = [json.loads(l) for l in (out / 'metrics.jsonl').read_text().splitlines()]
  assert lines == rows
  train = [r for r in rows if r['kind'] == 'train']
  assert [r['step'] for r in train] == [0, 4, 8, 12, 16, 19]
  assert all(r['tokens_per_s'] > 0 and r['live_slices'] == 2 for r in train)


def test_the_startup_clock_of_a_fresh_run_in_process(run):
  """A Trainer built in a running interpreter is timed from its construction: the first step
  ends after every start-up phase it waited for."""
  _, report, _ = run
  s = report['startup']
  init = s['init_lower_s'] + s['init_compile_s'] + s['init_run_s']
  assert s['first_step_from'] == 'trainer' and s['restore_s'] is None
  assert min(s['init_lower_s'], s['init_compile_s'], s['first_programs_s']) > 0
  assert report['compile_s'] >= init + s['first_programs_s']
  assert s['first_step_s'] >= report['compile_s'] + s['first_step_run_s'] > report['compile_s']


def test_eval_rows_do_not_depend_on_the_live_slices(tmp_path):
  """The eval set is fixed held-out rows: 3 live slices of 4 evaluate the same rows as 4."""
  from mecefo_jax.fault import evaluation
  from mecefo_jax.run.trainer import Trainer
  cfg = load_config(ROOT / 'configs' / 'tiny.yaml', [
      'mesh.slice=4', 'train.micro_batch=2', 'snapshot.enabled=false', 'train.plot=false'])
  trainer = Trainer(cfg, tmp_path, progress='quiet', start=StartMode(program_store=suite_store()))
  try:
    all_live = trainer.evaluate(3)
    c = trainer.controller
    assert evaluation.held_out_loss(c, 3) == all_live
    c.failed = {1}  # as after a failure of slice 1: the state moves onto slices 0, 2, 3
    c.executor.place(c.live())
    assert c.state_slices == (0, 2, 3)
    assert trainer.evaluate(3) == pytest.approx(all_live, rel=1e-6)
  finally:
    trainer.close()


def test_report_matches_the_schema(run):
  out, report, _ = run
  on_disk = json.loads((out / 'report.json').read_text())
  assert report_schema.errors(on_disk) == []
  assert on_disk['schema_version'] == report_schema.SCHEMA_VERSION
  assert on_disk['trace_nodes_by_slice'] is None  # no node fault log
  sn = on_disk['snapshots']
  assert sn['enabled'] and sn['saved'] == STEPS // 5 and sn['durable_saved'] == STEPS // 10
  # The finished run freed its in-memory tier on its way out: the report names none of it.
  assert sn['retained_steps'] == [] and not list((out / 'shm').glob('*/*/*'))
  assert sn['durable_retained_steps'] == [10, 20]
  tp = on_disk['throughput']
  assert tp['tokens_per_step'] == 2 * 8 * 64 and tp['eval_s'] > 0
  assert tp['train_s'] == pytest.approx(on_disk['wall_s'] - tp['eval_s'])


def _set(path, value):
  def change(report):
    node = report
    for key in path[:-1]:
      node = node[key]
    node[path[-1]] = value
  return change


@pytest.mark.parametrize('change, needle', [
    (lambda r: r.pop('eval_loss'), 'eval_loss: missing'),
    (lambda r: r['snapshots'].pop('saved'), 'snapshots.saved: missing'),
    (_set(['steps'], '20'), 'steps: expected int'),
    (_set(['preempted'], 0), 'preempted: expected bool'),
    (_set(['tokens'], True), 'tokens: expected int'),
    (_set(['evals', 0, 'loss'], 'low'), 'evals[0].loss: expected float'),
    (_set(['losses', 0], [0]), 'losses[0]: expected a pair'),
    (_set(['goodput', 'lost'], None), 'goodput.lost: expected float'),
    (_set(['failure_events'], [{'step': 1, 'slice': 0, 'kind': 'boom', 'source': 'api',
                                'wall_s': 0.1, 'live': 1}]), 'failure_events[0].kind'),
    (_set(['surprise'], 1), 'surprise: not in the schema'),
])
def test_schema_checker_rejects_a_wrong_report(run, change, needle):
  report = json.loads((run[0] / 'report.json').read_text())
  change(report)
  with pytest.raises(report_schema.ReportError) as err:
    report_schema.validate(report)
  assert needle in str(err.value)


def test_docs_report_md_documents_every_key():
  text = (ROOT / 'docs' / 'report.md').read_text()
  missing = [key for key, *_ in report_schema.rows() if f'`{key}`' not in text]
  assert not missing, f'docs/report.md lacks {missing}; regenerate the table with ' \
                      '`python -m mecefo_jax.run.report_schema --markdown`'
  assert report_schema.rows_markdown() in text, \
      "docs/report.md's metrics.jsonl tables differ from TrainRow and EvalRow " \
      '(records/metrics.py); regenerate them with `python -m mecefo_jax.run.report_schema --rows`'


def test_the_config_pages_list_every_key():
  """docs/config.md (generated; tests/test_config_rules.py keeps it equal to the declarations)
  holds every key, and the manual's configuration page and the index lead to it."""
  import dataclasses

  from mecefo_jax.config import Config
  text = (ROOT / 'docs' / 'config.md').read_text()
  cfg = Config()
  missing = [f'{sec.name}.{f.name}' for sec in dataclasses.fields(cfg)
             for f in dataclasses.fields(getattr(cfg, sec.name))
             if f'| `{sec.name}.{f.name}` |' not in text]
  assert not missing, f'docs/config.md lacks {missing}'
  for page in ('configuration.md', 'index.md'):
    assert '](config.md)' in (ROOT / 'docs' / page).read_text(), page


def test_the_layers_snippet_of_the_manual_runs():
  text = (ROOT / 'docs' / 'layers.md').read_text()
  section = text[text.index('# The MeCeFO layers'):]
  start = section.index('```python\n') + len('```python\n')
  # from another folder the package must be installed: -r requirements.txt is not enough
  assert 'pip install /path/to/mecefo-jax' in section[:start] and '`pip install .`' in \
      section[:start]
  code = section[start:section.index('\n```', start)]
  assert 'MeCeFOLinear(' in code and 'nnx.grad' in code
  exec(compile(code, 'README.md', 'exec'), {})


def test_tensorboard_scalars(run):
  pytest.importorskip('tensorboardX')
  out, report, _ = run
  assert report['tensorboard_dir'] == str(out / 'tb')
  data = b''.join(p.read_bytes() for p in (out / 'tb').glob('events.out.tfevents.*'))
  for tag in (b'train/loss', b'train/tokens_per_s', b'train/live_slices', b'eval/loss'):
    assert tag in data


def test_plot_written_by_the_run_and_by_the_cli(run, tmp_path, capsys):
  out, _, _ = run
  assert (out / 'training.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  # The CLI on a copy whose report has failure windows (one still open at the end).
  for name in ('metrics.jsonl', 'report.json'):
    shutil.copy(out / name, tmp_path / name)
  report = json.loads((tmp_path / 'report.json').read_text())
  report['failure_events'] = [
      {'step': 3, 'slice': 1, 'kind': 'fail', 'source': 'api', 'wall_s': 0.5, 'live': 1},
      {'step': 9, 'slice': 1, 'kind': 'repair', 'source': 'api', 'wall_s': 1.0, 'live': 2},
      {'step': 15, 'slice': 0, 'kind': 'fail', 'source': 'api', 'wall_s': 1.5, 'live': 1}]
  (tmp_path / 'report.json').write_text(json.dumps(report))
  png = tmp_path / 'plot.png'
  assert plot.main([str(tmp_path), '--out', str(png)]) == 0, capsys.readouterr().err
  assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and png.stat().st_size > 20_000


def _train(step: int, loss: float | None, wall_s: float, **more) -> TrainRow:
  return TrainRow(step=step, degraded_tokens=0.0, exact_tokens=64.0, grad_norm=1.0, loss=loss,
                  wall_s=wall_s, live_slices=2, tokens_per_s=100.0, **more)


def _lines(*rows) -> str:
  """metrics.jsonl's text of `rows`."""
  return ''.join(json.dumps(sections.to_json(row)) + '\n' for row in rows)


def _event(step: int, slice_: int, kind: str, source: str = 'api', live: int = 0):
  return AppliedEvent(step, slice_, kind, source, wall_s=0.0, live=live)


def test_an_old_report_and_its_rows_still_plot_and_compare(tmp_path, capsys):
  """A run of report schema 6 (no goodput.restart, rows without `time`): plotted and compared
  with a run of today's schema."""
  old = ROOT / 'tests' / 'fixtures' / 'old_layout' / 'run'
  assert json.loads((old / 'report.json').read_text())['schema_version'] == 6
  assert 'time' not in (old / 'metrics.jsonl').read_text()
  assert plot.main([str(old), '--out', str(tmp_path / 'old.png')]) == 0
  new = tmp_path / 'new'
  new.mkdir()
  (new / 'metrics.jsonl').write_text(_lines(_train(0, 5.0, 1.0, time=1000.0)))
  assert plot.main([str(old), str(new), '--out', str(tmp_path / 'both.png')]) == 0
  assert (tmp_path / 'old.png').stat().st_size > 20_000 and (tmp_path / 'both.png').exists()


def test_plot_cli_one_line_errors_a_missing_run_no_rows_and_an_unwritable_out(tmp_path, capsys):
  def error(*argv):
    assert plot.main([str(a) for a in argv]) == 2
    [line] = capsys.readouterr().err.splitlines()
    return line
  assert error(tmp_path / 'missing') == f'error: {tmp_path / "missing"}: no such run directory'
  assert error(tmp_path) == (f'error: {tmp_path}: holds no metrics.jsonl (not a run directory, '
                             'or a run that has not logged a step yet)')
  (tmp_path / 'metrics.jsonl').write_text('{"kind": "eval", "step": 0, "loss": 1.0}\n')
  assert error(tmp_path) == f'error: {tmp_path / "metrics.jsonl"} has no training rows to plot'
  (tmp_path / 'metrics.jsonl').write_text(_lines(_train(0, 1.0, 0.1)))
  out = tmp_path / 'no' / 'such' / 'x.png'
  assert error(tmp_path, '--out', out) == f'error: cannot write {out}: No such file or directory'


def test_failure_windows_per_slice():
  events = [_event(5, 1, 'fail'), _event(12, 2, 'fail'), _event(18, 1, 'repair')]
  windows = [(w['slice'], w['start'], w['end']) for w in plot.failure_windows(events, 29)]
  assert windows == [(1, 5, 18), (2, 12, 30)]


def test_live_slices_follow_the_failure_events_not_the_logged_steps():
  events = [_event(0, 3, 'fail', 'absent', 3), _event(7, 1, 'fail', 'trace:t', 2),
            _event(7, 3, 'repair', 'present', 3), _event(13, 2, 'fail', 'absent', 2)]
  assert plot.live_slices(events, 4, 29) == ([0, 7, 13, 29], [3, 3, 2, 2])
  assert plot.live_slices([], 4, 29) == ([0, 29], [4, 4])


def test_the_plot_title_names_the_deaths_of_a_supervised_run():
  death = lambda step, s: _event(step, s, 'fail', 'absent')
  events = [death(12, 2), death(12, 3), _event(20, 2, 'repair', 'present'), death(40, 1),
            _event(41, 0, 'fail', 'trace:t.txt')]
  title = plot._title(plot.PlotReport(steps=50, failure_events=events))
  assert title.splitlines()[1] == ('deaths (absent at a restart): slices 2, 3 at step 12; '
                                   'slice 1 at step 40')
  assert len(plot._title(plot.PlotReport(steps=50, failure_events=events[-1:])).splitlines()) == 1


def test_read_rows_stitches_a_resumed_run(tmp_path):
  rows = [_train(0, 5.0, 1.0), _train(4, 4.0, 2.0),
          _train(4, 3.9, 0.5),  # resumed: clock restarts
          EvalRow(4, 3.8, 44.7, eval_s=0.1, wall_s=0.7, live_slices=2)]
  (tmp_path / 'metrics.jsonl').write_text(_lines(*rows) + '{"step": 8, "lo')  # cut by a crash
  got = plot.read_rows(tmp_path)
  assert [(r.row.kind, r.row.step, r.row.loss) for r in got] == [
      ('train', 0, 5.0), ('train', 4, 3.9), ('eval', 4, 3.8)]
  assert [r.t for r in got] == [1.0, 2.5, 2.7]


def _history(run_dir, *events):
  (run_dir / 'history.jsonl').write_text(''.join(json.dumps(e) + '\n' for e in events))


def test_read_rows_counts_a_supervised_restart_on_the_time_axis(tmp_path):
  """The gap from a process's last row to the restarted loop counts where a death lies in it
  (rows stamped with `time`); a stop and resume, and rows of before `time`, keep no gap."""
  rows = [_train(0, 5.0, 1.0, time=1001.0), _train(4, 4.0, 2.0, time=1002.0),
          _train(4, 3.9, 0.5, time=1030.5),  # its loop started at 1030
          _train(8, 3.5, 1.5, time=1031.5)]
  (tmp_path / 'metrics.jsonl').write_text(_lines(*rows))
  _history(tmp_path, {'t': 1000.0, 'kind': 'start'}, {'t': 1010.0, 'kind': 'launch-death'},
           {'t': 1011.0, 'kind': 'launch-start'})
  assert [r.t for r in plot.read_rows(tmp_path)] == [1.0, 30.5, 31.5]  # 2 + 28 s of restart
  _history(tmp_path, {'t': 1000.0, 'kind': 'start'}, {'t': 1010.0, 'kind': 'stop'})
  assert [r.t for r in plot.read_rows(tmp_path)] == [1.0, 2.5, 3.5]


def test_the_restart_after_a_death_is_booked_from_the_death_less_its_compiles(tmp_path):
  import time
  import types

  from mecefo_jax.core.decider import DeciderMeta
  from mecefo_jax.core.goodput import Goodput
  from mecefo_jax.records.snapshot_meta import SnapshotMeta
  from mecefo_jax.records.history import HistoryLine, Kind
  from mecefo_jax.run import restart
  now = time.time()
  lines = [HistoryLine(now - 60, Kind.START), HistoryLine(now - 20, Kind.LAUNCH_DEATH),
           HistoryLine(now - 19, Kind.LAUNCH_DEATH), HistoryLine(now - 18, Kind.LAUNCH_START)]
  assert restart.death_before_start(lines) == now - 20  # the first death since the start
  assert restart.death_before_start(lines + [HistoryLine(now, Kind.START)]) is None
  assert restart.death_before_start([HistoryLine(now, Kind.LAUNCH_DEATH)]) == now
  _history(tmp_path, *(sections.to_json(line) for line in lines))
  saved = {'compile': 3.0, 'normal_productive': 9.0}  # the snapshot's ledger (no 'restart')
  ledger = Goodput(saved)
  ledger.book('compile', 5.0)  # this start's compiles
  controller = types.SimpleNamespace(goodput=ledger.seconds, book=ledger.book)
  restart.book(tmp_path, controller, SnapshotMeta(DeciderMeta([], [], saved, {}), [], 0, []))
  assert ledger.seconds['restart'] == pytest.approx(15.0, abs=1.0)
  assert ledger.seconds['compile'] == 8.0
  restart.book(tmp_path, controller, None)  # a start from step 0 restarts nothing
  assert ledger.seconds['restart'] == pytest.approx(15.0, abs=1.0)


def test_a_record_names_each_missing_wrong_and_unknown_key():
  @dataclasses.dataclass
  class Record:
    n: int = sections.entry('', 'a count')
    xs: list[float] = sections.entry('', 'values')

  errors: list[str] = []
  sections.check(Record, {'xs': [1.0, 'a'], 'extra': 1}, 'r', errors)
  assert any(e.startswith('r.n: missing') for e in errors), errors
  assert any(e.startswith('r.xs[1]') for e in errors), errors
  assert any(e.startswith('r.extra: not in the schema') for e in errors), errors
  assert len(errors) == 3, errors
