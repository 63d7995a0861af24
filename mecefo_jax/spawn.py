"""Workers forked from a supervisor that imported their modules once: a job's start and every
restart skip the ~2 CPU s of imports per process (launch.py `--spawn fork`, the default)."""
from __future__ import annotations

import atexit
import importlib
import importlib.util
import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings

WORKER = ['-m', 'mecefo_jax']  # a worker's command after sys.executable: what may be forked
# What a worker imports before its first step (its lazy imports included).
PRELOAD = ('jax', 'jax.numpy', 'flax.nnx', 'optax', 'orbax.checkpoint', 'yaml',
           'mecefo_jax.__main__', 'mecefo_jax.multihost', 'mecefo_jax.core.decider',
           'mecefo_jax.data.sources', 'mecefo_jax.records.progress_marks', 'mecefo_jax.run.parts',
           'mecefo_jax.run.trainer', 'mecefo_jax.run.report', 'mecefo_jax.run.rundir',
           'mecefo_jax.run.stop', 'mecefo_jax.snapshot.capacity', 'mecefo_jax.step.program_store',
           # jax's CPU LAPACK kernels, readied before a worker loads its first program
           # (step/retarget.py _init_lapack): ~0.2 CPU s a worker start
           'scipy.linalg')
OPTIONAL = ('tensorboardX',)  # imported where installed (train.tensorboard)
_POLL_S = 0.01
_imported_with: dict[str, str] | None = None  # the JAX_ variables jax read at its import


def jax_env(env) -> dict[str, str]:
  """The variables jax reads once, at its import (its config's defaults)."""
  return {k: v for k, v in env.items() if k.startswith('JAX_')}


def preload(env: dict[str, str]) -> None:
  """Imports what a worker of `env` imports, once: jax reads its JAX_ variables as a worker
  would (they are set here first, where jax is not imported yet)."""
  global _imported_with
  if _imported_with is not None:
    return
  if 'jax' not in sys.modules:
    os.environ.update(jax_env(env))
  _imported_with = jax_env(os.environ)
  for name in PRELOAD + tuple(m for m in OPTIONAL if importlib.util.find_spec(m)):
    importlib.import_module(name)


def forkable(cmd: list[str], env: dict[str, str]) -> bool:
  """Whether `cmd` (with `env`) is a worker this process can fork: its own Python's
  `-m mecefo_jax`, no thread of this process's running (a fork copies none of them, and any
  lock one holds stays held), no jax backend up (its runtime's threads), and jax imported (if
  it is) under the JAX_ variables the worker has."""
  if cmd[:3] != [sys.executable, *WORKER] or threading.active_count() > 1:
    return False
  if 'jax' not in sys.modules:
    return True
  if jax_backend_up():
    return False
  return _imported_with is None or jax_env(env) == _imported_with


def jax_backend_up() -> bool:
  """Whether jax has started a backend in this process (XLA has read its flags then); never
  imports jax itself."""
  if 'jax' not in sys.modules:
    return False
  from jax._src import xla_bridge  # (imported: jax is)
  return xla_bridge.backends_are_initialized()


class Signaled:
  """Popen's signal methods, for a child with a `pid` and `poll`."""
  pid: int

  def poll(self) -> int | None:
    raise NotImplementedError

  def send_signal(self, sig: int) -> None:
    if self.poll() is None:
      os.kill(self.pid, sig)

  def terminate(self) -> None:
    self.send_signal(signal.SIGTERM)

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)


class Forked(Signaled):
  """A forked worker, answering as a subprocess.Popen does."""

  def __init__(self, pid: int, args: list[str]):
    self.pid, self.args, self.returncode = pid, args, None

  def poll(self) -> int | None:
    if self.returncode is None:
      pid, status = os.waitpid(self.pid, os.WNOHANG)
      if pid:
        self.returncode = os.waitstatus_to_exitcode(status)  # a signal's death: -N, as Popen
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    if timeout is None and self.returncode is None:  # blocks in the kernel, no polling
      self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
    deadline = time.monotonic() + (timeout or 0.0)
    while self.poll() is None:
      if time.monotonic() >= deadline:
        raise subprocess.TimeoutExpired(self.args, timeout)
      time.sleep(_POLL_S)
    return self.returncode


