"""numpy's Philox4x64-10 for many keys at once: row i of `uniforms(keys, n)` equals
`np.random.Generator(np.random.Philox(key=keys[i])).random(n)` to the bit.

Why: the synthetic corpus draws each sample from its own Philox stream keyed by (seed, id); one
Generator per row cost ~40 us, which made a 4,096-row floor estimate 0.16 CPU s in every process
that builds the corpus. Here every row's blocks run through the 10 rounds as
uint64 arrays (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; numpy's
constants and counter order: the first block is counter 1, numpy increments before it draws).
Fewer than _FEW rows still take a Generator each: the rounds' array passes cost more then.
"""
from __future__ import annotations

import numpy as np

_M_2x1x1 = np.array([0xD2E7470EE14C6C93, 0xCA5A826395121157], np.uint64)[:, None, None]
_W0, _W1 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBB67AE8584CAA73B)  # key increments
_LOW32, _32 = np.uint64(0xFFFFFFFF), np.uint64(32)
_ROUNDS = 10
_FEW = 24  # fewer rows: numpy's Generator per row (~0.04 ms a row; the rounds ~1 ms a call)


def _mulhilo(a: np.ndarray, b_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(high, low) 64-bit halves of the 128-bit products a * b, from 32-bit partial products."""
  a_lo, a_hi = a & _LOW32, a >> _32
  b_lo, b_hi = b_N & _LOW32, b_N >> _32
  lo_lo, lo_hi, hi_lo = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo
  carry = ((lo_lo >> _32) + (lo_hi & _LOW32) + (hi_lo & _LOW32)) >> _32
  return a_hi * b_hi + (lo_hi >> _32) + (hi_lo >> _32) + carry, a * b_N


def _blocks(keys_Nx2: np.ndarray, n_blocks: int) -> np.ndarray:
  """uint64 [N, n_blocks, 4]: the 4 words of counters 1..n_blocks under each row's key."""
  n = len(keys_Nx2)
  shape = (n, n_blocks)
  c0 = np.broadcast_to(np.arange(1, n_blocks + 1, dtype=np.uint64), shape).copy()
  c1, c2, c3 = (np.zeros(shape, np.uint64) for _ in range(3))
  k0 = np.broadcast_to(keys_Nx2[:, :1], shape).copy()
  k1 = np.broadcast_to(keys_Nx2[:, 1:], shape).copy()
  with np.errstate(over='ignore'):  # uint64 arithmetic wraps, as the C code's does
    for r in range(_ROUNDS):
      if r:
        k0 += _W0
        k1 += _W1
      hi, lo = _mulhilo(_M_2x1x1, np.stack([c0, c2]))  # both products in one pass
      c0, c1, c2, c3 = hi[1] ^ c1 ^ k0, lo[1], hi[0] ^ c3 ^ k1, lo[0]
  return np.stack([c0, c1, c2, c3], axis=-1)


def uniforms(keys_Nx2: np.ndarray, n: int) -> np.ndarray:
  """float64 [N, n]: the first `n` doubles in [0, 1) of each row's Philox stream (key: a row of
  `keys_Nx2`, uint64), as numpy's Generator.random draws them (the top 53 bits of each word)."""
  keys_Nx2 = np.asarray(keys_Nx2, np.uint64).reshape(-1, 2)
  if len(keys_Nx2) < _FEW:  # the rounds' ~250 array operations cost more than a few Generators
    return np.stack([np.random.Generator(np.random.Philox(key=key)).random(n)
                     for key in keys_Nx2]) if len(keys_Nx2) else np.empty((0, n))
  words_NxW = _blocks(keys_Nx2, -(-n // 4)).reshape(len(keys_Nx2), -1)[:, :n]
  return (words_NxW >> np.uint64(11)) * (1.0 / 9007199254740992.0)
