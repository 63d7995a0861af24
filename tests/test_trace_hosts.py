"""The fault-log replay's fleets and charges: slices of K hosts, hot spares, one set of charges for
every process restart, the sensitivity's flips, and bad logs refused in one line."""
import json
import types

import pytest

from benchmarks import trace_scenarios
from mecefo_jax.config import ConfigError
from mecefo_jax.core import fault_log
from mecefo_jax.plan import measured
from mecefo_jax.plan import runs as trace_runs
from mecefo_jax.plan.fleet import Fleet, slice_events

DAY = fault_log.DAY_S
GPU = {'Level': 'Hardware Failure', 'Class': 'GPU', 'Desc': 'xid'}


def ev(node, day, kind):
  return {'node_id': node, 'event_time': day, 'event_type': f'fault_{kind}', 'fault_type': GPU}


def faults(*events):
  return fault_log.parse(json.dumps(sorted(events, key=lambda e: e['event_time'])), 'log')


def spans(events, n):
  """Each slice's [fail, repair) in days (None: no repair in the window)."""
  out = {s: [] for s in range(n)}
  for e in events:
    if e.kind == 'fail':
      out[e.slice].append([e.time_s / DAY, None])
    else:
      out[e.slice][-1][1] = e.time_s / DAY
  return {s: [tuple(x) for x in v] for s, v in out.items()}


def drawn(log, fleet, nodes, want):
  """The first seed whose draw puts the hosts as `want(members, spares)` asks."""
  for seed in range(64):
    events, members = slice_events(log, fleet, nodes, 'all', (0.0, 20.0), seed, 'log')
    spares = fault_log.draw_nodes(sorted({f.node for f in log}), fleet.servers, nodes, seed,
                                  'log')[:fleet.spares]
    if want(members, spares):
      return events, members
  raise AssertionError('no seed draws the hosts as asked')


def test_a_slice_is_down_while_any_of_its_hosts_is_its_overlaps_once():
  log = faults(ev('a', 1, 'start'), ev('a', 3, 'end'), ev('b', 2, 'start'), ev('b', 5, 'end'),
               ev('c', 10, 'start'), ev('c', 11, 'end'))
  fleet = Fleet.of(4, 2)
  assert (fleet.slices, fleet.hosts, fleet.servers) == (2, 2, 4)
  events, members = drawn(log, fleet, 4, lambda m, _: {'a', 'b'} == set(m[0]))
  assert spans(events, 2) == {0: [(1.0, 5.0)], 1: [(10.0, 11.0)]}  # c with the never-failing node
  # One host a slice: the events fault_log.slice_events gives, the same draw.
  one = slice_events(log, Fleet.of(4, 1), 4, 'all', (0.0, 20.0), 7, 'log')[0]
  assert one == fault_log.slice_events(json.dumps([ev('a', 1, 'start'), ev('a', 3, 'end'),
                                                   ev('b', 2, 'start'), ev('b', 5, 'end'),
                                                   ev('c', 10, 'start'), ev('c', 11, 'end')]),
                                       'log', 4, fault_log.LogMapping(4, seed=7), 20.0)


def test_a_hot_spare_joins_after_the_swap_and_the_repaired_host_becomes_the_spare():
  # a (in the slice) fails at day 1 for 4 days; the spare b joins at day 1.5. b fails at day 6:
  # the repaired a, now the spare, joins at 6.5.
  log = faults(ev('a', 1, 'start'), ev('a', 5, 'end'), ev('b', 6, 'start'), ev('b', 9, 'end'))
  fleet = Fleet.of(2, 1, spares=1, swap_days=0.5)
  events, _ = drawn(log, fleet, 2, lambda m, sp: m == [['a']] and sp == ['b'])
  assert spans(events, 1) == {0: [(1.0, 1.5), (6.0, 6.5)]}
  # The host back before its spare joins: the swap is called off, the slice is back then.
  log = faults(ev('a', 1, 'start'), ev('a', 1.25, 'end'))
  events, _ = drawn(log, fleet, 2, lambda m, sp: m == [['a']])
  assert spans(events, 1) == {0: [(1.0, 1.25)]}


