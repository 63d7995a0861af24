"""The slowest-tests table (benchmarks/suite_table.py) from pytest's --junitxml and the lines
tests/costs.py writes: each test's seconds, CPU seconds, processes and compiles."""
import json

from benchmarks import suite_table
import order
import costs

JUNIT = """<?xml version="1.0"?><testsuites><testsuite name="pytest" time="12.5">
<testcase classname="tests.test_a" name="test_slow" time="9.0"/>
<testcase classname="tests.test_a" name="test_fast" time="0.5"/>
<testcase classname="tests.test_b" name="test_mid[x]" time="3.0"/>
</testsuite></testsuites>"""


def test_a_line_a_test_then_the_table_with_its_cpu_seconds(tmp_path, monkeypatch):
  path = tmp_path / 'costs.jsonl'
  monkeypatch.setenv(costs.COSTS_ENV, str(path))
  since = costs.mark()
  sum(i * i for i in range(300_000))  # some CPU in this process
  costs.write('tests/test_a.py::test_slow', since)
  [line] = [json.loads(x) for x in path.read_text().splitlines()]
  assert line['test'] == 'tests/test_a.py::test_slow' and line['processes'] == 0
  assert 0 < line['cpu_s'] and 0 < line['wall_s']
  (tmp_path / 'suite.xml').write_text(JUNIT)
  times, wall_s = suite_table.durations(tmp_path / 'suite.xml')
  result = suite_table.table(times, wall_s, suite_table.costs(path), top=2)
  assert [r['test'] for r in result['slowest']] == ['tests/test_a.py::test_slow',
                                                    'tests/test_b.py::test_mid[x]']
  assert result['slowest'][0]['cpu_s'] == line['cpu_s'] and result['slowest'][1]['cpu_s'] is None
  assert result['cpu_s_total'] == (round(line['cpu_s'], 1) or None)  # (None: none recorded)
  assert result['files'][0] == {'file': 'tests/test_a.py', 's': 9.5}
  text = suite_table.markdown(result)
  assert f"| 1 | `tests/test_a.py::test_slow` | 9 | {line['cpu_s']:.1f} | 0 |" in text


def test_the_suite_hands_out_the_heaviest_files_first_and_unknown_ones_before_them(tmp_path):
  (tmp_path / 'suite.xml').write_text(JUNIT)
  path = tmp_path / 'order.json'
  suite_table.main(['--junit', str(tmp_path / 'suite.xml'), '--order', str(path),
                    '--source', 'a run'])
  seconds = order.file_seconds(path)
  assert seconds == {'tests/test_a.py': 9.5, 'tests/test_b.py': 3.0}
  files = ['tests/test_b.py', 'tests/test_new.py', 'tests/test_a.py', 'tests/test_newer.py']
  assert order.heaviest_first(files, seconds) == [
      'tests/test_new.py', 'tests/test_newer.py', 'tests/test_a.py', 'tests/test_b.py']
  assert order.heaviest_first(files, {}) == files and order.file_seconds(tmp_path / 'no') == {}
  assert order.name(order.ROOT / 'tests' / 'test_a.py') == 'tests/test_a.py'


def test_this_collection_runs_in_the_committed_order(request):
  """conftest.py put the collected files in tests/file_order.json's order; that table names no
  file that is gone (a file renamed since would go first, as a new one does, at any weight)."""
  seconds = order.file_seconds()
  collected = list(dict.fromkeys(order.name(item.path) for item in request.session.items))
  assert collected == order.heaviest_first(collected, seconds)
  gone = set(seconds) - {order.name(p) for p in order.ROOT.glob('tests/test_*.py')}
  assert not gone, (f'tests/file_order.json names {sorted(gone)}: write it again with '
                    'python -m benchmarks.suite_table --order (docs/development.md)')


def test_the_schedule_replay_hands_out_files_as_xdist_does():
  """xdist gives a worker its next file once <= 2 of its tests are left: the file of three slow
  tests, handed out last, runs after its worker's other files (35 s); first, 30 s."""
  from benchmarks import suite_schedule
  tests = {'a': [1.0] * 5, 'c': [1.0] * 5, 'd': [1.0] * 5, 'b': [10.0] * 3}
  assert suite_schedule.replay(tests, ['a', 'c', 'd', 'b'], 2) == [10.0, 35.0]
  assert suite_schedule.replay(tests, ['b', 'a', 'c', 'd'], 2) == [30.0, 15.0]
  times = {f'tests/{f}.py::t{i}': s for f, ss in tests.items() for i, s in enumerate(ss)}
  ends = suite_schedule.compare(times, 2, {'tests/a.py': 1.0})  # b, c, d unknown: first
  assert ends['xdist: most tests first'] == [10.0, 35.0]
  assert ends["heaviest first: this run's seconds"] == [30.0, 15.0]
  assert ends['heaviest first: tests/file_order.json'] == [30.0, 15.0]
