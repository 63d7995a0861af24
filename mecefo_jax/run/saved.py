"""What a run has on disk, read without JAX: the newest complete snapshot of each tier (for a
supervisor's line after a stop at once), and the empty tmpfs folders a job's starts left."""
from __future__ import annotations

from pathlib import Path

from mecefo_jax import files
from mecefo_jax.config import ConfigError
from mecefo_jax.records.run_state import read_run_state
from mecefo_jax.run import rundir
from mecefo_jax.snapshot.manifest import MANIFEST_NAME


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
  memory, durable = rundir.snapshot_dirs(rundir.recorded_snapshot_config(state), out_dir,
                                         state.run_id)
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


def sweep_empty_memory_dirs(out_dir: Path) -> None:
  """Removes the empty folders under the run directory's default tmpfs folder (a start killed
  before it wrote a snapshot leaves its run-id folder), deepest first; set-aside ones stay."""
  rundir.remove_empty_folders(files.default_snapshot_dir(rundir.run_name(out_dir)))
