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
from mecefo_jax.run import cli
from mecefo_jax.records.job import BAD_INPUT
from mecefo_jax.run.stop import TEST_DEATH_ENV
from procs import ROOT, TINY, error_lines, report

EXAMPLE = ROOT / 'examples' / 'own_model.py'
DOC = ROOT / 'docs' / 'own_model.md'
STEPS = 10
ARGS = [*TINY, f'train.steps={STEPS}', 'train.eval_every=0',
        'train.log_every=1', 'mecefo.tau=3', 'faults.takeover=spread']  # MeCeFO's degraded rows
TRACE = '2 1 fail\n3 3 fail\n6 1 repair\n8 3 repair\n'
# The built-in second model's job: one slice down and back, two live sets to build programs
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


@pytest.mark.parametrize('kind', ['own_model:TinyLM', 'gpt2'])
def test_the_supervisors_processes_train_a_model_as_a_one_process_replay(launcher, tmp_path, kind):
  """A user's model by its module:factory name, and the built-in second model."""
  folder = _user_folder(tmp_path, ONE_DOWN if kind == 'gpt2' else TRACE)
  cmd = [sys.executable, '-m', 'mecefo_jax.launch', '-n', '2', '--devices-per-process', '2', '--',
         '--model', kind, '--out', 'run', f'snapshot.dir={tmp_path / "shm"}',
         '--failures=trace:trace.txt', 'mesh.slice=4', 'mesh.ordered_reduce=true', *ARGS]
  if kind == 'gpt2':  # the user's model keeps the default: its programs built ahead as well
    cmd.append('faults.precompile=never')  # the built-in one's: ~1/4 less CPU
  job = launcher.run(cmd, timeout=600, cwd=folder, env=_env(launcher))
  assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
  result = report(folder / 'run')
  assert result['config']['model']['kind'] == kind
  assert result['samples']['degraded'] > 0 and result['samples']['dropped'] == 0
  state = json.loads((folder / 'run' / 'run_state.json').read_text())
  assert state['model']['kind'] == kind and len(state['model']['tree']) == 16
  line = (folder / 'run' / 'failures.txt').read_text().splitlines()[0]
  replay_cmd = re.fullmatch(r'# replay: `(python -m mecefo_jax [^`]*)`', line).group(1)
  replay = launcher.run([sys.executable, *shlex.split(replay_cmd)[1:]], timeout=600, cwd=folder,
                        env=_env(launcher))
  assert replay.returncode == 0, replay.stderr[-3000:]
  reference = report(folder / 'run' / 'replay')
  assert not (folder / 'runs').exists()  # the replay never replaces another run
  assert reference['config']['model']['kind'] == kind
  assert result['params_sha256'] == reference['params_sha256']
  assert result['samples'] == reference['samples']


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
