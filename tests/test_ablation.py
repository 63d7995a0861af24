"""Ablation benchmark: every variant compiles, runs, and the memory/FLOP ordering holds."""
import pytest

from benchmarks import ablation

SMALL = ['model.n_layers=1', 'model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=96', 'model.seq_len=32',
         'model.vocab_size=64', 'train.micro_batch=4']


def test_ablation_variants_run_and_order(launcher, tmp_path):
  result = launcher.benchmark('ablation', '--config', 'configs/tiny.yaml', '--repeats', '1',
                              '--warmup', '1', '--figure', tmp_path / 'a.png', *SMALL,
                              json_path=tmp_path / 'a.json')
  rows = {r['variant']: r for r in result['table']}
  assert len(rows) == len(ablation.VARIANTS) and (tmp_path / 'a.png').stat().st_size > 0
  naive, skip, mecefo = (rows[ablation.VARIANTS[n][0]] for n in ('naive_2', 'skip_2', 'mecefo_2'))
  # Two exact micro-batches: about twice the work of one; each technique then removes some.
  assert naive['flops_x'] == pytest.approx(2.0, rel=0.05)
  assert mecefo['flops_x'] < skip['flops_x'] < naive['flops_x']
  assert mecefo['temp_x'] < naive['temp_x'] and naive['temp_x'] > 1.5
  assert all(r['median_ms'] > 0 for r in rows.values())
