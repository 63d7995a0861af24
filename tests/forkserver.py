"""A fork server for the suite's Python processes: one per pytest process imports jax and this
package once and forks each `python SCRIPT` or `python -m MODULE` a test starts (~1.5 CPU s of
imports less a process), answering as subprocess.Popen; procs.Launcher starts the rest as usual.
The children are made as mecefo_jax/spawn.py makes the supervisor's forked workers."""
from __future__ import annotations

import importlib
import importlib.util
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from mecefo_jax import spawn  # (it imports no jax)

ROOT = Path(__file__).resolve().parents[1]
# What a new interpreter or a library reads once, at its start or its import: a process whose
# values differ from the server's is started as a new interpreter. (spawn.become sets the
# environment, sys.path from PYTHONPATH and the streams from PYTHONUNBUFFERED.)
READ_AT_START = ('PYTHON', 'JAX_', 'OPENBLAS_', 'OMP_', 'MKL_', 'LD_', 'MALLOC')
SET_IN_THE_CHILD = ('PYTHONPATH', 'PYTHONUNBUFFERED')
# Imported before the first fork, beyond a supervisor's own (spawn.PRELOAD); never a module a
# test runs with -m (runpy would warn that it was imported before it ran).
PRELOAD = ('mecefo_jax.run.cli', 'mecefo_jax.supervisor')
_MESSAGE_BYTES = 1 << 20
_WAKE_S = 0.1  # a wait re-checks at least this often (another thread may have read its exit)


def _fixed_at_start(env: dict[str, str]) -> dict[str, str]:
  return {k: v for k, v in env.items()
          if k.startswith(READ_AT_START) and k not in SET_IN_THE_CHILD}


def _code_to_run(args: list[str], cwd: Path, env: dict[str, str]) -> dict | None:
  """What a forked child runs for `args` (`python SCRIPT ...` or `python -m MODULE ...`) in
  `cwd` and `env`, if it imports this package from where the server did; else None."""
  if len(args) < 2 or args[0] != sys.executable:
    return None
  given = [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p]
  if args[1] == '-m' and len(args) > 2:
    head, run = str(cwd), {'module': args[2], 'argv': [args[2], *args[3:]]}
  elif args[1].endswith('.py') and not args[1].startswith('-'):
    script = (cwd / args[1]).resolve()
    head, run = str(script.parent), {'script': str(script), 'argv': [str(script), *args[2:]]}
  else:
    return None
  if Path(head).resolve() != ROOT and str(ROOT) not in given:
    return None  # it would import another mecefo_jax, or none
  return {**run, 'path_head': head}


class ForkServer:
  """The client: starts the server on its first use; `start` answers a Served or None."""

  def __init__(self, env: dict[str, str]):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    boot = (f'import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); '
            f'import forkserver; forkserver.serve({theirs.fileno()})')
    self.process = subprocess.Popen([sys.executable, '-c', boot], cwd=ROOT, env=env,
                                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                    start_new_session=True)
    theirs.close()
    self.sock, self.fixed = ours, _fixed_at_start(env)
    self.exits: dict[int, tuple[int, float]] = {}
    self.cpu_s = 0.0  # of the children whose end was read (tests/costs.py)
    self.lock = threading.RLock()

  def start(self, args, *, cwd, env, stdin=None, stdout=None, stderr=None,
            text=False, **other) -> Served | None:
    run = _code_to_run(args, Path(cwd), env)
    if other or run is None or _fixed_at_start(env) != self.fixed:
      return None
    keep, send, own = _stdio(stdin, stdout, stderr)
    request = json.dumps({**run, 'cwd': str(cwd), 'env': env,
                          'stderr_to_stdout': stderr == subprocess.STDOUT}).encode()
    with self.lock:
      try:
        socket.send_fds(self.sock, [request], send)
      finally:
        for fd in own:
          os.close(fd)
      pid = None
      while pid is None:
        pid = self._read(None).get('started')
    return Served(self, pid, args, *keep, text=text)

  def _read(self, timeout: float | None) -> dict:
    """One message within `timeout` ({} if none); each child's end is kept in `exits`."""
    if not select.select([self.sock], [], [], timeout)[0]:
      return {}
    received = self.sock.recv(_MESSAGE_BYTES)
    if not received:
      raise RuntimeError(f'the fork server (pid {self.process.pid}) ended: '
                         f'exit {self.process.wait()}')
    message = json.loads(received)
    if 'exit' in message:
      self.exits[message['exit']] = (message['code'], message['cpu_s'])
    return message

  def pump(self, timeout: float) -> None:
    """Reads what the server said, waiting up to `timeout` seconds for a first message."""
    with self.lock:
      if self._read(max(0.0, min(timeout, _WAKE_S))):
        while self._read(0):
          pass

  def close(self) -> None:
    self.sock.close()  # the server ends at its end of file
    try:
      self.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.process.kill()
      self.process.wait()


def _stdio(stdin, stdout, stderr):
  """(the parent's ends: stdin, stdout, stderr or None; the child's three descriptors; those
  of them this process made and closes once sent)."""
  keep, send, own = [], [], []
  for fd, given, child_reads in ((0, stdin, True), (1, stdout, False), (2, stderr, False)):
    kept = None
    if given is None or given == subprocess.STDOUT:
      sent = fd  # inherited (stderr to stdout: the child dups its own 1)
    elif given == subprocess.PIPE:
      r, w = os.pipe()
      kept, sent = (w, r) if child_reads else (r, w)
      own.append(sent)
    elif given == subprocess.DEVNULL:
      sent = os.open(os.devnull, os.O_RDWR)
      own.append(sent)
    else:
      sent = given if isinstance(given, int) else given.fileno()
    keep.append(kept)
    send.append(sent)
  return keep, send, own


