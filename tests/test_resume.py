"""Resume: the snapshot a restart takes over a sweep of timings (made-up per-host inventories),
initial_state's accounting, and every hint the product prints run exactly as printed."""
import json
import logging
import re
import shlex
from pathlib import Path

import jax
import numpy as np
import pytest

from mecefo_jax.config import ConfigError, load_config, to_dict
from mecefo_jax.records import history
from mecefo_jax.records.history import Kind
from mecefo_jax.records.job import BAD_INPUT, LAUNCH_ENV, STOPPED
from mecefo_jax.run import cli, hints, presence, rundir
from mecefo_jax.run import report as run_report
from mecefo_jax.run.resume import initial_state
from mecefo_jax.snapshot.host import choose
from mecefo_jax.records.run_state import RunState, write_run_state
from mecefo_jax.run.parts import StartMode
from mecefo_jax import sections
from mecefo_jax.core.decider import DeciderMeta
from mecefo_jax.records.snapshot_meta import SnapshotMeta
from procs import TINY, error_lines, report, suite_store

L3, L2, L4 = (0, 1, 2), (0, 1), (0, 1, 2, 3)


# ---- which snapshot a restart resumes from -------------------------------------------------
# Each case: what every process of the restarted job holds ({step: layout}, by process id),
# their logical hosts, the durable checkpoints, and the snapshot to take ((step, layout), or a
# durable checkpoint (step, None)).
SWEEP = {
    'death just before a snapshot: the dead host never wrote step 12, the others did':
        ([{11: L3, 12: L3}, {11: L3, 12: L3}], (0, 1), [], (12, L3)),
    'death just after a snapshot: all wrote 12, the dead host\'s memory is gone':
        ([{11: L3, 12: L3}, {11: L3, 12: L3}], (0, 1), [], (12, L3)),
    'a rejoin before the survivors\' first step: nothing new was written':
        ([{11: L3, 12: L3}, {11: L3, 12: L3}, {11: L3, 12: L3}], L3, [], (12, L3)),
    'a rejoin after the survivors trained: their layout, never the old hosts\' older one':
        ([{13: L2, 14: L2}, {13: L2, 14: L2}, {11: L3, 12: L3}], L3, [], (14, L2)),
    'a rejoin whose replacement holds an older timeline\'s newer step':
        ([{13: L2, 14: L2}, {13: L2, 14: L2}, {15: L3}], L3, [], (14, L2)),
    'two deaths in a row: host 3, then host 1 after writing 22':
        ([{21: L3, 22: L3}, {21: L3, 22: L3}], (0, 2), [20], (22, L3)),
    'a SIGINT during a restart: the inventory is as the restart found it':
        ([{13: L2, 14: L2}, {13: L2, 14: L2}], (0, 1), [10], (14, L2)),
    'more than one part lost: the durable checkpoint':
        ([{12: L3}, {}], (0, 1), [10], (10, None)),
    'the durable checkpoint newer than any usable snapshot':
        ([{12: L3}, {12: L3}], (0, 1), [15], (15, None)),
    'a tie: the in-memory snapshot (no bucket read)':
        ([{12: L3}, {12: L3}], (0, 1), [12], (12, L3)),
    'every host replaced, no durable tier: nothing':
        ([{}, {}, {}], L3, [], None),
}


@pytest.mark.parametrize('held, slots, durable, expected', SWEEP.values(), ids=list(SWEEP))
def test_the_snapshot_a_restart_takes_over_a_sweep_of_timings(held, slots, durable, expected):
  assert choose(held, slots, durable) == expected


