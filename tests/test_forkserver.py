"""The suite's fork server (tests/forkserver.py) starts what a new interpreter would: the same
argv, cwd, sys.path, environment, streams, exit codes and deaths by signal."""
import json
import os
import signal
import subprocess
import sys

import procs
from procs import ROOT

PROBE = '''import json, os, sys, time
if sys.argv[1] == 'wait':
  print('ready', flush=True)
  time.sleep(60)
print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd(), 'path0': sys.path[0], 'name': __name__,
                  'x': os.environ.get('PROBE_X'), 'stdin': sys.stdin.read()}))
print('to stderr', file=sys.stderr)
sys.exit(int(sys.argv[1]))
'''


def _start(launcher, tmp_path, arg, served: bool, **popen):
  (tmp_path / 'probe.py').write_text(PROBE)
  env = launcher.env(PROBE_X='7', PYTHONPATH=str(ROOT))
  proc = launcher.start([sys.executable, '-m', 'probe', arg], cwd=tmp_path,
                        env=env if served else {**env, 'PYTHONHASHSEED': '1'}, **popen)
  assert isinstance(proc, procs.forkserver.Served) == served
  return proc


def test_a_served_process_runs_as_a_new_interpreter_would(launcher, tmp_path):
  runs = []
  for served in (True, False):
    proc = _start(launcher, tmp_path, '3', served, stdin=subprocess.PIPE, text=True,
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, err = proc.communicate('some input', timeout=60)
    runs.append((proc.returncode, out.splitlines()[-1], json.loads(out.splitlines()[0]), err))
  assert runs[0] == runs[1]
  code, last, seen, err = runs[0]
  assert (code, last, err) == (3, 'to stderr', None)
  assert seen['argv'] == [str(tmp_path / 'probe.py'), '3'] and seen['x'] == '7'
  assert (seen['cwd'], seen['path0'], seen['name']) == (str(tmp_path),) * 2 + ('__main__',)
  assert seen['stdin'] == 'some input'


def test_a_served_process_dies_by_the_signal_its_group_is_sent(launcher, tmp_path):
  for served in (True, False):
    for sig in (signal.SIGINT, signal.SIGKILL):
      proc = _start(launcher, tmp_path, 'wait', served, stdout=subprocess.PIPE)
      assert proc.stdout.readline() == b'ready\n'
      assert proc.poll() is None
      os.killpg(proc.pid, sig)
      assert proc.wait(timeout=60) == -sig
      proc.stdout.close()
