"""colab/mecefo_quickstart.ipynb executed top to bottom in a kernel of this interpreter.

Run: python -m benchmarks.notebook_run --json OUT.json   (benchmarks/gpu_check.sh's notebook part)
The notebook's settings come from the environment (colab/README.md); unset here, the short
ones: MECEFO_NOTEBOOK_STEPS=30, MECEFO_NOTEBOOK_DEVICE_STEPS=20. It prints every cell's text
output; the JSON holds the seconds, the one-device part's step cost and run (on a runtime with
one accelerator device), and the first cell error. Exit 1 on a cell error. tests/test_notebook.py
runs the notebook through execute() too.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / 'colab' / 'mecefo_quickstart.ipynb'
SHORT = {'MECEFO_NOTEBOOK_STEPS': '30', 'MECEFO_NOTEBOOK_DEVICE_STEPS': '20'}


def kernelspec(work: Path) -> Path:
  """A JUPYTER_PATH whose 'python3' kernel runs this interpreter (before any user-wide one)."""
  spec = work / 'jupyter' / 'kernels' / 'python3'
  spec.mkdir(parents=True)
  (spec / 'kernel.json').write_text(json.dumps({
      'argv': [sys.executable, '-m', 'ipykernel_launcher', '-f', '{connection_file}'],
      'display_name': 'Python 3 (mecefo-jax)', 'language': 'python'}))
  return work / 'jupyter'


def execute(env: dict, work: Path, cell_timeout_s: int):
  """(the executed notebook, seconds, the first cell error or None): an in-memory copy of the
  notebook run with the kernel's environment `env`; the committed file is never written."""
  import nbformat
  from nbclient import NotebookClient
  from nbclient.exceptions import CellExecutionError
  nb = nbformat.read(NOTEBOOK, as_version=4)
  saved = os.environ.get('JUPYTER_PATH')
  os.environ['JUPYTER_PATH'] = str(kernelspec(work))  # where the client finds the kernel
  client = NotebookClient(nb, kernel_name='python3', timeout=cell_timeout_s,
                          resources={'metadata': {'path': str(ROOT / 'colab')}})
  t0, error = time.perf_counter(), None
  try:
    client.execute(env=env)
  except CellExecutionError as err:
    error = str(err).strip().splitlines()[-1]
  finally:
    if saved is None:
      del os.environ['JUPYTER_PATH']
    else:
      os.environ['JUPYTER_PATH'] = saved
    nbformat.write(nb, work / 'executed.ipynb')  # to look at when it fails
  return nb, time.perf_counter() - t0, error


def text(nb) -> str:
  """The text the notebook's cells printed (streams and plain-text results)."""
  parts = []
  for cell in nb.cells:
    for out in cell.get('outputs', []):
      if out.output_type == 'stream':
        parts.append(out.text)
      elif 'data' in out:
        parts.append(out.data.get('text/plain', ''))
  return ''.join(parts)


def device_figures(work: Path) -> dict | None:
  """The one-device part's step cost and training run, where it ran (MECEFO_NOTEBOOK_DIR)."""
  found = sorted(work.glob('mecefo_nb_device_*/step_cost.json'))
  if not found:
    return None
  cost = json.loads(found[0].read_text())
  report_path = found[0].parent / 'train' / 'report.json'
  report = json.loads(report_path.read_text()) if report_path.exists() else {}
  return {'device': cost['device'], 'times': cost['times'],
          'temp_bytes': {k: v.get('temp_bytes') for k, v in cost['memory'].items()},
          **{k: cost[k] for k in ('time_ratio', 'memory_ratio', 'micro_batch', 'seq_len')},
          'train': {k: report.get(k) for k in ('steps', 'device', 'first_loss', 'final_loss',
                                                'tokens_per_s', 'startup')}}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog='python -m benchmarks.notebook_run',
                              description=__doc__.splitlines()[0])
  p.add_argument('--json', default=None, help='write the figures to this JSON file')
  p.add_argument('--cell-timeout', type=int, default=600, help='seconds per cell')
  args = p.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix='mecefo-notebook-') as tmp:
    work = Path(tmp)
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get('PYTHONPATH')])])
    env = {**SHORT, **os.environ, 'MECEFO_NOTEBOOK_DIR': str(work), 'PYTHONPATH': path}
    nb, seconds, error = execute(env, work, args.cell_timeout)
    print(text(nb))
    result = {'seconds': seconds, 'error': error, 'one_device': device_figures(work)}
  if args.json:
    Path(args.json).write_text(json.dumps(result, indent=2))
  print(f'notebook executed in {seconds:.1f} s' + (f'; error: {error}' if error else ''))
  return 1 if error else 0


if __name__ == '__main__':
  sys.exit(main())
