"""The run directory: a run's identity, its files, what a fresh start clears (lock: dir_lock.py).

Files of a run directory (all written by process 0):
  run_state.json  status, run id, config, slice/host counts, a divergence (what a resume
                  reads first; records/run_state.py)
  failures.txt    the failure history of the state the run holds now, as a replayable trace
                  (cut back to the restored step when steps are trained again)
  failure_trace.txt  the run's own copy of the trace it was started with (--failures
                  trace:PATH), read at a resume: PATH may have moved since
  history.jsonl   append-only: every start, stop, end, failure event and steps thrown away,
                  a divergence, the settings a resume changed and the rollback it made, the
                  supervisor's events (records/history.py)
  .reached        the number of steps trained so far (rewritten each step: steps lost in a crash)
  stop_request    asks the job to stop after its current step (run/stop.py; the supervisor's:
                  records/job.py)
  metrics.jsonl, report.json, training.png, tb/  the run's outputs (run/metrics.py, run/plot.py)
  replay/         the run directory of failures.txt's replay command, once it is run
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

from mecefo_jax import files
from mecefo_jax.config import Config, ConfigError, SnapshotConfig, resume_may_change, to_dict
from mecefo_jax.records import history
from mecefo_jax.records.history import HISTORY, Kind
from mecefo_jax.records.job import STOP_FILE
from mecefo_jax.records.run_dir import recorded_snapshot_config, remove_empty_folders, snapshot_dirs
from mecefo_jax.records.run_state import RUN_STATE, RunState, read_run_state
from mecefo_jax.run import hints

log = logging.getLogger('mecefo')
FAILURES, REACHED, TRACE = 'failures.txt', '.reached', 'failure_trace.txt'
METRICS_FILE, REPORT, PLOT, TB_DIR = 'metrics.jsonl', 'report.json', 'training.png', 'tb'
OUTPUTS = (METRICS_FILE, REPORT, PLOT, TB_DIR, RUN_STATE, FAILURES, HISTORY, REACHED, STOP_FILE,
           TRACE)
# The keys a resumed run may change are declared on their settings (config.py, `on_resume`):
# none changes the state's shapes, so the snapshot carries over; config.resume_may_change.


# ---- run files ------------------------------------------------------------------------------

def write_failures(out_dir: Path, events: list[dict], replay_flags: str) -> None:
  """failures.txt: `events` (FailureEvent.to_dict() rows) as a trace FailureSchedule.from_trace
  reads back, headed by the flags its one-process replay needs and a comment per stall the
  supervisor recorded (which process stopped first, each one's phase)."""
  stalls = [f'# stall: {line.note}\n' for line in history.read(out_dir, warn=False)
            if line.kind is Kind.LAUNCH_STALL and line.note is not None]
  lines = [f"{e['step']} {e['slice']} {e['kind']}  # {e['source']}\n" for e in events]
  files.replace_text(Path(out_dir) / FAILURES,
                     f'# replay: {replay_flags}\n' + ''.join(stalls + lines))


class Reached:
  """The steps trained so far, rewritten in place after every step (a few microseconds: no
  fsync, the page cache outlives the process), so that a resume knows how many steps a crash
  threw away even between metrics rows and snapshots."""

  def __init__(self, out_dir: Path):
    self._fd = os.open(Path(out_dir) / REACHED, os.O_RDWR | os.O_CREAT, 0o644)

  def write(self, steps: int) -> None:
    os.pwrite(self._fd, f'{steps:>12d}'.encode(), 0)

  def close(self) -> None:
    os.close(self._fd)


@dataclasses.dataclass(frozen=True)
class Trace:
  """The failure trace a run replays: the file read, its text, its events' source label."""
  path: Path
  text: str
  source: str


def read_trace(out_dir: Path, failures: str, resume: bool) -> Trace | None:
  """The trace of faults.failures=trace:PATH (None for any other value). A resume reads the
  run directory's own copy (TRACE, kept at the start): PATH is then only shown, as it may have
  moved since (a run copied to another machine, a cleaned /tmp). Runs started before copies
  were kept read PATH."""
  if not failures.startswith('trace:'):
    return None
  given, copy = Path(failures[len('trace:'):]), Path(out_dir) / TRACE
  source = f'trace:{given.name}'
  if resume and copy.is_file():
    log.info('failure trace: the run\'s copy %s (started with %s)', copy, given)
    return Trace(copy, files.read_user_text(copy, 'failure trace', ConfigError), source)
  if resume and not given.exists():
    raise ConfigError(f'failure trace {str(given)!r} not found, and {str(out_dir)!r} holds no '
                      f'copy of it ({TRACE}: the run was started before runs kept one); put '
                      f'the trace back there to resume')
  return Trace(given, files.read_user_text(given, 'failure trace', ConfigError), source)


def keep_trace(out_dir: Path, trace: Trace) -> None:
  """The run's copy of its trace, what a resume reads (read_trace)."""
  copy = Path(out_dir) / TRACE
  if trace.path != copy:
    files.replace_text(copy, trace.text)


def read_reached(out_dir: Path) -> int | None:
  """The steps .reached records, None without it; a damaged one is ignored with a warning (the
  steps lost are then counted from metrics.jsonl alone)."""
  path = Path(out_dir) / REACHED
  text = (files.read_text(path) or '').strip()
  if text.isascii() and text.isdigit():
    return int(text)
  if text:
    log.warning('%s holds %r, not a step count: ignored', path, text[:20])
  return None


def replay_base(failures: str) -> tuple[dict, int] | None:
  """(config, devices) that replays `failures` (trace:PATH) as the run that wrote it trained,
  when PATH lies in a run directory (its run_state.json): the same model, data, slices and
  steps, in one process, in the run directory hints.REPLAY_DIR inside that run (never over
  another run: runs/latest stays), with the default snapshot places."""
  path = Path(failures[len('trace:'):]) if failures.startswith('trace:') else None
  recorded = read_run_state(path.parent) if path is not None and path.is_file() else None
  if recorded is None or not recorded.config or not recorded.n_slices:
    return None
  config = json.loads(json.dumps(recorded.config))
  config['train']['out_dir'] = str(path.parent / hints.REPLAY_DIR)
  config['snapshot'].update(dir='', durable_dir='')
  mesh = config['mesh'] = {**config['mesh'], 'slice': recorded.n_slices}
  return config, recorded.n_slices * mesh['fsdp'] * mesh['tensor']


# ---- a run's snapshots (where they live: records/run_dir.py) ----------------------------------

def remove_snapshots(sn: SnapshotConfig, out_dir: Path, run_id: str, *, durable: bool,
                     host: int | None = None) -> None:
  """Deletes run `run_id`'s in-memory snapshots (the tmpfs folder of `out_dir` too, once no
  run is left in it) and, with `durable`, its durable checkpoints, in a bucket too. `host`: a
  process of a multi-process run deletes only its own part (the others may still read theirs)."""
  from mecefo_jax.snapshot import aside  # (etils: not for light readers)
  memory, durable_dir = snapshot_dirs(sn, out_dir, run_id)
  mine = memory if host is None else memory / f'host{host}'
  shutil.rmtree(mine, ignore_errors=True)
  # In-memory snapshots set aside hold RAM: they go with the tier's (README: Snapshots and
  # resume); durable ones set aside are never removed here.
  set_aside = Path(aside.place(mine))
  shutil.rmtree(set_aside, ignore_errors=True)
  for empty in (set_aside.parent, memory, memory.parent):  # the last process out removes them
    with contextlib.suppress(OSError):
      empty.rmdir()
  if durable:
    from mecefo_jax.snapshot import recovery
    recovery.remove_tree(durable_dir)


def remove_empty_dirs(sn: SnapshotConfig, out_dir: Path, run_id: str) -> None:
  """Removes run `run_id`'s snapshot directories where they hold nothing (local ones)."""
  memory, durable = snapshot_dirs(sn, out_dir, run_id)
  for directory in (memory, Path(durable), Path(durable).parent):
    remove_empty_folders(directory)
  with contextlib.suppress(OSError):
    memory.parent.rmdir()


@dataclasses.dataclass(frozen=True)
class Checked:
  """What start() will do: the run recorded in the directory (None: none), the id to train
  under (the recorded run's when resuming), the config keys a resume changes ({key: [the
  run's value, this start's]}) and why run_state.json could not be read (--fresh replaces it)."""
  previous: RunState | None
  run_id: str
  changed: dict[str, list] = dataclasses.field(default_factory=dict)
  unreadable: str | None = None


def check_start(out_dir: Path, cfg: Config, *, resume: bool, replace: bool,
                replace_finished: bool = False) -> Checked:
  """What start() will do, checked without touching a file. `replace` (--fresh) replaces a run
  whose run_state.json cannot be read, too."""
  try:
    previous = read_run_state(out_dir)
  except ConfigError as err:
    if resume or not replace:
      raise
    return Checked(None, uuid.uuid4().hex[:12], unreadable=str(err))
  if resume:
    if previous is None:
      raise ConfigError(f'{hints.flag("--resume")}: there is no run in {str(out_dir)!r} to '
                        f'resume (no {RUN_STATE}); nothing was started')
    changed = _check_same_config(previous.config or {}, to_dict(cfg))
    return Checked(previous, previous.run_id, changed)
  if previous or (Path(out_dir) / METRICS_FILE).exists():
    if not (replace or replace_finished and previous and previous.status == 'finished'):
      status = previous.status if previous else 'unknown'
      raise ConfigError(f'run directory {str(out_dir)!r} holds another run ({status}); resume '
                        f'it with {hints.flag("--resume")}, replace it with '
                        f'{hints.flag("--fresh")}, or pass another {hints.flag("--out")}')
  return Checked(previous, uuid.uuid4().hex[:12])


def start(out_dir: Path, checked: Checked) -> None:
  """Makes the run directory ready for the run check_start() returned `checked` for: a new
  run's predecessor's outputs, snapshots and checkpoints are removed first."""
  previous = checked.previous
  if previous and previous.run_id == checked.run_id:
    return
  if previous or checked.unreadable or (Path(out_dir) / METRICS_FILE).exists():
    clear(out_dir, previous, checked.unreadable)


def clear(out_dir: Path, previous: RunState | None, unreadable: str | None = None) -> None:
  """Removes the outputs, snapshots and checkpoints of the run recorded in `out_dir` (and
  nothing else of the directory). `unreadable`: why its run_state.json could not be read; its
  snapshots and checkpoints, which that file names, are then left where they are."""
  run_id, kept = previous and previous.run_id, ''
  if previous and previous.config:
    sn = recorded_snapshot_config(previous)
    remove_snapshots(sn, out_dir, run_id, durable=True)
    kept = _set_aside_kept(sn, out_dir, run_id)
  for name in OUTPUTS:
    path = Path(out_dir) / name
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
  if unreadable:
    log.warning('a new run: removed the outputs of the previous run in %s, whose %s could not '
                'be read: its snapshots and checkpoints, if any, are left where they are '
                '(remove them by hand)', out_dir, RUN_STATE)
    return
  log.warning('a new run: removed the outputs, snapshots and checkpoints of the previous run '
              '%s in %s (pass --out to keep runs apart)%s', run_id or '(unknown id)', out_dir, kept)


def _set_aside_kept(sn: SnapshotConfig, out_dir: Path, run_id: str) -> str:
  """'; kept: ...' naming the durable checkpoints run `run_id` set aside (a local tier's), if
  any: a new run never removes them."""
  from mecefo_jax.snapshot import aside
  durable = snapshot_dirs(sn, out_dir, run_id)[1]
  place = Path(aside.place(durable)) if '://' not in durable else None
  if place is None or not place.is_dir():
    return ''
  return f'; kept: the checkpoints it set aside in {place} (remove them by hand)'


def flat(tree: dict, prefix: str = '') -> dict:
  """{'a.b': value} of a nested dict."""
  out = {}
  for key, value in tree.items():
    out.update(flat(value, f'{prefix}{key}.') if isinstance(value, dict) else
               {f'{prefix}{key}': value})
  return out


def _check_same_config(recorded: dict, current: dict) -> dict[str, list]:
  """{key: [recorded, given]} of the keys a resume changes; a change of a key whose setting
  does not allow it on resume (config.py's `on_resume`) is refused in one line (ConfigError)."""
  old, new = flat(recorded), flat(current)
  # A run recorded before model.kind trained the built-in llama.
  old_model, new_model = old.pop('model.kind', 'llama'), new.pop('model.kind', 'llama')
  if old_model != new_model:
    raise ConfigError(f'resume with another model: the run trained model.kind={old_model!r}, '
                      f'this start gives {new_model!r}; resume with the run\'s model, or start '
                      'anew with --fresh (or another --out)')
  # A key the run's record lacks is a setting added since: the run had its default.
  defaults = flat(to_dict(Config()))
  old.update({k: defaults[k] for k in new if k not in old and k in defaults})
  changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
  refused = [k for k in changed if not resume_may_change(k, old.get(k), new.get(k))]
  if refused:
    diffs = ', '.join(f'{k} ({old.get(k)!r} -> {new.get(k)!r})' for k in refused)
    raise ConfigError(f'resume with a changed config: {diffs}; resume with the run\'s values '
                      f'(docs/config.md: the keys a resume may change), or start anew with '
                      f'--fresh (or another --out)')
  return {k: [old.get(k), new.get(k)] for k in changed}
