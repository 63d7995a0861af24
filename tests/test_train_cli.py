"""train.py end to end (processes: how users run it) and its one-line errors (in-process)."""
import json

import numpy as np
import pytest

from mecefo_jax.data.sources import _OPTIONS, _PATHLESS
from mecefo_jax import config
from mecefo_jax.model import bases
from mecefo_jax.run import cli
from mecefo_jax.files import default_snapshot_dir
from mecefo_jax.records.run_dir import run_name
from procs import STEP_XLA_FLAGS, error_lines, report


def test_train_py_loss_goes_down(launcher, tmp_path):
  # Its steps cost more than its compiles: XLA's first LLVM level (procs.STEP_XLA_FLAGS).
  proc = launcher.train('train.steps=120', 'train.plot=false', '--out', tmp_path,
                        f'snapshot.dir={tmp_path}/shm',
                        env=launcher.env(XLA_FLAGS=STEP_XLA_FLAGS))
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = report(tmp_path)
  for key in ('steps', 'first_loss', 'final_loss', 'tokens', 'wall_s', 'params_sha256'):
    assert key in result
  assert result['steps'] == 120 and len(result['params_sha256']) == 64
  assert result['final_loss'] < result['first_loss'] - 1.0, result['losses']
  assert result['final_loss'] > result['entropy_floor']
  # The start-up clock, under train.py: from the process start, so past everything compile_s
  # holds (the imports and the data came before it).
  s = result['startup']
  assert s['first_step_from'] == 'process' and s['restore_s'] is None
  assert result['compile_s'] >= (s['init_lower_s'] + s['init_compile_s'] + s['init_run_s'] +
                                 s['first_programs_s'])
  assert s['first_step_s'] > result['compile_s'] + s['first_step_run_s']


@pytest.mark.parametrize('override, needle', [
    ('model.n_heads=5', 'model.n_heads=5 must divide model.d_model=64'),
    ('model.nope=1', "unknown config key 'model.nope'"),
    ('model.n_layers=two', "config key 'model.n_layers' must be int"),
    ('mesh.slice=64', 'mesh.slice*mesh.fsdp*mesh.tensor = 64 exceeds the'),
    ('mecefo.basis=qr', "config key 'mecefo.basis' must be one of svd, gaussian, got 'qr'"),
])
def test_bad_config_fails_with_one_clear_line(tmp_path, capsys, override, needle):
  code = cli.main([override, 'train.steps=1', '--out', str(tmp_path), 'train.compile_cache='])
  lines = error_lines(capsys.readouterr().err)
  assert code == 2 and len(lines) == 1 and needle in lines[0], lines


def test_bad_input_with_fresh_deletes_nothing_and_basis_names_match_the_registry(tmp_path,
                                                                               capsys):
  """A bad value is refused with the config, before --fresh would remove the run's files."""
  (tmp_path / 'run_state.json').write_text(json.dumps({'status': 'finished', 'run_id': 'x'}))
  (tmp_path / 'report.json').write_text('{}')
  code = cli.main(['--out', str(tmp_path), '--fresh', 'mecefo.basis=qr', 'train.compile_cache='])
  assert code == 2 and "mecefo.basis' must be one of" in capsys.readouterr().err
  assert sorted(p.name for p in tmp_path.iterdir()) == ['report.json', 'run_state.json']
  # A snapshot directory that cannot be made: refused before the previous run is touched.
  code = cli.main(['--out', str(tmp_path), '--fresh', f'snapshot.dir={tmp_path}/no/such',
                   'train.compile_cache=', 'mesh.slice=1'])
  assert code == 2 and 'does not exist' in capsys.readouterr().err
  assert sorted(p.name for p in tmp_path.iterdir() if p.name != '.lock') == [
      'report.json', 'run_state.json']
  assert tuple(bases.BASES) == config.BASIS_NAMES


