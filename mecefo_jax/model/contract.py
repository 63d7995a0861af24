"""The model contract: what the trainer needs from a model, the markers a model declares its
attention branch and its basis-taking layers with, and the blocks that run a degraded step.

A model of the contract (docs/algorithm.md §9) is an NNX module built by a factory
`factory(cfg: ModelConfig, rngs: nnx.Rngs)` whose

- `__call__(tokens_BxL, degrade: Degrade, bases, remat) -> logits_BxLxV` runs the forward,
  degraded as `degrade` says (`AttentionBranch` / `FFNBranch`, or `attention_output` /
  `ffn_branch` inside its own blocks), passing each basis of `bases` to its layer;
- parameters carry `logical_axes` metadata (names of sharding.LOGICAL_RULES; a scanned stack's
  leaves lead with 'layers': `stack`);
- attention branch is marked (`mark_attention`), and so are the MeCeFOLinear layers that take
  bases (`mark_ffn`); `bases` mirrors the marked layers' paths unless the model's
  `bases_table` ({basis path: layer path}) says where each basis lives;
- `loss(logits_BxLxV, targets_BxL)` gives per-token losses (`Model.loss`: cross-entropy).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mecefo_jax import ops
from mecefo_jax.config import resolve_compute_dtype
from mecefo_jax.layers import MeCeFOLinear

# Variable metadata keys of the markers: True on every parameter of the attention branch, and
# on the kernel of every layer that takes a basis.
ATTENTION_TAG = 'mecefo_attention'
BASIS_TAG = 'mecefo_basis'
# The logical axis a stacked (scanned) parameter leads with: one row per block.
LAYERS = 'layers'
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


def scan_unroll() -> int | bool:
  """lax.scan's unroll over the blocks for programs traced now: SCAN_UNROLL, or True inside
  unrolled()."""
  return _unroll.get(SCAN_UNROLL)


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


def _variables(module):
  return [node for _, node in nnx.iter_graph(module) if isinstance(node, nnx.Variable)]


def mark_attention(*modules):
  """Marks every parameter of `modules` as the attention branch: gradients only from exact rows
  (docs/algorithm.md §2.1, §3). Returns the modules (one, or a tuple)."""
  for module in modules:
    for variable in _variables(module):
      variable.set_metadata(ATTENTION_TAG, True)
  return modules[0] if len(modules) == 1 else modules


def mark_ffn(module):
  """Marks every MeCeFOLinear of `module` as taking a basis in degraded passes (§2.3): its
  kernel gradient is then projected. Returns the module."""
  layers = [node for _, node in nnx.iter_graph(module) if isinstance(node, MeCeFOLinear)]
  if not layers:
    raise TypeError(f'mark_ffn: {type(module).__name__} holds no MeCeFOLinear')
  for layer in layers:
    layer.kernel.set_metadata(BASIS_TAG, True)
  return module


def attention_output(a, degrade: bool | Degrade):
  """The attention branch's output; under §2.1 the backward stops here (the forward is exact)."""
  return jax.lax.stop_gradient(a) if Degrade.of(degrade).skip_attention else a


def _ffn_call(norm, ffn, x, bases):
  """Norm + FFN as one function, so a checkpoint of it keeps only its input x (and the
  parameters, which stay live anyway)."""
  return ffn(norm(x), bases)


def ffn_branch(norm, ffn, x, degrade: bool | Degrade, bases=None, remat: str = 'dots'):
  """`ffn(norm(x), bases)`; degraded, under nnx.remat (§2.2: jax.checkpoint over the modules'
  params, the layers' own calls recomputed in the backward) and with the bases (§2.3), which
  `ffn` passes to its MeCeFOLinear layers ({layer name: basis})."""
  d = Degrade.of(degrade)
  call = nnx.remat(_ffn_call, policy=ops.remat_policy(remat)) if d.remat_ffn else _ffn_call
  return call(norm, ffn, x, bases if d.lowrank else None)


