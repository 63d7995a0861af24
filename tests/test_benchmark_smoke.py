"""Each benchmark that no other test runs, at a tiny scale, as a user runs it from the repository
root: it exits 0 and writes its JSON with the run's metadata and sane figures (what each one
measures is its own business: docs/benchmarks.md; these only keep them runnable)."""
import yaml

from mecefo_jax.records import progress_marks
from procs import TINY


def test_stall_recovery_names_the_stopped_host_and_drops_nothing(launcher, tmp_path):
  """The suite's one job with a SIGSTOPped worker under the local supervisor (it was also
  tests/test_stall.py's): the stall's record, the supervisor's lines, the job retrained to the
  end without the stopped process, nothing dropped and no process left."""
  # --keep-cache: the suite's XLA flags and program store (an empty one is no part of a stall).
  result = launcher.benchmark('stall_recovery', '--processes', '3', '--steps', '8',
                              '--stop-at', '3', '--no-wait-builds', '--keep-cache', *TINY,
                              json_path=tmp_path / 'stall.json')
  assert result['named_host'] == result['host'] == 1 and result['stopped'] == [1], result
  assert result['detect_s'] > result['deadline_s'] > 0 and result['samples']['dropped'] == 0
  assert result['why'] == 'its process is stopped (SIGSTOP)'
  assert result['deadline_from'] == 'measured', result  # on the steps timed: 10x, >= 10 s
  assert result['waited_s'] >= result['deadline_s'], result  # named once the deadline ran out
  assert set(result['phases']) == {'0', '1', '2'}
  assert all(p['phase'] in progress_marks.PHASES for p in result['phases'].values()), result
  assert result['events'] == ['start', 'stall', 'start', 'end'] and result['left'] == []
  assert f"# stall: {result['note']}" in result['failures_txt'], result['failures_txt']
  said = ' '.join(result['supervisor_lines'])
  assert 'host 1 stopped first, in ' in said and '(its process is stopped (SIGSTOP))' in said
  assert 'after 0 death(s), 1 stall(s), 0 rejoin(s), 1 restart(s)' in said, said


def test_stop_time_saves_both_tiers_and_exits_143(launcher, tmp_path):
  result = launcher.benchmark('stop_time', '--at-step', '3', '--keep-xla-flags', *TINY,
                              json_path=tmp_path / 'stop.json')
  assert result['exit_code'] == 143 and result['both_tiers'] is True, result
  assert result['stop_s'] > 0


def test_gradient_error_of_a_low_rank_basis_is_between_zero_and_one(launcher, tmp_path):
  result = launcher.benchmark('gradient_error', '--every', '2', '--fractions', '0.25',
                              '--bases', 'svd', '--tau', '2', *TINY, 'train.steps=3',
                              json_path=tmp_path / 'grad.json')
  error = result['mean']['svd:0.25']['non_attention']
  assert 0 < error < 1 and len(result['rows']) == 2, result['mean']


def test_compile_depth_times_a_cold_run_of_this_tree(launcher, tmp_path):
  # Cold still (an empty HOME), at the suite's XLA flags: its compiles take less time.
  result = launcher.benchmark('compile_depth', '--trees', '.', '--layers', '1', '--repeats', '1',
                              '--keep-xla-flags', json_path=tmp_path / 'depth.json')
  [row] = result['rows']
  assert row['n_layers'] == 1 and row['programs_s'] > 0 and row['wall_s'] > 0, row


def test_step_trees_times_the_normal_and_degraded_step(launcher, tmp_path):
  # The suite's tiny model and XLA flags (the driver takes a config file, no overrides): its
  # two programs compile in less time, which is what this run pays for.
  config = tmp_path / 'tiny.yaml'
  sections = {}
  for override in TINY:  # 'model.d_model=32' -> model: {d_model: 32}
    key, value = override.split('=')
    section, name = key.split('.')
    sections.setdefault(section, {})[name] = yaml.safe_load(value)
  config.write_text(yaml.safe_dump(sections))
  result = launcher.benchmark('step_trees', '--trees', '.', '--config', config, '--repeats', '1',
                              '--steps', '2', '--keep-xla-flags',
                              json_path=tmp_path / 'steps.json')
  [row] = result['rows']
  assert row['normal_s'] > 0 and row['time_ratio'] > 0 and row['memory_ratio'] > 0, row


def test_ray_driver_lost_is_stopped_by_the_lease_and_resumed_at_that_step(launcher, tmp_path):
  # --keep-cache: its six trainers load the suite's programs (cold ones time no part of a lease).
  result = launcher.benchmark('ray_driver_lost', '--kill-at', '2', '--stopped-s', '10',
                              '--steps', '400', '--keep-cache', *TINY,
                              json_path=tmp_path / 'driver.json')
  assert 2 <= result['stop_step'] == result['resumed_step'] < 400, result
  assert result['kill_to_trainers_gone_s'] >= result['kill_to_stop_s'] >= 10
