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
    (text(ev('a', 2, 'start'), ev('b', 1, 'start')),
     'event 1 (node b, day 1) comes before the one ahead of it (day 2): events must be sorted'),
])
def test_a_bad_log_is_refused_in_one_line_naming_the_event(tmp_path, log, says):
  path = tmp_path / 'faults.json'
  path.write_text(log)
  with pytest.raises(ConfigError) as err:
    FailureSchedule.from_trace(path, 4)
  assert str(err.value).startswith(f'{path}: ') and says in str(err.value)
  assert '\n' not in str(err.value)


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
