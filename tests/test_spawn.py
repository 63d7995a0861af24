"""Workers forked from the supervisor (mecefo_jax/spawn.py): what is forked, and a fork is what
exec would have made of the worker (streams, descriptors, signals, environment, exit codes)."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from mecefo_jax import spawn
from procs import ROOT

WORKER = [sys.executable, '-m', 'mecefo_jax', '--out', 'r']


def test_the_worker_path_is_what_python_dash_m_would_have():
  supervisor = ['/venv/bin', '/mine', '/usr/lib/python3.11', '/venv/site-packages']
  assert spawn.worker_path(supervisor, '/mine', '/pkg:/mine:/user', '/work') == [
      '/work', '/pkg', '/mine', '/user', '/usr/lib/python3.11', '/venv/site-packages']


def test_only_a_worker_of_this_python_in_a_process_with_no_backend_up_is_forked():
  assert not spawn.forkable(['python3', '-m', 'mecefo_jax'], {})
  assert not spawn.forkable([sys.executable, '-m', 'mecefo_jax.launch'], {})
  # This pytest process has jax's backend up (its runtime's threads): never forked from.
  import jax
  jax.devices()
  assert not spawn.forkable(WORKER, {})


def test_a_forked_handle_answers_as_popen_does():
  pid = os.posix_spawn('/bin/sleep', ['sleep', '30'], os.environ)  # a child of this process
  proc = spawn.Forked(pid, ['sleep'])
  assert proc.poll() is None
  with pytest.raises(subprocess.TimeoutExpired):
    proc.wait(0.05)
  proc.kill()
  assert proc.wait(10) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL
  proc.kill()  # ended: nothing to signal, no error


# A supervisor stand-in: no jax backend, a pipe whose write end it alone holds, a SIGTERM
# handler of its own; each case forks a worker whose main is replaced by the case's.
DRIVER = textwrap.dedent('''
    import json, os, signal, subprocess, sys, time
    from mecefo_jax import spawn
    import mecefo_jax.__main__ as entry

    read_fd, write_fd = os.pipe()
    signal.signal(signal.SIGTERM, lambda *a: None)

    def report(started):
      print(json.dumps({'argv': sys.argv[1:], 'env': os.environ.get('CASE_VAR'),
                        'path0': sys.path[0], 'extra': '/extra' in sys.path,
                        'write_end_open': _open(write_fd), 'read_end_open': _open(read_fd),
                        'sigterm': signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}))
      return 3

    def _open(fd):
      try:
        os.fstat(fd)
        return True
      except OSError:
        return False

    CASES = {'report': report,
             'exit_text': lambda started: sys.exit('a line of its own'),
             'raises': lambda started: 1 / 0,
             'unbuffered_then_killed': lambda started: (sys.stdout.write('last words'),
                                                        os.kill(os.getpid(), signal.SIGKILL)),
             'sigterm': lambda started: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(5)),
             'ctrl_c': lambda started: (_ for _ in ()).throw(KeyboardInterrupt())}
    results = {}
    for case, main in CASES.items():
      entry.main = main
      log = open(f'{case}.log', 'w')
      cmd = [sys.executable, '-m', 'mecefo_jax', '--out', case]
      env = dict(os.environ, CASE_VAR=case, PYTHONUNBUFFERED='1',
                 PYTHONPATH=os.pathsep.join(['/extra', os.environ.get('PYTHONPATH', '')]))
      assert spawn.forkable(cmd, env), case
      proc = spawn.fork(cmd, env, stdout=log.fileno(), stderr=subprocess.STDOUT,
                        pass_fds=(read_fd,))
      log.close()
      results[case] = {'code': proc.wait(60), 'log': open(f'{case}.log').read()}
    env = dict(os.environ, JAX_ENABLE_X64='1')  # jax was imported without it: a fresh one
    results['other_jax_env_forkable'] = spawn.forkable(cmd, env)
    print(json.dumps(results))
''')


@pytest.mark.slow
def test_a_forked_worker_is_what_exec_would_make_of_it(launcher, tmp_path):
  done = launcher.run([sys.executable, '-c', DRIVER], timeout=120, cwd=tmp_path,
                      env=launcher.env(PYTHONPATH=str(ROOT)))
  assert done.returncode == 0, done.stderr
  results = json.loads(done.stdout.splitlines()[-1])
  report = results['report']
  assert report['code'] == 3
  seen = json.loads(report['log'])
  # Its arguments, its environment and `python -m`'s sys.path (cwd first, then PYTHONPATH).
  assert seen['argv'] == ['--out', 'report'] and seen['env'] == 'report'
  assert seen['path0'] == str(tmp_path) and seen['extra']
  # Only the descriptors passed: the supervisor's write end is not held (its end is seen).
  assert seen['read_end_open'] and not seen['write_end_open']
  assert seen['sigterm']  # the supervisor's handler is not the worker's
  assert results['exit_text'] == {'code': 1, 'log': 'a line of its own\n'}
  assert results['raises']['code'] == 1 and 'ZeroDivisionError' in results['raises']['log']
  # PYTHONUNBUFFERED: what it wrote reached the file though it died at once.
  assert results['unbuffered_then_killed'] == {'code': -signal.SIGKILL, 'log': 'last words'}
  assert results['sigterm']['code'] == -signal.SIGTERM
  assert results['ctrl_c']['code'] == -signal.SIGINT
  assert 'KeyboardInterrupt' in results['ctrl_c']['log']
  assert results['other_jax_env_forkable'] is False
