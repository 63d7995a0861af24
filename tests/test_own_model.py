"""A model of the contract defined outside the package (examples/own_model.py, copied out of the
checkout as a user would, and shown whole in docs/own_model.md): trained by the supervisor's
processes, which import it by its `module:factory` name, through failures equal to a replay run
as failures.txt prints it; through the Python API, killed and resumed bit-exact; a resume with
another model refused in one line."""
import importlib.util
import json
import re
import shlex
import shutil
import sys

import pytest

from mecefo_jax.config import load_config
from mecefo_jax.model import bases, models
from mecefo_jax.run import cli, hints
from mecefo_jax.records.job import BAD_INPUT
from mecefo_jax.run.stop import TEST_DEATH_ENV
from procs import ROOT, TINY, error_lines, report

EXAMPLE = ROOT / 'examples' / 'own_model.py'
DOC = ROOT / 'docs' / 'own_model.md'
STEPS = 10
ARGS = [*TINY, f'train.steps={STEPS}', 'train.eval_every=0',
        'train.log_every=1', 'mecefo.tau=3', 'faults.takeover=spread']  # MeCeFO's degraded rows
TRACE = '2 1 fail\n3 3 fail\n6 1 repair\n8 3 repair\n'
# The built-in second model's run: one slice down and back, two live sets to build programs
# for, not four (its overlapping failures are the user's model's to show).
ONE_DOWN = '2 1 fail\n6 1 repair\n'


def _user_folder(tmp_path, trace=TRACE):
  """A folder outside the checkout holding a copy of the example and a failure trace."""
  folder = tmp_path / 'user'
  folder.mkdir()
  shutil.copy(EXAMPLE, folder / 'own_model.py')
  (folder / 'trace.txt').write_text(trace)
  return folder


def _env(launcher):
  return launcher.env(PYTHONPATH=str(ROOT))  # the package importable, as where it is installed


@pytest.mark.parametrize('kind', ['own_model:TinyLM'])  # its gpt2 case: the next test
def test_the_supervisors_processes_train_a_model_as_a_one_process_replay(launcher, tmp_path, kind):
  """A user's model by its module:factory name."""
  folder = _user_folder(tmp_path)
  cmd = [sys.executable, '-m', 'mecefo_jax.launch', '-n', '2', '--devices-per-process', '2', '--',
         '--model', kind, '--out', 'run', f'snapshot.dir={tmp_path / "shm"}',
         '--failures=trace:trace.txt', 'mesh.slice=4', 'mesh.ordered_reduce=true', *ARGS]
  job = launcher.run(cmd, timeout=600, cwd=folder, env=_env(launcher))
  assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
  result = report(folder / 'run')
  assert result['config']['model']['kind'] == kind
  assert result['samples']['degraded'] > 0 and result['samples']['dropped'] == 0
  state = json.loads((folder / 'run' / 'run_state.json').read_text())
  assert state['model']['kind'] == kind and len(state['model']['tree']) == 16
  replay_cmd = _replay_command(folder / 'run')
  assert replay_cmd[1:3] == ['-m', 'mecefo_jax'], replay_cmd
  replay = launcher.run([sys.executable, *replay_cmd[1:]], timeout=600, cwd=folder,
                        env=_env(launcher))
  assert replay.returncode == 0, replay.stderr[-3000:]
  _assert_replayed(folder, kind)


def _replay_command(run) -> list[str]:
  """The replay command on failures.txt's first line, split (`python -m mecefo_jax ...`, or
  `python train.py ...` where the run was started in-process)."""
  line = (run / 'failures.txt').read_text().splitlines()[0]
  return shlex.split(re.fullmatch(r'# replay: `(python [^`]*)`', line).group(1))


def _assert_replayed(folder, kind):
  result, reference = report(folder / 'run'), report(folder / 'run' / 'replay')
  assert not (folder / 'runs').exists()  # the replay never replaces another run
  assert reference['config']['model']['kind'] == kind
  assert result['params_sha256'] == reference['params_sha256']
  assert result['samples'] == reference['samples']


