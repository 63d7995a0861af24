"""train.py end to end (subprocess) and its one-line errors for bad configuration."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _train(*args, timeout=300, env=None):
  return subprocess.run([sys.executable, 'train.py', *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_train_py_loss_goes_down(tmp_path):
  proc = _train('train.steps=120', '--out', str(tmp_path), f'snapshot.dir={tmp_path}/shm')
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads((tmp_path / 'report.json').read_text())
  for key in ('steps', 'first_loss', 'final_loss', 'tokens', 'wall_s', 'params_sha256'):
    assert key in report
  assert report['steps'] == 120 and len(report['params_sha256']) == 64
  assert report['final_loss'] < report['first_loss'] - 1.0, report['losses']
  assert report['final_loss'] > report['entropy_floor']


@pytest.mark.parametrize('override, needle', [
    ('model.n_heads=5', 'model.n_heads=5 must divide model.d_model=64'),
    ('model.nope=1', "unknown config key 'model.nope'"),
    ('model.n_layers=two', "config key 'model.n_layers' must be int"),
    ('mesh.slice=64', 'mesh.slice*mesh.fsdp*mesh.tensor = 64 exceeds the'),
    ('mecefo.basis=qr', "mecefo.basis must be one of svd, gaussian, got 'qr'"),  # bases.py
])
def test_bad_config_fails_with_one_clear_line(override, needle):
  proc = _train(override, 'train.steps=1', timeout=120)
  assert proc.returncode == 2
  lines = [l for l in proc.stderr.strip().splitlines() if l.startswith('error:')]
  assert len(lines) == 1 and needle in lines[0], proc.stderr[-1500:]


def test_train_py_on_a_text_folder(tmp_path):
  (tmp_path / 'docs').mkdir()
  (tmp_path / 'docs' / 'a.txt').write_text((ROOT / 'README.md').read_text() * 4)
  proc = _train('--data', f'text:{tmp_path / "docs"}', '--no-snapshots', 'train.steps=20',
                '--out', str(tmp_path / 'run'))
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads((tmp_path / 'run' / 'report.json').read_text())
  assert report['entropy_floor'] is None and report['final_loss'] < report['first_loss']
  # stderr is a pipe here, not a terminal: plain log lines, no progress bar.
  assert '\r' not in proc.stderr and '%|' not in proc.stderr
  for needle in (' step 0/20 loss ', ' step 19/20 loss ',
                 ' eval after step 19: loss ', ' done: 20 steps'):
    assert needle in proc.stderr, proc.stderr[-2000:]


def test_quiet_prints_only_warnings_and_the_summary(tmp_path):
  proc = _train('--quiet', '--resume', 'train.steps=3', 'train.plot=false', '--out', str(tmp_path),
                f'snapshot.dir={tmp_path}/shm', 'mesh.slice=1', 'model.n_layers=1', timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert any('resume: no intact snapshot' in l for l in lines), lines  # a warning still shows
  assert lines[-1].startswith('done: 3 steps, loss ') and 'eval ' in lines[-1], lines
  assert not any(' step ' in l and ' loss ' in l for l in lines[:-1]), lines
  assert not any('compiled step' in l or ' data: ' in l or 'goodput' in l for l in lines), lines


def test_bad_data_path_fails_with_one_clear_line(tmp_path):
  proc = _train('--data', f'text:{tmp_path}/missing', 'train.steps=1', timeout=120)
  lines = [l for l in proc.stderr.strip().splitlines() if l.startswith('error:')]
  assert proc.returncode == 2 and len(lines) == 1 and 'path not found' in lines[0], proc.stderr


def test_dry_run_compiles_and_reports_without_training(tmp_path):
  from mecefo_jax.snapshot.recovery import run_name
  from mecefo_jax.snapshot.store import default_snapshot_dir

  out, scratch = tmp_path / 'new' / 'run', tmp_path / 'tmp'
  scratch.mkdir()
  env = {**os.environ, 'TMPDIR': str(scratch)}
  proc = _train('--dry-run', '--out', str(out), timeout=120, env=env)
  assert proc.returncode == 0, proc.stderr[-2000:]
  info = json.loads(proc.stdout[proc.stdout.index('{'):])
  assert info['param_count'] > 0 and info['step_memory_bytes']['temp_bytes'] > 0
  # Nothing left behind: no run directory, no tmpfs snapshots, no scratch directory.
  assert not (tmp_path / 'new').exists() and not list(scratch.iterdir())
  assert not default_snapshot_dir(run_name(out)).exists()


def test_persistent_compile_cache_is_filled_and_reused_bit_exactly(tmp_path):
  cache, env = tmp_path / 'xla', {k: v for k, v in os.environ.items()
                                  if k not in ('JAX_COMPILATION_CACHE_DIR', 'XLA_FLAGS')}
  reports = []
  for run in ('a', 'b'):
    proc = subprocess.run([sys.executable, 'train.py', '-q', '--out', str(tmp_path / run),
                           'train.steps=3', '--no-snapshots', 'train.plot=false',
                           f'train.compile_cache={cache}'],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports.append(json.loads((tmp_path / run / 'report.json').read_text()))
    if run == 'a':
      entries = {p.name for p in cache.iterdir()}
      assert any(name.startswith('jit_step') for name in entries), entries
  assert {p.name for p in cache.iterdir()} == entries  # the second run compiled nothing new
  assert reports[0]['params_sha256'] == reports[1]['params_sha256']
