"""Training state (params, AdamW state, low-rank bases, step, RNG), its optimizer and shardings."""
from __future__ import annotations

import functools
import hashlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from mecefo_jax import ops
from mecefo_jax.config import Config, MeCeFOConfig, ModelConfig
from mecefo_jax.model import llama
from mecefo_jax.sharding import replicated, tree_shardings

FFN_MATRICES = ('gate', 'up', 'down')


class TrainState(NamedTuple):
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # pure dict of arrays (see llama.create)
  opt_state: Any
  bases: Any  # {'block{i}': {'gate','up','down': [d_in, r]}}; {} for gaussian bases
  bases_step: jax.Array  # int32: step the svd bases were computed at, -1 before the first
  rng: jax.Array  # uint32[2] raw PRNG key


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  """AdamW with linear warmup and cosine decay; weight decay only on matrices."""
  o = cfg.optimizer
  warmup = min(o.warmup_steps, cfg.train.steps)
  # Start at lr/(warmup+1), not 0, so that step 0 already trains.
  schedule = optax.warmup_cosine_decay_schedule(
      o.lr / (warmup + 1), o.lr, warmup, max(cfg.train.steps, warmup + 1),
      end_value=o.lr * o.min_lr_ratio)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  adamw = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                      mask=decay_mask)
  return optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw) if o.grad_clip > 0 else adamw


def ranks(m: ModelConfig, mc: MeCeFOConfig) -> dict[str, int]:
  """Low-rank Wgrad rank of each FFN matrix (by its input dimension)."""
  def rank(d_in):
    r = mc.rank or max(1, round(mc.rank_fraction * d_in))
    return min(r, d_in, m.d_model if d_in == m.ffn_dim else m.ffn_dim)
  return {'gate': rank(m.d_model), 'up': rank(m.d_model), 'down': rank(m.ffn_dim)}


def basis_axes() -> dict:
  return {'gate': ('embed', 'rank'), 'up': ('embed', 'rank'), 'down': ('mlp', 'rank')}


def _ffn_kernels(params, i):
  ffn = params[f'block{i}']['ffn']
  return {name: ffn[name]['kernel'] for name in FFN_MATRICES}


def svd_bases(params, cfg: Config, key, previous: dict | None = None) -> dict:
  """Paper's bases: top singular input subspace of every FFN matrix (randomized SVD), or, given
  the `previous` bases, one warm-started subspace iteration from them (mecefo.refresh=warm)."""
  r = ranks(cfg.model, cfg.mecefo)
  out = {}
  for i in range(cfg.model.n_layers):
    kernels = _ffn_kernels(params, i)
    if previous is not None:
      out[f'block{i}'] = {name: ops.refine_basis(w, previous[f'block{i}'][name])
                          for name, w in kernels.items()}
      continue
    keys = jax.random.split(jax.random.fold_in(key, i), len(FFN_MATRICES))
    out[f'block{i}'] = {name: ops.svd_basis(w, r[name], k, cfg.mecefo.power_iters)
                        for (name, w), k in zip(kernels.items(), keys)}
  return out


def gaussian_bases(cfg: Config, key) -> dict:
  """Fresh unbiased Gaussian bases for every FFN matrix (E[V Vᵀ] = I)."""
  r, m = ranks(cfg.model, cfg.mecefo), cfg.model
  d_in = {'gate': m.d_model, 'up': m.d_model, 'down': m.ffn_dim}
  out = {}
  for i in range(m.n_layers):
    keys = jax.random.split(jax.random.fold_in(key, i), len(FFN_MATRICES))
    out[f'block{i}'] = {name: ops.gaussian_basis(k, d_in[name], r[name], jnp.dtype(m.param_dtype))
                        for name, k in zip(FFN_MATRICES, keys)}
  return out


def init_state(cfg: Config, graphdef=None) -> TrainState:
  """Fresh state; jit it with out_shardings=state_shardings(...) to create it sharded."""
  rng = jax.random.PRNGKey(cfg.train.seed)
  _, params = llama.create(cfg.model, cfg.train.seed)
  opt_state = make_optimizer(cfg).init(params)
  bases = {}
  if cfg.mecefo.basis == 'svd':
    bases = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: svd_bases(params, cfg, rng)))
  return TrainState(jnp.zeros((), jnp.int32), params, opt_state, bases,
                    jnp.full((), -1, jnp.int32), rng)


@functools.lru_cache(maxsize=64)
def abstract_state(cfg: Config) -> TrainState:
  """The train state's shapes and dtypes, without allocating (cached per config)."""
  return jax.eval_shape(lambda: init_state(cfg))


def create_sharded(cfg: Config, mesh: Mesh) -> TrainState:
  """A fresh state created directly in its shardings on `mesh`."""
  return jax.jit(lambda: init_state(cfg), out_shardings=state_shardings(cfg, mesh))()


def params_sha256(params) -> str:
  """SHA-256 over every parameter's path, dtype, shape and bytes: equal iff bit-identical."""
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(params))
  for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
    arr = np.ascontiguousarray(leaf)
    h.update(f'{jax.tree_util.keystr(path)}|{arr.dtype}|{arr.shape}|'.encode())
    h.update(arr.tobytes())
  return h.hexdigest()


@functools.lru_cache(maxsize=256)
def state_shardings(cfg: Config, mesh: Mesh) -> TrainState:
  """NamedShardings of the state: replicated across slices, sharded inside a slice by the rules."""
  _, param_shapes, param_axes = llama.abstract(cfg.model)
  shapes = jax.eval_shape(lambda: init_state(cfg))
  param_sh = tree_shardings(param_axes, param_shapes, mesh)
  opt_sh = optax.tree_map_params(make_optimizer(cfg), lambda _, s: s, shapes.opt_state, param_sh,
                                 transform_non_params=lambda _: replicated(mesh),
                                 is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  bases_axes = {b: basis_axes() for b in shapes.bases}
  return TrainState(replicated(mesh), param_sh, opt_sh,
                    tree_shardings(bases_axes, shapes.bases, mesh),
                    replicated(mesh), replicated(mesh))
