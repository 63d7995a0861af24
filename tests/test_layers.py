"""Tests of MeCeFOLinear (NNX) and MeCeFODense (Linen), alone and inside foreign models."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn, nnx

from mecefo_jax.layers import MeCeFODense, MeCeFOLinear
from mecefo_jax.ops import gaussian_basis

D_IN, D_OUT, R = 6, 5, 2


def _x(lead=(2, 4), seed=0):
  return jax.random.normal(jax.random.key(seed), lead + (D_IN,))


def _basis(seed=1, d_in=D_IN, rank=R):
  return gaussian_basis(jax.random.key(seed), d_in, rank)


def _projected(basis, dw):
  return basis @ basis.T @ dw


def _rel_err(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _sin_loss(y):
  return jnp.sum(jnp.sin(y))


def _regression_data(seed=0, n=128, d_in=8):
  kx, ka = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (n, d_in))
  y = jnp.tanh(x @ jax.random.normal(ka, (d_in, 1)))
  return x, y


# ---------------------------------------------------------------- NNX


def test_linear_matches_nnx_linear_params_and_outputs():
  kwargs = dict(use_bias=True, param_dtype=jnp.float32,
                bias_init=nnx.initializers.normal(1.0))
  ours = MeCeFOLinear(D_IN, D_OUT, rngs=nnx.Rngs(3), **kwargs)
  ref = nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(3), **kwargs)
  ours_state, ref_state = nnx.state(ours, nnx.Param), nnx.state(ref, nnx.Param)
  assert set(dict(ours_state)) == set(dict(ref_state)) == {'kernel', 'bias'}
  jax.tree.map(np.testing.assert_array_equal, ours_state, ref_state)
  x = _x()
  np.testing.assert_array_equal(ours(x), ref(x))
  np.testing.assert_array_equal(ours(x, out_sharding=None), ref(x, out_sharding=None))


def test_linear_without_bias_matches():
  ours = MeCeFOLinear(D_IN, D_OUT, use_bias=False, rngs=nnx.Rngs(4))
  ref = nnx.Linear(D_IN, D_OUT, use_bias=False, rngs=nnx.Rngs(4))
  assert ours.bias is None
  np.testing.assert_array_equal(ours(_x(), basis=_basis()), ref(_x()))


def _nnx_grads(layer, x, basis):
  return nnx.grad(lambda m: _sin_loss(m(x, basis)))(layer)


def test_linear_with_basis_projects_kernel_grad_only():
  layer = MeCeFOLinear(D_IN, D_OUT, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(5))
  x, basis = _x(), _basis()
  np.testing.assert_allclose(layer(x, basis), layer(x), rtol=1e-6, atol=1e-6)
  exact, lowrank = _nnx_grads(layer, x, None), _nnx_grads(layer, x, basis)
  np.testing.assert_allclose(lowrank['kernel'][...], _projected(basis, exact['kernel'][...]),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(lowrank['bias'][...], exact['bias'][...], rtol=1e-6, atol=1e-6)
  assert _rel_err(lowrank['kernel'][...], exact['kernel'][...]) > 0.1


def test_linear_call_keywords_rejected_on_lowrank_path():
  layer = MeCeFOLinear(D_IN, D_OUT, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError):
    layer(_x(), basis=_basis(), out_sharding=jax.sharding.PartitionSpec())


def test_linear_composes_with_jax_jit_and_grad():
  layer = MeCeFOLinear(D_IN, D_OUT, rngs=nnx.Rngs(6))
  graphdef, params = nnx.split(layer, nnx.Param)
  x, basis = _x(), _basis()

  def loss(params, basis):
    return _sin_loss(nnx.merge(graphdef, params)(x, basis))

  grads = jax.jit(jax.grad(loss))(params, basis)
  exact = jax.grad(loss)(params, None)
  np.testing.assert_allclose(grads['kernel'][...], _projected(basis, exact['kernel'][...]),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(grads['bias'][...], exact['bias'][...], rtol=1e-5, atol=1e-6)


class ForeignMLP(nnx.Module):
  """Someone else's regressor that only swaps nnx.Linear for MeCeFOLinear."""

  def __init__(self, d_in, d_hidden, rngs):
    self.hidden = MeCeFOLinear(d_in, d_hidden, rngs=rngs)
    self.out = MeCeFOLinear(d_hidden, 1, rngs=rngs)

  def __call__(self, x, bases=(None, None)):
    return self.out(nnx.relu(self.hidden(x, bases[0])), bases[1])


