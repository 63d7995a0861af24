"""How a supervisor reads its job, whatever runs its processes (here, ssh, Ray): their exits (a
death, a survivor's, a failed start-up, in words) and the run they train (resumed, started)."""
from __future__ import annotations

import signal
from pathlib import Path

from mecefo_jax.config import ConfigError
from mecefo_jax.run import rundir
from mecefo_jax.run.exits import BAD_INPUT, JOB_EXITS, PEER_LOST, STOPPED

SURVIVOR_EXITS = (STOPPED, PEER_LOST)  # a process's exits that are not its death


def exit_text(code: int) -> str:
  if code < 0:
    return f'killed by {signal.Signals(-code).name}'
  names = {**JOB_EXITS, PEER_LOST: 'lost a peer'}
  return f'exit {code}' + (f' ({names[code]})' if code in names else '')


def dead(exited: dict[int, int]) -> list[int]:
  """The hosts among `exited` ({host: code}) whose exit is a death (a signal, a crash)."""
  return [h for h, c in exited.items() if c != 0 and c not in JOB_EXITS and
          c not in SURVIVOR_EXITS]


def failed_in_start_up(exited: dict[int, int], first: int, local: bool) -> list[int]:
  """The hosts whose process failed in start-up, `first` first (its lines are on the
  terminal): an input error, or (`local`: the run directory is here) an error of its own; none
  where a process was killed (a death: restarted)."""
  if any(c < 0 for c in exited.values()):
    return []
  return sorted((h for h, c in exited.items() if c == BAD_INPUT or local and c > 0 and
                 c not in JOB_EXITS and c not in SURVIVOR_EXITS), key=lambda h: h != first)


def error_lines(log: Path, since: int) -> list[str]:
  """The `error:` lines a process wrote to `log` past byte `since` (else its last line)."""
  with open(log, 'rb') as f:
    f.seek(since)
    lines = f.read().decode(errors='replace').splitlines()
  return [line for line in lines if line.startswith('error:')] or lines[-1:]


def resuming(train_args: list[str], out: Path) -> bool:
  """Whether a job of `train_args` resumes the run in `out`: --resume, or an unfinished run
  there (train.py resumes it on its own)."""
  if '--resume' in train_args or '--fresh' in train_args:
    return '--resume' in train_args
  try:
    return rundir.unfinished(out)
  except ConfigError:  # a damaged run_state.json: train.py says so in its own line
    return False


def starts(out: Path) -> int:
  """The starts the run's history.jsonl records (a job writes one once it trains)."""
  history = rundir.read_history(out) if out.is_dir() else []
  return sum(e['kind'] == 'start' for e in history)