def test_a_spare_that_fails_on_its_way_leaves_the_slice_waiting_for_the_next():
  # a fails at 1; spare b is on its way (ready at 2) but fails at 1.5; c is down until 3,
  # then spare, so it joins at 4.
  log = faults(ev('a', 1, 'start'), ev('a', 10, 'end'), ev('b', 1.5, 'start'), ev('b', 12, 'end'),
               ev('c', 0.5, 'start'), ev('c', 3, 'end'))
  fleet = Fleet.of(3, 1, spares=2, swap_days=1.0)
  events, _ = drawn(log, fleet, 3, lambda m, sp: m == [['a']] and sp == ['b', 'c'])
  assert spans(events, 1) == {0: [(1.0, 4.0)]}


def test_a_fleet_that_does_not_divide_into_slices_is_refused():
  with pytest.raises(ConfigError, match='400 servers less 4 spares do not make slices of 8 hosts'):
    Fleet.of(400, 8, 4)
  assert Fleet.of(400, 8, 8).slices == 49


def test_every_process_restart_is_charged_the_same_and_the_peers_what_if_neither():
  s = types.SimpleNamespace(snapshots={'every': 20, 'tax_pct': 1.03})
  for name in ('spread', 'budget:1.0', 'exact', 'elastic-restart'):
    assert trace_runs.charges(s, name) == (1.03, 10.5)  # the step in flight, half an interval
  assert trace_runs.charges(s, 'elastic-restart+peers') == trace_runs.charges(
      s, 'spread+peers') == (0.0, 1.0)
  assert trace_runs.spec_of('elastic-restart+peers') == 'drop' == trace_runs.spec_of(
      'elastic-restart')


def test_the_snapshot_tax_is_the_measured_cost_of_one_snapshot_over_the_interval():
  m = json.loads(open(measured.source('snapshot_tax')).read())
  args = lambda every, tax: types.SimpleNamespace(snapshot_every=every, snapshot_overhead_pct=tax)
  auto = trace_runs.snapshot_charges(args(0, None))
  assert auto['every'] == m['auto_every']
  assert auto['tax_pct'] == pytest.approx(100 * m['auto_cost_s'] / (m['auto_every']
                                                                     * m['auto_idle_step_s']))
  assert trace_runs.snapshot_charges(args(m['auto_every'] // 2, None))['tax_pct'] == pytest.approx(
      2 * auto['tax_pct'])
  assert trace_runs.snapshot_charges(args(0, 0.5))['tax_pct'] == 0.5


def test_the_sensitivity_taxes_process_restarts_only_and_names_where_two_change_places():
  mean = lambda samples: {'samples_pct': samples}
  every = {'spread': {15.0: mean(91.0), 660.0: mean(89.0)},
           'checkpoint-restart-32-spares': {15.0: mean(90.5), 660.0: mean(89.5)}}
  out = trace_scenarios.sensitivity(every, list(every), [15.0, 660.0, 1200.0], list(every))
  assert out['restart_s'] == [15.0, 660.0] and out['tax_pct'] == [0.0, 0.5, 1.0, 2.0]
  assert out['goodput_pct']['spread'][2] == pytest.approx([91.0 * 0.99, 89.0 * 0.99])
  assert out['goodput_pct']['checkpoint-restart-32-spares'][3] == [90.5, 89.5]
  assert out['winner'][0] == ['spread', 'checkpoint-restart-32-spares']
  assert out['winner'][1][0] == 'spread'  # 91 x 0.995 > 90.5
  assert out['winner'][2] == ['checkpoint-restart-32-spares'] * 2  # 91 x 0.99 < 90.5
  assert out['flips'] == ['spread ahead of checkpoint-restart-32-spares only at tax 0%: R = 15 s; '
                          'tax 0.5%: R = 15 s']


@pytest.mark.parametrize('log, says', [
    ('[]', 'the fault log has no events'),
    ('node,day\na,1\n', "log.json:1: the header must be node,start,end, got 'node,day'"),
    (json.dumps([ev('a', 5, 'start')]), 'the window 5:5 (days) holds no time; the log has 1 events'),
])
def test_the_replay_refuses_a_bad_log_in_one_line(tmp_path, log, says):
  from benchmarks import trace_goodput
  path = tmp_path / 'log.json'
  path.write_text(log)
  with pytest.raises(SystemExit) as err:
    trace_goodput.main(['--trace', str(path), '--days', '5:'])
  assert str(err.value).startswith(f'error: {path}') and says in str(err.value)
  assert '\n' not in str(err.value)


def test_the_replay_has_help(capsys):
  from benchmarks import trace_goodput
  with pytest.raises(SystemExit) as err:
    trace_goodput.main(['--help'])
  assert err.value.code == 0 and '--slice-hosts' in capsys.readouterr().out
