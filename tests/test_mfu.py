"""MFU benchmark: the analytic FLOP count agrees with XLA's, the peak table, MFU arithmetic."""
import pytest

from benchmarks import mfu
from mecefo_jax.config import load_config

SMALL = ['model.n_layers=2', 'model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=96',
         'model.seq_len=32', 'model.vocab_size=64']


@pytest.mark.parametrize('kind, peak', [
    ('NVIDIA H100 80GB HBM3', 989.0), ('NVIDIA H100 PCIe', 756.0), ('NVIDIA H200', 989.0),
    ('NVIDIA A100-SXM4-80GB', 312.0), ('TPU v4', 275.0), ('TPU v5 lite', 197.0), ('TPU v5p', 459.0),
    ('TPU v6 lite', 918.0), ('cpu', None)])
def test_peak_table(kind, peak):
  assert mfu.peak_tflops(kind) == peak


def test_model_flops_formula():
  m = load_config('configs/llama_60m.yaml', []).model
  f = mfu.model_flops_per_token(m)
  # 8 blocks of 4·512² + 3·512·1376 matmul params, plus the 512 × 256 head.
  assert f['matmul_params'] == 8 * (4 * 512**2 + 3 * 512 * 1376) + 512 * 256
  assert f['total'] == 6 * f['matmul_params'] + 12 * 8 * 256 * 512


def test_mfu_run_agrees_with_xla(launcher, tmp_path):
  result = launcher.benchmark('mfu', '--config', 'configs/tiny.yaml', '--micro-batches', '2,4',
                              '--repeats', '1', '--peak-tflops', '0.5', *SMALL,
                              json_path=tmp_path / 'm.json')
  assert [r['micro_batch'] for r in result['rows']] == [2, 4]
  for row in result['rows']:
    assert row['mfu'] == pytest.approx(row['model_tflops_per_s'] / 0.5)
    # XLA also counts AdamW and the elementwise ops; the matmuls dominate even at this size.
    assert 1.0 <= row['xla_tflops_per_s'] / row['model_tflops_per_s'] < 1.2
  assert result['best_mfu'] == max(r['mfu'] for r in result['rows'])
  assert result['peak_source'] == 'argument'
  assert result['compute_dtype'] == 'float32'  # model.compute_dtype=auto, resolved on CPU


def test_rows_without_a_peak_have_no_mfu():
  cfg = load_config('configs/tiny.yaml', SMALL)
  measured = {4: {'time': {'median_s': 0.5}, 'memory': {}, 'xla_flops': None}}
  [row] = mfu.rows(cfg, measured, peak=None)
  assert row['mfu'] is None and row['xla_tflops_per_s'] is None
  assert row['model_tflops_per_s'] == pytest.approx(
      mfu.model_flops_per_token(cfg.model)['total'] * 4 * 32 / 0.5 / 1e12)


@pytest.mark.parametrize('bad', ['0', '4,x', '-2'])
def test_mfu_refuses_bad_micro_batches(capsys, bad):
  with pytest.raises(SystemExit) as stop:
    mfu.main(['--config', 'configs/tiny.yaml', '--micro-batches', bad, *SMALL])
  assert stop.value.code == 2
  assert f'--micro-batches must be positive integers, got {bad!r}' in capsys.readouterr().err
