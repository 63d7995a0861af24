"""Low-rank weight-gradient matmul: exact forward and input gradient, projected weight gradient."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _exact_matmul(x, w):
  return jnp.matmul(x, w)


@jax.custom_vjp
def _lowrank_core(x, w, basis):
  return jnp.matmul(x, w)


def _core_fwd(x, w, basis):
  # Only x @ basis ([..., r]) is kept for the weight gradient, never x itself.
  xv = jnp.matmul(x, basis)
  return jnp.matmul(x, w), (xv, w, basis)


def _core_bwd(res, g):
  xv, w, basis = res
  # xv has x's dtype (the basis is cast to it), so dx matches x even when w's dtype differs.
  dx = jnp.matmul(g, w.T).astype(xv.dtype)
  r, d_out = xv.shape[-1], g.shape[-1]
  xv_Txr = xv.reshape(-1, r)
  g_Txo = g.reshape(-1, d_out)
  # Contract tokens first: [r, d_out] is small, then lift back to d_in with the basis.
  small_rxo = jnp.matmul(xv_Txr.T, g_Txo, preferred_element_type=jnp.float32)
  dw = jnp.matmul(basis.astype(jnp.float32), small_rxo).astype(w.dtype)
  # The basis is a fixed projection, not a trained quantity: no gradient flows into it.
  return dx, dw, jnp.zeros_like(basis)


_lowrank_core.defvjp(_core_fwd, _core_bwd)


def lowrank_matmul(x: jax.Array, w: jax.Array, basis: jax.Array | None) -> jax.Array:
  """`x @ w` whose weight gradient is projected onto span(basis).

  Forward: exactly `x @ w` (x may have any leading dims). Backward: dx is exact;
  dw = basis @ ((x @ basis)ᵀ g), flattened over leading dims, i.e. the exact
  gradient xᵀ g projected by basis basisᵀ on the input side. `basis=None` gives
  the exact gradient. basis: [d_in, r].
  """
  if basis is None:
    return _exact_matmul(x, w)
  if basis.ndim != 2 or basis.shape[0] != w.shape[0]:
    raise ValueError(
        f'basis must be [d_in={w.shape[0]}, rank], got {tuple(basis.shape)}')
  return _lowrank_core(x, w, basis.astype(x.dtype))
