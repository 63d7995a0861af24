"""The package as pip puts it: built configs by name, the commands, and a wheel installed into a
fresh virtualenv that trains and launches from outside the checkout."""
import ast
import os
import shutil
import site
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from mecefo_jax import __main__ as entry
from mecefo_jax import config, spawn, supervisor
from mecefo_jax.config import ConfigError
from mecefo_jax.run import startup
from procs import ROOT, TINY, report, usage_error

SCRIPTS = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['scripts']


def test_a_config_is_a_file_or_the_name_of_a_built_in_one(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # outside the checkout: names still resolve, in the package
  tiny = config.CONFIGS / 'tiny.yaml'
  assert config.config_file('tiny') == config.config_file('tiny.yaml') == tiny
  assert {'tiny', 'llama_60m', 'llama_1b'} <= set(config.builtin_configs())
  (tmp_path / 'tiny').write_text('train:\n  steps: 3\n')  # a file of that name wins
  assert config.config_file('tiny') == Path('tiny')
  assert config.config_file('sub/x.yaml') == Path('sub/x.yaml')  # a path: as given
  with pytest.raises(ConfigError, match=r"'nope' is neither a file nor a built-in config "
                                        r'\(one of gpt2_tiny, llama_130m, .*tiny\)'):
    config.config_file('nope')
  assert (ROOT / 'configs').resolve() == config.CONFIGS.resolve()  # the checkout's link


def test_python_m_mecefo_jax_is_train_py_and_every_command_has_its_entry(capsys, monkeypatch):
  from mecefo_jax.run import hints
  monkeypatch.setattr(startup, '_entry', None)  # main() marks the entry: restored after
  monkeypatch.setattr(hints, '_TRAIN', list(hints._TRAIN))  # and how it was started
  assert entry.main(['--config', 'tiny', '--print-config']) == 0
  assert '  n_layers: 2\n' in capsys.readouterr().out
  assert SCRIPTS['mecefo-train'] == 'mecefo_jax.__main__:main'
  for name, target in SCRIPTS.items():
    module, function = target.split(':')
    assert callable(vars(__import__(module, fromlist=[function]))[function]), name


def test_printed_commands_name_the_command_that_started_the_trainer(monkeypatch):
  from mecefo_jax.run import hints
  monkeypatch.setattr(hints, '_TRAIN', list(hints._TRAIN))
  for argv0, command in [('/venv/bin/mecefo-train', 'mecefo-train'),
                         ('/site/mecefo_jax/__main__.py', 'python -m mecefo_jax'),
                         ('train.py', 'python train.py')]:
    hints.entered(argv0)
    assert hints.resume(Path('X')) == f'`{command} --out X --resume`'
    launch = 'mecefo-launch' if command == 'mecefo-train' else 'python -m mecefo_jax.launch'
    assert f'(`{launch} -n 3 ... -- --out X ...`' in hints.resume(Path('X'), n_hosts=3)


def test_help_and_usage_errors_name_the_command_as_typed(capsys, monkeypatch):
  """An installed command's --help and usage errors name it (`see mecefo-train --help`), and a
  supervised run's resume hint names the supervisor command that was typed."""
  from mecefo_jax import launch
  from mecefo_jax.records import job
  from mecefo_jax.run import cli, hints
  monkeypatch.setattr(hints, '_TRAIN', list(hints._TRAIN))
  for argv0, command in [('/venv/bin/mecefo-train', 'mecefo-train'),
                         ('/site/mecefo_jax/__main__.py', 'python -m mecefo_jax'),
                         ('train.py', 'python train.py')]:
    hints.entered(argv0)
    with pytest.raises(SystemExit):
      cli.parse_args(['--help'])
    text = capsys.readouterr().out
    assert text.startswith(f'usage: {command} [-h]') and f'example: {command} --config' in text
    assert 'train.py' not in text.replace('python train.py', '') or command == 'python train.py'
    assert usage_error(capsys, cli.parse_args, ['--nope']).endswith(f'(see {command} --help)')
  for argv0, command in [('/venv/bin/mecefo-launch', 'mecefo-launch'),
                         ('/site/mecefo_jax/launch.py', 'python -m mecefo_jax.launch')]:
    monkeypatch.setattr(sys, 'argv', [argv0])
    with pytest.raises(SystemExit):
      launch.parse_args(['--help'])
    text = capsys.readouterr().out
    assert text.startswith(f'usage: {command} [-h]') and f'example: {command} -n 4' in text
    assert 'train.py' not in text.replace("train.py's)", '')  # only beside mecefo-train's
    assert text.count('mecefo_jax.launch') == (command != 'mecefo-launch') * 2, text
    assert usage_error(capsys, launch.parse_args, ['-n', '1']).endswith(f'(see {command} --help)')
    monkeypatch.setenv(job.LAUNCH_ENV, '-n 2 -- --out R --fresh')
    monkeypatch.setenv(job.LAUNCH_COMMAND_ENV, launch.parse_args(['-n', '2']).command)
    assert hints.resume(Path('R')) == f'`{command} -n 2 -- --out R`'
  from mecefo_jax.run import plot, report_schema
  for script, main in [('mecefo-plot', plot.main), ('mecefo-report', report_schema.main)]:
    monkeypatch.setattr(sys, 'argv', [f'/venv/bin/{script}'])
    with pytest.raises(SystemExit):
      main(['--help'])
    assert capsys.readouterr().out.startswith(f'usage: {script} [-h]')


def test_the_supervisor_starts_this_package_not_a_file_of_the_checkout():
  assert Path(supervisor.PACKAGE_ROOT, 'mecefo_jax', '__main__.py').is_file()
  args = SimpleNamespace(devices_per_process=1, argv=['mecefo-launch'], gpus=False)
  job = SimpleNamespace(args=args, watch=None, _train_args=lambda: ['--out', 'runs/x'])
  cmd, env = supervisor.Supervisor.command(job, pid=0, host=0, n=1, port=1234)
  assert cmd[:3] == [sys.executable, '-m', 'mecefo_jax'] and cmd[-2:] == ['--out', 'runs/x']
  assert env['PYTHONPATH'].split(os.pathsep)[0] == supervisor.PACKAGE_ROOT
  for module in (supervisor, spawn):
    names = {node.value for node in ast.walk(ast.parse(Path(module.__file__).read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not {n for n in names if n.endswith('train.py')}, module.__name__


def _wheel(tmp_path: Path) -> Path:
  """The wheel of the checkout, built from a copy of what it packages (no build/ or egg-info
  left in the checkout) with the setuptools installed here: no network, no build isolation."""
  src = tmp_path / 'src'
  shutil.copytree(ROOT / 'mecefo_jax', src / 'mecefo_jax',
                  ignore=shutil.ignore_patterns('__pycache__'))
  for name in ('pyproject.toml', 'README.md'):
    shutil.copy(ROOT / name, src / name)
  subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps', '--no-index',
                  '--no-build-isolation', '-w', tmp_path / 'dist', src], check=True)
  [wheel] = (tmp_path / 'dist').glob('mecefo_jax-*.whl')
  return wheel


def _venv(tmp_path: Path, wheel: Path) -> Path:
  """A fresh virtualenv holding the wheel alone; the dependencies are this environment's (a
  .pth file names its site-packages), so nothing is downloaded."""
  venv = tmp_path / 'venv'
  subprocess.run([sys.executable, '-m', 'venv', '--without-pip', venv], check=True)
  [packages] = venv.glob('lib/python*/site-packages')
  (packages / 'dependencies.pth').write_text('\n'.join(site.getsitepackages()) + '\n')
  subprocess.run([sys.executable, '-m', 'pip', '--python', venv / 'bin' / 'python', 'install',
                  '-q', '--no-deps', '--no-index', wheel], check=True)
  return venv


def test_an_installed_wheel_trains_and_launches_from_outside_the_checkout(tmp_path, launcher):
  checkout = sorted(os.listdir(ROOT))
  venv = _venv(tmp_path, _wheel(tmp_path))
  pip_show = subprocess.run([sys.executable, '-m', 'pip', '--python', venv / 'bin' / 'python',
                             'show', '-f', 'mecefo-jax'], capture_output=True, text=True)
  assert 'mecefo_jax/configs/tiny.yaml' in pip_show.stdout, pip_show.stdout
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  env = {k: v for k, v in launcher.env().items() if k != 'PYTHONPATH'}
  run = lambda *args, timeout=240: launcher.run([*args], cwd=elsewhere, env=env, timeout=timeout)
  where = run(venv / 'bin' / 'python', '-c', 'import mecefo_jax; print(mecefo_jax.__file__)')
  assert where.stdout.startswith(str(venv)), where  # the wheel's package, not the checkout's
  helped = run(venv / 'bin' / 'mecefo-launch', '--help')  # the scripts name themselves
  assert helped.returncode == 0 and helped.stdout.startswith('usage: mecefo-launch '), helped
  refused = run(venv / 'bin' / 'mecefo-train', '--nope')
  assert refused.stderr.strip().endswith('(see mecefo-train --help)'), refused.stderr
  trained = run(venv / 'bin' / 'mecefo-train', '--config', 'tiny', '--out', 'X', *TINY,
                'train.steps=4', '--no-snapshots')
  assert trained.returncode == 0, trained.stderr[-3000:]
  assert report(elsewhere / 'X')['steps'] == 4
  job = run(venv / 'bin' / 'python', '-m', 'mecefo_jax.launch', '-n', '2', '--', '--out', 'Y',
            *TINY, 'mesh.slice=2', 'train.steps=4', timeout=300)
  assert job.returncode == 0, job.stderr[-3000:]
  result = report(elsewhere / 'Y')
  assert result['steps'] == 4 and result['mesh']['slice'] == 2
  assert sorted(os.listdir(ROOT)) == checkout  # no build/ or egg-info left in the checkout