class Inventory:
  """Made-up per-host snapshots with HostSnapshots' restore_latest: what initial_state reads."""

  def __init__(self, held, slots, durable, cfg):
    self.held, self.slots, self.durable, self.cfg = held, slots, durable, cfg
    self.per_block = []  # snapshots of the per-block layout passed over: none here
    self.set_aside = []  # snapshots that failed their checks, set aside: none here

  def restore_latest(self, target, at_most=None):
    assert at_most is None  # a resume of a run that did not diverge
    choice = choose(self.held, self.slots, self.durable)
    if choice is None:
      return None
    step, layout = choice
    state = jax.tree.map(lambda t: jax.device_put(np.full(t.shape, step, t.dtype), t.sharding),
                         target)
    events = [{'step': step, 'layout': layout}]
    meta = sections.to_json(SnapshotMeta(DeciderMeta([], events, {}, {}), [], step, []))
    return step, state, meta, f'snapshot {step} of {layout or "the durable tier"}'


@pytest.fixture(scope='module')
def tiny(devices):
  cfg = load_config(None, [*TINY, 'mesh.slice=2'])
  return cfg, presence.find(cfg, Path('/nonexistent'), resume=False)


@pytest.mark.parametrize('held, slots, durable, expected', SWEEP.values(), ids=list(SWEEP))
def test_initial_state_resumes_the_chosen_snapshot_and_counts_the_steps_lost(
    tiny, tmp_path, held, slots, durable, expected):
  cfg, present = tiny
  # What the previous job had trained (.reached, rewritten at every step): one step beyond
  # the newest snapshot anywhere, thrown away.
  reached = max([s for h in held for s in h] + durable, default=0) + 1
  rundir.Reached(tmp_path).write(reached)
  inventory = Inventory(held, slots, durable, cfg)
  if expected is None:  # an explicit --resume refuses; an automatic one starts anew
    with pytest.raises(ConfigError, match='no usable snapshot or checkpoint.*nothing was started'):
      initial_state(cfg, present, inventory, tmp_path, resume=True, explicit=True)
    start = initial_state(cfg, present, inventory, tmp_path, resume=True)
    assert (start.step, start.meta, start.steps_lost) == (0, None, None)
    return
  start = initial_state(cfg, present, inventory, tmp_path, resume=True, explicit=True)
  step = expected[0]
  assert (start.step, start.reached, start.steps_lost) == (step, reached, reached - step)
  assert start.meta.controller.events == sections.to_json([{'step': step, 'layout': expected[1]}])
  assert int(np.asarray(jax.tree.leaves(start.state)[0]).ravel()[0]) == step


# ---- the hints, run as printed --------------------------------------------------------------

def _printed(pattern: str, text: str) -> list[str]:
  """The argv of the last `python train.py ...` command after `pattern` in `text`."""
  command = re.findall(pattern + r' `(python train\.py [^`]*)`', text)[-1]
  return shlex.split(command)[2:]


