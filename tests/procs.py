"""The one way tests start processes (train.py, benchmarks, tools): tracked, killed by pid.

A test that starts a process takes the `launcher` fixture (tests/conftest.py), and that alone
marks it `slow`. Processes share the suite's one compilation cache directory (conftest.py:
suite_cache; train.py uses only its program store) with the in-process runs;
`env(compile_cache=False)` gives a run an empty one of its own, for a test about compiling or
a cold start. Never the user's home.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkserver

ROOT = Path(__file__).resolve().parents[1]
# The suite's XLA flags, in-process (tests/conftest.py) and in every process it starts: LLVM's
# optimizations off, so the tiny models' programs compile ~40% faster and run as exactly (no
# fast-math either way). The suite's time is mostly compiles.
SUITE_XLA_FLAGS = '--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false'
# For a process whose training steps cost more than its compiles (the notebook's tiny.yaml runs):
# LLVM's first optimization level. On `train.py --host-devices 4 mesh.slice=4` with tiny.yaml, 60
# steps, a cold store: steps 11 s -> 3.2 s, compiles 1.9 s -> ~3 s, 28 -> 16 CPU s a run; on the
# TINY model (steps ~0.01 s) the same flag costs more than it saves (6 programs 6.7 -> 10.9 s).
STEP_XLA_FLAGS = '--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false'


def pin_blas_kernels() -> None:
  """Names OpenBLAS's AVX2 kernels (on an x86-64 CPU that has AVX2) before any BLAS loads.

  jax's CPU QR and SVD (the low-rank bases, ops/basis.py) call the LAPACK of scipy's wheel,
  whose OpenBLAS picks kernels by CPU: an AVX-512 Xeon's bases differ from an AMD's in their
  last bits, and so does every parameter after a degraded step. Named, the golden run's fixture
  (tests/fixtures/run_records) and the params hashes that tests compare travel across CPUs.
  """
  cpu = Path('/proc/cpuinfo')
  if cpu.is_file() and ' avx2' in cpu.read_text():
    os.environ['OPENBLAS_CORETYPE'] = 'Haswell'


# The model every process-starting test trains: one layer, 16-token rows, seconds per run; and
# no training.png at its end (~1 CPU s of matplotlib a run, a quarter of a short warm train.py):
# tests/test_run_outputs.py checks the plot.
TINY = ('model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=48', 'model.seq_len=16',
        'model.n_layers=1', 'train.micro_batch=4', 'train.plot=false')


FORK_ENV = 'MECEFO_TEST_FORK'  # 0: every process a new interpreter (no fork server)
_server: forkserver.ForkServer | None = None


def _fork_server(env: dict[str, str]) -> forkserver.ForkServer:
  """This pytest process's fork server, started on first use with the launcher's `env`."""
  global _server
  if _server is None:
    _server = forkserver.ForkServer(env)
    atexit.register(_server.close)
  return _server


def forked_cpu_s() -> float:
  """CPU seconds of the fork server's children whose end was read (tests/costs.py)."""
  return _server.cpu_s if _server else 0.0


