"""Tests of the low-rank weight-gradient matmul and of the SVD and Gaussian bases."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mecefo_jax.ops import transformer
from mecefo_jax.ops.basis import gaussian_basis, refine_basis, svd_basis
from mecefo_jax.ops.lowrank import lowrank_matmul

# All distinct, so every residual shape says which array it is.
T, D_IN, D_OUT, R = 5, 6, 7, 3


def _arrays(lead=(T,), seed=0, dtype=jnp.float32):
  kx, kw, kv = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, lead + (D_IN,), dtype)
  w = jax.random.normal(kw, (D_IN, D_OUT), dtype)
  basis = gaussian_basis(kv, D_IN, R)
  return x, w, basis


def _sin_loss(matmul):
  # A non-trivial cotangent: g = cos(y), not all ones.
  return lambda x, w: jnp.sum(jnp.sin(matmul(x, w)))


def _grads(basis, x, w):
  return jax.grad(_sin_loss(lambda x, w: lowrank_matmul(x, w, basis)), argnums=(0, 1))(x, w)


def _exact_grads(x, w):
  return jax.grad(_sin_loss(jnp.matmul), argnums=(0, 1))(x, w)


def _projected_dw(x, w, basis):
  """V Vᵀ (xᵀ g) with g = cos(x @ w), in float64 numpy, flattened over leading dims."""
  x_Txi = np.asarray(x, np.float64).reshape(-1, D_IN)
  w_ixo = np.asarray(w, np.float64)
  v_ixr = np.asarray(basis, np.float64)
  g_Txo = np.cos(x_Txi @ w_ixo)
  return v_ixr @ v_ixr.T @ (x_Txi.T @ g_Txo)


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def _random_orthogonal(key, n):
  q, _ = jnp.linalg.qr(jax.random.normal(key, (n, n)))
  return q


@pytest.mark.parametrize('lead', [(T,), (2, T), (2, 3, T)])
def test_forward_is_exact_matmul(lead):
  x, w, basis = _arrays(lead)
  y = lowrank_matmul(x, w, basis)
  assert y.shape == lead + (D_OUT,)
  np.testing.assert_allclose(y, x @ w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('lead', [(T,), (2, T), (2, 3, T)])
def test_dx_is_exact(lead):
  x, w, basis = _arrays(lead)
  dx, _ = _grads(basis, x, w)
  dx_exact, _ = _exact_grads(x, w)
  np.testing.assert_allclose(dx, dx_exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('lead', [(T,), (2, T), (2, 3, T)])
def test_dw_is_projected_exact_gradient(lead):
  x, w, basis = _arrays(lead)
  _, dw = _grads(basis, x, w)
  _, dw_exact = _exact_grads(x, w)
  np.testing.assert_allclose(dw, _projected_dw(x, w, basis), rtol=1e-4, atol=1e-4)
  assert _rel_err(dw, dw_exact) > 0.1  # rank 3 of 6 really changes it


def test_full_rank_orthonormal_basis_gives_exact_gradient():
  x, w, _ = _arrays((2, T))
  basis = _random_orthogonal(jax.random.key(7), D_IN)
  dx, dw = _grads(basis, x, w)
  dx_exact, dw_exact = _exact_grads(x, w)
  np.testing.assert_allclose(dx, dx_exact, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, dw_exact, rtol=1e-4, atol=1e-4)


def test_none_basis_is_plain_matmul():
  x, w, _ = _arrays((2, T))
  np.testing.assert_array_equal(lowrank_matmul(x, w, None), jnp.matmul(x, w))
  dx, dw = _grads(None, x, w)
  dx_exact, dw_exact = _exact_grads(x, w)
  np.testing.assert_array_equal(dx, dx_exact)
  np.testing.assert_array_equal(dw, dw_exact)


def _mc_dw(x, w, keys, scale):
  def one(key):
    return _grads(gaussian_basis(key, D_IN, R) * scale, x, w)[1]
  return jax.vmap(one)(keys)


def test_gaussian_basis_estimate_is_unbiased():
  x, w, _ = _arrays((T,))
  _, dw_exact = _exact_grads(x, w)
  keys = jax.random.split(jax.random.key(1), 2000)
  dw_samples = _mc_dw(x, w, keys, 1.0)
  single_err = np.mean([_rel_err(s, dw_exact) for s in dw_samples[:50]])
  mean_err = _rel_err(dw_samples.mean(0), dw_exact)
  assert single_err > 0.5
  assert mean_err < 0.1
  assert mean_err < single_err / 10
  # An estimator biased by a missing 1/sqrt(r) fails the same tolerance.
  unscaled_mean_err = _rel_err(_mc_dw(x, w, keys, np.sqrt(R)).mean(0), dw_exact)
  assert unscaled_mean_err > 0.5


def test_saved_residuals_are_tokens_by_rank_not_x():
  x, w, basis = _arrays((2, T))
  _, vjp_fn = jax.vjp(lambda x, w: lowrank_matmul(x, w, basis), x, w)
  shapes = [leaf.shape for leaf in jax.tree_util.tree_leaves(vjp_fn)]
  assert x.shape not in shapes
  assert (2, T, R) in shapes
  # The check can fail: the exact path does save x.
  _, exact_vjp_fn = jax.vjp(lambda x, w: lowrank_matmul(x, w, None), x, w)
  assert x.shape in [leaf.shape for leaf in jax.tree_util.tree_leaves(exact_vjp_fn)]


def test_composes_with_jit_grad_vmap_checkpoint():
  x, w, basis = _arrays((2, T))
  loss = _sin_loss(lambda x, w: lowrank_matmul(x, w, basis))
  dx, dw = _grads(basis, x, w)
  jit_dx, jit_dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  np.testing.assert_allclose(jit_dx, dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jit_dw, dw, rtol=1e-5, atol=1e-5)
  ckpt_dx, ckpt_dw = jax.grad(jax.checkpoint(loss), argnums=(0, 1))(x, w)
  np.testing.assert_allclose(ckpt_dx, dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ckpt_dw, dw, rtol=1e-5, atol=1e-5)
  # vmap over the leading batch: per-example dw sums to the batched dw.
  vmap_dw = jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None))(x, w)
  np.testing.assert_allclose(vmap_dw.sum(0), dw, rtol=1e-4, atol=1e-4)


def test_bf16_inputs():
  x, w, basis = _arrays((2, T))
  x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  y16 = lowrank_matmul(x16, w16, basis)
  assert y16.dtype == jnp.bfloat16
  dx16, dw16 = _grads(basis, x16, w16)
  assert dx16.dtype == jnp.bfloat16 and dw16.dtype == jnp.bfloat16
  assert np.all(np.isfinite(np.asarray(dx16, np.float32)))
  assert np.all(np.isfinite(np.asarray(dw16, np.float32)))
  dx32, dw32 = _grads(basis, x16.astype(jnp.float32), w16.astype(jnp.float32))
  assert _rel_err(dx16, dx32) < 3e-2
  assert _rel_err(dw16, dw32) < 3e-2


def test_mixed_dtypes_give_grads_in_each_inputs_dtype():
  x, w, basis = _arrays((2, T))
  dx, dw = _grads(basis, x.astype(jnp.bfloat16), w)
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32


@pytest.mark.parametrize('bad_shape', [(D_IN + 1, R), (D_IN,), (D_IN, R, 1)])
def test_bad_basis_shape_raises(bad_shape):
  x, w, _ = _arrays((T,))
  with pytest.raises(ValueError):
    lowrank_matmul(x, w, jnp.ones(bad_shape))


def _known_spectrum_w(spectrum, d_in=32, d_out=24, seed=3):
  ku, kv = jax.random.split(jax.random.key(seed))
  u = _random_orthogonal(ku, d_in)[:, :d_out]
  v = _random_orthogonal(kv, d_out)
  return u @ jnp.diag(spectrum) @ v.T, u


def _projector_err(q, u_r):
  return float(jnp.linalg.norm(q @ q.T - u_r @ u_r.T))


def test_svd_basis_recovers_top_singular_subspace():
  spectrum = jnp.concatenate([jnp.array([10., 9., 8., 7., 6.]), jnp.full((19,), 0.1)])
  w, u = _known_spectrum_w(spectrum)
  q = svd_basis(w, 5, jax.random.key(0))
  assert q.shape == (32, 5) and q.dtype == jnp.float32
  np.testing.assert_allclose(q.T @ q, jnp.eye(5), atol=1e-5)
  assert _projector_err(q, u[:, :5]) < 1e-3


def test_svd_basis_power_iterations_help_on_flat_spectrum():
  # Top 4 only twice the (slowly decaying) tail: one range-finder pass mixes them.
  spectrum = jnp.concatenate([jnp.full((4,), 2.0), jnp.linspace(1.0, 0.5, 20)])
  w, u = _known_spectrum_w(spectrum)
  key = jax.random.key(0)
  err_no_power = _projector_err(svd_basis(w, 4, key, power_iters=0, oversample=0), u[:, :4])
  err_power = _projector_err(svd_basis(w, 4, key, power_iters=4, oversample=0), u[:, :4])
  assert err_no_power > 0.5
  assert err_power < 0.1 * err_no_power


def test_refine_basis_tracks_the_top_subspace_from_a_previous_basis():
  spectrum = jnp.concatenate([jnp.full((4,), 2.0), jnp.linspace(1.0, 0.5, 20)])
  w, u = _known_spectrum_w(spectrum)
  start = svd_basis(w, 4, jax.random.key(0), power_iters=0, oversample=0)  # a poor basis
  errs, q = [_projector_err(start, u[:, :4])], start
  for _ in range(4):  # each refresh is one subspace iteration: the error shrinks every time
    q = refine_basis(w, q)
    errs.append(_projector_err(q, u[:, :4]))
  assert all(b < a for a, b in zip(errs, errs[1:])) and errs[-1] < 0.01 * errs[0], errs
  np.testing.assert_allclose(q.T @ q, jnp.eye(4), atol=1e-5)
  # The weights move a little (as between refreshes): one iteration from the old exact basis
  # is closer to the new top subspace than the old basis was.
  w2 = w + 0.05 * jax.random.normal(jax.random.key(5), w.shape)
  u2 = jnp.linalg.svd(w2, full_matrices=False)[0][:, :4]
  stale = _projector_err(u[:, :4], u2)
  assert stale > 0.01 and _projector_err(refine_basis(w2, u[:, :4]), u2) < 0.5 * stale


def test_svd_basis_bf16_and_invalid_rank():
  w = jax.random.normal(jax.random.key(0), (16, 12), jnp.bfloat16)
  q = svd_basis(w, 4, jax.random.key(1))
  assert q.dtype == jnp.bfloat16 and q.shape == (16, 4)
  np.testing.assert_allclose(np.asarray(q.T @ q, np.float32), np.eye(4), atol=3e-2)
  for bad_rank in (0, 13):
    with pytest.raises(ValueError):
      svd_basis(w, bad_rank, jax.random.key(1))


def test_gaussian_basis_shape_dtype_and_invalid_rank():
  v = gaussian_basis(jax.random.key(0), D_IN, R, jnp.bfloat16)
  assert v.shape == (D_IN, R) and v.dtype == jnp.bfloat16
  with pytest.raises(ValueError):
    gaussian_basis(jax.random.key(0), D_IN, 0)


def test_gaussian_basis_projector_has_identity_mean():
  keys = jax.random.split(jax.random.key(2), 4000)
  vvt = jax.vmap(lambda k: (lambda v: v @ v.T)(gaussian_basis(k, D_IN, 2)))(keys)
  assert np.max(np.abs(vvt.mean(0) - np.eye(D_IN))) < 0.1
  assert np.max(np.abs(vvt[0] - np.eye(D_IN))) > 0.3  # one sample is far from I


# --- transformer math ------------------------------------------------------------------------

def test_rms_norm_and_cross_entropy_match_their_definitions():
  x = jax.random.normal(jax.random.key(0), (2, 3, 8))
  scale = jnp.linspace(0.5, 1.5, 8)
  want = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale
  np.testing.assert_allclose(transformer.rms_norm(x, scale), want, rtol=1e-5, atol=1e-6)
  logits, targets = x[..., :5], jnp.array([[0, 1, 4], [3, 2, 0]])
  want = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(transformer.token_cross_entropy(logits, targets), want, rtol=1e-5)


def test_rope_rotates_pairs_by_position_so_scores_depend_on_the_offset_only():
  q, k = jax.random.normal(jax.random.key(1), (2, 1, 1, 1, 8))
  at = lambda x, pos: transformer.rope(jnp.tile(x, (1, pos + 1, 1, 1)))[0, pos, 0]
  np.testing.assert_allclose(jnp.linalg.norm(at(q, 5)), jnp.linalg.norm(q), rtol=1e-5)
  score = lambda i, j: jnp.dot(at(q, i), at(k, j))
  np.testing.assert_allclose(score(7, 4), score(3, 0), rtol=1e-4)
  assert abs(score(7, 4) - score(4, 4)) > 1e-3
