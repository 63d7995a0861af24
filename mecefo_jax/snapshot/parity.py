"""XOR erasure coding of per-host snapshot directories: any one lost member of a group is rebuilt."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Sequence

import numpy as np

PARITY_FILE = 'group_parity.bin'
_PARITY_MAGIC = b'MXP1'
_TREE_MAGIC = b'MTR1'


class ParityError(ValueError):
  """A parity group cannot be encoded or rebuilt as asked."""


# ---- bytes ---------------------------------------------------------------------------------------

def encode_group(shards: Sequence[bytes]) -> bytes:
  """XOR parity of `shards` (any lengths, zero-padded to the longest); the header keeps the lengths."""
  lengths = [len(shard) for shard in shards]
  xor = np.zeros(max(lengths, default=0), np.uint8)
  for shard in shards:
    xor[:len(shard)] ^= np.frombuffer(shard, np.uint8)
  header = struct.pack(f'<4sI{len(lengths)}Q', _PARITY_MAGIC, len(lengths), *lengths)
  return header + xor.tobytes()


def _parse_parity(parity: bytes) -> tuple[list[int], np.ndarray]:
  magic, count = struct.unpack_from('<4sI', parity)
  if magic != _PARITY_MAGIC:
    raise ParityError('not a parity block made by encode_group')
  lengths = list(struct.unpack_from(f'<{count}Q', parity, 8))
  return lengths, np.frombuffer(parity, np.uint8, offset=8 + 8 * count)


def rebuild(shards: Sequence[bytes | None], parity: bytes) -> bytes:
  """The one shard given as None, recomputed bit-exactly from the others and their parity."""
  lengths, xor_of_all = _parse_parity(parity)
  missing = [i for i, shard in enumerate(shards) if shard is None]
  if len(shards) != len(lengths) or len(missing) != 1:
    raise ParityError(f'need the {len(lengths)} shards of the group with exactly one None, '
                      f'got {len(shards)} with {len(missing)} missing')
  rebuilt = xor_of_all.copy()
  for i, shard in enumerate(shards):
    if shard is None:
      continue
    if len(shard) != lengths[i]:
      raise ParityError(f'shard {i} has {len(shard)} bytes, the parity was made from {lengths[i]}')
    rebuilt[:len(shard)] ^= np.frombuffer(shard, np.uint8)
  return rebuilt[:lengths[missing[0]]].tobytes()


# ---- directory trees as bytes --------------------------------------------------------------------

def pack_tree(root: str | os.PathLike) -> bytes:
  """Deterministic byte image of a directory tree (relative paths, empty dirs, file contents)."""
  root = Path(root)
  chunks = [_TREE_MAGIC]
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames.sort()  # os.walk descends in this order, so the image is deterministic
    for name in dirnames:
      rel = os.path.relpath(os.path.join(dirpath, name), root).encode()
      chunks += [struct.pack('<cI', b'D', len(rel)), rel]
    for name in sorted(filenames):
      rel = os.path.relpath(os.path.join(dirpath, name), root).encode()
      data = Path(dirpath, name).read_bytes()
      chunks += [struct.pack('<cIQ', b'F', len(rel), len(data)), rel, data]
  return b''.join(chunks)


def unpack_tree(image: bytes, root: str | os.PathLike) -> None:
  """Recreates the tree of `pack_tree` at `root` (which must not exist); atomic via a rename."""
  root = Path(root)
  staging = root.with_name(root.name + '.rebuild-tmp')
  shutil.rmtree(staging, ignore_errors=True)
  staging.mkdir(parents=True)
  view = memoryview(image)
  if bytes(view[:4]) != _TREE_MAGIC:
    raise ParityError('not a tree image made by pack_tree')
  pos = 4
  while pos < len(view):
    kind, path_len = struct.unpack_from('<cI', view, pos)
    size = struct.unpack_from('<Q', view, pos + 5)[0] if kind == b'F' else None
    pos += 5 + (8 if kind == b'F' else 0)
    target = staging / bytes(view[pos:pos + path_len]).decode()
    pos += path_len
    if kind == b'D':
      target.mkdir(parents=True, exist_ok=True)
    else:
      target.parent.mkdir(parents=True, exist_ok=True)
      target.write_bytes(view[pos:pos + size])
      pos += size
  os.rename(staging, root)


# ---- parity groups of host directories ----------------------------------------------------------
# A group of n >= 2 hosts is coded like RAID-5 with rotating parity. Host i's byte image is cut into
# n-1 chunks; chunk k of host i is covered by the parity block kept on host (i + 1 + k) % n, so the
# first chunk of host i lies on host (i + 1) % n and no host ever holds parity of its own data. Each
# host keeps one parity block (the XOR of one chunk of every other member), i.e. 1/(n-1) of an
# image. Losing host L loses its image and its parity block; chunk k of L is the XOR of the block
# on host (L + 1 + k) % n with the matching chunks of the other survivors. For n = 2 this is a
# mirror.

def parity_holder(member: int, chunk: int, group_size: int) -> int:
  """Index of the host that keeps the parity covering `chunk` of `member`'s image."""
  return (member + 1 + chunk) % group_size