class Launcher:
  """Starts processes in sessions of their own, so that each is killed with its children."""
  starts = 0  # processes started by this pytest process (tests/costs.py counts them per test)

  def __init__(self, compile_cache: Path, scratch: Path):
    """`compile_cache`: the suite's; `scratch`: where the cold runs' empty ones go."""
    self.compile_cache, self.scratch = compile_cache, scratch
    self.started: list[subprocess.Popen] = []
    self._cold = 0

  def env(self, compile_cache: bool = True, **extra: str) -> dict:
    """This environment with the suite's XLA flags but not conftest's 8 fake devices (train.py's
    --host-devices sets them); the suite's compilation cache, or with `compile_cache=False` an
    empty one."""
    # OpenBLAS single-threaded, as the benchmarks set it (benchmarks/__init__.py): numpy's and
    # scipy's read it as they load, which a forked child (tests/forkserver.py) did before it.
    env = dict(os.environ, XLA_FLAGS=SUITE_XLA_FLAGS, JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1',
               OPENBLAS_NUM_THREADS='1')
    # Python's default: a process writes the bytecode of what it compiled (__pycache__, ignored
    # by git) and the next reads it. A sandbox's PYTHONDONTWRITEBYTECODE=1 made each of the
    # suite's processes compile this package and the benchmarks from source: ~0.5 CPU s each.
    env.pop('PYTHONDONTWRITEBYTECODE', None)
    if compile_cache:  # every program, however fast it compiled: runs repeat the tiny model's
      env.update(JAX_COMPILATION_CACHE_DIR=str(self.compile_cache),
                 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
    else:
      self._cold += 1
      env['JAX_COMPILATION_CACHE_DIR'] = str(self.scratch / f'cold-{self._cold}')
    return {**env, **extra}

  def start(self, args, *, cwd=ROOT, env=None, **popen) -> subprocess.Popen:
    """`args` started in `cwd` with `env` (this launcher's by default): forked from the fork
    server where it can run them (tests/forkserver.py), else a new process."""
    args, env = [str(a) for a in args], env or self.env()
    server = _fork_server(self.env()) if os.environ.get(FORK_ENV, '1') != '0' else None
    proc = (server and server.start(args, cwd=cwd, env=env, **popen) or
            subprocess.Popen(args, cwd=cwd, env=env, start_new_session=True, **popen))
    self.started.append(proc)
    Launcher.starts += 1
    return proc

  def run(self, args, *, timeout: float, **popen) -> subprocess.CompletedProcess:
    """Runs to the end within `timeout` seconds (killed past it): code, stdout, stderr."""
    proc = self.start(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
      out, err = proc.communicate(timeout=timeout)
    finally:
      kill(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

  def python(self, *args, timeout: float = 240, **popen) -> subprocess.CompletedProcess:
    return self.run([sys.executable, *args], timeout=timeout, **popen)

  def train(self, *args, timeout: float = 240, **popen) -> subprocess.CompletedProcess:
    """`python train.py ARGS` from the repository root (or `cwd`)."""
    return self.python(ROOT / 'train.py', *args, timeout=timeout, **popen)

  def benchmark(self, name: str, *args, json_path: Path, optimized: bool = False) -> dict:
    """The result JSON of `python -m benchmarks.NAME ARGS --json json_path`, as users run it
    from the repository root (it must exit 0), with the run metadata every result carries.
    `optimized`: XLA's own flags instead of the suite's, for a benchmark whose training steps
    cost more than its compiles (quality's 2 x 300 steps: 47 s against 71 s alone, the same
    losses; at 2 x 150 steps 47-49 CPU s against 58-61; its preset and trace runs, compiles
    mostly, took longer so)."""
    args = [*map(str, args), '--json', str(json_path)]
    env = self.env(XLA_FLAGS='') if optimized else None
    proc = self.python('-m', f'benchmarks.{name}', *args, timeout=900, env=env)
    assert proc.returncode == 0, (f'exit {proc.returncode}\n' + proc.stdout[-4000:] +
                                  proc.stderr[-4000:])
    result = json.loads(Path(json_path).read_text())
    assert result['command'] == shlex.join(['python', '-m', f'benchmarks.{name}', *args])
    assert result['commit'] is None or re.fullmatch(r'[0-9a-f]{40}(-dirty)?', result['commit'])
    device = result['device']
    assert device['platform'] == 'cpu' and device['device_kind'] and device['device_count'] >= 1
    assert device['host_cpu_count'] >= 1
    assert re.fullmatch(r'\d{4}-\d\d-\d\dT.*\+00:00', result['date'])
    return result

  def kill_all(self, since: int = 0) -> None:
    for proc in self.started[since:]:
      kill(proc)


def suite_store():
  """The suite's program store (conftest.py: suite_cache), opened as train.py opens one."""
  from mecefo_jax.step import program_store
  return program_store.open_store('', 8 << 10)


def kill(proc: subprocess.Popen) -> None:
  """SIGKILL to the process and everything in its session (its children), then reaps it."""
  if proc.poll() is None:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  proc.wait()


@contextlib.contextmanager
def busy_core():
  """One core kept busy by another process (`yes > /dev/null`) while the block runs: the
  supervisor's fault tests hold on a loaded machine too."""
  hog = subprocess.Popen(['yes'], stdout=subprocess.DEVNULL, start_new_session=True)
  try:
    yield hog
  finally:
    kill(hog)


def wait_all(procs, timeout: float) -> list[int]:
  """Exit codes of `procs`, all within `timeout` seconds (all killed past it)."""
  deadline = time.monotonic() + timeout
  try:
    return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
  finally:
    for p in procs:
      kill(p)


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
  """Polls `condition` until true; fails if `proc` exits first or after `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while not condition():
    assert proc is None or proc.poll() is None, \
        f'the process exited ({proc.returncode}) before {what}'
    assert time.monotonic() < deadline, f'no {what} within {timeout} s'
    time.sleep(0.01)


def tree(*roots: Path) -> dict[str, tuple[int, str]]:
  """{path: (size, sha256)} of every file under `roots` (directories as (-1, ''), so that an
  empty one made or removed shows too): what a start left untouched compares equal."""
  import hashlib
  found = {}
  for root in map(Path, roots):
    for path in sorted(root.rglob('*')) if root.is_dir() else ():
      found[str(path)] = ((path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
                          if path.is_file() else (-1, ''))
  return found


def report(out: Path) -> dict:
  return json.loads((Path(out) / 'report.json').read_text())


def requeued_ids(out: Path, seq_len: int) -> list[int]:
  """The stream's sample ids a `requeue` run trained, in step order, read back from its
  metrics.jsonl (train.log_every=1): each step's first_sample and its tokens; a step trained
  again after a restore counts once, by its last row."""
  rows = {}
  for line in (out / 'metrics.jsonl').read_text().splitlines():
    row = json.loads(line)
    if row['kind'] == 'train':
      rows[row['step']] = row
  assert sorted(rows) == list(range(len(rows))), f'steps missing from the rows: {sorted(rows)}'
  ids = []
  for step in sorted(rows):
    n = round((rows[step]['exact_tokens'] + rows[step]['degraded_tokens']) / seq_len)
    ids += range(rows[step]['first_sample'], rows[step]['first_sample'] + n)
  return ids


def usage_error(capsys, parse, argv) -> str:
  """The one `error: ...` line that `parse(argv)` (a command's argument parser) exits with."""
  import pytest
  with pytest.raises(SystemExit) as stop:
    parse(argv)
  assert stop.value.code == 2
  [line] = capsys.readouterr().err.splitlines()
  assert line.startswith('error: '), line
  return line


def error_lines(text: str) -> list[str]:
  return [line for line in text.splitlines() if line.startswith('error:')]
