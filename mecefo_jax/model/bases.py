"""Low-rank FFN bases (docs/algorithm.md §2.3) of a model's basis layers (model/models.py),
behind one registry: a new basis is its functions, one row of BASES and its name in
config.BASIS_NAMES (checked with the config, before a run)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from mecefo_jax import ops
from mecefo_jax.config import Config, ConfigError, MeCeFOConfig
from mecefo_jax.model import models


def ranks(model: models.Spec, mc: MeCeFOConfig) -> tuple[int, ...]:
  """Low-rank Wgrad rank of each of the model's basis layers (by its input dimension), in the
  order of model.basis_layers."""
  def rank(layer):
    r = mc.rank or max(1, round(mc.rank_fraction * layer.d_in))
    return min(r, layer.d_in, layer.d_out)
  return tuple(rank(layer) for layer in model.basis_layers)


def axes(model: models.Spec) -> dict:
  """The bases' logical axes: ([layers,] the kernel's input axis, rank), in the bases' tree."""
  return _tree({layer.path: layer.basis_axes for layer in model.basis_layers})


def _tree(flat: dict) -> dict:
  """A nested dict from {path: value}."""
  out: dict = {}
  for path, value in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _layer_keys(key, n_layers: int, n_matrices: int):
  """[n_layers, n_matrices] keys: layer i's keys of each basis layer, split from fold_in(key, i)."""
  return jax.vmap(lambda i: jax.random.split(jax.random.fold_in(key, i), n_matrices))(
      jnp.arange(n_layers))


def _per_layer(layer: models.BasisLayer, fn, *xs):
  """`fn` over a stacked layer's rows (lax.map: one layer's QR/SVD in the program whatever the
  depth, no batched LAPACK calls; vmapped, the refresh of llama_60m's width never returned on
  CPU), or on an unstacked layer's arrays."""
  return jax.lax.map(lambda x: fn(*x), xs) if layer.stacked else fn(*xs)


def _keys_of(layer: models.BasisLayer, key, j: int, n: int):
  keys = _layer_keys(key, layer.shape[0] if layer.stacked else 1, n)[:, j]
  return keys if layer.stacked else keys[0]


def svd_bases(params, cfg: Config, key, previous: dict | None = None) -> dict:
  """Paper's bases: top singular input subspace of every basis layer's kernel (randomized SVD),
  or, given the `previous` bases, one warm-started subspace iteration from them
  (mecefo.refresh=warm); layer by layer over stacked kernels, each with its own key."""
  model = models.spec(cfg.model)
  layers, r = model.basis_layers, ranks(model, cfg.mecefo)
  kernel = lambda layer: _get(params, layer.kernel)
  if previous is not None:
    return _tree({layer.path: _per_layer(layer, ops.refine_basis, kernel(layer),
                                         _get(previous, layer.path)) for layer in layers})
  return _tree({layer.path: _per_layer(
      layer, lambda w, k, rank=r[j]: ops.svd_basis(w, rank, k, cfg.mecefo.power_iters),
      kernel(layer), _keys_of(layer, key, j, len(layers))) for j, layer in enumerate(layers)})


def gaussian_bases(cfg: Config, key) -> dict:
  """Fresh unbiased Gaussian bases for every basis layer (E[V Vᵀ] = I), all layers at once."""
  model = models.spec(cfg.model)
  layers, r = model.basis_layers, ranks(model, cfg.mecefo)
  dtype = jnp.dtype(cfg.model.param_dtype)

  def one(j, layer):
    draw = lambda k: ops.gaussian_basis(k, layer.d_in, r[j], dtype)
    keys = _keys_of(layer, key, j, len(layers))
    return jax.vmap(draw)(keys) if layer.stacked else draw(keys)
  return _tree({layer.path: one(j, layer) for j, layer in enumerate(layers)})


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
