"""Every command the product prints for the user to run next, from one place (tests run each)."""
from __future__ import annotations

import os
import shlex
from pathlib import Path

# The supervisor's own command line, which it hands to the processes it starts: a run it made
# is resumed by rerunning it (the restarts are its job, --host-slot and all).
LAUNCH_ENV = 'MECEFO_LAUNCH_ARGS'


def _train(*args) -> str:
  return shlex.join(['python', 'train.py', *map(str, args)])


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
  """How to replay the failures of the run in `out_dir` in one process."""
  trace = Path(out_dir) / 'failures.txt'
  return f'`{_train("--failures", f"trace:{trace}")}`'
