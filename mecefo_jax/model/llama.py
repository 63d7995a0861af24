"""LLaMA-style decoder in Flax NNX: thin modules owning parameters and their logical axes."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mecefo_jax import ops
from mecefo_jax.config import ModelConfig
from mecefo_jax.layers import MeCeFOLinear
from mecefo_jax.model import contract
# Re-exported: the contract's names as this module gave them before the contract.
from mecefo_jax.model.contract import (FULL, NONE, SCAN_UNROLL, Degrade, compute_dtype,  # noqa: F401
                                       unrolled)

# The key of the stacked blocks: every leaf under it has a leading `layers` axis (one row per block).
BLOCKS = 'blocks'
# Its bases table: where each FFN basis lives in the train state (snapshots hold this layout),
# {basis path: layer path}; the contract finds the layers by their marker (contract.mark_ffn).
BASES_TABLE = {(BLOCKS, name): (BLOCKS, 'ffn', name) for name in ('gate', 'up', 'down')}


def _linear(d_in, d_out, axes, cfg: ModelConfig, rngs):
  return MeCeFOLinear(d_in, d_out, use_bias=False, dtype=compute_dtype(cfg),
                      param_dtype=jnp.dtype(cfg.param_dtype),
                      kernel_init=nnx.initializers.normal(cfg.init_std),
                      kernel_metadata={'logical_axes': axes}, rngs=rngs)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, cfg: ModelConfig):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.dtype(cfg.param_dtype)), logical_axes=('norm',))
    self.eps = cfg.norm_eps

  def __call__(self, x):
    return ops.rms_norm(x, self.scale[...], self.eps)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d = cfg.d_model
    self.q = _linear(d, d, ('embed', 'heads'), cfg, rngs)
    self.k = _linear(d, d, ('embed', 'heads'), cfg, rngs)
    self.v = _linear(d, d, ('embed', 'heads'), cfg, rngs)
    self.o = _linear(d, d, ('heads', 'embed'), cfg, rngs)
    self.n_heads, self.rope_theta = cfg.n_heads, cfg.rope_theta

  def __call__(self, x_BxLxD):
    b, l, d = x_BxLxD.shape
    split = lambda t: t.reshape(b, l, self.n_heads, d // self.n_heads)
    q = ops.rope(split(self.q(x_BxLxD)), self.rope_theta)
    k = ops.rope(split(self.k(x_BxLxD)), self.rope_theta)
    out_BxLxHxK = ops.causal_attention(q, k, split(self.v(x_BxLxD)))
    return self.o(out_BxLxHxK.reshape(b, l, d))


class FeedForward(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.gate = _linear(cfg.d_model, cfg.ffn_dim, ('embed', 'mlp'), cfg, rngs)
    self.up = _linear(cfg.d_model, cfg.ffn_dim, ('embed', 'mlp'), cfg, rngs)
    self.down = _linear(cfg.ffn_dim, cfg.d_model, ('mlp', 'embed'), cfg, rngs)

  def __call__(self, x_BxLxD, bases=None):
    """SwiGLU through the layers' own calls; `bases` ({'gate','up','down'}) makes their weight
    gradients low-rank."""
    b = bases or {}
    return ops.swiglu_ffn(x_BxLxD, functools.partial(self.gate, basis=b.get('gate')),
                          functools.partial(self.up, basis=b.get('up')),
                          functools.partial(self.down, basis=b.get('down')))


class Block(nnx.Module):
  """Pre-norm block; `degraded` (bool or Degrade) cuts the attention backward, remats the FFN
  and makes its weight gradients low-rank (model/contract.py's blocks)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.attn_norm, self.attn = contract.mark_attention(RMSNorm(cfg.d_model, cfg),
                                                        Attention(cfg, rngs))
    self.ffn_norm = RMSNorm(cfg.d_model, cfg)
    self.ffn = contract.mark_ffn(FeedForward(cfg, rngs))

  def __call__(self, h_BxLxD, degraded: bool | Degrade = False, bases=None, remat: str = 'dots'):
    # Forward stays exact; degraded, the backward sees only the residual path around attention.
    h_BxLxD = h_BxLxD + contract.attention_output(self.attn(self.attn_norm(h_BxLxD)), degraded)
    return h_BxLxD + contract.ffn_branch(self.ffn_norm, self.ffn, h_BxLxD, degraded, bases, remat)


class LLaMA(contract.Model):
  """Decoder-only LM: embedding, n pre-norm blocks (stacked, run by one lax.scan), final
  RMSNorm, untied LM head."""
  bases_table = BASES_TABLE

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.embed = nnx.Param(
        nnx.initializers.normal(cfg.init_std)(rngs.params(), (cfg.vocab_size, cfg.d_model),
                                              jnp.dtype(cfg.param_dtype)),
        logical_axes=('vocab', 'embed'))
    self.blocks = contract.stack(lambda r: Block(cfg, r), cfg.n_layers, rngs)
    self.final_norm = RMSNorm(cfg.d_model, cfg)
    self.head = _linear(cfg.d_model, cfg.vocab_size, ('embed', 'vocab'), cfg, rngs)
    self.dtype = compute_dtype(cfg)

  def __call__(self, tokens_BxL, degraded: bool | Degrade = False, bases=None, remat: str = 'dots'):
    h = jnp.take(self.embed[...], tokens_BxL, axis=0).astype(self.dtype)
    layer = lambda block, h_BxLxD, layer_bases: block(h_BxLxD, degraded, layer_bases, remat)
    h = contract.scan(self.blocks, h, layer, bases[BLOCKS] if bases is not None else None)
    return self.head(self.final_norm(h))


def create(cfg: ModelConfig, seed: int | jax.Array = 0):
  """(graphdef, params as a pure dict) for a freshly initialised model; `seed` may be traced
  (the initializer takes it as an argument: train_state.lower_init)."""
  graphdef, state = nnx.split(LLaMA(cfg, nnx.Rngs(params=jax.random.key(seed))))
  return graphdef, nnx.to_pure_dict(state)


def abstract(cfg: ModelConfig):
  """(graphdef, params ShapeDtypeStructs, params logical axes) without allocating."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: LLaMA(cfg, nnx.Rngs(params=0))))
  axes = jax.tree.map(lambda v: v.get_metadata().get('logical_axes'), state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))
  shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))
  return graphdef, nnx.to_pure_dict(shapes), nnx.to_pure_dict(axes)


def forward(graphdef, params, tokens_BxL, degraded: bool | Degrade = False, bases=None,
            remat='dots'):
  """Pure forward: logits [B, L, V] from a pure params dict; `degraded` as in Block."""
  return nnx.merge(graphdef, params)(tokens_BxL, degraded, bases, remat)


def layer(tree, i: int):
  """Layer i's slice of the stacked blocks of `tree` (params, gradients or bases)."""
  return jax.tree.map(lambda x: x[i], tree[BLOCKS])
