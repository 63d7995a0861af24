"""What a degraded row is worth: make-up steps read off eval curves, v fitted over p and seeds,
the thresholds it is held against, and the benchmark end to end at a tiny scale (slow)."""
import json

import pytest

from benchmarks import row_value, row_value_fit as fit
from procs import TINY


def test_make_up_steps_are_read_where_the_curve_crosses_the_fault_free_loss():
  curve = [(25, 3.0), (50, 2.0), (75, 1.5), (100, 1.0)]
  assert fit.crossing_step(curve, 1.75) == pytest.approx(62.5)  # halfway from 2.0 to 1.5
  assert fit.make_up_steps(curve, 1.25, 50) == pytest.approx(37.5)
  assert fit.make_up_steps(curve, 2.5, 50) == pytest.approx(-12.5)  # there before step 50
  assert fit.make_up_steps(curve, 3.5, 50) == pytest.approx(-25.0)  # the first eval is below
  assert fit.make_up_steps(curve, 0.5, 50) is None  # not within the steps it ran


def test_v_is_one_less_the_ratio_of_the_slopes_over_p_through_the_origin():
  # Dropped rows cost 40 steps per unit p, degraded 10: a degraded row is worth 3/4 of an exact one.
  points = {s: {'dropped': [(p, 40 * p + e) for p, e in ((0.125, 1), (0.25, -1), (0.5, 0))],
                'degraded': [(p, 10 * p) for p in (0.125, 0.25, 0.5)]} for s in range(3)}
  a_drop = fit.slope(*zip(*[(p, m) for p, m in points[0]['dropped']]))
  assert fit.row_value(points) == pytest.approx(1 - 10 / a_drop)
  assert abs(fit.row_value(points) - 0.75) < 0.01
  low, high = fit.bootstrap(points)
  assert low <= fit.row_value(points) <= high


def test_the_interval_widens_with_seeds_that_disagree():
  same = {s: {'dropped': [(0.5, 20.0)], 'degraded': [(0.5, 10.0)]} for s in range(5)}
  spread = {s: {'dropped': [(0.5, 20.0)], 'degraded': [(0.5, 10.0 + 6 * (s - 2))]} for s in range(5)}
  assert fit.bootstrap(same) == pytest.approx([0.5, 0.5])
  low, high = fit.bootstrap(spread)
  assert low < 0.5 < high and high - low > 0.3


def test_the_thresholds_are_d_for_budget_and_d_times_1_plus_r_over_r_for_spread():
  assert fit.thresholds(0.66) == {'budget': 0.66, 'spread_r1': pytest.approx(1.32)}
  assert fit.thresholds(0.5, r=4.0)['spread_r4'] == pytest.approx(0.625)


@pytest.mark.slow
def test_the_benchmark_pairs_every_arm_by_seed(launcher, tmp_path):
  # The tests' tiny model (procs.TINY's shape) at the benchmark's 64 rows: the arms' 360 steps
  # cost little beside the compiles then (24 CPU s against 80 at tiny.yaml's 64 x 64 model).
  result = launcher.benchmark(
      'row_value', '--steps', '20', '--extra', '1', '--seeds', '0,1', '--degraded', '16,32',
      '--eval-every', '10', '--eval-rows', '64', '--time-repeats', '1',
      *(a for a in TINY if a.startswith('model.')), json_path=tmp_path / 'rv.json')
  mode = result['modes']['full']
  assert mode['seeds'] == [0, 1] and set(mode['per_seed']['0']['arms']) == {
      'degraded_16', 'degraded_32', 'dropped_16', 'dropped_32'}
  for seed in mode['per_seed'].values():
    assert [s for s, _ in seed['fault_free']] == [10, 20]
    for arm in seed['arms'].values():  # a faulty arm runs until it reaches the target, at most 40
      assert arm['evals'][-1][0] <= 40
  assert 0.0 < mode['d_flops'] < 1.0 and mode['params'] > 0
  assert (mode['v'] is None) == bool(mode['censored'])


def test_reuse_takes_the_fault_free_and_dropped_arms_of_the_same_settings_only(tmp_path):
  args = row_value._args(['--steps', '20', '--seeds', '0,1'])
  arms = {'degraded_8': {'make_up_steps': 1.0}, 'dropped_8': {'make_up_steps': 2.0}}
  earlier = {**{k: getattr(args, k) for k in row_value.SETTINGS},
             'modes': {'full': {'per_seed': {'0': {'fault_free': [[10, 3.0]], 'arms': arms}}}}}
  path = tmp_path / 'earlier.json'
  path.write_text(json.dumps(earlier))
  assert row_value.reusable(args, str(path)) == {
      0: {'fault_free': [[10, 3.0]], 'arms': {'dropped_8': {'make_up_steps': 2.0}}}}
  with pytest.raises(SystemExit, match=r'other settings \(steps\)'):
    row_value.reusable(row_value._args(['--steps', '30']), str(path))


def test_add_to_keeps_the_seeds_an_earlier_run_of_the_same_settings_finished(tmp_path):
  args = row_value._args(['--steps', '20', '--seeds', '0,1,2'])
  earlier = {**{k: getattr(args, k) for k in row_value.SETTINGS}, 'machine_time_s': 60.0,
             'modes': {'full': {'per_seed': {'0': {'fault_free': [[10, 3.0]], 'arms': {}}}}}}
  path = tmp_path / 'earlier.json'
  path.write_text(json.dumps(earlier))
  assert row_value.seeds_done(args, str(path), 'full') == (
      {0: {'fault_free': [[10, 3.0]], 'arms': {}}}, 60.0)
  assert row_value.seeds_done(args, str(path), 'gaussian') == ({}, 60.0)
  with pytest.raises(SystemExit, match=r'--add-to .*: other settings \(rows\)'):
    row_value.seeds_done(row_value._args(['--steps', '20', '--rows', '32']), str(path), 'full')