@pytest.mark.slow  # two whole trainings (in this process: the supervisor's part is the test above)
def test_the_built_in_second_model_trains_through_failures_as_its_replay(tmp_path, monkeypatch,
                                                                        devices):
  """gpt2 through a slice down and back (one process of 4 slices), then failures.txt's replay
  command: the same params and samples. Merged from the test above's gpt2 case, which ran it
  through the supervisor's 2 processes too (what that test shows for any model)."""
  folder = _user_folder(tmp_path, ONE_DOWN)
  monkeypatch.chdir(folder)
  args = ['--model', 'gpt2', '--out', 'run', f'snapshot.dir={tmp_path / "shm"}',
          '--failures=trace:trace.txt', 'mesh.slice=4', 'faults.precompile=never', *ARGS]
  assert cli.main(args) == 0
  result = report(folder / 'run')
  assert result['config']['model']['kind'] == 'gpt2'
  assert result['samples']['degraded'] > 0 and result['samples']['dropped'] == 0
  # The command as the trainer was last entered in this process (hints.entered).
  replay_cmd, program = _replay_command(folder / 'run'), shlex.split(hints.train_command())
  assert replay_cmd[:len(program)] == program, replay_cmd
  assert cli.main(replay_cmd[len(program):]) == 0
  _assert_replayed(folder, 'gpt2')


def test_the_example_killed_and_resumed_ends_bit_exact(launcher, tmp_path):
  folder = _user_folder(tmp_path)
  (tmp_path / 'shm').mkdir()
  run = lambda out, *extra, env=None: launcher.run(
      [sys.executable, 'own_model.py', '--host-devices', '4', '--failures', 'trace:trace.txt',
       '--out', out, *extra, f'snapshot.dir={tmp_path / "shm" / out}', 'snapshot.every=1',
       *ARGS], timeout=600, cwd=folder, env={**_env(launcher), **(env or {})})
  whole = run('whole')
  assert whole.returncode == 0, whole.stderr[-3000:]
  killed = run('killed', env={TEST_DEATH_ENV: '0:5'})
  assert killed.returncode == -9, killed.stderr[-3000:]
  resumed = run('killed', '--resume')
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  done, again = report(folder / 'whole'), report(folder / 'killed')
  assert again['resumed_from_step'] == 5 and done['samples']['degraded'] > 0
  assert again['params_sha256'] == done['params_sha256']
  assert again['samples'] == done['samples']


def test_a_resume_with_another_model_is_refused_in_one_line(tmp_path, capsys, devices):
  out = tmp_path / 'run'
  base = ['--out', str(out), *TINY, 'train.steps=4', 'snapshot.enabled=false',
          '--stop-after', '2']
  assert cli.main(base) != BAD_INPUT
  capsys.readouterr()
  assert cli.main(['--out', str(out), '--resume', '--model', 'gpt2']) == BAD_INPUT
  lines = error_lines(capsys.readouterr().err)
  assert len(lines) == 1 and 'resume with another model' in lines[0], lines
  assert "model.kind='llama'" in lines[0] and "'gpt2'" in lines[0], lines


def test_the_docs_example_is_the_whole_example_file_and_its_bases_are_as_it_shows():
  """What docs/own_model.md shows is the file the tests above run, and the bases tree it shows
  for a list of blocks is the one the trainer builds for that model."""
  shown = re.findall(r'```python\n(.*?)\n```', DOC.read_text(), re.S)
  assert shown == [EXAMPLE.read_text().rstrip('\n')]
  loaded = importlib.util.spec_from_file_location('own_model_shown', EXAMPLE)
  module = importlib.util.module_from_spec(loaded)
  loaded.loader.exec_module(module)
  kind = models.register(module.TinyLM)
  cfg = load_config(None, [f'model.kind={kind}', 'model.n_layers=2'])
  d, ffn = cfg.model.d_model, cfg.model.ffn_dim
  inner = {'w_in': ('embed', 'rank'), 'w_out': ('mlp', 'rank')}
  assert bases.axes(models.spec(cfg.model)) == {'layers': {i: {'mlp': {'inner': inner}}
                                                           for i in range(2)}}
  assert [(layer.path[-1], layer.shape[0]) for layer in models.spec(cfg.model).basis_layers] == \
      [('w_in', d), ('w_out', ffn)] * 2  # each basis [d_in, rank]
  assert "bases = {'layers': {0: {'mlp': {'inner': {'w_in': [d_model, rank], 'w_out': [ffn_dim, " \
      "rank]}}}," in DOC.read_text()
