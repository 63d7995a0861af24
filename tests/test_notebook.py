"""colab/mecefo_quickstart.ipynb: committed without outputs, its §5 text true to its code, and runs
top to bottom on CPU.

The run uses the notebook's tiny setting (MECEFO_NOTEBOOK_STEPS), a kernel of this interpreter
(a kernelspec written into a temp JUPYTER_PATH: benchmarks/notebook_run.py), 4 simulated CPU devices, and an in-memory
copy of the notebook: the committed file is never written.
"""
import json
import re
import sys
from pathlib import Path

import nbformat
import pytest
from packaging.requirements import Requirement

from benchmarks import notebook_run
from mecefo_jax import install
from mecefo_jax.config import FaultConfig
from procs import STEP_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / 'colab' / 'mecefo_quickstart.ipynb'
STEPS = 30  # CI's MECEFO_NOTEBOOK_STEPS: failure at 9-18, crash at 14, snapshot at 10
CELL_TIMEOUT_S = 150


def read_notebook():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  return nb


def test_notebook_is_committed_without_outputs():
  nb = read_notebook()
  code = [c for c in nb.cells if c.cell_type == 'code']
  assert code, 'the notebook has no code cells'
  dirty = [i for i, c in enumerate(nb.cells)
           if c.cell_type == 'code' and (c.outputs or c.execution_count is not None)]
  assert not dirty, (f'cells {dirty} of {NOTEBOOK.name} have outputs or execution counts: clear '
                     'them before committing (see colab/README.md)')


def test_the_notebook_leaves_jax_persistent_cache_off_as_train_py_does():
  code = '\n'.join(c.source for c in read_notebook().cells if c.cell_type == 'code')
  assert 'jax_compilation_cache_dir' not in code
  assert "jax.config.update('jax_enable_compilation_cache', False)" in code


def test_section_5_names_the_takeover_policy_its_code_runs():
  cells = read_notebook().cells
  i = next(i for i, c in enumerate(cells) if c.source.startswith('## 5.'))
  override = re.search(r'faults\.takeover=(\w+)', cells[i + 1].source)
  policy = override.group(1) if override else FaultConfig.takeover
  text = ' '.join(cells[i].source.split())
  assert f'takeover policy `{policy}`' in text or f'default takeover policy, `{policy}`' in text
  # ... and says which the default is where the code names another
  assert override is None or f'the default, `{FaultConfig.takeover}`' in text


# ---- the install cell's check (mecefo_jax/install.py) -------------------------------------------
FAKE = {'jax': '0.10.2', 'flax': '0.12.8', 'pyyaml': '6.0.1', 'xxhash': '3.0.0', 'numpy': '2.1rc1'}


def test_requirements_txt_sections():
  runtime, test = install.sections((ROOT / 'requirements.txt').read_text())
  names = [r.split('>')[0].split('=')[0] for r in runtime]
  assert {'jax', 'flax', 'xxhash', 'tqdm', 'tensorboardX', 'matplotlib'} <= set(names)
  assert 'pytest>=8' in test and 'pytest>=8' not in runtime
  assert install.sections('a==1  # why\n# Tests\nb>=2\n') == (['a==1'], ['b>=2'])


@pytest.mark.parametrize('requirement, met', [
    ('jax>=0.10,<0.12', True), ('jax>=0.11', False), ('flax==0.12.8', True),
    ('flax==0.12.7', False), ('PyYAML>=6', True), ('xxhash>=3.4', False), ('tqdm>=4.66', False),
    ('numpy>=2.0', True), ('numpy>=2.1', False),  # a pre-release installed: by its order
    ('tqdm>=4.66; python_version < "3"', True),  # not for this Python
])
def test_unmet_compares_installed_versions_with_the_specifiers(requirement, met):
  assert install.unmet([requirement], FAKE.get) == ([] if met else [requirement])


def test_this_environment_meets_the_runtime_requirements():
  """What lets the notebook run in CI without a pip call (it would need the network)."""
  runtime, _ = install.sections((ROOT / 'requirements.txt').read_text())
  assert install.unmet(runtime) == []
  assert install.installed_version('no-such-distribution-mecefo') is None


@pytest.mark.parametrize('plugin, jax', [(None, 'jax>=0.10,<0.12'),
                                         ('libtpu', 'jax[tpu]<0.12,>=0.10'),
                                         ('jax-cuda12-plugin', 'jax[cuda12]<0.12,>=0.10')])