def _mse(model, x, y, bases=(None, None)):
  return jnp.mean((model(x, bases) - y) ** 2)


def test_foreign_nnx_model_trains_with_lowrank_grads():
  x, y = _regression_data()
  model = ForeignMLP(8, 32, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, key):
    k_hidden, k_out = jax.random.split(key)
    bases = (gaussian_basis(k_hidden, 8, 4), gaussian_basis(k_out, 32, 8))
    loss, grads = nnx.value_and_grad(_mse)(model, x, y, bases)
    optimizer.update(model, grads)
    return loss

  initial = float(_mse(model, x, y))
  for key in jax.random.split(jax.random.key(1), 100):
    step(model, optimizer, key)
  # Biases alone (kernel grads dead) only reach ~0.4x here; low-rank kernels reach ~0.06x.
  assert float(_mse(model, x, y)) < 0.15 * initial


# ---------------------------------------------------------------- Linen


def test_dense_params_and_exact_path_match_nn_dense():
  x = _x()
  ours, ref = MeCeFODense(D_OUT), nn.Dense(D_OUT)
  params = ours.init(jax.random.key(2), x)
  ref_params = ref.init(jax.random.key(2), x)
  assert set(params['params']) == set(ref_params['params']) == {'kernel', 'bias'}
  jax.tree.map(np.testing.assert_array_equal, params, ref_params)
  np.testing.assert_array_equal(ours.apply(params, x), ref.apply(params, x))
  # Params created on the low-rank path are the same too.
  jax.tree.map(np.testing.assert_array_equal,
               ours.init(jax.random.key(2), x, basis=_basis()), ref_params)


def test_dense_with_basis_projects_kernel_grad_under_jit():
  x, basis = _x(), _basis()
  layer = MeCeFODense(D_OUT, bias_init=nn.initializers.normal(1.0))
  params = layer.init(jax.random.key(3), x)
  np.testing.assert_allclose(layer.apply(params, x, basis), layer.apply(params, x),
                             rtol=1e-6, atol=1e-6)

  def loss(params, basis):
    return _sin_loss(layer.apply(params, x, basis))

  grads = jax.jit(jax.grad(loss))(params, basis)['params']
  exact = jax.grad(loss)(params, None)['params']
  np.testing.assert_allclose(grads['kernel'], _projected(basis, exact['kernel']),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(grads['bias'], exact['bias'], rtol=1e-5, atol=1e-6)
  assert _rel_err(grads['kernel'], exact['kernel']) > 0.1


class ForeignLinenMLP(nn.Module):
  """Someone else's Linen regressor that only swaps nn.Dense for MeCeFODense."""
  d_hidden: int

  @nn.compact
  def __call__(self, x, bases=(None, None)):
    h = nn.relu(MeCeFODense(self.d_hidden)(x, bases[0]))
    return MeCeFODense(1)(h, bases[1])


def test_foreign_linen_model_trains_with_lowrank_grads():
  x, y = _regression_data()
  model = ForeignLinenMLP(32)
  params = model.init(jax.random.key(0), x)
  tx = optax.adam(1e-2)

  def mse(params, bases=(None, None)):
    return jnp.mean((model.apply(params, x, bases) - y) ** 2)

  @jax.jit
  def step(params, opt_state, key):
    k_hidden, k_out = jax.random.split(key)
    bases = (gaussian_basis(k_hidden, 8, 4), gaussian_basis(k_out, 32, 8))
    grads = jax.grad(mse)(params, bases)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  initial = float(mse(params))
  opt_state = tx.init(params)
  for key in jax.random.split(jax.random.key(1), 100):
    params, opt_state = step(params, opt_state, key)
  # Biases alone (kernel grads dead) only reach ~0.5x here; low-rank kernels reach ~0.05x.
  assert float(mse(params)) < 0.15 * initial
