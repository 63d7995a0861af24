"""The loop's hooks one by one, without a run: their cadence, their stops, their report keys."""
import dataclasses
import json
import math
import types
from pathlib import Path

import pytest

from mecefo_jax.config import load_config
from mecefo_jax.core.decider import DeciderState
from mecefo_jax.records.history import Kind
from mecefo_jax.records.metrics import Eval, EvalRow
from mecefo_jax.records.run_state import Diverged
from mecefo_jax.run import hints, loop_hooks  # noqa: F401  (loop_hooks: the order, tests/test_resume.py)
from mecefo_jax.run.evaluation import Evals
from mecefo_jax.run.hooks import Divergence, Every, Hook, Hooks, RunEnd, StepRecord, StopRun
from mecefo_jax.run.metric_rows import MetricRows
from mecefo_jax.run.records import RunRecords
from mecefo_jax.run.run_files import RunFiles
from mecefo_jax.run.saving import SnapshotSaver, Stop
from mecefo_jax.run.stop import StopRequest
from mecefo_jax.run.report_schema import Report
from mecefo_jax.sections import Draft
from mecefo_jax.snapshot.interval import START, Interval, SnapshotInterval

PLAN = types.SimpleNamespace(live=(0, 1), eval=None, first_id=None)


def _record(step: int, loss: float | None = 1.0) -> StepRecord:
  values = {'degraded_tokens': 0.0, 'exact_tokens': 64.0, 'grad_norm': 1.0, 'loss': loss}
  return StepRecord(step, PLAN, None if loss is None else values, loop_start=0.0)


def test_every_runs_its_function_after_every_nth_step_and_wants_those_steps_fetched():
  seen = []
  hook = Every(3, lambda r: seen.append(r.steps_done))
  for step in range(10):
    assert hook.wants_values(step) == (step % 3 == 2)
    hook.after_step(_record(step))
  assert seen == [3, 6, 9]
  with pytest.raises(ValueError, match='n >= 1'):
    Every(0, print)


def test_a_hook_that_is_no_hook_is_refused_before_anything_is_built(tmp_path):
  from mecefo_jax.run.trainer import Trainer

  class Duck:  # the methods, but not the class: the loop would fail on a missing one later
    def after_step(self, record):
      return None
  with pytest.raises(TypeError, match=r'is not a mecefo_jax.run.hooks.Hook; subclass it'):
    Trainer(load_config(None, []), tmp_path / 'run', hooks=[Every(2, print), Duck()])
  assert not (tmp_path / 'run').exists()


OUT = Path('runs/diverging')


class _Recorded(list):
  """What a Divergence records: run_state.json's record (RunFiles.diverged), each the same as
  its history.jsonl line (RunRecords.history)."""
  out_dir = OUT

  def diverged(self, diverged: Diverged) -> None:
    self.append(dataclasses.asdict(diverged))

  def history(self, kind: Kind, **fields) -> None:
    assert kind is Kind.DIVERGED and fields == {'diverged': Diverged(**self[-1])}


def _divergence(start_step: int = 0, saved=(10,)):
  """A Divergence hook of a start at `start_step` whose tiers hold snapshots of steps `saved`;
  what it records."""
  origin = types.SimpleNamespace(step=start_step, resumed_from=start_step or None)
  saver = types.SimpleNamespace(newest=lambda bound, restored: max(
      (s for s in saved if s <= bound), default=None))
  recorded = _Recorded()
  return Divergence(origin, saver, recorded, recorded, lr=0.5), recorded


def test_divergence_ends_the_run_at_a_non_finite_loss_without_counting_that_step():
  hook, recorded = _divergence()
  assert hook.after_step(_record(3, None)) is None  # not fetched: nothing to judge
  assert hook.after_step(_record(3, 2.0)) is None
  stop = hook.after_step(_record(4, math.nan))
  assert stop.steps_done == 4 and 'the training loss is not finite (nan) at step 4' in stop.message
  # Step 3 was the last seen finite: no snapshot of a step <= 3 (only 10): nothing to go back to.
  assert recorded == [{'diverged_at_step': 4, 'last_finite_step': 3, 'rollback_to': None}]
  assert 'before any snapshot of a step seen finite' in stop.message
  assert stop.message.endswith(f'({hints.fresh(OUT)})') and '--resume' not in stop.message
  report = Draft(Report)
  hook.report(RunEnd(4, 1.0, stop.message), report)
  assert report.diverged_at_step == 4


