"""Supervisor: a training job as N local processes that keeps training when one of them dies.

  mecefo-launch -n N [--devices-per-process K] [--rejoin-after S] -- <mecefo-train args>
  (= python -m mecefo_jax.launch ...; its help and errors name the one typed)

Starts N training processes (`python -m mecefo_jax` of this very package, installed or not, forked
from the supervisor: mecefo_jax/spawn.py) (logical hosts 0..N-1) with a local coordinator. When one
dies (SIGKILL, a crash, the OOM killer), the survivors are stopped at once and restarted as a job
of the survivors that resumes the same run: each keeps its logical host (`--host-slot`) and so its
in-memory snapshot part, the dead host's part is rebuilt from parity, and its slices are taken over
by faults.takeover (docs/tpu.md). With --rejoin-after S, a replacement for the dead host is ready S
seconds after the death (standing in for the repair); the job is then stopped at an agreed step
(SIGTERM) and restarted with it. A job whose processes stop making progress (their progress marks,
mecefo_jax/watch.py) is stopped as after the death of the one that stopped first (--stall-s). With
--backend ray the processes run on the nodes of a running Ray cluster, one host per node, under the
same rules (mecefo_jax/ray_driver.py). Exit code: the job's.
"""
from __future__ import annotations

import argparse
import glob
import os
import shlex
import signal
import sys
from pathlib import Path

from mecefo_jax.config import DEFAULT_OUT, ConfigError
from mecefo_jax.records import run_dir
from mecefo_jax.records.history import Kind
from mecefo_jax.records.job import (BAD_INPUT, LAUNCH_COMMAND_ENV, LAUNCH_MODULE, SIGINT_REASON,
                                    STOPPED, STOPPED_S, command)
from mecefo_jax.run.cli import OneLineParser, at_least
from mecefo_jax.supervisor import Supervisor

_OWN_FLAGS = ('--coordinator', '--num-processes', '--process-id', '--host-slot', '--host-devices')
_GPU_DEVICES = '/dev/nvidia[0-9]*'  # one device file per NVIDIA GPU the machine shows


def parse_args(argv=None) -> argparse.Namespace:
  typed = command(LAUNCH_MODULE)  # as typed: mecefo-launch or python -m ...
  p = OneLineParser(prog=typed, description=__doc__.split('\n')[0],
                    epilog=f'example: {typed} -n 4 --rejoin-after 60 -- --out runs/job '
                           'mesh.slice=4')
  p.add_argument('-n', '--num-processes', type=int, required=True, help='processes (hosts), >= 2')
  p.add_argument('--devices-per-process', type=int, default=1,
                 help='devices of each process: CPU devices (--host-devices), or GPUs with --gpus')
  p.add_argument('--gpus', action='store_true',
                 help='give process of host h the GPUs h*K .. h*K+K-1 (CUDA_VISIBLE_DEVICES)')
  p.add_argument('--rejoin-after', type=at_least(0, float), default=None, metavar='SECONDS',
                 help='start a replacement for a dead host this long after its death')
  p.add_argument('--max-restarts', type=at_least(0), default=10,
                 help='give up after this many restarts')
  p.add_argument('--stall-s', type=at_least(0, float), default=None, metavar='SECONDS',
                 help='a job whose processes make no progress this long has stalled: the one '
                      'stopped first is left out as after a death (default: deadlines measured '
                      'on the job, mecefo_jax/watch.py; 0: never)')
  p.add_argument('--stopped-s', type=at_least(0, float), default=STOPPED_S, metavar='SECONDS',
                 help='the processes stop the job (snapshotted) once this supervisor has been '
                      'stopped (SIGSTOP, Ctrl-Z) this long; it restarts the job when it runs again '
                      f'(default {STOPPED_S:g})')
  p.add_argument('--spawn', choices=('fork', 'exec'), default='fork',
                 help='--backend local: each process forked from this supervisor, which imports '
                      'their modules once (a restart pays no imports), or a fresh interpreter '
                      '(mecefo_jax/spawn.py; default fork)')
  p.add_argument('--backend', choices=('local', 'ray'), default='local',
                 help='where the processes run: this machine, or the nodes of a running Ray '
                      'cluster, one host per node (pip install "ray>=2.60,<3")')
  p.add_argument('--address', default=None,
                 help='--backend ray: the cluster (default: $RAY_ADDRESS, else the local one)')
  p.add_argument('--ray-resources', type=_resources, default={'CPU': 1.0}, metavar='NAME=N,...',
                 help='--backend ray: what each host holds on its node (default CPU=1; e.g. '
                      'TPU=4,CPU=8); --gpus adds GPU=K')
  p.add_argument('--slice-hosts', type=at_least(1), default=1, metavar='K',
                 help='--backend ray: hosts K*u .. K*u+K-1 are TPU slice u, on the K nodes of one '
                      'slice (Ray\'s ray.io/tpu-slice-name label), which leave and rejoin whole')
  p.add_argument('--megascale', action='store_true',
                 help='--backend ray, TPU multislice: set MEGASCALE_NUM_SLICES, _SLICE_ID and '
                      '_COORDINATOR_ADDRESS for the TPU slices of each job (not run on a pod)')
  p.add_argument('--log-dir', default=None,
                 help='output of the processes other than process 0 (whose output is shown): '
                      'host<h>.log files (default: <--out>/logs, or runs/launch_logs)')
  p.add_argument('--events', default=None, metavar='FILE',
                 help='also write each event as a JSON line (time, kind, hosts) to FILE')
  p.add_argument('train_args', nargs=argparse.REMAINDER,
                 help='-- then the training arguments (mecefo-train\'s, = train.py\'s)')
  args, unknown = p.parse_known_args(argv)
  if unknown:  # a training flag before `--`: argparse alone would not say where it goes
    p.error(f'unrecognized arguments: {" ".join(unknown)}; the training arguments go after --, '
            f'e.g. -- {shlex.join(unknown + args.train_args)}')
  args.train_args = args.train_args[1:] if args.train_args[:1] == ['--'] else args.train_args
  if args.num_processes < 2 or args.devices_per_process < 1:
    p.error('need -n >= 2 (a lone process has no peer to hold its snapshot parity) and '
            '--devices-per-process >= 1')
  if args.backend == 'local' and (args.slice_hosts > 1 or args.megascale):
    p.error('--slice-hosts and --megascale place hosts on TPU slices: they need --backend ray '
            '(or deploy/pod_controller.py)')
  if args.num_processes % args.slice_hosts:
    p.error(f'-n {args.num_processes}: a multiple of --slice-hosts={args.slice_hosts} (whole '
            'TPU slices)')
  if args.gpus and args.backend == 'local':  # on Ray, the nodes' GPUs
    _check_gpus(p, args.num_processes * args.devices_per_process)
  own = [a for a in args.train_args if a.split('=')[0] in _OWN_FLAGS]
  if own:
    p.error(f'{own[0].split("=")[0]} is set by the supervisor; leave it out of the training '
            'arguments')
  args.out = _train_out(args.train_args) or Path(DEFAULT_OUT)
  args.log_dir = Path(args.log_dir or args.out / 'logs')
  args.argv = list(sys.argv[1:] if argv is None else argv)
  args.command = typed
  return args