def test_a_stop_saves_its_step_and_the_printed_hints_resume_and_replay_it(
    devices, tmp_path, caplog, capsys, monkeypatch):
  """--stop-after (a stop request like SIGTERM's): the stop step in both tiers, the resume hint
  run exactly as printed continues it with the run's own config (train.steps=12, not the
  default) and its own copy of the trace (the given file is gone by then), the records count
  no lost step, and failures.txt's replay line reproduces it in a directory of its own. The
  last trained step (5, not a logged one) ends metrics.jsonl and the stop's summary line, not
  the last logged step (4); its rows, lost after the snapshot, are written by the resume."""
  monkeypatch.setenv('XLA_FLAGS', '')  # a resume re-simulates the run's devices there
  monkeypatch.chdir(tmp_path)  # the printed commands run from here
  (tmp_path / 'trace.txt').write_text('3 1 fail\n7 1 repair\n')
  caplog.set_level(logging.INFO, 'mecefo')
  code = cli.main(['--out', 'run', *TINY, 'mesh.slice=2', 'train.steps=12', 'train.log_every=4',
                   '--failures', 'trace:trace.txt', f'snapshot.dir={tmp_path}/shm',
                   'train.compile_cache=', '--stop-after', '6'])
  assert code == STOPPED
  message = next(m for m in caplog.messages if m.startswith('stopped by --stop-after 6 after '
                                                            '6 steps, saved as the in-memory'))
  rows = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').open()]
  last = [r for r in rows if r['kind'] == 'train'][-1]
  assert last['step'] == 5 and report(tmp_path / 'run')['final_loss'] == last['loss']
  assert any(f"-> {last['loss']:.4f}, eval" in m for m in caplog.messages)  # the summary
  assert f'{tmp_path}/shm/' in message and 'checkpoints' in message, message
  (tmp_path / 'trace.txt').unlink()  # a cleaned /tmp, a run copied to another machine
  assert (tmp_path / 'run' / rundir.TRACE).read_text() == '3 1 fail\n7 1 repair\n'
  # A crash between the stop's snapshot and its rows (the soak saw one): the rows of step 5
  # are gone from metrics.jsonl, and the resume writes them back from the snapshot's meta.
  metrics = tmp_path / 'run' / 'metrics.jsonl'
  metrics.write_text(''.join(f'{json.dumps(r)}\n' for r in rows if r['step'] != 5))
  assert cli.main(_printed('resume with', message)) == 0
  rows = [json.loads(line) for line in metrics.open()]
  assert [r['step'] for r in rows if r['kind'] == 'train'] == [0, 4, 5, 8, 11]
  assert [{**r, 'time': 0} for r in rows if r['step'] == 5] == [{**last, 'time': 0}]
  result = report(tmp_path / 'run')
  assert (result['steps'], result['resumed_from_step'], result['steps_lost'],
          result['steps_lost_total']) == (12, 6, 0, 0)
  # Restored, not initialized; its first step (6: not a logged one) still stops the clock.
  startup = result['startup']
  assert startup['init_lower_s'] is None and startup['init_run_s'] is None
  assert startup['first_step_s'] > startup['restore_s'] + startup['first_programs_s'] > 0
  lines = history.read(tmp_path / 'run')
  assert [line.kind for line in lines if line.kind is not Kind.FAILURE] == [
      Kind.START, Kind.STOP, Kind.END, Kind.START, Kind.END]
  assert [line.event['kind'] for line in lines if line.kind is Kind.FAILURE] == ['fail', 'repair']
  trace = (tmp_path / 'run' / 'failures.txt').read_text()
  assert cli.main(_printed('# replay:', trace)) == 0
  replay = report(tmp_path / 'run' / 'replay')  # a run directory of its own, inside the run's
  assert replay['params_sha256'] == result['params_sha256']
  assert replay['samples'] == result['samples'] and replay['steps'] == 12
  assert not (tmp_path / 'runs').exists() and report(tmp_path / 'run') == result
  capsys.readouterr()
  assert cli.main(_printed('# replay:', trace)) == BAD_INPUT  # again: the replay is not replaced
  [line] = error_lines(capsys.readouterr().err)
  assert "run directory 'run/replay' holds another run (finished)" in line, line


def test_an_explicit_resume_with_nothing_usable_is_one_line_and_starts_nothing(tmp_path, capsys):
  out = tmp_path / 'run'
  assert cli.main(['--out', str(out), '--resume', 'train.compile_cache=']) == BAD_INPUT
  [line] = error_lines(capsys.readouterr().err)
  assert 'no run in' in line and 'to resume' in line, line
  out.mkdir(exist_ok=True)
  write_run_state(out, RunState('stopped', run_id='abc', n_slices=1, n_hosts=1,
                         config=to_dict(load_config(None, TINY))))
  (out / rundir.METRICS_FILE).write_text('{"kind": "train", "step": 3}\n')
  files = lambda: sorted(p.name for p in out.iterdir() if not p.name.startswith('.'))
  before = files()
  code = cli.main(['--out', str(out), '--resume', f'snapshot.dir={tmp_path}/empty',
                   'train.compile_cache='])
  [line] = error_lines(capsys.readouterr().err)
  assert code == BAD_INPUT and 'no usable snapshot or checkpoint' in line, line
  assert '(none was saved)' in line, line  # not 'none intact': none is damaged
  fresh = re.search(r'`(python train\.py [^`]*)`', line).group(1)
  assert fresh == hints.fresh(out).split('`')[1]
  assert files() == before  # no history line, no checkpoint folder, nothing removed
  assert (out / rundir.METRICS_FILE).read_text() == '{"kind": "train", "step": 3}\n'