def test_divergence_is_a_non_finite_gradient_norm_too_and_names_the_snapshot_to_go_back_to():
  """A finite loss with an inf gradient norm: that step's update would make the state NaN. The
  snapshot to go back to is of a step <= the last step seen finite (12): 10, not 13."""
  hook, recorded = _divergence(start_step=5, saved=(10, 13))
  assert hook.after_step(StepRecord(12, PLAN, {'loss': 3.0, 'grad_norm': 1.0}, 0.0)) is None
  stop = hook.after_step(StepRecord(13, PLAN, {'loss': 3.0, 'grad_norm': math.inf}, 0.0))
  assert 'the training gradient norm is not finite (inf) at step 13' in stop.message
  assert recorded == [{'diverged_at_step': 13, 'last_finite_step': 12, 'rollback_to': 10}]
  assert ('the newest snapshot before it is of step 10 (the last step seen finite: 12): go back '
          f'to it with a lower learning rate, {hints.rollback(OUT, 0.5, 1)}') in stop.message
  # A resumed start's first step diverging: its restored snapshot (5) is not gone back to.
  hook, recorded = _divergence(start_step=5, saved=(3, 5))
  stop = hook.after_step(StepRecord(5, PLAN, {'loss': math.nan, 'grad_norm': math.nan}, 0.0))
  assert 'loss and gradient norm are not finite (nan, nan) at step 5' in stop.message
  assert recorded == [{'diverged_at_step': 5, 'last_finite_step': 4, 'rollback_to': 3}]


def test_a_poisoned_step_reads_as_a_divergence_while_its_file_names_it(tmp_path, monkeypatch):
  """The soak's transient divergence (run/hooks.TEST_POISON_ENV): the step its file names has
  a NaN loss; another step, or the same once the file is gone, is finite."""
  from mecefo_jax.run.hooks import TEST_POISON_ENV
  poison = tmp_path / 'poison'
  monkeypatch.setenv(TEST_POISON_ENV, str(poison))
  hook, recorded = _divergence()
  assert hook.after_step(_record(3)) is None  # no file: nothing poisoned
  poison.write_text('4')
  assert hook.after_step(_record(3)) is None
  stop = hook.after_step(_record(4))
  assert 'the training loss is not finite (nan) at step 4' in stop.message
  poison.unlink()  # the resume trains step 4 again
  hook, recorded = _divergence()
  assert hook.after_step(_record(4)) is None and recorded == []


def test_hooks_run_in_order_until_one_stops_and_merge_their_report_keys():
  calls = []

  class Named(Hook):
    def __init__(self, name, stop=False):
      self.name, self.stop = name, stop

    def before_step(self, step):
      calls.append(('before', self.name))

    def after_step(self, record):
      calls.append(('after', self.name))
      return StopRun(self.name, record.steps_done) if self.stop else None

    def report(self, end, report):
      report.steps = 10 * report.steps + end.steps_done if self.name != 'a' else end.steps_done

  hooks = Hooks([Named('a'), Named('b', stop=True), Named('c')])
  hooks.before_step(0)
  assert hooks.after_step(_record(0)) == StopRun('b', 1)
  assert calls == [('before', 'a'), ('before', 'b'), ('before', 'c'), ('after', 'a'),
                   ('after', 'b')]
  report = Draft(Report)
  hooks.report(RunEnd(1, 0.5, 'b'), report)
  assert report.steps == 111  # a, then b, then c
  with pytest.raises(AttributeError, match="declares no key 'step'"):
    report.step = 1  # a key Report does not declare is refused where it is set
  with pytest.raises(ValueError, match='no value for schema_version'):
    report.build()
  assert not hooks.wants_values(0) and list(hooks) == list(hooks.ordered)


def test_the_interval_is_snapshot_every_or_the_tuners_from_auto():
  fixed, auto = Interval.of(3, 0.01, 100), Interval.of('auto', 0.01, 20)
  assert fixed.every == 3 and fixed.tuner is None and fixed.due(6) and not fixed.due(7)
  assert fixed.report() == SnapshotInterval(every=3)
  assert auto.every == START and auto.tuner is not None
  report = auto.report()
  assert report.auto and report.max_every == 20 and report.budget == 0.01 and report.every == 8
  fixed.after_step(3, 1.0, False)  # a fixed interval measures nothing
  assert fixed.every == 3


def test_a_stop_request_ends_the_run_after_its_step_saved_where_snapshots_are():
  records = RunRecords('.', enabled=False)
  saver = SnapshotSaver(None, None, None, None, records=records,
                        resume_hint='`python train.py --resume`')
  stop = Stop(StopRequest(after_step=2), saver, records, '`python train.py --resume`')
  assert stop.after_step(_record(0)) is None
  end = stop.after_step(_record(1))
  assert end == StopRun('stopped by --stop-after 2 after 2 steps, saved nothing (snapshots are '
                        'off)', 2)
  report = Draft(Report)
  stop.report(RunEnd(2, 1.0, end.message), report)
  saver.report(RunEnd(2, 1.0, end.message), report)
  assert report.preempted and not report.snapshots.enabled
  assert report.snapshot_interval == SnapshotInterval()
  assert not saver.wants_values(0)