def test_pip_args_keep_the_accelerator_plugin_in_step_with_jax(plugin, jax):
  version = {plugin: '1.0'}.get
  args = install.pip_args(['jax>=0.10,<0.12; python_version >= "3"', 'flax==0.12.8'], version)
  assert args == [str(Requirement(jax)), 'flax==0.12.8']  # the marker, already evaluated, dropped


def test_imported_names_the_modules_a_kernel_would_keep_at_their_old_version():
  import yaml  # noqa: F401  (PyYAML's module)
  assert 'yaml' in install.imported(['pyyaml>=6'])
  assert install.imported(['no-such-distribution-mecefo>=1']) == []


def test_notebook_runs_on_cpu(launcher, tmp_path):
  # The kernel's environment: no conftest's 8 devices (the notebook picks 4), no repo URL.
  # The one-accelerator path, forced on the CPU: the device part runs tiny (llama_60m on a GPU).
  # Its steps cost more than its compiles: procs.STEP_XLA_FLAGS (CPU s 91.8, 87.9 -> 81.1, 83.2).
  env = launcher.env(MECEFO_NOTEBOOK_STEPS=str(STEPS), MECEFO_NOTEBOOK_DIR=str(tmp_path),
                     PYTHONPATH=str(ROOT), MECEFO_NOTEBOOK_ONE_DEVICE='1',
                     MECEFO_NOTEBOOK_DEVICE_MODEL='configs/tiny.yaml',
                     MECEFO_NOTEBOOK_DEVICE_STEPS='10', XLA_FLAGS=STEP_XLA_FLAGS)
  env.pop('MECEFO_REPO_URL', None)
  committed = NOTEBOOK.read_bytes()
  nb, elapsed, error = notebook_run.execute(env, tmp_path, CELL_TIMEOUT_S)
  print(f'notebook executed in {elapsed:.1f} s ({tmp_path / "executed.ipynb"})')
  assert error is None, error
  errors = [out for cell in nb.cells for out in cell.get('outputs', [])
            if out.output_type == 'error']
  assert not errors, errors
  text = notebook_run.text(nb)
  assert f'python: {sys.executable}' in text, 'the kernel is not this interpreter'
  assert 'runtime packages installed at allowed versions' in text, 'the install cell ran pip'
  assert 'mesh of 4 slices' in text
  assert 'MECEFO_NOTEBOOK_ONE_DEVICE=1: the one-device path, with the CPU as the device' in text
  assert 'the failure demos need >= 2 data-parallel slices, which one device cannot give, so ' \
         'they run on 4 simulated CPU devices' in text
  cost = re.search(r'degraded step on 2 micro-batches vs normal on 1: time ([\d.]+)x, temp '
                   r'memory ([\d.]+)x', text)
  assert cost and float(cost.group(1)) > 0 and float(cost.group(2)) > 0, text[-3000:]
  assert re.search(r'normal step, 1 micro-batch +[\d.]+ ms +[\d.]+ MiB temp memory', text)
  assert 'trained 10 steps of configs/tiny.yaml on cpu: loss ' in text
  device = notebook_run.device_figures(tmp_path)  # gpu_check.sh's notebook part records them
  assert device['train']['steps'] == 10 and device['time_ratio'] > 0 and device['device'][
      'platform'] == 'cpu' and device['temp_bytes']['degraded_2'] > 0
  assert 'relative difference (with failure vs fault-free)' in text
  assert 'slice 1 FAILED' in text and 'slice 1 repaired' in text
  assert 'max |low-rank - V Vᵀ exact|' in text
  assert 'crash: the trainer process died at the start of step 14' in text
  assert 'in-memory snapshots left by the crashed run (steps done): [10] in ' in text  # its own
  assert 'resumed from the snapshot taken after 10 steps' in text
  assert 'resume check: final params_sha256 matches the uninterrupted run' in text
  # The runs share the program store train.py opens (here the suite's): the later runs load
  # what the fault-free one compiled, the resumed one what the run with the failure compiled.
  runs = next(p for p in tmp_path.glob('mecefo_nb_*') if (p / 'fault_free').is_dir())
  loaded = {run: json.loads((runs / run / 'report.json').read_text())['programs']['loaded']
            for run in ('with_failure', 'crashed')}
  assert all(n >= 1 for n in loaded.values()), loaded
  assert 'live plot through on_log' in text
  images = sum('image/png' in out.get('data', {}) for cell in nb.cells
               for out in cell.get('outputs', []))
  assert images >= 6, f'{images} plots'  # the device run's, the 4 runs' and the toy model's
  assert NOTEBOOK.read_bytes() == committed, 'the committed notebook was modified'
