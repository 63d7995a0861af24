"""Drop-in Flax layers (NNX and Linen) whose weight gradient can be made low-rank with a basis."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn, nnx

from mecefo_jax.ops.lowrank import lowrank_matmul


def _lowrank_affine(inputs, kernel, bias, basis):
  y = lowrank_matmul(inputs, kernel, basis)
  return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


class MeCeFOLinear(nnx.Linear):
  """`nnx.Linear` with the same constructor and parameters (`kernel`, `bias`).

  Calling it without a basis is exactly `nnx.Linear`. With `basis` ([in_features, r])
  the forward is unchanged and the kernel gradient is projected onto span(basis)
  (see `mecefo_jax.ops.lowrank_matmul`). The low-rank path uses a plain matmul, so a
  custom `dot_general` applies only to exact calls, and so do `nnx.Linear`'s call
  keywords (`out_sharding`).
  """

  def __call__(self, inputs: jax.Array, basis: jax.Array | None = None, **kwargs) -> jax.Array:
    if basis is None:
      return super().__call__(inputs, **kwargs)
    if any(v is not None for v in kwargs.values()):
      raise ValueError(f'{sorted(kwargs)} are not supported with a basis (low-rank path)')
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
    return _lowrank_affine(inputs, kernel, bias, basis)


class MeCeFODense(nn.Dense):
  """Linen `nn.Dense` with an optional `basis` argument for a low-rank kernel gradient."""

  @nn.compact
  def __call__(self, inputs: jax.Array, basis: jax.Array | None = None) -> jax.Array:
    if basis is None:
      return super().__call__(inputs)
    kernel = self.param('kernel', self.kernel_init,
                        (jnp.shape(inputs)[-1], self.features), self.param_dtype)
    bias = (self.param('bias', self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    return _lowrank_affine(inputs, kernel, bias, basis)
