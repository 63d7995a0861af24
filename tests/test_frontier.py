"""The frontier: reads a quality --seeds JSON and a failure_throughput JSON, picks a default."""
import json
import math

import pytest

from benchmarks import frontier


def _inputs():
  drops = {'neighbor': (18.0, 35.0), 'spread': (12.0, 15.0), 'budget:1.0': (1.9, 1.5),
           'drop': (12.0, 13.0), 'exact': (13.0, 14.0), 'checkpoint-restart': (3.0, 12.0), 'naive': (30.0, 50.0)}  # (8 slices, 32 slices)
  throughput = {'results_by_slices': {
      str(n): {p: {'high': {'drop_pct': d[k], 'compile_time_frac': 0.01, 'move_time_frac': 0.005}}
               for p, d in drops.items()}
      for k, n in enumerate((8, 32))}}
  increases = {'neighbor': [2.0, 3.0, 4.0], 'spread': [0.5, 0.7, 0.9],
               'budget:1.0': [0.8, 1.0, 1.2], 'drop': [0.0, 0.1, 0.2], 'exact': [0.0] * 3}
  summary = {'high': {p: {'mean': sum(x) / 3, 'sem': 0.1, 'per_seed': x}
                      for p, x in increases.items()}}
  # Held-out loss falls 0.001 per step over the last 300 of 1000 steps, to 2.0: +1% (0.02) of
  # loss is worth 20 steps, 2% of the run.
  curve = {'losses': [[s, 3.0 - s / 1000] for s in range(0, 1000, 10)], 'eval_loss': 2.0,
           'evals': [{'step': s, 'loss': 2.0 + (999 - s) / 1000} for s in range(99, 1000, 100)]}
  per_seed = {str(k): {'steps': 1000, 'fault_free': curve, 'presets': {'high': {'runs': {
      p: {'eval_increase_pct': x[k], 'samples': {'dropped': 64 * (p == 'drop')}}
      for p, x in increases.items()}}}} for k in range(3)}
  quality = {'mode': 'seeds', 'slices': 8, 'seeds': [0, 1, 2], 'summary': summary,
             'data': 'pydoc', 'per_seed': per_seed}
  return quality, throughput


def test_frontier_reads_both_and_recommends_the_fastest_to_the_fault_free_loss(tmp_path):
  quality, throughput = _inputs()
  result = frontier.frontier(quality, throughput, 32, 'high')
  p = result['policies']
  assert set(p) == {'neighbor', 'spread', 'budget:1.0', 'drop', 'exact', 'checkpoint-restart'}
  assert p['spread']['drop_pct_at_32'] == 15.0 and p['spread']['drop_pct_at_8'] == 12.0
  assert p['spread']['programs_pct_at_32'] == pytest.approx(1.5)  # compiles + moves
  assert p['checkpoint-restart']['loss_increase_pct'] == 0.0
  assert p['checkpoint-restart']['by_construction']
  assert p['neighbor']['make_up_steps_pct'] == pytest.approx(6.0)  # +3% of loss: 60 steps
  assert p['neighbor']['make_up_steps_sem'] == pytest.approx(2.0 / 3 ** 0.5)
  # spread: +0.5, 0.7, 0.9% of loss are 1.0, 1.4, 1.8% more steps; the slowdown, per seed then
  # the mean: 1 - 0.85 / (1 + extra steps).
  assert p['spread']['time_to_loss_slowdown_pct_at_32'] == pytest.approx(
      100 * (1 - sum(0.85 / (1 + m) for m in (0.010, 0.014, 0.018)) / 3))
  # budget:1.0: drop 1.5% <= 2% at 32 slices and mean +1.0% <= +1%: both targets met.
  assert p['budget:1.0']['targets_met'] and result['recommended'] == 'budget:1.0'
  assert frontier.frontier(quality, throughput, 32, 'high', 'spread')['recommended'] == 'spread'
  with pytest.raises(ValueError, match='no 256-slice results'):
    frontier.frontier(quality, throughput, 256, 'high')
  rows = frontier.table_rows({**result})
  assert rows[2]['policy'] == 'budget:1.0 (recommended)'
  assert rows[0]['loss_increase_at_8_pct'] == '+3.00 ± 0.10 (+2.00, +3.00, +4.00)'
  result['inputs'] = {'quality': ['q.json'], 'throughput': 't.json'}
  frontier.plot(result, quality, str(tmp_path / 'f.png'))
  assert (tmp_path / 'f.png').stat().st_size > 0


def test_without_a_policy_meeting_both_targets_the_smallest_slowdown_is_recommended():
  quality, throughput = _inputs()
  throughput['results_by_slices']['32']['budget:1.0']['high']['drop_pct'] = 30.0
  result = frontier.frontier(quality, throughput, 32, 'high')
  assert not any(v['targets_met'] for v in result['policies'].values())
  # checkpoint-restart (12%, no loss), drop (13%, +0.1%) and exact (14%, 0) would be faster,
  # but one is not a takeover policy, one loses samples and one grows a slice's memory.
  assert result['policies']['drop']['samples_dropped'] == 3 * 64
  assert result['policies']['exact']['time_to_loss_slowdown_pct_at_32'] == pytest.approx(14.0)
  assert result['recommended'] == 'spread' and result['recommended_by'] == 'time_to_loss'


def test_make_up_steps_need_a_falling_fault_free_loss():
  quality, _ = _inputs()
  run = quality['per_seed']['0']
  assert frontier.make_up_steps_pct(run, -1.0) == pytest.approx(-2.0)  # better: fewer steps
  flat = {**run, 'fault_free': {**run['fault_free'], 'evals': [
      {'step': s, 'loss': 2.0} for s in (799, 899, 999)]}}
  with pytest.raises(ValueError, match='rises over the last 300 steps'):
    frontier.make_up_steps_pct(flat, 1.0)
  one = {**run, 'fault_free': {**run['fault_free'], 'evals': [{'step': 999, 'loss': 2.0}]}}
  with pytest.raises(ValueError, match='1 evals in its last 300 steps'):
    frontier.make_up_steps_pct(one, 1.0)
  assert frontier.slowdown_pct(0.0, 0.0) == 0.0 and frontier.slowdown_pct(50.0, 100.0) == 75.0


def test_main_joins_per_seed_files_and_writes_json_and_the_paper_points(tmp_path):
  quality, throughput = _inputs()
  for s in range(3):  # one quality file per seed, as separate processes write them
    one = {**quality, 'seeds': [s], 'commit': 'c', 'per_seed': {str(s): quality['per_seed'][str(s)]}}
    (tmp_path / f'q{s}.json').write_text(json.dumps(one))
  (tmp_path / 't.json').write_text(json.dumps(throughput))
  out = frontier.main(['--quality', *(str(tmp_path / f'q{s}.json') for s in range(3)),
                       '--throughput', str(tmp_path / 't.json'), '--json', str(tmp_path / 'o.json')])
  assert json.loads((tmp_path / 'o.json').read_text())['recommended'] == out['recommended']
  assert out['seeds'] == [0, 1, 2] and out['policies']['neighbor']['loss_increase_pct'] == 3.0
  with pytest.raises(ValueError, match='repeat a seed'):
    frontier.main(['--quality', str(tmp_path / 'q0.json'), str(tmp_path / 'q0.json'),
                   '--throughput', str(tmp_path / 't.json')])
  paper = out['paper']['350M']
  assert paper['drop_pct'] == 1.07
  assert paper['loss_increase_pct'] == pytest.approx(100 * (math.log(19.04) / math.log(18.74) - 1))
