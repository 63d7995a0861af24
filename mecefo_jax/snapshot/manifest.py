"""Snapshot manifests: size and checksum of every file; a manifest marks a snapshot complete."""
from __future__ import annotations

import dataclasses
import json
import mmap
import os

import xxhash
from etils import epath

from mecefo_jax import files, sections
from mecefo_jax.records.run_dir import MANIFEST_NAME  # (a supervisor reads it too)
from mecefo_jax.sections import entry

_HASH_BLOCK = 1 << 22
# Every-step snapshots hash the whole state each step: XXH3 of a mapped 326 MB tmpfs file costs
# ~0.045 s here (CRC-32 ~0.12 s, reading + sha256 ~0.24 s). It detects truncation and corruption;
# it is not meant against tampering. Only this format verifies: a manifest of another (older)
# format reads as unreadable, and the snapshot is skipped like any other damaged one.
_FORMAT = 3
NO_MANIFEST = 'no manifest (incomplete snapshot)'  # verify_manifest's word for an unfinished save


def _digest(path: epath.Path) -> str:
  digest = xxhash.xxh3_64()
  try:
    with open(os.fspath(path), 'rb') as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
      digest.update(m)  # pages hashed in place, no copy into Python
  except (OSError, ValueError):  # not a local file (bucket), or empty (mmap refuses size 0)
    with path.open('rb') as f:
      while block := f.read(_HASH_BLOCK):
        digest.update(block)
  return digest.hexdigest()


@dataclasses.dataclass
class Stamp:
  """What a manifest of any format begins with: its format."""
  format: int = entry('', f'the manifest\'s format (this version reads {_FORMAT})')


@dataclasses.dataclass
class FileEntry:
  """One file of a snapshot as its manifest holds it."""
  bytes: int = entry('bytes', 'its size')
  xxh3: str = entry('', 'XXH3-64 of its bytes, in hex')


@dataclasses.dataclass
class Manifest(Stamp):
  """mecefo_manifest.json: every file of a finished snapshot (its presence marks it complete)."""
  files: dict[str, FileEntry] = entry('', 'each file by its path in the step directory')


def _intact(path: epath.Path, expected: FileEntry) -> bool:
  """Size and checksum match the manifest entry."""
  return path.stat().length == expected.bytes and _digest(path) == expected.xxh3


def _files(root: epath.Path):
  for child in sorted(root.iterdir()):
    if child.is_dir():
      yield from _files(child)
    elif child.name != MANIFEST_NAME:
      yield child


def write_manifest(step_dir: str | os.PathLike) -> None:
  """Checksum and size of every file of a finished snapshot; its presence marks the snapshot complete."""
  step_dir = epath.Path(step_dir)
  manifest = Manifest(format=_FORMAT, files={
      str(f.relative_to(step_dir)): FileEntry(f.stat().length, _digest(f))
      for f in _files(step_dir)})
  staging = step_dir / (MANIFEST_NAME + '.tmp')
  staging.write_text(json.dumps(sections.to_json(manifest), indent=1))
  staging.rename(step_dir / MANIFEST_NAME)  # atomic: a manifest is either whole or absent


def _stamp(path: epath.Path) -> Stamp | None:
  """The format of the manifest at `path`, read alone (an older format's entries differ)."""
  try:
    return files.read_json(path, Stamp, remedy='')
  except files.FileError:
    return None


def _wrong_format(found: int) -> str:
  return f'unreadable manifest (format {found}, this version reads {_FORMAT})'


def verify_manifest(step_dir: str | os.PathLike) -> str | None:
  """None if every file listed in the manifest is present and intact, else what is wrong."""
  step_dir = epath.Path(step_dir)
  path = step_dir / MANIFEST_NAME
  try:
    manifest = files.read_json(path, Manifest, remedy='')
  except files.FileError as e:
    stamp = _stamp(path)
    other = stamp is not None and stamp.format != _FORMAT
    return _wrong_format(stamp.format) if other else f'unreadable manifest ({e})'
  if manifest is None:
    return NO_MANIFEST
  if manifest.format != _FORMAT:
    return _wrong_format(manifest.format)
  for name, expected in manifest.files.items():
    file = step_dir / name
    if not file.exists():
      return f'{name} is missing'
    if not _intact(file, expected):
      return f'{name} fails its checksum'
  return None
