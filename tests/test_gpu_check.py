"""benchmarks/gpu_check.sh on CPU: every part with tiny models (the figures in the one JSON, at
most 8 files), and the time guard (a part past its limit, the parts past the total)."""
import json
import sys
from importlib import metadata
from pathlib import Path

import pytest

from benchmarks import gpu_check
from mecefo_jax import install
from mecefo_jax.snapshot.manager import default_snapshot_dir
from procs import ROOT, TINY

SCRIPT = ROOT / 'benchmarks' / 'gpu_check.sh'
PARTS = ['imports', 'quickstart', 'notebook', 'first_step_cold', 'first_step_warm', 'step_cost',
         'compile_degraded_empty', 'compile_degraded_warm', 'compile_degraded_off', 'mfu_mb4',
         'mfu_mb8', 'snapshot']


def _runs_tmpfs() -> set:
  """The tmpfs snapshot folders of gpu_check's quickstart runs (its one train.py run with
  snapshots), named after its run folder: other tests' runs may come and go meanwhile."""
  return set(default_snapshot_dir('x').parent.glob('quickstart-*'))


def _check(launcher, out, timeout, **env):
  before = _runs_tmpfs()
  proc = launcher.run(['bash', SCRIPT], timeout=timeout,
                      env=launcher.env(OUT=str(out), PYTHON=sys.executable, **env))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  # Its runs' tmpfs folders go with its scratch folder, a run killed at its limit's too.
  assert _runs_tmpfs() <= before
  files = sorted(p.name for p in out.iterdir())
  assert files == ['gpu_check.json', 'gpu_check.log'], files  # at most 8 asked
  result = json.loads((out / 'gpu_check.json').read_text())
  assert list(result['parts']) == PARTS
  assert '== imports' in proc.stdout and (out / 'gpu_check.log').read_text() == proc.stdout
  return result


def test_every_part_runs_with_tiny_models_and_lands_in_one_json(launcher, tmp_path):
  result = _check(launcher, tmp_path / 'out', 600, GPU_CHECK_MODEL='configs/tiny.yaml',
                  GPU_CHECK_MODEL_1B='configs/tiny.yaml',
                  GPU_CHECK_MFU_OVERRIDES='model.seq_len=32',
                  GPU_CHECK_OVERRIDES=' '.join(TINY),
                  GPU_CHECK_QUICKSTART_ARGS=' '.join(['train.steps=20', *TINY]),
                  GPU_CHECK_REPEATS='1', GPU_CHECK_LIMIT_NOTEBOOK='0')  # tests/test_notebook.py
  parts = result['parts']
  assert {n: p['status'] for n, p in parts.items()} == {**dict.fromkeys(PARTS, 'ok'),
                                                        'notebook': 'skipped'}, parts
  assert result['device'] == {'platform': 'cpu', 'device_kind': 'cpu', 'device_count': 1}
  assert result['versions']['jax'] == metadata.version('jax')
  assert result['versions']['flax'] == metadata.version('flax') and result['wheels'] is None
  assert result['total_s'] <= 420 and result['limits_s']['first_step'] == 60
  cold, warm = (parts[f'first_step_{r}']['figures'] for r in ('cold', 'warm'))
  for run in (cold, warm):
    assert run['startup']['first_step_from'] == 'process' and run['startup']['first_step_s'] > 0
  # Cold: a fresh HOME, so an empty program store; warm: the same command finds its programs.
  assert cold['programs']['compiled'] >= 1 and cold['programs']['loaded'] == 0
  assert warm['programs']['compiled'] == 0 and warm['programs']['loaded'] >= 1
  for mb in (4, 8):
    [row] = parts[f'mfu_mb{mb}']['figures']['rows']
    assert row['micro_batch'] == mb and row['mfu'] is None  # no CPU peak
    assert row['xla_tflop_per_step'] >= row['model_tflop_per_step'] > 0
  cost = parts['step_cost']['figures']
  assert set(cost['temp_bytes']) == {'normal_1', 'degraded_2', 'naive_2'} and cost['time_ratio'] > 0
  assert parts['snapshot']['figures']['overhead_pct'] is not None
  modes = [parts[f'compile_degraded_{m}']['figures'] for m in ('empty', 'warm', 'off')]
  # (merged here: test_benchmark_smoke.py's compile_autotune run of mode `empty`, these asserts)
  assert [f['mode'] for f in modes] == ['empty', 'warm', 'off']
  assert all(f['compile_s'] > 0 and f['temp_bytes'] > 0 for f in modes), modes
  assert parts['quickstart']['figures']['steps'] == 20


