"""Snapshot directories: writable, and with room for the snapshots kept, checked before training."""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path


# A test hook at the OS boundary (tests/test_storage_faults.py), a comma-separated list of the
# tiers that see a full disk: `durable` (`memory`) makes each durable (in-memory) save write to
# /dev/full before its manifest (a real ENOSPC from the kernel that fails the save, Orbax's part
# written; a portable stand-in for a directory that fills, which needs a small mount and root).
TEST_DEV_FULL_ENV = 'MECEFO_TEST_DEV_FULL'


def test_dev_full(what: str) -> bool:
  """Whether TEST_DEV_FULL_ENV sends `what`'s writes to /dev/full."""
  return what in os.environ.get(TEST_DEV_FULL_ENV, '').split(',')


class SnapshotError(ValueError):
  """A snapshot directory is unusable, or a background save failed."""


def _hint(key: str) -> str:
  return f'(set {key}=..., or --no-snapshots)'


def check_writable(directory: Path, key: str = 'snapshot.dir') -> Path:
  """The existing directory that will hold `directory`; raises unless we can create files there.
  `key`: the config key that names the directory (in the error)."""
  existing = directory if directory.exists() else directory.parent
  if not existing.is_dir():
    raise SnapshotError(f'snapshot directory {directory}: parent {existing} does not exist '
                        f'or is not a directory {_hint(key)}')
  try:  # os.access says yes to root on read-only mounts; only a real write tells
    with tempfile.NamedTemporaryFile(dir=existing, prefix='.mecefo-probe-'):
      pass
  except OSError as e:
    raise SnapshotError(f'snapshot directory {directory}: {existing} is not writable '
                        f'({errno.errorcode.get(e.errno, e.errno)}) {_hint(key)}') from None
  return existing


def held_bytes(directory: Path) -> int:
  """Bytes of the snapshots already in a tier's `directory` (a resume's): the tier prunes them
  to its `keep` newest, so their room counts as the tier's own."""
  held = 0
  # os.walk skips a folder that goes meanwhile: another process's Orbax removes its finished or
  # failed saves' *.orbax-checkpoint-tmp folders while this one counts (a loaded suite run).
  for folder, _, names in os.walk(directory):
    for name in names:
      try:
        held += os.stat(os.path.join(folder, name), follow_symlinks=False).st_size
      except FileNotFoundError:
        pass  # removed between the listing and its stat
  return held


def check_capacity(directory: str | os.PathLike, state_bytes: int, keep: int, *,
                   factor: float = 1.0, key: str = 'snapshot.dir') -> None:
  """Raises SnapshotError unless `directory` is writable and has room for keep+1 snapshots:
  its free space and what its snapshots hold already (pruned to `keep` as saves go on) make
  keep+1, and one more fits in the free space alone (the first save, before any pruning).
  `key`: the config key that names the directory (in the error)."""
  directory = Path(directory)
  existing = check_writable(directory, key)
  needed = int(state_bytes * (keep + 1) * factor)  # keep finished + one in flight
  free, held = shutil.disk_usage(existing).free, held_bytes(directory)
  mib, one = 2 ** 20, int(state_bytes * factor)
  if free + held < needed:
    held_text = f' + {held / mib:.1f} MiB its snapshots hold' if held else ''
    raise SnapshotError(f'snapshot directory {directory}: {free / mib:.1f} MiB free{held_text} '
                        f'< {needed / mib:.1f} MiB needed ({keep}+1 snapshots of '
                        f'{state_bytes / mib:.1f} MiB x {factor:g}) {_hint(key)}')
  if free < one:  # the snapshots it holds are pruned only once the next save is written
    raise SnapshotError(f'snapshot directory {directory}: {free / mib:.1f} MiB free < '
                        f'{one / mib:.1f} MiB for the next snapshot ({state_bytes / mib:.1f} '
                        f'MiB x {factor:g}), which must be written before the '
                        f'{held / mib:.1f} MiB of older ones are pruned {_hint(key)}')