def test_train_py_on_a_text_folder(launcher, tmp_path):
  (tmp_path / 'docs').mkdir()
  # A fixed text made here: the README's text changes, and 20 steps on some of it raised the loss.
  words = np.random.default_rng(0).choice(['slice', 'step', 'loss', 'takeover', 'snapshot',
                                           'the', 'a', 'of', 'rows', 'degraded'], 6000)
  (tmp_path / 'docs' / 'a.txt').write_text(' '.join(words))
  proc = launcher.train('--data', f'text:{tmp_path / "docs"}', '--no-snapshots', 'train.steps=20',
                        '--out', tmp_path / 'run')
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = report(tmp_path / 'run')
  assert result['entropy_floor'] is None and result['final_loss'] < result['first_loss']
  # stderr is a pipe here, not a terminal: plain log lines, no progress bar.
  assert '\r' not in proc.stderr and '%|' not in proc.stderr
  for needle in (' step 0/20 loss ', ' step 19/20 loss ',
                 ' eval at step 19: loss ', ' done: 20 steps'):
    assert needle in proc.stderr, proc.stderr[-2000:]


def test_quiet_prints_only_warnings_and_the_summary(launcher, tmp_path):
  proc = launcher.train('--quiet', '--failures=low', 'train.steps=3', 'train.plot=false',
                        '--out', tmp_path, f'snapshot.dir={tmp_path}/shm', 'mesh.slice=1',
                        'model.n_layers=1')
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert any('one slice: a failure leaves' in l for l in lines), lines  # a warning still shows
  # The summary, then the one warning a failure preset with no failure ends the run with.
  assert lines[-2].startswith('done: 3 steps, loss ') and 'eval ' in lines[-2], lines
  assert '--failures low produced no failure in this run' in lines[-1], lines
  assert not any(' step ' in l and ' loss ' in l for l in lines[:-2]), lines
  assert not any('compiled step' in l or ' data: ' in l or 'goodput' in l for l in lines), lines


def test_bad_data_path_fails_with_one_clear_line(tmp_path, capsys):
  code = cli.main(['--data', f'text:{tmp_path}/missing', 'train.steps=1', '--out', str(tmp_path),
                   'train.compile_cache='])
  lines = error_lines(capsys.readouterr().err)
  assert code == 2 and len(lines) == 1 and 'path not found' in lines[0], lines


@pytest.mark.parametrize('flag, value, needle', [
    ('--data', 'text:', 'text:: missing path after text:'),
    ('--failures', 'trace:', "config key 'faults.failures' must be one of none, low, mid, high, "
                             "trace:PATH, got 'trace:'")])
def test_a_flag_spec_without_its_path_says_the_path_is_missing(tmp_path, capsys, flag, value,
                                                               needle):
  code = cli.main([flag, value, 'train.steps=1', '--out', str(tmp_path), 'train.compile_cache='])
  lines = error_lines(capsys.readouterr().err)
  assert code == 2 and lines == [f'error: {needle}'], lines


def test_help_lists_every_data_source_and_option(capsys):
  with pytest.raises(SystemExit) as stop:
    cli.parse_args(['--help'])
  assert stop.value.code == 0
  text = ' '.join(capsys.readouterr().out.split())  # unwrapped
  text = text[text.index('options:'):]
  data = text[text.index('--data DATA'):text.index('--dry-run')]
  forms = [name if name in _PATHLESS else f'{name}:' for name in _OPTIONS]
  missing = [form for form in forms if form not in data]
  missing += [f'{key}=' for keys in _OPTIONS.values() for key in keys if f'{key}=' not in data]
  assert not missing, data


def test_dry_run_compiles_and_reports_without_training(launcher, tmp_path):
  out, scratch = tmp_path / 'new' / 'run', tmp_path / 'tmp'
  scratch.mkdir()
  proc = launcher.train('--dry-run', '--out', out, env=launcher.env(TMPDIR=str(scratch)))
  assert proc.returncode == 0, proc.stderr[-2000:]
  info = json.loads(proc.stdout[proc.stdout.index('{'):])
  assert info['param_count'] > 0 and info['step_memory_bytes']['temp_bytes'] > 0
  # Nothing left behind: no run directory, no tmpfs snapshots, no scratch directory.
  assert not (tmp_path / 'new').exists() and not list(scratch.iterdir())
  assert not default_snapshot_dir(run_name(out)).exists()