def fork(cmd: list[str], env: dict[str, str], stdout: int | None = None,
         stderr: int | None = None, pass_fds: tuple[int, ...] = ()) -> Forked:
  """Starts the worker `cmd` as a fork of this process (forkable() first): what
  subprocess.Popen(cmd, env=env, stdout=, stderr=, pass_fds=) starts, less the imports."""
  preload(env)
  sys.stdout.flush()
  sys.stderr.flush()
  with warnings.catch_warnings():  # Python 3.12 warns of any thread; forkable() checked
    warnings.simplefilter('ignore', DeprecationWarning)  # Python's (OpenBLAS's idle pool
    pid = os.fork()                                       # forks safely: its own atfork)
  if pid == 0:
    code = 1
    try:
      become(env, argv=[sys.modules['mecefo_jax.__main__'].__file__, *cmd[3:]],
             path_head=os.getcwd(), stdout=stdout, stderr=stderr, pass_fds=pass_fds)
      code = run_as_program(_worker_main)
    finally:
      os._exit(code)  # never back into the supervisor's code, none of its exit handlers
  return Forked(pid, cmd)


def become(env: dict[str, str], argv: list[str], path_head: str, stdin: int | None = None,
           stdout: int | None = None, stderr: int | None = None,
           pass_fds: tuple[int, ...] = ()) -> None:
  """This fork made what exec would make of it: the streams, the descriptors, the signals, the
  environment, and sys.path (`path_head` first: a script's directory, or the cwd of `-m`) and
  sys.argv of a new interpreter started with `env`."""
  for fd, given in ((0, stdin), (1, stdout)):
    if given is not None:
      os.dup2(given, fd)
  if stderr is not None:
    os.dup2(1 if stderr == subprocess.STDOUT else stderr, 2)
  keep = sorted({0, 1, 2, *pass_fds})
  for lo, hi in zip(keep, keep[1:] + [os.sysconf('SC_OPEN_MAX')]):
    os.closerange(lo + 1, hi)  # as exec with close_fds: the parent's pipes are its own
  for sig in signal.valid_signals():
    handler = signal.getsignal(sig)
    if callable(handler) and handler is not signal.default_int_handler:
      signal.signal(sig, signal.SIG_DFL)  # the parent's handlers (launch.serve)
  signal.signal(signal.SIGINT, signal.default_int_handler)
  sys.path[:] = worker_path(sys.path, os.environ.get('PYTHONPATH', ''),
                            env.get('PYTHONPATH', ''), path_head)
  os.environ.clear()
  os.environ.update(env)
  # A new interpreter's root logger has no handler until its main sets one (cli.py); this
  # one may have one on the parent's stderr (orbax logs through it as it is imported).
  logging.root.handlers.clear()
  _streams(unbuffered=bool(env.get('PYTHONUNBUFFERED')))
  sys.argv = list(argv)


def worker_path(path: list[str], own: str, given: str, cwd: str) -> list[str]:
  """The sys.path of a new interpreter whose first entry is `cwd` (its script's directory, or
  its cwd for `-m`) with PYTHONPATH `given`, from this process's `path` (its own first entry,
  then its own PYTHONPATH's entries, then the installation's)."""
  own_entries = [p for p in own.split(os.pathsep) if p]
  given_entries = [p for p in given.split(os.pathsep) if p]
  rest = [p for p in path[1:] if p not in own_entries and p not in given_entries]
  return [cwd, *given_entries, *rest]


def _streams(unbuffered: bool) -> None:
  """sys.stdout and sys.stderr on descriptors 1 and 2 as a new interpreter makes them
  (PYTHONUNBUFFERED: each write reaches the file at once; a worker's last words rely on it)."""
  sys.stdout = _stream(sys.stdout, 1, buffered=not unbuffered, line=False)
  sys.stderr = _stream(sys.stderr, 2, buffered=False, line=not unbuffered)


def _stream(old: io.TextIOWrapper, fd: int, buffered: bool, line: bool) -> io.TextIOWrapper:
  raw = io.FileIO(fd, 'w', closefd=False)
  return io.TextIOWrapper(io.BufferedWriter(raw) if buffered else raw, encoding=old.encoding,
                          errors=old.errors, write_through=not buffered, line_buffering=line)


def _worker_main() -> int | None:
  from mecefo_jax.__main__ import main
  return main(started=time.time())


def run_as_program(main) -> int:
  """Runs `main()` as the interpreter runs a program, and ends as it ends one (its threads
  joined, then atexit's handlers, the streams flushed; an uncaught Ctrl-C ends it by SIGINT):
  the exit code, for os._exit."""
  code = 0
  try:
    code = main()
  except SystemExit as end:
    code = end.code
  except KeyboardInterrupt:
    traceback.print_exc()
    code = -signal.SIGINT
  except BaseException:
    traceback.print_exc()
    code = 1
  if code is not None and not isinstance(code, int):
    print(code, file=sys.stderr)
    code = 1
  threading._shutdown()  # the interpreter's end: its threads joined, then atexit's handlers
  atexit._run_exitfuncs()
  sys.stdout.flush()
  sys.stderr.flush()
  if code == -signal.SIGINT:  # an uncaught Ctrl-C ends a Python process by that signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
  return (code or 0) & 0xFF