def _check_gpus(p, needed: int) -> None:
  """--gpus on a machine without that many NVIDIA GPUs: refused (jax would fall back to the
  CPU without a word, and the job would train there)."""
  found = len(glob.glob(_GPU_DEVICES))
  if found < needed:
    p.error(f'--gpus: the job needs {needed} GPU(s) (-n x --devices-per-process) and this machine '
            f'shows {found} (/dev/nvidiaN); leave --gpus out to run on CPU devices')


def _resources(text: str) -> dict[str, float]:
  """'TPU=4,CPU=8' -> {'TPU': 4.0, 'CPU': 8.0}."""
  try:
    pairs = [item.split('=') for item in text.split(',') if item]
    return {name.strip(): float(n) for name, n in pairs}
  except ValueError:
    raise argparse.ArgumentTypeError(f'expected NAME=N,... (e.g. CPU=1,TPU=4), got {text!r}')


def _train_out(train_args: list[str]) -> Path | None:
  """train.py's --out among its arguments, if given."""
  for i, a in enumerate(train_args):
    if a.startswith('--out='):
      return Path(a[len('--out='):])
    if a == '--out' and i + 1 < len(train_args):
      return Path(train_args[i + 1])
  return None


class StopNow(Exception):
  """A second SIGINT/SIGTERM: the job is killed at once."""


def serve(sup: Supervisor) -> int:
  """Runs `sup` to its end; SIGTERM and Ctrl-C stop its job at an agreed step (one request
  that every process honours after the same step), a second one at once."""
  def on_signal(signum, frame):
    sup.signals += 1
    name = signal.Signals(signum).name
    if sup.signals > 1:
      raise StopNow(name)
    sup.interrupted = name
    sup.say(Kind.LAUNCH_SIGNAL,
            f'{name}: stopping the job after its next step (a second one stops it at once)')
    sup._ask_stop(SIGINT_REASON if signum == signal.SIGINT else name)
  signal.signal(signal.SIGTERM, on_signal)
  signal.signal(signal.SIGINT, on_signal)
  try:
    return sup.run()
  except StopNow as now:
    sup.kill_all()
    sup.say(Kind.LAUNCH_END,
            f'{now}: the job was killed at once, without a final snapshot; '
            f'{run_dir.describe(sup.args.out)}; resume it with the same command', code=STOPPED)
    return STOPPED
  finally:
    sup.stop_all()
    run_dir.sweep_empty_memory_dirs(sup.args.out)


def main(argv=None) -> int:
  args = parse_args(argv)
  holder = run_dir.holder(args.out)
  if holder is not None:  # refused before anything is written (train.py's own check races it)
    print(f'error: {run_dir.in_use_message(args.out, holder)}', file=sys.stderr)
    return BAD_INPUT
  os.environ[LAUNCH_COMMAND_ENV] = args.command  # the processes' hints: rerun it as typed
  try:
    sup = Supervisor(args) if args.backend == 'local' else _ray_driver(args)
  except ConfigError as err:  # a cluster that cannot run the job: one line
    print(f'error: {err}', file=sys.stderr)
    return BAD_INPUT
  return serve(sup)


def _ray_driver(args) -> Supervisor:
  """The Ray transport's supervisor, connected to the cluster (ConfigError: it cannot run)."""
  try:
    from mecefo_jax import ray_driver
  except ImportError as err:
    raise ConfigError(f'--backend ray needs Ray ({err}): pip install "ray>=2.60,<3"') from None
  ray_driver.connect(args.address)
  return ray_driver.RayDriver(args)


if __name__ == '__main__':
  sys.exit(main())