def basis(bases, name: str):
  """The basis of layer `name` in an FFN's `bases` (None: an exact call)."""
  return None if bases is None else bases.get(name)


class AttentionBranch(nnx.Module):
  """`attn(norm(x))`, marked as the attention branch, its backward cut when degraded (params
  under `norm` and `inner`)."""

  def __init__(self, norm: nnx.Module, attn: nnx.Module):
    self.norm, self.inner = mark_attention(norm, attn)

  def __call__(self, x, degrade: bool | Degrade = False):
    return attention_output(self.inner(self.norm(x)), degrade)


class FFNBranch(nnx.Module):
  """`ffn(norm(x), bases)`: degraded, rematerialised with low-rank weight gradients for `ffn`'s
  MeCeFOLinear layers. `bases` of the branch: {'inner': {layer name: basis}}."""

  def __init__(self, norm: nnx.Module, ffn: nnx.Module):
    self.norm, self.inner = norm, mark_ffn(ffn)

  def __call__(self, x, degrade: bool | Degrade = False, bases=None, remat: str = 'dots'):
    return ffn_branch(self.norm, self.inner, x, degrade, basis(bases, 'inner'), remat)


class Model(nnx.Module):
  """Optional base of a model: the loss the trainer calls. `bases_table`: {basis path: layer
  path} (tuples of keys), or None: each basis at its layer's path."""
  bases_table: dict | None = None

  def loss(self, logits_BxLxV, targets_BxL):
    """Per-token loss [B, L]."""
    return ops.token_cross_entropy(logits_BxLxV, targets_BxL)


def stack(make_block, n: int, rngs: nnx.Rngs):
  """`n` blocks as one module whose parameters have a leading 'layers' axis; each layer is
  initialised from its own key under one vmap (`make_block(rngs)`), so a program that creates
  the model holds one block's initializer at any depth. Run it with `scan`."""
  keys = jax.random.split(rngs.params(), n)
  graphdef, template = nnx.split(nnx.eval_shape(lambda: make_block(nnx.Rngs(params=0))))
  values = jax.vmap(lambda key: nnx.to_pure_dict(nnx.state(make_block(nnx.Rngs(params=key)))))(keys)
  values = jax.tree.leaves(values)
  is_var = lambda x: isinstance(x, nnx.Variable)
  variables = jax.tree.leaves(template, is_leaf=is_var)
  stacked = [v.replace(value, logical_axes=(LAYERS, *v.get_metadata()['logical_axes']))
             for v, value in zip(variables, values)]
  treedef = jax.tree.structure(template, is_leaf=is_var)
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, stacked))


def scan(blocks, h, call, per_layer=None):
  """`h` through the stacked `blocks` by one lax.scan: `call(block, h, layer_xs) -> h`, where
  layer_xs is that layer's slice of `per_layer` (e.g. its bases; None for none)."""
  graphdef, stacked = nnx.split(blocks)

  def layer(h, xs):
    params, layer_xs = xs
    return call(nnx.merge(graphdef, params), h, layer_xs), None

  h, _ = jax.lax.scan(layer, h, (stacked, per_layer), unroll=scan_unroll())
  return h


def linear(d_in: int, d_out: int, axes, rngs: nnx.Rngs, *, dtype, param_dtype, init_std: float,
           use_bias: bool = False) -> MeCeFOLinear:
  """A MeCeFOLinear with logical axes on its kernel (and bias: the output axis)."""
  return MeCeFOLinear(d_in, d_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=nnx.initializers.normal(init_std),
                      kernel_metadata={'logical_axes': axes},
                      bias_metadata={'logical_axes': axes[-1:]}, rngs=rngs)


def compute_dtype(cfg) -> jnp.dtype:
  """The dtype activations and matmuls run in: cfg.compute_dtype (a ModelConfig), `auto`
  resolved for the default backend (the one a run's devices are on)."""
  return jnp.dtype(resolve_compute_dtype(cfg.compute_dtype, jax.default_backend()))