class Served(spawn.Signaled):
  """A forked child of the server, answering as a subprocess.Popen."""

  def __init__(self, server: ForkServer, pid: int, args, stdin, stdout, stderr, text: bool):
    self.server, self.pid, self.args, self.returncode = server, pid, args, None
    self.text = text
    self.stdin, self.stdout, self.stderr = (
        None if fd is None else open(fd, mode + ('' if text else 'b'))
        for fd, mode in ((stdin, 'w'), (stdout, 'r'), (stderr, 'r')))

  def poll(self) -> int | None:
    if self.returncode is None:
      self.server.pump(0)
      self._check()
    return self.returncode

  def _check(self) -> None:
    if self.returncode is None and self.pid in self.server.exits:
      self.returncode, cpu_s = self.server.exits.pop(self.pid)
      self.server.cpu_s += cpu_s

  def wait(self, timeout: float | None = None) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    self._check()
    while self.returncode is None:
      left = _WAKE_S if deadline is None else deadline - time.monotonic()
      if left <= 0:
        raise subprocess.TimeoutExpired(self.args, timeout)
      self.server.pump(left)
      self._check()
    return self.returncode

  def communicate(self, input=None, timeout: float | None = None):
    """What subprocess.Popen.communicate answers: the child's stdout and stderr read to their
    end (None where not a pipe), once it has exited."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if self.stdin:
      if input:
        self.stdin.write(input)
      self.stdin.close()
    pipes = {f.fileno(): bytearray() for f in (self.stdout, self.stderr) if f}
    open_fds = set(pipes)
    while open_fds:
      left = None if deadline is None else deadline - time.monotonic()
      if left is not None and left <= 0:
        raise subprocess.TimeoutExpired(self.args, timeout)
      for fd in select.select(list(open_fds), [], [], left)[0]:
        chunk = os.read(fd, 1 << 16)
        pipes[fd] += chunk
        if not chunk:
          open_fds.discard(fd)
    self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    out = [self._decoded(f, pipes) for f in (self.stdout, self.stderr)]
    return out[0], out[1]

  def _decoded(self, f, pipes):
    if not f:
      return None
    data = bytes(pipes[f.fileno()])
    f.close()
    return io.TextIOWrapper(io.BytesIO(data)).read() if self.text else data


def serve(fd: int) -> None:
  """The server: forks a child per request, and says when each started and how it ended."""
  sock = socket.socket(fileno=fd)
  spawn.preload(dict(os.environ))
  for name in PRELOAD:
    importlib.import_module(name)
  wake_r, wake_w = os.pipe()
  os.set_blocking(wake_r, False)
  os.set_blocking(wake_w, False)
  signal.signal(signal.SIGCHLD, lambda *_: None)
  signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
  while True:
    ready = select.select([sock, wake_r], [], [])[0]
    if wake_r in ready:
      _drain(wake_r)
      _reap(sock)
    if sock in ready:
      request, fds, _, _ = socket.recv_fds(sock, _MESSAGE_BYTES, 3)
      if not request:
        return  # the suite's process ended
      pid = _fork(json.loads(request), fds, (sock.fileno(), wake_r, wake_w))
      for received in fds:
        os.close(received)
      sock.send(json.dumps({'started': pid}).encode())


def _drain(fd: int) -> None:
  try:
    while os.read(fd, 512):
      pass
  except BlockingIOError:
    pass


def _reap(sock: socket.socket) -> None:
  while True:
    try:
      pid, status, usage = os.wait4(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if not pid:
      return
    sock.send(json.dumps({'exit': pid, 'code': os.waitstatus_to_exitcode(status),
                          'cpu_s': usage.ru_utime + usage.ru_stime}).encode())


def _fork(request: dict, fds: list[int], servers: tuple[int, ...]) -> int:
  """A child running `request` in a session of its own; answers once it is in it (so that a
  signal to its group reaches it)."""
  ready_r, ready_w = os.pipe()
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:
    code = 1
    try:
      signal.set_wakeup_fd(-1)
      os.setsid()
      for fd in (*servers, ready_r):
        os.close(fd)
      os.write(ready_w, b'.')
      os.chdir(request['cwd'])
      stdin, stdout, stderr = fds
      spawn.become(request['env'], request['argv'], request['path_head'], stdin=stdin,
                   stdout=stdout, stderr=subprocess.STDOUT if request['stderr_to_stdout']
                   else stderr)
      code = spawn.run_as_program(lambda: _run(request))
    finally:
      os._exit(code)
  os.close(ready_w)
  os.read(ready_r, 1)
  os.close(ready_r)
  return pid


def _run(request: dict) -> None:
  """As `python -m MODULE` or `python SCRIPT` runs it (a module imported before runs anew)."""
  if 'module' in request:
    name = request['module']
    spec = importlib.util.find_spec(name)
    sys.modules.pop(f'{name}.__main__' if spec and spec.submodule_search_locations else name,
                    None)
    runpy.run_module(name, run_name='__main__', alter_sys=True)
  else:
    runpy.run_path(request['script'], run_name='__main__')
