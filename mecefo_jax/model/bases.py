"""Low-rank FFN bases (docs/algorithm.md §2.3) behind one registry: a new basis is its functions,
one row of BASES and its name in config.BASIS_NAMES (checked with the config, before a run)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from mecefo_jax import ops
from mecefo_jax.config import Config, ConfigError, MeCeFOConfig, ModelConfig
from mecefo_jax.model import llama

FFN_MATRICES = ('gate', 'up', 'down')
# Bases mirror the stacked blocks' FFN kernels: {BLOCKS: {'gate','up','down': [layers, d_in, r]}}.
AXES = {'gate': ('layers', 'embed', 'rank'), 'up': ('layers', 'embed', 'rank'),
        'down': ('layers', 'mlp', 'rank')}


def ranks(m: ModelConfig, mc: MeCeFOConfig) -> dict[str, int]:
  """Low-rank Wgrad rank of each FFN matrix (by its input dimension)."""
  def rank(d_in):
    r = mc.rank or max(1, round(mc.rank_fraction * d_in))
    return min(r, d_in, m.d_model if d_in == m.ffn_dim else m.ffn_dim)
  return {'gate': rank(m.d_model), 'up': rank(m.d_model), 'down': rank(m.ffn_dim)}


def _layer_keys(key, n_layers: int):
  """[n_layers, 3] keys: layer i's keys for gate, up and down, split from fold_in(key, i)."""
  return jax.vmap(lambda i: jax.random.split(jax.random.fold_in(key, i), len(FFN_MATRICES)))(
      jnp.arange(n_layers))


def svd_bases(params, cfg: Config, key, previous: dict | None = None) -> dict:
  """Paper's bases: top singular input subspace of every FFN matrix (randomized SVD), or, given
  the `previous` bases, one warm-started subspace iteration from them (mecefo.refresh=warm);
  layer by layer over the stacked kernels (lax.map), each with its own key."""
  r = ranks(cfg.model, cfg.mecefo)
  ffn = params[llama.BLOCKS]['ffn']
  # lax.map (a scan), not vmap: one layer's QR/SVD in the program whatever the depth, and no
  # batched LAPACK calls (vmapped, the refresh of llama_60m's width never returned on CPU).
  if previous is not None:
    old = previous[llama.BLOCKS]
    return {llama.BLOCKS: {name: jax.lax.map(lambda wv: ops.refine_basis(*wv),
                                             (ffn[name]['kernel'], old[name]))
                           for name in FFN_MATRICES}}
  keys = _layer_keys(key, cfg.model.n_layers)
  one = lambda name, k: jax.lax.map(
      lambda wk: ops.svd_basis(wk[0], r[name], wk[1], cfg.mecefo.power_iters),
      (ffn[name]['kernel'], k))
  return {llama.BLOCKS: {name: one(name, keys[:, j]) for j, name in enumerate(FFN_MATRICES)}}


def gaussian_bases(cfg: Config, key) -> dict:
  """Fresh unbiased Gaussian bases for every FFN matrix (E[V Vᵀ] = I), all layers at once."""
  r, m = ranks(cfg.model, cfg.mecefo), cfg.model
  d_in = {'gate': m.d_model, 'up': m.d_model, 'down': m.ffn_dim}
  keys = _layer_keys(key, m.n_layers)
  one = lambda name, k: jax.vmap(
      lambda kk: ops.gaussian_basis(kk, d_in[name], r[name], jnp.dtype(m.param_dtype)))(k)
  return {llama.BLOCKS: {name: one(name, keys[:, j]) for j, name in enumerate(FFN_MATRICES)}}


@dataclasses.dataclass(frozen=True)
class BasisKind:
  """How a basis type enters training.

  `refresh(params, cfg, key, previous)`: bases kept in the train state and recomputed every
  mecefo.tau degraded steps (`previous`: warm start, or None); None when drawn per step.
  `draw(cfg, key)`: fresh bases for every degraded step; None when kept in the state.
  """
  refresh: Callable | None = None
  draw: Callable | None = None

  def stored(self, params, cfg: Config, key) -> dict:
    """The bases the train state keeps ({} for per-step bases)."""
    return self.refresh(params, cfg, key, None) if self.refresh else {}

  def for_step(self, state_bases, cfg: Config, key) -> dict:
    """The bases a degraded step projects onto."""
    return self.draw(cfg, key) if self.draw else state_bases


BASES = {
    'svd': BasisKind(refresh=svd_bases),  # the paper's: top singular input subspace
    'gaussian': BasisKind(draw=gaussian_bases),  # unbiased: E[V Vᵀ] = I
}


def kind(cfg: Config) -> BasisKind:
  """The registry entry of cfg.mecefo.basis, or a one-line ConfigError."""
  try:
    return BASES[cfg.mecefo.basis]
  except KeyError:
    raise ConfigError(f"mecefo.basis must be one of {', '.join(BASES)}, got "
                      f'{cfg.mecefo.basis!r}') from None
