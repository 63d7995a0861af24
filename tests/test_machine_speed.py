"""benchmarks/machine_speed.py: a round's CPU seconds against the reference's, in one line."""
import pytest

from benchmarks import machine_speed


def test_a_round_is_timed_and_read_against_the_reference(devices):
  result = machine_speed.measure(2)
  rounds = result['rounds_cpu_s']
  assert len(rounds) == 2 and all(r > 0 for r in rounds)
  assert result['median_cpu_s'] == pytest.approx(sum(rounds) / 2)
  assert result['slowdown'] == round(result['median_cpu_s'] / machine_speed.REFERENCE_CPU_S, 2)
  line = machine_speed.line(result)
  assert line.startswith(f"machine speed: {result['median_cpu_s']:.2f} CPU s a round, "
                         f"{result['slowdown']:.2f}x the reference's "), line


def test_no_rounds_is_a_usage_error(capsys):
  with pytest.raises(SystemExit) as stop:
    machine_speed.main(['--rounds', '0'])
  assert stop.value.code == 2
  assert capsys.readouterr().err.splitlines()[-1].endswith('--rounds must be >= 1, got 0')


def test_without_json_it_prints_its_one_line(capsys, devices):
  result = machine_speed.main(['--rounds', '1'])
  assert capsys.readouterr().out.splitlines() == [machine_speed.line(result)]