def test_a_part_past_its_limit_is_a_timeout_and_parts_past_the_total_are_skipped(launcher,
                                                                                  tmp_path):
  # 30 s in all, 10 of them kept for the bookkeeping: imports gets 1 s (too short to import
  # jax and flax), the quickstart 15 s (it trains, snapshotting into tmpfs, until it is
  # killed), the later parts nothing (less than 5 s left). The tiny model: with train.py's
  # default one the quickstart had not trained step 0 at 15 s beside a busy core (2026-12-03).
  result = _check(launcher, tmp_path / 'out', 120, GPU_CHECK_TOTAL_S='30',
                  GPU_CHECK_LIMIT_IMPORTS='1', GPU_CHECK_LIMIT_QUICKSTART='15',
                  GPU_CHECK_QUICKSTART_ARGS=' '.join(['train.steps=1000000', *TINY]))
  statuses = {n: p['status'] for n, p in result['parts'].items()}
  assert statuses == {'imports': 'timeout', 'quickstart': 'timeout',
                      **dict.fromkeys(PARTS[2:], 'skipped')}
  assert ' step 0/1000000 ' in (tmp_path / 'out' / 'gpu_check.log').read_text()  # its tmpfs
  assert result['parts']['imports']['limit_s'] == 1 and result['wheels'] is None  # went too
  assert result['total_s'] <= 30 + 5  # a part killed 5 s after its limit at worst


def test_wheels_adds_only_what_is_missing_or_refused_never_the_accelerator_stack(tmp_path,
                                                                                 monkeypatch):
  names = ['jax-0.11.2-py3-none-any.whl', 'jaxlib-0.11.2-cp312-cp312-manylinux_2_27_x86_64.whl',
           'jax_cuda12_plugin-0.11.2-cp312-cp312-manylinux_2_27_x86_64.whl',
           'nvidia_cudnn_cu12-9.28.0.42-py3-none-manylinux_2_27_x86_64.whl',
           'flax-0.12.10-py3-none-any.whl', 'xxhash-4.1.0-cp312-cp312-manylinux_2_28_x86_64.whl',
           'no_such_dist_mecefo-1.0-py3-none-any.whl']
  for name in names:
    (tmp_path / name).touch()
  chosen = lambda: [Path(p).name for p in gpu_check.wheels(tmp_path)]
  assert chosen() == ['no_such_dist_mecefo-1.0-py3-none-any.whl']  # flax, xxhash: installed here
  real = install.installed_version
  monkeypatch.setattr(install, 'installed_version',
                      lambda name: '0.1' if name in ('flax', 'jax') else real(name))
  assert chosen() == ['flax-0.12.10-py3-none-any.whl', 'no_such_dist_mecefo-1.0-py3-none-any.whl']


@pytest.mark.parametrize('rc, log, expect, status', [
    (0, '', 0, 'ok'), (143, 'stopped', 143, 'ok'), (124, '', 0, 'timeout'), (137, '', 0, 'timeout'),
    (1, 'jaxlib...XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating', 0, 'oom'),
    (1, 'Traceback ... ValueError', 0, 'failed'), (None, '', 0, 'skipped')])
def test_a_part_is_recorded_with_its_status(tmp_path, capsys, rc, log, expect, status):
  (tmp_path / 'part.log').write_text(log)
  path = tmp_path / 'check.json'
  args = ['part', str(path), 'mfu_mb8', 'mfu', '--cmd', 'python -m benchmarks.mfu', '--limit',
          '50', '--expect', str(expect), '--log', str(tmp_path / 'part.log')]
  gpu_check.main(args + ([] if rc is None else ['--rc', str(rc), '--seconds', '3']))
  entry = json.loads(path.read_text())['parts']['mfu_mb8']
  assert (entry['status'], entry['rc'], entry['limit_s']) == (status, rc, 50)
  assert entry['command'] == 'python -m benchmarks.mfu' and 'figures' not in entry
  assert f'== mfu_mb8: {status}' in capsys.readouterr().out


def test_the_notebook_part_keeps_the_one_device_figures(tmp_path, capsys):
  figures = {'seconds': 41.5, 'error': None,
             'one_device': {'time_ratio': 1.1, 'memory_ratio': 0.7, 'train': {'steps': 20}}}
  (tmp_path / 'notebook.json').write_text(json.dumps(figures))
  path = tmp_path / 'check.json'
  gpu_check.main(['part', str(path), 'notebook', 'notebook', '--rc', '0', '--seconds', '42',
                  '--limit', '60', '--json', str(tmp_path / 'notebook.json')])
  entry = json.loads(path.read_text())['parts']['notebook']
  assert entry['status'] == 'ok' and entry['figures'] == figures
  assert gpu_check.headline(entry) == ('notebook in 42s; on one device degraded/normal time '
                                       '1.100, temp memory 0.700')

