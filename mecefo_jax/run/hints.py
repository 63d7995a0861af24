"""Every command the product prints for the user to run next, from one place (tests run each)."""
from __future__ import annotations

import contextlib
import os
import shlex
from pathlib import Path

# The supervisor's own command line, which it hands to the processes it starts: a run it made
# is resumed by rerunning it (the restarts are its job, --host-slot and all).
LAUNCH_ENV = 'MECEFO_LAUNCH_ARGS'
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
  return shlex.join(['python', '-m', 'mecefo_jax.launch', *kept])


def resume(out_dir: Path, n_hosts: int = 1) -> str:
  """How to continue the run in `out_dir` (a supervised run: its launch command again)."""
  command = launch_command()
  if command:
    return f'`{command}`'
  if n_hosts > 1:
    return (f'the launch command of its {n_hosts} processes again (`python -m mecefo_jax.launch '
            f'-n {n_hosts} ... -- --out {out_dir} ...`, docs/tpu.md)')
  return f'`{_train("--out", out_dir, "--resume")}`'


def fresh(out_dir: Path) -> str:
  return f'`{_train("--out", out_dir, "--fresh")}` (with your flags)'


def replay(out_dir: Path) -> str:
  """How to replay the failures of the run in `out_dir` in one process, into a run directory of
  its own inside it (a run directory never holds two runs, and runs/latest is left alone)."""
  trace = Path(out_dir) / 'failures.txt'
  return f'`{_train("--failures", f"trace:{trace}", "--out", Path(out_dir) / REPLAY_DIR)}`'
