"""Node fault logs as failure events: parsing, pairing, untidy and bad logs, nodes and time mapped."""
import json
import logging
import math
import re
from pathlib import Path

import pytest

from mecefo_jax.config import ConfigError, load_config
from mecefo_jax.core import fault_log
from mecefo_jax.core.failures import FailureSchedule
from mecefo_jax.core.fault_log import LogMapping

LOG = Path(__file__).resolve().parents[1] / 'benchmarks' / 'traces' / 'infinitehbd_days0-174.5.json'
GPU = {'Level': 'Hardware Failure', 'Class': 'GPU', 'Desc': 'xid'}
NIC = {'Level': 'Hardware Failure', 'Class': 'NIC', 'Desc': 'down'}
STRESS = {'Level': 'Other Failure', 'Class': 'Stress Test Failure', 'Desc': 'burn-in'}


def ev(node, day, kind, fault=GPU):
  return {'node_id': node, 'event_time': day, 'event_type': f'fault_{kind}', 'fault_type': fault}


def text(*events) -> str:
  return json.dumps(list(events))


def down(*events):
  return fault_log.down_intervals(fault_log.parse(text(*events), 'log'), 'log')


def test_a_node_is_down_while_any_of_its_faults_is_open():
  assert down(ev('a', 1, 'start'), ev('a', 2, 'start', NIC), ev('a', 3, 'end'),
              ev('a', 4, 'end', NIC), ev('b', 5, 'start')) == {'a': [(1, 4)], 'b': [(5, math.inf)]}
  # An end and a start at one time keep the node down; apart, they are two outages.
  assert down(ev('a', 1, 'start'), ev('a', 2, 'end'), ev('a', 2, 'start', NIC),
              ev('a', 3, 'end', NIC), ev('a', 4, 'start'), ev('a', 5, 'end')) == {
                  'a': [(1, 3), (4, 5)]}


def test_untidy_events_are_read_with_a_warning_naming_each(caplog):
  with caplog.at_level(logging.WARNING, logger='mecefo'):
    got = down(ev('a', 1, 'end'), ev('a', 2, 'start'), ev('a', 3, 'start'), ev('a', 4, 'end'),
               ev('a', 5, 'end'))
  # The orphan end on the log's first day: down from day 1 to day 1, no time: dropped.
  assert got == {'a': [(2, 4)]}
  assert [m.split(':')[1] for m in caplog.messages] == [
      ' event 0 (node a, day 1, GPU)', ' event 2 (node a, day 3, GPU)',
      ' event 4 (node a, day 5, GPU)', ' 1 fault(s) end when they start (zero length)']
  assert 'no fault_start before it' in caplog.messages[0]
  assert 'already open since day 2' in caplog.messages[1]
  assert 'ended already: ignored' in caplog.messages[2]


@pytest.mark.parametrize('log, says', [
    ('[{"node_id": "a",', 'not a JSON fault log: Expecting'),
    ('{"events": []}', 'a fault log is a JSON list of events, got a dict'),
    (text(ev('a', 1, 'start'), ev('', 2, 'end')), 'event 1: node_id must be a non-empty string'),
    (text(ev('a', 1, 'start'), ev('a', -2, 'end')), 'event 1: event_time must be a number'),
    (text(ev('a', 1, 'start'), ev('a', '2', 'end')), 'event 1: event_time must be a number'),
    (text(ev('a', 1, 'begin')), 'event 0: event_type must be fault_start or fault_end'),
    (text({**ev('a', 1, 'start'), 'fault_type': {'Class': 'GPU'}}), 'event 0: fault_type must'),
    ('', 'the fault log is empty'),
    (' \n', 'the fault log is empty'),
    ('[]', 'the fault log has no events'),
    ('{}', 'a fault log is a JSON list of events, got a dict'),
    ('node_id,event_time,event_type\na,1,fault_start\n', 'not a JSON fault log: Expecting value'),
    (text(ev('a', 1, 'start'), {**ev('a', 2, 'end'), 'host': 'h1', 'Time': 2}),
     "event 1: unknown field(s) 'host', 'Time' (an event has node_id, event_time, event_type, "
     'fault_type); got {'),
])
def test_a_bad_log_is_refused_in_one_line_naming_the_event(tmp_path, log, says):
  path = tmp_path / 'faults.json'  # a *.json file is a node log, whatever its text
  path.write_text(log)
  with pytest.raises(ConfigError) as err:
    FailureSchedule.from_trace(path, 4)
  assert str(err.value).startswith(f'{path}: ') and says in str(err.value)
  assert '\n' not in str(err.value)


