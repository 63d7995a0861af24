"""The frontier: reads a quality --seeds JSON and a failure_throughput JSON, picks a default."""
import json
import math

import pytest

from benchmarks import frontier


def _inputs():
  drops = {'neighbor': (18.0, 35.0), 'spread': (12.0, 15.0), 'budget:1.0': (1.9, 1.5),
           'checkpoint-restart': (3.0, 12.0), 'naive': (30.0, 50.0)}  # (8 slices, 32 slices)
  throughput = {'results_by_slices': {
      str(n): {p: {'high': {'drop_pct': d[k]}} for p, d in drops.items()}
      for k, n in enumerate((8, 32))}}
  increases = {'neighbor': [2.0, 3.0, 4.0], 'spread': [0.5, 0.7, 0.9],
               'budget:1.0': [0.8, 1.0, 1.2]}
  summary = {'high': {p: {'mean': sum(x) / 3, 'sem': 0.1, 'per_seed': x}
                      for p, x in increases.items()}}
  curve = {'losses': [[s, 3.0 - s / 100] for s in range(0, 100, 10)],
           'evals': [{'step': 99, 'loss': 2.0}]}
  quality = {'mode': 'seeds', 'slices': 8, 'seeds': [0, 1, 2], 'summary': summary,
             'data': 'pydoc', 'per_seed': {str(s): {'fault_free': curve} for s in range(3)}}
  return quality, throughput


def test_frontier_reads_both_and_recommends_the_closest_to_both_targets(tmp_path):
  quality, throughput = _inputs()
  result = frontier.frontier(quality, throughput, 32, 'high')
  p = result['policies']
  assert set(p) == {'neighbor', 'spread', 'budget:1.0', 'checkpoint-restart'}  # naive: no y
  assert p['spread']['drop_pct_at_32'] == 15.0 and p['spread']['drop_pct_at_8'] == 12.0
  assert p['checkpoint-restart']['loss_increase_pct'] == 0.0
  assert p['checkpoint-restart']['by_construction']
  # budget:1.0: drop 1.5% <= 2% at 32 slices and mean +1.0% <= +1%: both targets met.
  assert p['budget:1.0']['targets_met'] and result['recommended'] == 'budget:1.0'
  assert p['spread']['target_ratio'] == pytest.approx(7.5)
  assert frontier.frontier(quality, throughput, 32, 'high', 'spread')['recommended'] == 'spread'
  with pytest.raises(ValueError, match='no 256-slice results'):
    frontier.frontier(quality, throughput, 256, 'high')
  rows = frontier.table_rows({**result})
  assert rows[2]['policy'] == 'budget:1.0 (recommended)'
  assert rows[0]['loss_increase_at_8_pct'] == '+3.00 ± 0.10 (+2.00, +3.00, +4.00)'
  result['inputs'] = {'quality': ['q.json'], 'throughput': 't.json'}
  frontier.plot(result, quality, str(tmp_path / 'f.png'))
  assert (tmp_path / 'f.png').stat().st_size > 0


def test_main_joins_per_seed_files_and_writes_json_and_the_paper_points(tmp_path):
  quality, throughput = _inputs()
  for s in range(3):  # one quality file per seed, as separate processes write them
    inc = {p: {'eval_increase_pct': v['per_seed'][s]} for p, v in quality['summary']['high'].items()}
    one = {**quality, 'seeds': [s], 'commit': 'c', 'per_seed': {
        str(s): {**quality['per_seed'][str(s)], 'presets': {'high': {'runs': inc}}}}}
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
