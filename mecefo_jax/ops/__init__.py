"""Pure JAX math of MeCeFO (no Flax): low-rank weight gradients, bases, transformer pieces."""
from mecefo_jax.ops.basis import gaussian_basis, refine_basis, svd_basis
from mecefo_jax.ops.lowrank import lowrank_matmul
from mecefo_jax.ops.transformer import (causal_attention, gelu_ffn, layer_norm, remat_policy,
                                        rms_norm, rope, swiglu_ffn, token_cross_entropy)

__all__ = ['lowrank_matmul', 'svd_basis', 'refine_basis', 'gaussian_basis', 'rms_norm', 'rope',
           'causal_attention', 'swiglu_ffn', 'remat_policy', 'token_cross_entropy', 'layer_norm',
           'gelu_ffn']
