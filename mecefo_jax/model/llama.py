"""LLaMA-style decoder in Flax NNX: thin modules owning parameters and their logical axes."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mecefo_jax import ops
from mecefo_jax.config import ModelConfig, resolve_compute_dtype
from mecefo_jax.layers import MeCeFOLinear

# Top-level parameter names inside a block whose gradient comes only from exact micro-batches.
ATTENTION_BRANCH = ('attn', 'attn_norm')
# The key of the stacked blocks: every leaf under it has a leading `layers` axis (one row per block).
BLOCKS = 'blocks'
# lax.scan's unroll over the blocks, the same at every depth: 1 keeps one block body in every
# program, so that compile time does not grow with n_layers (report.json: programs.scan_unroll).
SCAN_UNROLL = 1
_unroll: contextvars.ContextVar[int | bool] = contextvars.ContextVar('scan_unroll')


@contextlib.contextmanager
def unrolled():
  """Programs traced inside run the blocks unrolled (lax.scan unroll=True): only for XLA's cost
  analysis, which counts a loop's body once whatever its trip count (benchmarks/mfu.py)."""
  token = _unroll.set(True)
  try:
    yield
  finally:
    _unroll.reset(token)


@dataclasses.dataclass(frozen=True)
class Degrade:
  """Which docs/algorithm.md §2 techniques a pass uses; frozen and hashable, so it is static under jit.

  `degraded=True` everywhere means all three (the MeCeFO degraded step), `False` none; single
  flags exist for the ablation (benchmarks/ablation.py).
  """
  skip_attention: bool = False  # §2.1: stop_gradient on the attention branch output
  remat_ffn: bool = False  # §2.2: jax.checkpoint the FFN branch (policy from `remat`)
  lowrank: bool = False  # §2.3: low-rank FFN weight gradients with the given bases

  @classmethod
  def of(cls, degraded: 'bool | Degrade') -> 'Degrade':
    if isinstance(degraded, cls):
      return degraded
    return FULL if degraded else NONE

  def __bool__(self) -> bool:
    return self.skip_attention or self.remat_ffn or self.lowrank


NONE, FULL = Degrade(), Degrade(True, True, True)


def compute_dtype(cfg: ModelConfig) -> jnp.dtype:
  """The dtype activations and matmuls run in: cfg.compute_dtype, `auto` resolved for the
  default backend (the one a run's devices are on)."""
  return jnp.dtype(resolve_compute_dtype(cfg.compute_dtype, jax.default_backend()))


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


def ffn_branch(norm: RMSNorm, ffn: FeedForward, h_BxLxD, bases):
  """Pre-FFN norm + FFN as one function, so a checkpoint of it keeps only its input h (and the
  parameters, which stay live anyway)."""
  return ffn(norm(h_BxLxD), bases)


class Block(nnx.Module):
  """Pre-norm block; `degraded` (bool or Degrade) cuts the attention backward, remats the FFN
  and makes its weight gradients low-rank."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg)
    self.attn = Attention(cfg, rngs)
    self.ffn_norm = RMSNorm(cfg.d_model, cfg)
    self.ffn = FeedForward(cfg, rngs)

  def __call__(self, h_BxLxD, degraded: bool | Degrade = False, bases=None, remat: str = 'dots'):
    d = Degrade.of(degraded)
    a = self.attn(self.attn_norm(h_BxLxD))
    # Forward stays exact; backward sees only the residual path around attention.
    h_BxLxD = h_BxLxD + (jax.lax.stop_gradient(a) if d.skip_attention else a)
    branch = ffn_branch
    if d.remat_ffn:
      # nnx.remat is jax.checkpoint over the modules' params: the layers' own calls (dtype casts
      # included) run inside the boundary and are recomputed in the backward pass.
      branch = nnx.remat(ffn_branch, policy=ops.remat_policy(remat))
    return h_BxLxD + branch(self.ffn_norm, self.ffn, h_BxLxD, bases if d.lowrank else None)


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
  """All cfg.n_layers blocks as one Block whose parameters have a leading `layers` axis; each
  layer is initialised from its own key under one vmap, so a program that creates the model
  holds one block's initializer at any depth."""
  keys = jax.random.split(rngs.params(), cfg.n_layers)
  graphdef, template = nnx.split(nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(params=0))))
  values = jax.vmap(lambda key: nnx.to_pure_dict(nnx.state(Block(cfg, nnx.Rngs(params=key)))))(keys)
  values = jax.tree.leaves(values)
  variables = jax.tree.leaves(template, is_leaf=lambda x: isinstance(x, nnx.Variable))
  stacked = [v.replace(value, logical_axes=('layers', *v.get_metadata()['logical_axes']))
             for v, value in zip(variables, values)]
  treedef = jax.tree.structure(template, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, stacked))


class LLaMA(nnx.Module):
  """Decoder-only LM: embedding, n pre-norm blocks (stacked, run by one lax.scan), final
  RMSNorm, untied LM head."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.embed = nnx.Param(
        nnx.initializers.normal(cfg.init_std)(rngs.params(), (cfg.vocab_size, cfg.d_model),
                                              jnp.dtype(cfg.param_dtype)),
        logical_axes=('vocab', 'embed'))
    self.blocks = _stacked_blocks(cfg, rngs)
    self.final_norm = RMSNorm(cfg.d_model, cfg)
    self.head = _linear(cfg.d_model, cfg.vocab_size, ('embed', 'vocab'), cfg, rngs)
    self.dtype = compute_dtype(cfg)

  def __call__(self, tokens_BxL, degraded: bool | Degrade = False, bases=None, remat: str = 'dots'):
    h = jnp.take(self.embed[...], tokens_BxL, axis=0).astype(self.dtype)
    graphdef, stacked = nnx.split(self.blocks)

    def layer(h_BxLxD, xs):
      params, layer_bases = xs
      return nnx.merge(graphdef, params)(h_BxLxD, degraded, layer_bases, remat), None

    layer_bases = bases[BLOCKS] if bases is not None else None
    h, _ = jax.lax.scan(layer, h, (stacked, layer_bases), unroll=_unroll.get(SCAN_UNROLL))
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


def _keys(path) -> list:
  return [getattr(k, 'key', getattr(k, 'name', None)) for k in path]


def is_stacked(path) -> bool:
  """True for leaves of the stacked blocks (leading `layers` axis), in params or any tree that
  mirrors them (optimizer moments, bases)."""
  return BLOCKS in _keys(path)


def layer(tree, i: int):
  """Layer i's slice of the stacked blocks of `tree` (params, gradients or bases)."""
  return jax.tree.map(lambda x: x[i], tree[BLOCKS])


def is_attention_branch(path) -> bool:
  """True for parameters that degraded micro-batches give no gradient (docs/algorithm.md §2.1)."""
  return any(k in ATTENTION_BRANCH for k in _keys(path))
