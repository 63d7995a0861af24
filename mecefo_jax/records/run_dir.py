"""A run directory as a supervisor reads it, without JAX: who holds its lock (run/dir_lock.py
takes it), where the run's snapshots live (run/rundir.py clears them) and the newest complete
one of each tier (for the supervisor's line after a stop at once), and the empty tmpfs folders a
job's starts left."""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
from pathlib import Path

from mecefo_jax import files
from mecefo_jax.config import ConfigError, SnapshotConfig
from mecefo_jax.records.run_state import RunState, read_run_state

LOCK = '.lock'
MANIFEST_NAME = 'mecefo_manifest.json'  # a snapshot's, written last (snapshot/manifest.py)
SNAPSHOT_KEYS = {f.name for f in dataclasses.fields(SnapshotConfig)}

# ---- its lock -----------------------------------------------------------------------------------

def in_use_message(out_dir: Path, holder: str) -> str:
  return (f'run directory {str(out_dir)!r} is in use by another training process (pid '
          f'{holder or "?"}); wait for it to end or pass another --out')


def holder(out_dir: Path) -> str | None:
  """The pid that holds `out_dir`'s lock ('' if unknown), None if none does: a look (the
  supervisor's, before it writes anything) that takes nothing and creates nothing."""
  try:
    fd = os.open(Path(out_dir) / LOCK, os.O_RDONLY)
  except (FileNotFoundError, NotADirectoryError):
    return None
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while a start holds it
    return None
  except BlockingIOError:
    return os.read(fd, 32).decode(errors='replace').strip()
  finally:
    os.close(fd)


# ---- where a run's snapshots live ---------------------------------------------------------------

def run_name(out_dir: Path) -> str:
  """Stable per run directory, so a resumed trainer finds its tmpfs snapshots."""
  resolved = str(Path(out_dir).resolve())
  return f'{Path(resolved).name}-{hashlib.sha1(resolved.encode()).hexdigest()[:8]}'


def snapshot_dirs(sn: SnapshotConfig, out_dir: Path, run_id: str) -> tuple[Path, str]:
  """(in-memory tier, durable tier) directories of run `run_id`: one run's snapshots never
  share a directory with another's, whatever --out they were written for."""
  memory = (Path(sn.dir) if sn.dir else files.default_snapshot_dir(run_name(out_dir))) / run_id
  durable = sn.durable_dir or str(Path(out_dir).resolve() / 'checkpoints')
  return memory, f'{durable.rstrip("/")}/{run_id}'


def recorded_snapshot_config(state: RunState) -> SnapshotConfig:
  recorded = (state.config or {}).get('snapshot', {})
  return SnapshotConfig(**{k: v for k, v in recorded.items() if k in SNAPSHOT_KEYS})


def remove_empty_folders(directory: Path) -> None:
  """Removes the empty folders under `directory` and itself if empty, deepest first; a folder
  with a file in it stays, and so do set-aside ones (kept as they were)."""
  for empty in sorted(Path(directory).glob('**/'), key=lambda p: -len(p.parts)):
    if 'set_aside' not in empty.relative_to(directory).parts:
      with contextlib.suppress(OSError):
        empty.rmdir()


def sweep_empty_memory_dirs(out_dir: Path) -> None:
  """Removes the empty folders under the run directory's default tmpfs folder (a start killed
  before it wrote a snapshot leaves its run-id folder), deepest first; set-aside ones stay."""
  remove_empty_folders(files.default_snapshot_dir(run_name(out_dir)))


# ---- which of them are complete -----------------------------------------------------------------

def _complete(step_dirs: list[Path]) -> bool:
  return bool(step_dirs) and all((d / MANIFEST_NAME).is_file() for d in step_dirs)


def _steps(directory: Path) -> list[int]:
  return sorted({int(p.name) for p in directory.glob('*') if p.name.isdigit()}, reverse=True)


def newest(out_dir: Path) -> tuple[int | None, int | None]:
  """(The newest step whose in-memory snapshot has every host's part complete, the newest
  complete durable checkpoint): None where there is none, or the run cannot be read."""
  try:
    state = read_run_state(out_dir)
  except ConfigError:
    return None, None
  if state is None:  # no run yet
    return None, None
  memory, durable = snapshot_dirs(recorded_snapshot_config(state), out_dir, state.run_id)
  hosts = sorted(memory.glob('host*')) or [memory]
  in_memory = next((s for s in _steps(hosts[0]) if _complete([h / str(s) for h in hosts])), None)
  durable_dir = Path(durable)
  on_disk = next((s for s in _steps(durable_dir) if _complete([durable_dir / str(s)])), None)
  return in_memory, on_disk


def describe(out_dir: Path) -> str:
  """'the newest snapshot is step 41 (in memory) and the newest durable checkpoint step 40':
  what a resume continues from."""
  in_memory, on_disk = newest(out_dir)
  if in_memory is None and on_disk is None:
    return 'no snapshot of this run is complete: a resume starts it again from step 0'
  best = max(s for s in (in_memory, on_disk) if s is not None)
  return (f'the newest complete in-memory snapshot is step {in_memory}, the newest durable '
          f'checkpoint step {on_disk}: a resume continues from step {best}, the steps trained '
          'after it are not saved')
