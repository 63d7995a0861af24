"""Snapshot directories: writable, and with room for the snapshots kept, checked before training."""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path


class SnapshotError(ValueError):
  """A snapshot directory is unusable, or a background save failed."""


def check_writable(directory: Path) -> Path:
  """The existing directory that will hold `directory`; raises unless we can create files there."""
  existing = directory if directory.exists() else directory.parent
  if not existing.is_dir():
    raise SnapshotError(f'snapshot directory {directory}: parent {existing} does not exist '
                        f'or is not a directory')
  try:  # os.access says yes to root on read-only mounts; only a real write tells
    with tempfile.NamedTemporaryFile(dir=existing, prefix='.mecefo-probe-'):
      pass
  except OSError as e:
    raise SnapshotError(f'snapshot directory {directory}: {existing} is not writable '
                        f'({errno.errorcode.get(e.errno, e.errno)})') from None
  return existing


def check_capacity(directory: str | os.PathLike, state_bytes: int, keep: int, *,
                   factor: float = 1.0) -> None:
  """Raises SnapshotError unless `directory` is writable and has room for keep+1 snapshots."""
  directory = Path(directory)
  existing = check_writable(directory)
  needed = int(state_bytes * (keep + 1) * factor)  # keep finished + one in flight
  free = shutil.disk_usage(existing).free
  if free < needed:
    raise SnapshotError(f'snapshot directory {directory}: {free / 2**20:.1f} MiB free < '
                        f'{needed / 2**20:.1f} MiB needed ({keep}+1 snapshots of '
                        f'{state_bytes / 2**20:.1f} MiB x {factor:g})')