def test_a_csv_log_not_named_json_is_read_as_step_lines_and_refused_on_line_1(tmp_path):
  path = tmp_path / 'faults.csv'
  path.write_text('node_id,event_time,event_type\na,1,fault_start\n')
  with pytest.raises(ConfigError) as err:
    FailureSchedule.from_trace(path, 4)
  assert str(err.value) == (f"{path}:1: expected 'step slice fail|repair', got "
                            "'node_id,event_time,event_type'")


def test_an_empty_step_trace_warns_that_the_run_has_no_failures(tmp_path, caplog):
  path = tmp_path / 'trace.txt'
  path.write_text('# nothing yet\n')
  with caplog.at_level(logging.WARNING, logger='mecefo'):
    assert FailureSchedule.from_trace(path, 4).all_events() == []
  assert caplog.messages == [f'failure trace {path} holds no events: the run has no failures']


def test_an_unsorted_log_is_sorted_with_one_warning_counting_the_events_out_of_order(caplog):
  tidy = [ev('a', 1, 'start'), ev('b', 1.5, 'start'), ev('a', 2, 'end'), ev('a', 2, 'start', NIC),
          ev('b', 3, 'end'), ev('a', 4, 'end', NIC)]
  # b's end (day 3) moved to the front and b's start after a's day-2 pair: 4 events come after
  # a later one; the two at day 2 keep their file order (an end, then a start: a stays down).
  shuffled = [tidy[4], tidy[0], tidy[2], tidy[3], tidy[1], tidy[5]]
  with caplog.at_level(logging.WARNING, logger='mecefo'):
    faults = fault_log.parse(text(*shuffled), 'log')
  assert caplog.messages == ['log: 4 event(s) out of time order (the first: event 1, node a, '
                             'day 1, after day 3): sorted by event_time']
  assert [(f.index, f.day) for f in faults] == [(1, 1), (4, 1.5), (2, 2), (3, 2), (0, 3), (5, 4)]
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger='mecefo'):
    assert down(*shuffled) == down(*tidy) == {'a': [(1, 4)], 'b': [(1.5, 3)]}
  assert len(caplog.messages) == 1  # the shuffled log's: a sorted one warns nothing


def test_a_zero_length_fault_never_fails_its_slice_the_other_nodes_fail_and_are_repaired(
    tmp_path, caplog):
  """Node z's only fault ends when it starts: its slice is live at every step, with no event
  (not even a one-step outage); node a is down from day 1 to day 2. A step is an hour of log
  time (compress 60, 60 s steps): a fails at step 24 and is repaired at step 48."""
  path = tmp_path / 'faults.json'
  path.write_text(text(ev('z', 1, 'start'), ev('a', 1, 'start'), ev('z', 1, 'end'),
                       ev('a', 2, 'end')))
  mapping = LogMapping(compress=60.0)
  with caplog.at_level(logging.WARNING, logger='mecefo'):
    sched = FailureSchedule.from_trace(path, 2, log=mapping, cluster_step_s=60.0)
  assert any('1 fault(s) end when they start' in m for m in caplog.messages)
  z, a = sched.trace_nodes.index('z'), sched.trace_nodes.index('a')
  failed = list(sched.failed_sets(60))
  assert all(z not in f for f in failed)
  assert [a in f for f in failed] == [False] * 24 + [True] * 24 + [False] * 12
  assert [(e.step, e.slice, e.kind) for e in sched.all_events()] == [
      (24, a, 'fail'), (48, a, 'repair')]
  # from_timed builds the same schedule from the log's timed events: none for z's slice.
  played = fault_log.replay(path.read_text(), str(path), 2, mapping)
  assert played.nodes == sched.trace_nodes and {e.slice for e in played.events} == {a}
  timed = FailureSchedule.from_timed(played.events, 2, 60.0, 'trace:faults.json')
  assert timed.all_events() == sched.all_events()


def test_fault_classes_filter_and_an_unknown_class_is_refused():
  faults = fault_log.parse(text(ev('a', 1, 'start', STRESS), ev('b', 2, 'start'),
                                ev('c', 3, 'start', NIC)), 'log')
  nodes = lambda classes: [f.node for f in fault_log.counted(faults, classes, 'log')]
  assert nodes('all') == ['a', 'b', 'c']
  assert nodes('-Stress Test Failure') == ['b', 'c']
  assert nodes('GPU,NIC') == ['b', 'c'] and nodes('Hardware Failure,-NIC') == ['b']
  with pytest.raises(ConfigError, match=re.escape("fault class 'CPU' is in no event of the log")):
    nodes('-CPU')


