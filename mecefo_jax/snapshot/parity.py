"""XOR erasure coding of equal-length parts held by a group of hosts: any one lost part is rebuilt.

The layout of the per-host snapshots of a multi-process run (snapshot/host.py). A group of n >= 2
hosts is coded like RAID-5 with rotating parity: every part has one length, a multiple of n-1,
and is cut into n-1 chunks; chunk k of part i is covered by the parity block kept on host
(i + 1 + k) % n, so the first chunk of part i lies on host (i + 1) % n and no host ever holds
parity of its own part. Each host keeps one block (the XOR of one chunk of every other part),
1/(n-1) of a part. Losing host L loses its part and its block; chunk k of L is the XOR of the
block on host (L + 1 + k) % n with the matching chunks of the other survivors. For n = 2 this
is a mirror.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class ParityError(ValueError):
  """A parity group cannot be encoded as asked."""


def parity_holder(member: int, chunk: int, group_size: int) -> int:
  """Index of the host that keeps the parity covering `chunk` of `member`'s part."""
  return (member + 1 + chunk) % group_size


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
