"""How long an agreed stop takes: SIGTERM -> the stop step saved in every tier -> exit.

Run: python -m benchmarks.stop_time [--config configs/llama_60m.yaml] [--processes 1]
    [--devices-per-process 1] [--at-step 3] [--keep-xla-flags] [--json OUT] [overrides...]

Starts a run (one train.py process, or --processes N under the supervisor, which passes the
SIGTERM on to every process), waits until it has logged --at-step, sends SIGTERM (a
preemption's notice) and times it until the exit. The run must exit 143 having printed
`stopped by SIGTERM after N steps, saved as the in-memory snapshot ... and the durable checkpoint
...`: the stop step in both tiers. A preemption's grace period is 30 s on the clouds we target
(GCE, GKE): the time must stay well under it.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common

STOP_LINE = re.compile(r'stopped by (.+?) after (\d+) steps?, saved as the (.+?); resume with')


def _args(argv):
  p = common.parser(__doc__.splitlines()[0])
  p.set_defaults(config='configs/llama_60m.yaml')
  p.add_argument('--processes', type=int, default=1)
  p.add_argument('--devices-per-process', type=int, default=1)
  p.add_argument('--at-step', type=int, default=3, help='SIGTERM once this step is logged')
  common.add_keep_xla_flags(p)
  return p.parse_intermixed_args(argv)


def _command(args, out: Path, shm: Path) -> list[str]:
  train = ['--config', args.config, '--out', str(out), f'snapshot.dir={shm}',
           'train.log_every=1', 'train.eval_every=0', 'train.plot=false', *args.overrides]
  if args.processes == 1:
    return [sys.executable, 'train.py', f'--host-devices={args.devices_per_process}', *train]
  return [sys.executable, '-m', 'mecefo_jax.launch', '-n', str(args.processes),
          '--devices-per-process', str(args.devices_per_process), '--', *train]


def _logged(out: Path, step: int) -> bool:
  metrics = out / 'metrics.jsonl'
  return metrics.is_file() and f'"step": {step},' in metrics.read_text()


def measure(args, tmp: Path, shm: Path) -> dict:
  out = tmp / 'run'
  env = common.job_env(args.keep_xla_flags, keep_cache=True)
  proc = subprocess.Popen(_command(args, out, shm), cwd=common.REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True)
  try:
    while not _logged(out, args.at_step):
      if proc.poll() is not None:
        raise SystemExit(f'error: the run ended before step {args.at_step}:\n'
                         f'{proc.stdout.read()[-3000:]}')
      time.sleep(0.05)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=600)
    stop_s = time.perf_counter() - t0
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  match = STOP_LINE.search(text)
  if proc.returncode != 143 or not match:
    raise SystemExit(f'error: exit {proc.returncode}, no stop message:\n{text[-3000:]}')
  saved = match.group(3).split(' and the ')
  return {'processes': args.processes, 'sigterm_after_step': args.at_step,
          'stopped_after_step': int(match.group(2)), 'stop_s': round(stop_s, 2),
          'saved': saved, 'both_tiers': len(saved) == 2, 'exit_code': proc.returncode}


def main(argv=None) -> dict:
  args = _args(argv)
  tmpfs = '/dev/shm' if Path('/dev/shm').is_dir() else None  # the in-memory tier's home
  with tempfile.TemporaryDirectory(prefix='mecefo-stop-') as tmp, \
       tempfile.TemporaryDirectory(prefix='mecefo-stop-', dir=tmpfs) as shm:
    row = measure(args, Path(tmp), Path(shm))
  result = {**common.run_info('benchmarks.stop_time', argv), 'config': args.config,
            'overrides': args.overrides, **row}
  common.emit(result, common.markdown_table([row], ['processes', 'sigterm_after_step',
                                                    'stopped_after_step', 'stop_s',
                                                    'both_tiers']), args.json)
  return result


if __name__ == '__main__':
  main()
