"""Every command the product prints for the user to run next, from one place (tests run each)."""
from __future__ import annotations

import contextlib
import os
import shlex
from pathlib import Path

from mecefo_jax.records.job import LAUNCH_COMMAND_ENV, LAUNCH_ENV, LAUNCH_MODULE

# A refusal names train.py's flags while its command line runs (cli.main), else the Trainer's
# own arguments (a notebook has no --resume to pass).
_ARGUMENTS = {'--resume': 'resume=True', '--fresh': 'replace=True', '--out': 'out_dir'}
_command_line = False
# How the user started training, for the commands printed: the checkout's train.py unless an
# installed entry says otherwise (mecefo_jax/__main__.py: `mecefo-train`, `python -m mecefo_jax`).
_TRAIN = ['python', 'train.py']
# Where a run's failures.txt replays into unless --out says otherwise: inside that run.
REPLAY_DIR = 'replay'


def entered(argv0: str) -> None:
  """The trainer was started as `argv0` (sys.argv[0] of mecefo_jax/__main__.py)."""
  name = Path(argv0).name
  _TRAIN[:] = (['mecefo-train'] if name == 'mecefo-train' else
               ['python', '-m', 'mecefo_jax'] if name == '__main__.py' else ['python', 'train.py'])


def train_command() -> str:
  """The training command as the user typed it (entered): its help and errors name it."""
  return shlex.join(_TRAIN)


@contextlib.contextmanager
def command_line():
  """While train.py's command line runs: refusals name its flags."""
  global _command_line
  saved, _command_line = _command_line, True
  try:
    yield
  finally:
    _command_line = saved


def flag(name: str) -> str:
  """train.py's flag `name` (--resume, --fresh, --out), or the Trainer argument it stands for."""
  return name if _command_line else _ARGUMENTS[name]


def _train(*args) -> str:
  return shlex.join([*_TRAIN, *map(str, args)])


def launch_command() -> str | None:
  """The supervisor command that started this process (without --fresh, --resume,
  --stop-after), if one did."""
  args = os.environ.get(LAUNCH_ENV)
  if args is None:
    return None
  args, kept = shlex.split(args), []
  while args:  # what made this start and must not make the next one: a wipe, a stop
    arg = args.pop(0)
    if arg == '--stop-after' and args:
      args.pop(0)
    elif arg not in ('--fresh', '--resume') and not arg.startswith('--stop-after='):
      kept.append(arg)
  launch = os.environ.get(LAUNCH_COMMAND_ENV) or f'python -m {LAUNCH_MODULE}'
  return shlex.join([*shlex.split(launch), *kept])


def resume(out_dir: Path, n_hosts: int = 1) -> str:
  """How to continue the run in `out_dir` (a supervised run: its launch command again)."""
  command = launch_command()
  if command:
    return f'`{command}`'
  if n_hosts > 1:  # the supervisor of the same install as the trainer typed
    launch = 'mecefo-launch' if _TRAIN == ['mecefo-train'] else f'python -m {LAUNCH_MODULE}'
    return (f'the launch command of its {n_hosts} processes again (`{launch} -n {n_hosts} ... '
            f'-- --out {out_dir} ...`, docs/tpu.md)')
  return f'`{_train("--out", out_dir, "--resume")}`'


def rollback(out_dir: Path, lr: float, n_hosts: int = 1) -> str:
  """How to resume the diverged run in `out_dir` with a tenth of its learning rate `lr`."""
  lower = f'optimizer.lr={lr / 10:g}'
  if launch_command() or n_hosts > 1:
    return f'{resume(out_dir, n_hosts)} with {lower} added'
  return f'`{_train("--out", out_dir, "--resume", lower)}`'


def fresh(out_dir: Path) -> str:
  return f'`{_train("--out", out_dir, "--fresh")}` (with your flags)'


def replay(out_dir: Path) -> str:
  """How to replay the failures of the run in `out_dir` in one process, into a run directory of
  its own inside it (a run directory never holds two runs, and runs/latest is left alone)."""
  trace = Path(out_dir) / 'failures.txt'
  return f'`{_train("--failures", f"trace:{trace}", "--out", Path(out_dir) / REPLAY_DIR)}`'
