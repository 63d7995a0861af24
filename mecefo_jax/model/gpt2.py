"""GPT-2-style decoder (model.kind=gpt2), a second model of the contract: pre-LayerNorm blocks,
GELU MLP, learned positions, tied input/output embeddings; built from the contract's blocks."""
from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from mecefo_jax import ops
from mecefo_jax.config import ModelConfig
from mecefo_jax.model import contract
from mecefo_jax.model.contract import Degrade


def _dense(d_in, d_out, axes, cfg: ModelConfig, rngs, std=None):
  return contract.linear(d_in, d_out, axes, rngs, dtype=contract.compute_dtype(cfg),
                         param_dtype=jnp.dtype(cfg.param_dtype), use_bias=True,
                         init_std=cfg.init_std if std is None else std)


def _residual_std(cfg: ModelConfig) -> float:
  """GPT-2's init of the projections into the residual stream: std / sqrt(2 × layers)."""
  return cfg.init_std / math.sqrt(2 * cfg.n_layers)


class LayerNorm(nnx.Module):
  def __init__(self, dim: int, cfg: ModelConfig):
    dtype = jnp.dtype(cfg.param_dtype)
    self.scale = nnx.Param(jnp.ones((dim,), dtype), logical_axes=('norm',))
    self.bias = nnx.Param(jnp.zeros((dim,), dtype), logical_axes=('norm',))
    self.eps = cfg.norm_eps

  def __call__(self, x):
    return ops.layer_norm(x, self.scale[...], self.bias[...], self.eps)


class SelfAttention(nnx.Module):
  """Causal multi-head attention with biases, no rotary embedding (positions are learned)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d = cfg.d_model
    self.q = _dense(d, d, ('embed', 'heads'), cfg, rngs)
    self.k = _dense(d, d, ('embed', 'heads'), cfg, rngs)
    self.v = _dense(d, d, ('embed', 'heads'), cfg, rngs)
    self.proj = _dense(d, d, ('heads', 'embed'), cfg, rngs, _residual_std(cfg))
    self.n_heads = cfg.n_heads

  def __call__(self, x_BxLxD):
    b, l, d = x_BxLxD.shape
    split = lambda t: t.reshape(b, l, self.n_heads, d // self.n_heads)
    out = ops.causal_attention(split(self.q(x_BxLxD)), split(self.k(x_BxLxD)),
                               split(self.v(x_BxLxD)))
    return self.proj(out.reshape(b, l, d))


class MLP(nnx.Module):
  """GELU MLP; its two MeCeFOLinear layers take the bases {'fc', 'proj'} of a degraded pass."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.fc = _dense(cfg.d_model, cfg.ffn_dim, ('embed', 'mlp'), cfg, rngs)
    self.proj = _dense(cfg.ffn_dim, cfg.d_model, ('mlp', 'embed'), cfg, rngs, _residual_std(cfg))

  def __call__(self, x_BxLxD, bases=None):
    return ops.gelu_ffn(x_BxLxD, lambda x: self.fc(x, basis=contract.basis(bases, 'fc')),
                        lambda x: self.proj(x, basis=contract.basis(bases, 'proj')))


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.attn = contract.AttentionBranch(LayerNorm(cfg.d_model, cfg), SelfAttention(cfg, rngs))
    self.mlp = contract.FFNBranch(LayerNorm(cfg.d_model, cfg), MLP(cfg, rngs))

  def __call__(self, h_BxLxD, degrade: Degrade, bases, remat):
    h_BxLxD = h_BxLxD + self.attn(h_BxLxD, degrade)
    return h_BxLxD + self.mlp(h_BxLxD, degrade, contract.basis(bases, 'mlp'), remat)


class GPT2(contract.Model):
  """Token + learned position embeddings, stacked blocks (one lax.scan), final LayerNorm, logits
  from the token embedding (tied)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    init, dtype = nnx.initializers.normal(cfg.init_std), jnp.dtype(cfg.param_dtype)
    self.wte = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.d_model), dtype),
                         logical_axes=('vocab', 'embed'))
    self.wpe = nnx.Param(init(rngs.params(), (cfg.seq_len, cfg.d_model), dtype),
                         logical_axes=('position', 'embed'))
    self.h = contract.stack(lambda r: Block(cfg, r), cfg.n_layers, rngs)
    self.ln_f = LayerNorm(cfg.d_model, cfg)
    self.dtype = contract.compute_dtype(cfg)

  def __call__(self, tokens_BxL, degrade: Degrade, bases=None, remat='dots'):
    wte = self.wte[...].astype(self.dtype)
    x = jnp.take(wte, tokens_BxL, axis=0) + self.wpe[:tokens_BxL.shape[1]].astype(self.dtype)
    layer = lambda block, h, layer_bases: block(h, degrade, layer_bases, remat)
    x = contract.scan(self.h, x, layer, contract.basis(bases, 'h'))
    return self.ln_f(x) @ wte.T
