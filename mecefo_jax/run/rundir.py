"""The run directory: one run's identity, its lock, and what a fresh start clears."""
from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import shutil
import uuid
from pathlib import Path

from mecefo_jax.config import Config, ConfigError, SnapshotConfig, to_dict
from mecefo_jax.run.metrics import METRICS_FILE
from mecefo_jax.snapshot import recovery

log = logging.getLogger('mecefo')
LOCK = '.lock'
SNAPSHOT_KEYS = {f.name for f in dataclasses.fields(SnapshotConfig)}
OUTPUTS = (METRICS_FILE, 'report.json', 'training.png', 'tb', recovery.RUN_STATE)
# Keys a resumed run may change, as none changes what is trained (README: Snapshots and
# resume); train.steps only upward (the learning-rate schedule then follows the new length).
SAFE_ON_RESUME = ('train.steps', 'train.log_every', 'train.eval_every', 'train.eval_batches',
                  'train.plot', 'train.out_dir', 'train.compile_cache', 'train.move_programs',
                  'train.program_store_mb', 'snapshot.enabled', 'snapshot.dir',
                  'snapshot.every', 'snapshot.keep', 'snapshot.durable_dir',
                  'snapshot.durable_every', 'snapshot.durable_keep', 'snapshot.keep_when_finished',
                  'faults.precompile')


def lock(out_dir: Path):
  """An exclusive lock on `out_dir` held until the returned file is closed; the kernel drops it
  when its process dies (SIGKILL included), so a stale lock is simply taken over."""
  fd = os.open(Path(out_dir) / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
  holder = os.read(fd, 32).decode(errors='replace').strip()
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    raise ConfigError(f'run directory {str(out_dir)!r} is in use by another training process '
                      f'(pid {holder or "?"}); wait for it to end or pass another --out') from None
  if holder and holder != str(os.getpid()):
    log.info('run directory lock of pid %s (no longer running) taken over', holder)
  os.ftruncate(fd, 0)
  os.pwrite(fd, str(os.getpid()).encode(), 0)
  return os.fdopen(fd, 'r+')


def unlock(held) -> None:
  """Releases a lock() at a clean exit, its pid erased first: the next start then finds no
  holder to report (a killed process leaves its pid, and the next start takes it over)."""
  held.truncate(0)
  held.close()


def start(out_dir: Path, cfg: Config, *, resume: bool, replace: bool,
          replace_finished: bool = False) -> str:
  """The run id to train under: the recorded run's when resuming (same config but for
  SAFE_ON_RESUME), else a new one; a fresh start over another run needs `replace`
  (`replace_finished`: enough for a finished run, as in the default runs/latest)."""
  previous = recovery.read_run_state(out_dir)
  if resume and previous.get('run_id'):
    _check_same_config(previous.get('config', {}), to_dict(cfg))
    return previous['run_id']
  if not resume and (previous or (Path(out_dir) / METRICS_FILE).exists()):
    if not (replace or replace_finished and previous.get('status') == 'finished'):
      status = previous.get('status', 'unknown')
      raise ConfigError(f'run directory {str(out_dir)!r} holds another run ({status}); resume '
                        'it with --resume, replace it with --fresh, or pass another --out')
    clear(out_dir, previous)
  return uuid.uuid4().hex[:12]


def clear(out_dir: Path, previous: dict) -> None:
  """Removes the outputs, snapshots and checkpoints of the run recorded in `out_dir` (and
  nothing else of the directory)."""
  run_id = previous.get('run_id')
  if run_id and previous.get('config'):
    recorded = previous['config'].get('snapshot', {})
    sn = SnapshotConfig(**{k: v for k, v in recorded.items() if k in SNAPSHOT_KEYS})
    recovery.remove_snapshots(sn, out_dir, run_id, durable=True)
  for name in OUTPUTS:
    path = Path(out_dir) / name
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
  log.warning('a new run: removed the outputs, snapshots and checkpoints of the previous run '
              '%s in %s (pass --out to keep runs apart)', run_id or '(unknown id)', out_dir)


def _flat(tree: dict, prefix: str = '') -> dict:
  out = {}
  for key, value in tree.items():
    out.update(_flat(value, f'{prefix}{key}.') if isinstance(value, dict) else
               {f'{prefix}{key}': value})
  return out


def _check_same_config(recorded: dict, current: dict) -> None:
  old, new = _flat(recorded), _flat(current)
  changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k) and not (
      k in SAFE_ON_RESUME and not (k == 'train.steps' and new[k] < old[k]))]
  if changed:
    diffs = ', '.join(f'{k} ({old.get(k)!r} -> {new.get(k)!r})' for k in changed)
    raise ConfigError(f'resume with a changed config: {diffs}; resume with the run\'s values, '
                      'or start anew with --fresh (or another --out)')