def test_metric_rows_write_a_train_row_every_log_every_steps_then_the_steps_other_rows(tmp_path):
  cfg = load_config(None, ['train.steps=5', 'train.log_every=2'])
  rows, tokens = [], iter(range(0, 10_000, 100))
  hook = MetricRows(cfg, tmp_path, 0, 2, tokens=lambda: next(tokens), samples=lambda: 0,
                    losses=[], mode='quiet', on_log=rows.append)
  with hook.opened():
    for step in range(5):
      record = _record(step, loss=5.0 - step)
      if step == 2:
        record.eval_row = EvalRow(2, 3.5, 33.1, eval_s=0.1, wall_s=1.0, live_slices=2)
      hook.maker.after_step(record)  # before the snapshot hook
      assert hook.rows_of(step) == record.rows  # what that snapshot's meta carries
      hook.after_step(record)
  assert [(r['kind'], r['step']) for r in rows] == [('train', 0), ('train', 2), ('eval', 2),
                                                      ('train', 4)]
  written = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert [(r['kind'], r['step']) for r in written] == [(r['kind'], r['step']) for r in rows]
  report = Draft(Report)
  hook.report(RunEnd(5, 2.0, None), report)
  assert report.losses == [(0, 5.0), (2, 3.0), (4, 1.0)] and report.final_loss == 1.0
  # The eval's 0.1 s (its row's) is left out of the rates: 5 steps in 2.0 - 0.1 s.
  assert report.throughput.eval_s == 0.1 and report.throughput.steps_per_s == 5 / 1.9
  assert report.first_loss == 5.0


def test_run_files_lock_the_run_and_write_nothing_before_its_start(tmp_path):
  cfg = load_config(None, [])
  out = tmp_path / 'run'
  files = RunFiles(cfg, out)
  try:
    assert [p.name for p in out.iterdir()] == ['.lock']
    assert files.check(resume=False, replace=False, replace_finished=False) is None
    assert len(files.run_id) == 12 and files.schedule(2, resume=False).all_events() == []
    assert [p.name for p in out.iterdir()] == ['.lock']
  finally:
    files.release(refused=True)
  assert not out.exists()  # a refused start's empty run directory goes



def test_evals_run_where_the_plan_has_one_unless_the_run_stops_and_once_more_at_the_end():
  losses = iter([2.0, 1.5, 1.0])
  controller = types.SimpleNamespace(evaluate=lambda n: next(losses), live=lambda: (0, 1),
                                     exclude_from_steps=lambda s: None,
                                     wait_for_steps=lambda: None)
  emitted, stopping = [], {3}
  hook = Evals(controller, 2, last_step=4, has_eval=True, stopping=lambda r: r.step in stopping,
               emit=emitted.append, evals=[Eval(0, 3.0, 20.1)])
  for step in range(1, 5):
    plan = types.SimpleNamespace(live=(0, 1), eval=None if step == 2 else 'eval program',
                                 first_id=None)
    record = StepRecord(step, plan, {'loss': 1.0}, loop_start=0.0)
    hook.after_step(record)
    assert [r.step for r in record.rows] == ([step] if step in (1, 4) else [])
  hook.at_end(0.0, stopped=None)  # the last step's eval ran: no second one
  assert [e.step for e in hook.evals] == [0, 1, 4] and emitted == []
  report = Draft(Report)
  hook.report(RunEnd(5, 1.0, None), report)
  assert report.eval_loss == 1.5 and [e.step for e in report.evals] == [0, 1, 4]
  hook.last_step = 5
  hook.at_end(0.0, stopped=None)  # a final eval after a step without one
  assert [r.step for r in emitted] == [5] and emitted[0].loss == 1.0


def test_the_snapshot_to_go_back_to_is_listed_or_in_flight_never_a_step_not_saved(tmp_path):
  """SnapshotSaver.newest: the tiers' steps and the save just started (not listed yet), <= the
  bound; a step whose save was not due (nothing started) is no snapshot."""
  tier = types.SimpleNamespace(steps=lambda: [4, 2])

  class Tiers:
    tiers, durable = [tier], None

    def due(self, steps):
      return steps % 2 == 0

    def maybe_save(self, steps, state, meta, stop=False):
      return ('memory',) if self.due(steps) or stop else ()

    def where(self, steps, started):
      return [f'{t} {steps}' for t in started]

  parts = types.SimpleNamespace(state=None, dump_meta=lambda: DeciderState().to_meta(),
                                losses=[], evals=[], rows_of=lambda step: [])
  saver = SnapshotSaver(Tiers(), parts, parts, parts, records=RunRecords(tmp_path, enabled=False),
                        resume_hint='')
  saver.save(6)  # started, in flight: not listed yet
  saver.save(7)  # not due: nothing saved
  assert [saver.newest(b) for b in (1, 3, 5, 7)] == [None, 2, 4, 6]
  assert SnapshotSaver(None, None, None, None, None, '').newest(9) is None


