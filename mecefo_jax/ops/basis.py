"""Subspace bases for the low-rank weight gradient: randomized SVD of W and random Gaussian."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def svd_basis(w: jax.Array, rank: int, key: jax.Array, power_iters: int = 2,
              oversample: int = 8) -> jax.Array:
  """Orthonormal [d_in, rank] basis of the top-`rank` left singular subspace of w [d_in, d_out].

  Randomized range finder (Halko et al.) with `power_iters` power iterations,
  computed in float32 whatever w's dtype.
  """
  d_in, d_out = w.shape
  if not 1 <= rank <= min(d_in, d_out):
    raise ValueError(f'rank must be in [1, {min(d_in, d_out)}] for w {w.shape}, got {rank}')
  w32 = w.astype(jnp.float32)
  k = min(rank + oversample, d_in, d_out)
  omega_oxk = jax.random.normal(key, (d_out, k), jnp.float32)
  q_ixk, _ = jnp.linalg.qr(w32 @ omega_oxk)
  for _ in range(power_iters):
    # Re-orthonormalise after each multiply so small singular directions survive in f32.
    z_oxk, _ = jnp.linalg.qr(w32.T @ q_ixk)
    q_ixk, _ = jnp.linalg.qr(w32 @ z_oxk)
  u_kxk, _, _ = jnp.linalg.svd(q_ixk.T @ w32, full_matrices=False)
  return (q_ixk @ u_kxk[:, :rank]).astype(w.dtype)


def refine_basis(w: jax.Array, v_ixr: jax.Array, power_iters: int = 1) -> jax.Array:
  """`power_iters` subspace iterations of w wᵀ from a previous orthonormal basis v [d_in, r].

  The warm-started refresh: the weights move little between refreshes, so one iteration from
  the last basis tracks the top singular subspace at a fraction of svd_basis's cost (no random
  start, no oversampling, no final SVD: V Vᵀ depends only on the span).
  """
  w32, q_ixr = w.astype(jnp.float32), v_ixr.astype(jnp.float32)
  for _ in range(power_iters):
    z_oxr, _ = jnp.linalg.qr(w32.T @ q_ixr)  # orthonormalised between multiplies, as above
    q_ixr, _ = jnp.linalg.qr(w32 @ z_oxr)
  return q_ixr.astype(w.dtype)


def gaussian_basis(key: jax.Array, d_in: int, rank: int, dtype=jnp.float32) -> jax.Array:
  """Random [d_in, rank] Gaussian basis scaled by 1/sqrt(rank), so that E[V Vᵀ] = I."""
  if rank < 1:
    raise ValueError(f'rank must be >= 1, got {rank}')
  v = jax.random.normal(key, (d_in, rank), jnp.float32) / jnp.sqrt(rank)
  return v.astype(dtype)
