"""failure_throughput benchmark: measures, replays every policy, and re-reads its costs."""
import json
import math

import pytest


SMALL = ['model.n_layers=1', 'model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=96',
         'model.seq_len=32', 'model.vocab_size=64', 'train.micro_batch=4']
QUICK = ['--slices', '2,4', '--measure', 'anchors', '--presets', 'high', '--hours', '4',
         '--seeds', '1', '--repeats', '1', '--warmup', '0']


def test_measure_then_replay_every_policy_and_reread_as_flops(launcher, tmp_path):
  out = tmp_path / 'ft.json'
  result = launcher.benchmark('failure_throughput', '--config', 'configs/tiny.yaml', *QUICK,
                              *SMALL, json_path=out)
  policies = {'neighbor', 'spread', 'exact', 'budget:1.0', 'budget:1.05', 'drop', 'naive',
              'checkpoint-restart'}
  assert set(result['results_by_slices']) == {'2', '4'}
  assert all(set(r) == policies for r in result['results_by_slices'].values())
  assert all(math.isfinite(r['high']['drop_pct']) for r in result['results'].values())
  m = result['measurement']
  assert {'refresh', 'refresh_full', 'fused_normal', 'update'} <= set(m['times'])  # warm refresh
  assert m['flops']['fused_normal'] > 0 and m['flops']['refresh'] < m['flops']['fused_normal']
  # Every compiled program is moved onto the second (fake) device once timed.
  assert m['move_onto'] == 'device 1 from device 0' and {'update', 'eval'} <= set(m['move_s'])
  assert result['programs'] == {'move': True, 'ordered_reduce': False, 'refresh': 'warm',
                                'eval_every': 100}
  assert result['premove'] == {'on': True, 'cap': 64}
  assert sum(r['high']['moved'] + r['high']['premoved'] for r in result['results'].values()) > 0
  # The same costs read as FLOPs, programs compiled per set: no new timing.
  again = launcher.benchmark('failure_throughput', '--config', 'configs/tiny.yaml', *QUICK,
                             '--costs', out, '--stat', 'flops', '--move', 'off', *SMALL,
                             json_path=tmp_path / 'ft_flops.json')
  assert again['costs']['normal_s'] == pytest.approx(result['costs']['normal_s'])
  assert again['measurement'] == json.loads(out.read_text())['measurement']
  assert set(again['results']) == policies and not again['programs']['move']
  assert all(r['high']['moved'] == 0 for r in again['results'].values())