def test_one_process_never_resumes_a_supervised_run_from_scratch(tmp_path, capsys, monkeypatch):
  """Case 3: the hosts' snapshot parts are one job's; one process says how to resume it."""
  write_run_state(tmp_path, RunState('stopped', run_id='abc', n_slices=4, n_hosts=2))
  monkeypatch.delenv(LAUNCH_ENV, raising=False)
  assert cli.main(['--out', str(tmp_path), '--resume', 'train.compile_cache=']) == BAD_INPUT
  [line] = error_lines(capsys.readouterr().err)
  assert 'was trained by 2 processes' in line and 'python -m mecefo_jax.launch -n 2' in line
  monkeypatch.setenv(LAUNCH_ENV, '-n 2 -- --out run --fresh --stop-after 9 train.steps=30')
  assert hints.resume(tmp_path, 2) == ('`python -m mecefo_jax.launch -n 2 -- --out run '
                                       'train.steps=30`')


def test_the_loop_runs_its_hooks_in_their_declared_order_a_users_hook_before_the_stop(
    tmp_path, monkeypatch):
  from mecefo_jax.run import trainer as trainer_mod
  from mecefo_jax.run.hooks import Every, Hook
  cfg = load_config(None, [*TINY, 'mesh.slice=2', 'train.steps=3', f'snapshot.dir={tmp_path}/m',
                           'train.eval_every=1'])

  class Dummy(Hook):  # a new hook: one object passed to Trainer, nothing else edited
    def __init__(self):
      self.seen = []

    def wants_values(self, step):
      return True

    def after_step(self, record):
      self.seen.append((record.step, record.live, round(record.values['loss'], 6),
                        [row.kind for row in record.rows]))
      assert record.step_s > 0 and all(how in ('compiled', 'loaded', 'moved')
                                       for _, how in record.built)

  dummy, every = Dummy(), []
  run = trainer_mod.Trainer(cfg, tmp_path / 'run', progress='quiet',
                            start=StartMode(program_store=suite_store()),
                            hooks=[dummy, Every(2, lambda r: every.append(r.steps_done))])
  calls = []
  for hook in run.hooks:
    monkeypatch.setattr(hook, 'after_step', lambda record, _h=hook, _f=hook.after_step:
                        calls.append(type(_h).__name__) or _f(record))
  try:
    result = run.run()
  finally:
    run.close()
  order = ['ProgressMark', 'Divergence', 'Evals', '_RowMaker', 'SnapshotSaver', 'MetricRows',
           'Dummy', 'Every', 'Stop']
  assert calls == order * 3 and result['steps'] == 3
  assert [e['step'] for e in result['evals']] == [0, 1, 2]  # an eval is in the next snapshot's meta
  losses = dict(result['losses'])
  assert [s for s, *_ in dummy.seen] == [0, 1, 2] and every == [2]
  assert all(live == (0, 1) and kinds == ['train', 'eval'] and loss == round(losses[s], 6)
             for s, live, loss, kinds in dummy.seen if s in losses)


def test_only_process_0_writes_the_run_records(tmp_path):
  from mecefo_jax.run.records import RunRecords
  event = {'step': 3, 'slice': 1, 'kind': 'fail', 'source': 'trace:t'}
  for enabled in (False, True):
    records = RunRecords(tmp_path, enabled)
    records.open_reached()
    records.reached(4)
    records.events([event])
    records.history(Kind.STOP, step=4)
    records.close_reached()
  assert rundir.read_reached(tmp_path) == 4
  assert [line.kind for line in history.read(tmp_path)] == [Kind.FAILURE, Kind.STOP]
  assert (tmp_path / 'failures.txt').read_text().splitlines()[1:] == ['3 1 fail  # trace:t']
