"""How a supervisor reads its job, whatever runs its processes (here, ssh, Ray): their exits (a
death, a survivor's, a failed start-up, in words), the run they train (resumed, started) and
the TPU slices its hosts form (--slice-hosts: the unit that fails and rejoins whole)."""
from __future__ import annotations

import signal
from pathlib import Path

from mecefo_jax.config import ConfigError
from mecefo_jax.records import history, run_state
from mecefo_jax.records.history import Kind
from mecefo_jax.records.job import BAD_INPUT, JOB_EXITS, PEER_LOST, STOPPED

SURVIVOR_EXITS = (STOPPED, PEER_LOST)  # a process's exits that are not its death
# A death by SIGABRT may be a survivor's: gloo's checks (and jax's coordination client) abort a
# process whose peer died in a collective, and the peer's own exit can show a look later (a
# loaded suite run: gloo's "Received data size doesn't match expected size" on host 0 after
# host 1's SIGKILL, seen first, so host 0 was taken for the dead one).
ABORTED = -signal.SIGABRT


def exit_text(code: int) -> str:
  if code < 0:
    return f'killed by {signal.Signals(-code).name}'
  names = {**JOB_EXITS, PEER_LOST: 'lost a peer'}
  return f'exit {code}' + (f' ({names[code]})' if code in names else '')


def dead(exited: dict[int, int]) -> list[int]:
  """The hosts among `exited` ({host: code}) whose exit is a death (a signal, a crash)."""
  return [h for h, c in exited.items() if c != 0 and c not in JOB_EXITS and
          c not in SURVIVOR_EXITS]


def blamed(died: list[int], exited: dict[int, int]) -> int | None:
  """Of the hosts that `died`, the one a restart is for: the first whose exit is not an abort;
  None when every one is an abort (the death that caused them may not show yet)."""
  return next((h for h in died if exited[h] != ABORTED), None)


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
    return run_state.unfinished(out)
  except ConfigError:  # a damaged run_state.json: train.py says so in its own line
    return False


def starts(out: Path) -> int:
  """The starts the run's history.jsonl records (a job writes one once it trains)."""
  lines = history.read(out) if out.is_dir() else []
  return sum(line.kind is Kind.START for line in lines)


def tpu_slice(host: int, slice_hosts: int) -> list[int]:
  """The logical hosts of `host`'s TPU slice: hosts K*u .. K*u+K-1 are slice u (K =
  `slice_hosts`; with 1, a host alone)."""
  first = host // slice_hosts * slice_hosts
  return list(range(first, first + slice_hosts))


def megascale_env(hosts: list[int], slot: int, slice_hosts: int,
                  coordinator: str) -> dict[str, str]:
  """TPU multislice, for the process of logical host `slot` in the job of `hosts`: the job's TPU
  slices numbered 0.. in logical order (so that process ids, numbered by slot, are those jax
  derives from them), the coordinator on process 0's host (`coordinator`: its address)."""
  units = sorted({h // slice_hosts for h in hosts})
  return {'MEGASCALE_NUM_SLICES': str(len(units)),
          'MEGASCALE_SLICE_ID': str(units.index(slot // slice_hosts)),
          'MEGASCALE_COORDINATOR_ADDRESS': coordinator}
