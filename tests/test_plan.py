"""mecefo-plan: a user's fault log (JSON or CSV) read alike, bad logs refused in one line, the
rule that picks the setting, requeue in the replay, and the measured inputs it ships."""
import datetime
import json
import subprocess
import sys
import tomllib

import pytest

from mecefo_jax import config
from mecefo_jax.core import fault_log
from mecefo_jax.plan import cli, measured, node_log, recommend, restart_profiles
from procs import ROOT

GPU = {'Level': 'Hardware Failure', 'Class': 'GPU', 'Desc': 'xid'}
# node, start day, end day (None: still down at the log's end); two outages of `a` overlap.
OUTAGES = [('a', 0.0, 0.5), ('b', 0.25, 1.75), ('a', 0.375, 1.0), ('c', 1.5, None)]
EPOCH = datetime.datetime(2024, 3, 1, tzinfo=datetime.timezone.utc)


def json_log(outages=OUTAGES) -> str:
  """Each outage its own fault (Desc), as each CSV row is: overlapping ones of a node merge."""
  events = [{'node_id': n, 'event_time': t, 'event_type': kind,
             'fault_type': {**GPU, 'Desc': str(i)}}
            for i, (n, start, end) in enumerate(outages)
            for t, kind in ((start, 'fault_start'), (end, 'fault_end')) if t is not None]
  return json.dumps(sorted(events, key=lambda e: e['event_time']))


def csv_log(unit: str, outages=OUTAGES) -> str:
  as_unit = {'days': lambda d: f'{d:g}',
             's': lambda d: f'{EPOCH.timestamp() + d * fault_log.DAY_S:.0f}',
             'iso': lambda d: (EPOCH + datetime.timedelta(days=d)).isoformat()}[unit]
  rows = [f"{n},{as_unit(start)},{'' if end is None else as_unit(end)}"
          for n, start, end in outages]
  return '\n'.join(['node,start,end', *rows]) + '\n'


@pytest.mark.parametrize('unit', ['days', 's', 'iso'])
@pytest.mark.parametrize('given', [True, False])  # --time-unit UNIT, or detected
def test_a_csv_log_in_each_time_unit_gives_the_json_logs_faults(tmp_path, unit, given):
  (tmp_path / 'log.json').write_text(json_log())
  (tmp_path / 'log.csv').write_text(csv_log(unit))
  from_json = node_log.read(str(tmp_path / 'log.json'))
  from_csv = node_log.read(str(tmp_path / 'log.csv'), unit if given else 'auto')
  assert ([(f.node, f.day, f.start) for f in from_csv]
          == [(f.node, f.day, f.start) for f in from_json])
  down = fault_log.down_intervals(from_csv, 'log.csv')
  assert down == fault_log.down_intervals(from_json, 'log.json')
  assert down['a'] == [(0.0, 1.0)] and down['c'] == [(1.5, float('inf'))]


@pytest.mark.parametrize('text, says', [
    (None, 'log.csv: cannot read the fault log: No such file or directory'),
    ('', 'log.csv: the fault log is empty (expected a header node,start,end'),
    ('host,down,up\na,1,2\n', "log.csv:1: the header must be node,start,end, got 'host,down,up'"),
    ('node,start,end\n', 'log.csv: no outage after the header node,start,end'),
    ('node,start,end\na,1,2\nb,x,3\n', "log.csv:3: start 'x' is not a number of days >= 0"),
    ('node,start,end\na,2024-03-01,2024-03-02\nb,2024-03-01,soon\n',
     "log.csv:3: end 'soon' is not an ISO 8601 time"),
    ('node,start,end\na,1,2\nb,3,2.5\n', "log.csv:3: end '2.5' is before start '3'"),
    ('node,start,end\na,1,2\nb,3\n', 'log.csv:3: expected 3 fields node,start,end, got 2'),
    ('node,start,end\nsoon,later,never\n', "log.csv:2: start 'later' is neither a number"),
    ('[]', 'log.csv: the fault log has no events'),
])
def test_a_bad_log_is_one_line_naming_the_file_the_line_and_what_is_wrong(tmp_path, capsys,
                                                                          monkeypatch, text, says):
  monkeypatch.chdir(tmp_path)
  if text is not None:
    (tmp_path / 'log.csv').write_text(text)
  assert cli.main(['--trace', 'log.csv']) == 2
  err = capsys.readouterr().err
  assert err.startswith(f'error: {says}'), err
  assert err.count('\n') == 1 and 'Traceback' not in err


def test_a_json_log_holds_days():
  with pytest.raises(cli.ConfigError, match='a JSON node log holds days'):
    node_log.read(str(ROOT / 'benchmarks/traces/infinitehbd_days0-174.5.json'), 's')


D = {'d': 0.5, 'budget': 0.5, 'spread_r1': 1.0}


def row(loss: float, degraded: float = 0.0, dropped: float = 0.0) -> dict:
  return {'loss_equivalent_pct': loss, 'degraded_pct': degraded, 'dropped_pct': dropped}