def _chunk(image: bytes, chunk: int, group_size: int) -> bytes:
  size = -(-len(image) // (group_size - 1))
  return image[chunk * size:(chunk + 1) * size]


def _covered_chunks(holder: int, images: Sequence[bytes | None]) -> list[bytes | None]:
  """The chunk of every other member that `holder`'s parity covers (None for a lost member)."""
  n = len(images)
  return [None if images[i] is None else _chunk(images[i], (holder - i - 1) % n, n)
          for i in range(n) if i != holder]


def _write_parity_file(parity_dir: Path, holder: int, images: Sequence[bytes]) -> None:
  header = json.dumps({'group_size': len(images), 'holder': holder,
                       'lengths': [len(image) for image in images],
                       'sha256': [hashlib.sha256(image).hexdigest() for image in images]}).encode()
  parity_dir.mkdir(parents=True, exist_ok=True)
  staging = parity_dir / (PARITY_FILE + '.tmp')
  with open(staging, 'wb') as f:
    f.write(struct.pack('<Q', len(header)) + header)
    f.write(encode_group(_covered_chunks(holder, images)))
  os.replace(staging, parity_dir / PARITY_FILE)  # readers never see a half-written block


def _read_parity_file(parity_dir: Path) -> tuple[dict, bytes]:
  data = (parity_dir / PARITY_FILE).read_bytes()
  header_len = struct.unpack_from('<Q', data)[0]
  return json.loads(data[8:8 + header_len]), data[8 + header_len:]


def write_group_parity(host_dirs: Sequence[str | os.PathLike],
                       parity_dirs: Sequence[str | os.PathLike]) -> None:
  """Writes parity_dirs[j]/group_parity.bin for every member j (parity_dirs[j] lives on host j)."""
  if len(host_dirs) < 2 or len(host_dirs) != len(parity_dirs):
    raise ParityError(f'a parity group needs >= 2 hosts and one parity dir each, '
                      f'got {len(host_dirs)} hosts and {len(parity_dirs)} parity dirs')
  images = [pack_tree(d) for d in host_dirs]
  for holder, parity_dir in enumerate(parity_dirs):
    _write_parity_file(Path(parity_dir), holder, images)


def rebuild_host(host_dirs: Sequence[str | os.PathLike], parity_dirs: Sequence[str | os.PathLike],
                 lost: int) -> Path:
  """Recreates host_dirs[lost] bit-exactly (and its parity block) from the other members."""
  n = len(host_dirs)
  survivors = [i for i in range(n) if i != lost]
  headers_and_blocks = {j: _read_parity_file(Path(parity_dirs[j])) for j in survivors}
  header = headers_and_blocks[survivors[0]][0]
  images: list[bytes | None] = [None if i == lost else pack_tree(host_dirs[i]) for i in range(n)]
  for i in survivors:  # a member that changed since the parity was written would corrupt the rebuild
    if hashlib.sha256(images[i]).hexdigest() != header['sha256'][i]:
      raise ParityError(f'{host_dirs[i]} changed since its group parity was written; cannot rebuild '
                        f'{host_dirs[lost]}')
  chunks = []
  for chunk in range(n - 1):
    holder = parity_holder(lost, chunk, n)
    chunks.append(rebuild(_covered_chunks(holder, images), headers_and_blocks[holder][1]))
  image = b''.join(chunks)
  if hashlib.sha256(image).hexdigest() != header['sha256'][lost]:
    raise ParityError(f'rebuilt image of {host_dirs[lost]} does not match its recorded sha256')
  unpack_tree(image, host_dirs[lost])
  images[lost] = image
  _write_parity_file(Path(parity_dirs[lost]), lost, images)
  return Path(host_dirs[lost])


# ---- equal-length parts held in memory (multi-process snapshots) ----------------------------------
# Same RAID-5 layout on numpy parts of equal length (a multiple of n-1): part i is cut into n-1
# chunks and chunk k of part i is covered by the block of host (i + 1 + k) % n.

def _part_chunk(part: np.ndarray, k: int, n: int) -> np.ndarray:
  size = len(part) // (n - 1)
  return part[k * size:(k + 1) * size]


def parity_block(parts: Sequence[np.ndarray], holder: int) -> np.ndarray:
  """The parity block that host `holder` keeps: XOR of one chunk of every other part."""
  n = len(parts)
  if n < 2 or any(len(p) != len(parts[0]) or len(p) % (n - 1) for p in parts):
    raise ParityError(f'need >= 2 parts of one length divisible by {n - 1}')
  block = np.zeros(len(parts[0]) // (n - 1), np.uint8)
  for i, part in enumerate(parts):
    if i != holder:
      block ^= _part_chunk(part, (holder - i - 1) % n, n)
  return block


def rebuild_part(parts: Sequence[np.ndarray | None], blocks: Sequence[np.ndarray | None],
                 lost: int) -> np.ndarray:
  """Part `lost` (given as None, its block may be None too) from the others and their blocks."""
  n = len(parts)
  chunks = []
  for k in range(n - 1):
    holder = parity_holder(lost, k, n)
    chunk = blocks[holder].copy()
    for i, part in enumerate(parts):
      if i not in (holder, lost):
        chunk ^= _part_chunk(part, (holder - i - 1) % n, n)
    chunks.append(chunk)
  return np.concatenate(chunks)
