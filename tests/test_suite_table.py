"""The slowest-tests table (benchmarks/suite_table.py) from pytest's --junitxml and the lines
tests/costs.py writes: each test's seconds, CPU seconds, processes and compiles."""
import json

from benchmarks import suite_table
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