def test_nodes_are_drawn_onto_slices_by_seed_and_time_maps_to_steps():
  log = text(ev('a', 1, 'start'), ev('b', 1.5, 'start'), ev('a', 2, 'end'))
  draws = {tuple(fault_log.draw_nodes(['a', 'b'], 4, 4, seed, 'log')) for seed in range(8)}
  assert len(draws) > 1 and all(sorted(d, key=str) == [None, None, 'a', 'b'] for d in draws)
  assert fault_log.draw_nodes(['a', 'b'], 4, 4, 3, 'log') == fault_log.draw_nodes(
      ['a', 'b'], 4, 4, 3, 'log')
  with pytest.raises(ConfigError, match='5 slices, but the cluster has 4 nodes'):
    fault_log.draw_nodes(['a', 'b'], 5, 4, 0, 'log')
  with pytest.raises(ConfigError, match='2 nodes fail in the log, more than the cluster size 1'):
    fault_log.draw_nodes(['a', 'b'], 1, 1, 0, 'log')
  # Two slices, the log's two nodes; a step is an hour of log time (compress 60, 60 s steps), the
  # window starts at day 1.25, when node a is down already: it fails at step 0.
  mapping = LogMapping(nodes=0, start_day=1.25, compress=60.0, seed=0)
  node_of = fault_log.draw_nodes(['a', 'b'], 2, 2, 0, 'log')
  a, b = node_of.index('a'), node_of.index('b')
  sched = FailureSchedule.from_trace(Path('log.json'), 2, log, log=mapping, cluster_step_s=60.0)
  assert [(e.step, e.slice, e.kind) for e in sched.all_events()] == sorted(
      [(0, a, 'fail'), (6, b, 'fail'), (18, a, 'repair')])


def test_a_run_maps_the_log_by_its_config(tmp_path):
  from mecefo_jax.run.run_files import RunFiles
  overrides = ['faults.trace_nodes=400', 'faults.trace_classes=-Stress Test Failure',
               'faults.trace_start_day=10', 'faults.trace_compress=1440', 'train.seed=3']
  cfg = load_config(None, [*overrides, f'faults.failures=trace:{LOG}'])
  assert LogMapping.of(cfg) == LogMapping(400, '-Stress Test Failure', 10.0, 1440.0, 3)
  files = RunFiles(cfg, tmp_path / 'run')
  try:
    files.check(resume=False, replace=False, replace_finished=False)
    sched = files.schedule(400, resume=False)
  finally:
    files.release(refused=True)
  # A log day is a step (60 s) from day 10 on: the faults open at day 10 fail at step 0.
  text, mapping = LOG.read_text(), LogMapping.of(cfg)
  expected = FailureSchedule.from_timed(
      fault_log.slice_events(text, str(LOG), 400, mapping), 400, 60.0, f'trace:{LOG.name}')
  assert sched.all_events() == expected.all_events() and sched.all_events()[0].step == 0
  assert sched.all_events() != FailureSchedule.from_trace(LOG, 400, log=LogMapping(
      400, seed=3), cluster_step_s=60.0).all_events()


def test_a_run_of_a_node_log_records_the_node_each_slice_replays(tmp_path):
  """report.json's trace_nodes_by_slice: the draw of fault_log.draw_nodes (a seed drawing one
  logged node and one that never fails), the log's faults after the run's steps."""
  from mecefo_jax.run import cli
  from procs import TINY, report
  log = tmp_path / 'faults.json'
  log.write_text(text(ev('a', 30, 'start'), ev('b', 31, 'start'), ev('b', 32, 'end')))
  draw = lambda seed: fault_log.draw_nodes(['a', 'b'], 2, 4, seed, 'log')
  seed = next(s for s in range(1, 50) if None in draw(s) and set(draw(s)) - {None})
  out = tmp_path / 'run'
  assert cli.main(['--out', str(out), '--failures', f'trace:{log}', *TINY, 'mesh.slice=2',
                   'train.steps=2', 'train.eval_every=0',
                   'train.compile_cache=', f'snapshot.dir={tmp_path}/shm',
                   'faults.trace_nodes=4', f'train.seed={seed}']) == 0
  assert report(out)['trace_nodes_by_slice'] == draw(seed)


def test_the_real_log_reads_clean():
  faults = fault_log.parse(LOG.read_text(), str(LOG))
  spans = fault_log.down_intervals(faults, str(LOG))
  # 14 faults end when they start: 11 nodes whose only faults they are never go down.
  assert len(faults) == 622 and len({f.node for f in faults}) == 159 and len(spans) == 148
  assert sum(math.isinf(s[-1][1]) for s in spans.values()) == 4  # open at the cut, day 174.5
  events = fault_log.slice_events(LOG.read_text(), str(LOG), 400, LogMapping(nodes=400), 174.5)
  down = set()
  for e in events:
    (down.add if e.kind == 'fail' else down.discard)(e.slice)
  assert len(down) == 4  # the slices down at the window's end: the 4 faults open at the cut
