"""Pure-JAX transformer math: RMSNorm, LayerNorm, RoPE, causal attention, SwiGLU and GELU FFNs,
cross-entropy."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mecefo_jax.config import check_setting

# Names that the 'dots' remat policy keeps: the two big FFN matmul outputs.
FFN_SAVED_NAMES = ('ffn_gate', 'ffn_up')


def rms_norm(x_BxLxD, scale_D, eps: float = 1e-6):
  """RMSNorm computed in float32, returned in x's dtype."""
  x32 = x_BxLxD.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * inv * scale_D.astype(jnp.float32)).astype(x_BxLxD.dtype)


def layer_norm(x_BxLxD, scale_D, bias_D, eps: float = 1e-5):
  """LayerNorm computed in float32, returned in x's dtype."""
  x32 = x_BxLxD.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  out = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale_D.astype(jnp.float32)
  return (out + bias_D.astype(jnp.float32)).astype(x_BxLxD.dtype)


def rope(x_BxLxHxK, theta: float = 10000.0):
  """Rotary position embedding (rotate-half form) over the last dim."""
  seq_len, head_dim = x_BxLxHxK.shape[1], x_BxLxHxK.shape[-1]
  half = head_dim // 2
  freq_K2 = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle_LxK2 = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * freq_K2[None, :]
  sin, cos = jnp.sin(angle_LxK2)[None, :, None, :], jnp.cos(angle_LxK2)[None, :, None, :]
  x32 = x_BxLxHxK.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxK.dtype)


def causal_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK):
  """Causal softmax attention; XLA on CPU, fused kernels where the backend has them."""
  return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, is_causal=True)


def swiglu_ffn(x_BxLxD, gate, up, down):
  """SwiGLU FFN, down(silu(gate(x)) * up(x)), over three linear maps (callables).

  The maps are the caller's layers (in the model, `MeCeFOLinear`s with their bases bound), so
  the published layer is what trains; the gate and up outputs carry the names that
  remat_policy('dots') keeps.
  """
  g = checkpoint_name(gate(x_BxLxD), 'ffn_gate')
  u = checkpoint_name(up(x_BxLxD), 'ffn_up')
  return down(jax.nn.silu(g) * u)


def gelu_ffn(x_BxLxD, up, down):
  """GPT-2's MLP, down(gelu(up(x))), over two linear maps (callables); the up output carries a
  name that remat_policy('dots') keeps."""
  return down(jax.nn.gelu(checkpoint_name(up(x_BxLxD), 'ffn_up'), approximate=True))


def remat_policy(name: str):
  """jax.checkpoint policy for the degraded FFN: 'full' keeps only the input, 'dots' also the
  named matmul outputs (gate/up)."""
  check_setting('mecefo.ffn_remat', name)
  if name == 'full':
    return jax.checkpoint_policies.nothing_saveable
  return jax.checkpoint_policies.save_only_these_names(*FFN_SAVED_NAMES)


def token_cross_entropy(logits_BxLxV, targets_BxL):
  """Per-token cross-entropy in float32, [B, L]."""
  logits32 = logits_BxLxV.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits32, axis=-1)
  picked = jnp.take_along_axis(logits32, targets_BxL[..., None], axis=-1)[..., 0]
  return logz - picked