def test_the_rule_takes_the_highest_allowed_and_a_tie_goes_to_no_degraded_then_no_dropped_rows():
  table = {'spread': row(95.0, degraded=3.0), 'budget:1.0': row(96.0, degraded=8.0),
           'exact': row(93.0), 'elastic-restart': row(94.0, dropped=3.0),
           'checkpoint-restart-32-spares': row(99.0)}
  pick = lambda v_low, spares=False: recommend.recommend(table, v_low, D, spares)['recommended']
  assert pick(0.6) == 'budget:1.0'  # above d: budget allowed; spread's 2d not reached
  assert pick(1.1) == 'budget:1.0'  # both allowed: the highest
  assert pick(0.4) == 'elastic-restart'  # v's low end below d: no takeover that degrades
  assert pick(0.6, spares=True) == 'checkpoint-restart-32-spares'  # pools only when offered
  out = recommend.recommend(table, 0.4, D, False)
  assert set(out['excluded']) == {'spread', 'budget:1.0', 'checkpoint-restart-32-spares'}
  table |= {'budget:1.0': row(94.15, degraded=8.0), 'requeue': row(94.0)}
  assert pick(0.6) == 'requeue'  # within 0.2 of the best: no degraded rows, then no dropped
  assert recommend.recommend(table, 0.6, D, False)['tied'] == ['budget:1.0', 'elastic-restart',
                                                               'requeue']
  table['requeue'] = row(93.7)  # 0.45 behind the best: out of the tie, elastic restart in it
  assert pick(0.6) == 'elastic-restart'
  assert recommend.threshold('budget:1.05', D) == 0.5 == D['d']
  assert recommend.threshold('neighbor', D) == recommend.threshold('spread', D) == 1.0


def _plan(tmp_path, *flags) -> dict:
  (tmp_path / 'log.json').write_text(json_log([('a', 0.1, 0.6), ('b', 0.3, 0.4), ('c', 1.2, 1.9),
                                               ('a', 1.5, None)]))
  argv = ['--trace', str(tmp_path / 'log.json'), '--nodes', '8', '--days', '0:2', *flags]
  return cli.plan(cli.parser().parse_args(argv), argv)


def test_requeue_trains_drops_plans_at_its_pace_and_drops_no_row(tmp_path):
  result = _plan(tmp_path)
  requeue, drop = result['approaches']['requeue'], result['approaches']['elastic-restart']
  assert drop['dropped_pct'] > 1.0 and requeue['dropped_pct'] == 0.0 == requeue['degraded_pct']
  for key in ('loss_equivalent_pct', 'loss_equivalent_r1_pct', 'samples_pct', 'goodput_pct'):
    assert requeue[key] == drop[key], key
  assert result['recommended'] == 'requeue'  # tied with elastic restart: it loses no sample


def test_the_plan_names_its_inputs_and_their_provenance(tmp_path):
  result = _plan(tmp_path, '--slice-hosts', '2', '--seeds', '2', '--restart-s', '60',
                 '--spares', '2,4', '--v', '0.9')
  i = result['inputs']
  assert (i['slices'], i['seeds'], i['restart']['total_s'], i['spares']) == (4, 2, 60.0, [2, 4])
  assert i['loss_model']['v_low'] == 0.9 and i['spares_offered']
  assert result['recommended'] in result['approaches']
  assert set(result['provenance']) == set(measured.SOURCES)
  assert all(p['source'].startswith('docs/results/') for p in result['provenance'].values())
  assert 'recommended: ' + result['recommended'] in cli.table(result)


def test_a_restart_given_by_phases_keeps_the_others_of_fast():
  fast = restart_profiles.fast(10.0)
  mine = restart_profiles.given(10.0, phases='detect_s=5, programs_s=40')
  assert mine.total_s == pytest.approx(fast.total_s + 5 - fast.detect_s + 30)
  basis = dict(mine.basis)
  assert basis['detect_s'] == 'given' and basis['process_start_s'] == 'measured'
  with pytest.raises(cli.ConfigError, match="restart phase 'boot_s=3'"):
    restart_profiles.given(10.0, phases='boot_s=3')


@pytest.mark.parametrize('name', list(measured.SOURCES))
def test_the_shipped_measurements_equal_the_docs_results_they_were_copied_from(name):
  """A docs/results file rerun, or the package data edited by hand, fails here until
  `python -m mecefo_jax.plan.measured` copies it again."""
  assert measured._read(name) == measured.copied(name, ROOT)


def test_mecefo_plan_is_an_installed_command_and_ships_its_data():
  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())
  module, function = project['project']['scripts']['mecefo-plan'].split(':')
  assert module == 'mecefo_jax.plan.cli' and callable(vars(cli)[function])
  assert 'plan/data/*.json' in project['tool']['setuptools']['package-data']['mecefo_jax']
  assert {p.stem for p in measured.DATA.glob('*.json')} == set(measured.SOURCES)


@pytest.mark.slow
def test_the_planner_imports_no_jax(tmp_path):
  (tmp_path / 'log.csv').write_text(csv_log('iso'))
  code = ('import sys; from mecefo_jax.plan import cli; '
          f"assert cli.main(['--trace', {str(tmp_path / 'log.csv')!r}, '--nodes', '4']) == 0; "
          "assert 'jax' not in sys.modules, 'jax imported'")
  done = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert 'recommended: requeue' in done.stdout


def test_the_default_takeover_is_the_rules_pick_on_the_shared_log():
  """config.py's default is what docs/failures.md's rule picks on the shared log at slices of 1
  and of 8 servers, as benchmarks.default_pick recorded it."""
  recorded = json.loads((ROOT / 'docs/results/default_pick_infinitehbd.json').read_text())
  assert set(recorded['recommended']) == {'1', '8'}
  for k, plan in recorded['fleets'].items():
    assert plan['recommended'] == recorded['recommended'][k]
    loss = plan['inputs']['loss_model']
    verdict = recommend.recommend(plan['approaches'], loss['v_low'], loss['thresholds'], False)
    assert verdict['recommended'] == plan['recommended']  # the rule of today's code
  assert set(recorded['recommended'].values()) == {config.FaultConfig().takeover}