def test_the_step_loop_ends_where_every_slice_went_down_and_records_that_step(tmp_path):
  """run/loop.StepLoop: the first step of a start is fetched (the start-up clock's end); a step
  whose slices are all down ends the loop there, its step recorded for a resume."""
  from mecefo_jax.fault.controller import AllSlicesDown
  from mecefo_jax.run.loop import StepLoop
  down_at, fetched, reached = [], [], []

  def step(step, elapsed):
    if step == 2:
      raise AllSlicesDown('all 2 slices are down')
    return {'loss': 1.0}

  controller = types.SimpleNamespace(
      step=step, settle=lambda: None, events=[], last_plan=PLAN, last_built=(),
      fetch=lambda metrics, vote: (fetched.append(metrics) or metrics, None),
      stream_position=lambda: 0)
  parts = types.SimpleNamespace(
      cfg=load_config(None, ['train.steps=5']), out_dir=tmp_path, controller=controller,
      presence=types.SimpleNamespace(slots=(0,)), snapshots=None,
      origin=types.SimpleNamespace(step=1), files=types.SimpleNamespace(all_down_at=down_at.append),
      records=types.SimpleNamespace(events=lambda events: None, reached=reached.append),
      stop=StopRequest(), startup=types.SimpleNamespace(step_done=lambda: None))
  steps_done, why = StepLoop(parts, Hooks([]), restarted_by=None).run(0.0)
  assert (steps_done, down_at, fetched, reached) == (2, [2], [{'loss': 1.0}], [2])
  assert why.startswith('all 2 slices are down. When devices return, ') and 'step 2' in why


def test_the_step_loop_ends_at_a_sample_budget_past_train_steps():
  """train.samples ends the loop once the stream holds that many samples (here 6 a step, as
  under `requeue` with slices down), after train.steps where it must; the last step is marked."""
  from mecefo_jax.run.loop import StepLoop
  trained, records = [0], []

  def step(step, elapsed):
    trained[0] += 6
    return {'loss': 1.0}

  class Last(Hook):
    def after_step(self, record):
      records.append((record.step, record.last))

  controller = types.SimpleNamespace(
      step=step, settle=lambda: None, events=[], last_plan=PLAN, last_built=(),
      fetch=lambda metrics, vote: (metrics, None), stream_position=lambda: trained[0])
  parts = types.SimpleNamespace(
      cfg=load_config(None, ['train.steps=2', 'train.samples=20']), controller=controller,
      presence=types.SimpleNamespace(slots=(0,)), snapshots=None,
      origin=types.SimpleNamespace(step=0), records=types.SimpleNamespace(
          events=lambda events: None, reached=lambda step: None),
      stop=StopRequest(), startup=types.SimpleNamespace(step_done=lambda: None))
  assert StepLoop(parts, Hooks([Last()]), restarted_by=None).run(0.0) == (4, None)
  assert records == [(0, False), (1, False), (2, False), (3, True)]  # 24 >= 20 after step 3


def test_an_eval_waits_for_the_steps_dispatched_ahead_before_its_clock_starts(monkeypatch):
  from mecefo_jax.run import evaluation
  clock = {'now': 100.0, 'queued': 4.0}  # 4 s of steps dispatched ahead, still on the devices

  def run_queued():  # whatever waits on the state first waits for them
    clock['now'], clock['queued'] = clock['now'] + clock['queued'], 0.0

  class Controller:
    excluded = []

    def wait_for_steps(self):
      run_queued()

    def evaluate(self, n_batches):
      run_queued()
      clock['now'] += 0.5
      return 2.0

    def exclude_from_steps(self, seconds):
      self.excluded.append(seconds)

    def live(self):
      return (0, 1)
  monkeypatch.setattr(evaluation, 'time', types.SimpleNamespace(perf_counter=lambda: clock['now']))
  evals = Evals(Controller(), 2, 9, has_eval=True, stopping=lambda r: False, emit=print, evals=[])
  row = evals.row(4, loop_start=90.0)
  # Only the eval's own 0.5 s is left out of step time and of tokens/s.
  assert row.eval_s == 0.5 and Controller.excluded == [0.5] and row.wall_s == 14.5
