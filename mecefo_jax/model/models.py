"""Which model a run trains (model.kind: a built-in name or `module:factory`) and what the
trainer reads from it: its tree, logical axes, attention branch and basis-taking layers."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import os
import sys
from typing import Any, Callable

import jax
from flax import nnx

from mecefo_jax.config import ConfigError, ModelConfig
from mecefo_jax.model import contract
from mecefo_jax.model.contract import Degrade
from mecefo_jax.sharding import LOGICAL_RULES

# model.kind's built-in names: the factory of each, imported on first use.
BUILTIN = {'llama': 'mecefo_jax.model.llama:LLaMA', 'gpt2': 'mecefo_jax.model.gpt2:GPT2'}
# Factories given as Python objects (Trainer(model=...)) in this process, by their identity.
_registered: dict[str, Callable] = {}


class ContractError(ConfigError):
  """A model that breaks the contract (model/contract.py); one line naming what is missing."""


def identity(factory: Callable | str) -> str:
  """The model.kind naming `factory`: a string as it is, else `module:qualname` (a script run as
  __main__ by its file's name, the module another process imports it as)."""
  if isinstance(factory, str):
    return factory
  module = factory.__module__
  if module == '__main__':
    main = getattr(sys.modules['__main__'], '__file__', None)
    module = os.path.splitext(os.path.basename(main))[0] if main else module
  return f'{module}:{factory.__qualname__}'


def register(factory: Callable | str) -> str:
  """model.kind for `factory`; an object is kept in this process under that name (other
  processes import it by the name)."""
  kind = identity(factory)
  if not isinstance(factory, str):
    _registered[kind] = factory
    spec.cache_clear()
  return kind


def _import(kind: str) -> Callable:
  """The object `module:factory` names, loaded as an entry point's value (the same syntax); a
  module not found is looked for in the current directory too (a user's file beside the run)."""
  target = BUILTIN.get(kind, kind)
  module_name, _, attr = target.partition(':')
  if not module_name or not attr:
    raise ConfigError(f"model.kind must be one of {', '.join(BUILTIN)} or MODULE:FACTORY, got "
                      f'{kind!r}')
  try:
    return importlib.metadata.EntryPoint('model', target, 'mecefo_jax.models').load()
  except ModuleNotFoundError as err:
    if err.name != module_name.split('.')[0] or os.getcwd() in sys.path:
      raise ConfigError(f'model.kind {kind!r}: cannot import {module_name} ({err})') from None
    sys.path.insert(0, os.getcwd())
    return _import(kind)
  except AttributeError:
    raise ConfigError(f'model.kind {kind!r}: {module_name} has no {attr}') from None


def factory(kind: str) -> Callable:
  """The factory `(ModelConfig, nnx.Rngs) -> module` model.kind names."""
  return _registered.get(kind) or _import(kind)


@dataclasses.dataclass(frozen=True)
class BasisLayer:
  """One layer that takes a basis: where its basis and kernel are, its kernel's shape and axes."""
  path: tuple  # in the bases tree
  kernel: tuple  # in the params
  shape: tuple  # the kernel's: ([layers,] d_in, d_out)
  axes: tuple  # the kernel's logical axes

  @property
  def stacked(self) -> bool:
    return self.axes[0] == contract.LAYERS

  @property
  def d_in(self) -> int:
    return self.shape[-2]

  @property
  def d_out(self) -> int:
    return self.shape[-1]

  @property
  def basis_axes(self) -> tuple:
    return (*self.axes[:-2], self.axes[-2], 'rank')


def keys_of(path) -> tuple:
  return tuple(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', None))) for k in path)


def _metadata_tree(state, fn):
  return nnx.to_pure_dict(jax.tree.map(fn, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _flat(tree) -> dict[tuple, Any]:
  return {keys_of(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
  """A model of the contract as the trainer sees it (one per ModelConfig: `spec`)."""
  kind: str
  cfg: ModelConfig
  factory: Callable
  graphdef: Any
  shapes: Any  # params as ShapeDtypeStructs (pure dict)
  axes: Any  # params' logical axes (pure dict)
  attention: frozenset  # paths of the attention branch's params
  basis_layers: tuple  # BasisLayer, in the model's order

  def create(self, seed):
    """(graphdef, params as a pure dict) freshly initialised from `seed` (may be traced)."""
    graphdef, state = nnx.split(self.factory(self.cfg, nnx.Rngs(params=jax.random.key(seed))))
    return graphdef, nnx.to_pure_dict(state)

  def forward(self, graphdef, params, tokens_BxL, degraded: bool | Degrade = False, bases=None,
              remat='dots'):
    """Logits [B, L, V] from a pure params dict."""
    return nnx.merge(graphdef, params)(tokens_BxL, Degrade.of(degraded), bases, remat)

  def token_losses(self, graphdef, params, tokens_NxL1, degraded, bases, remat):
    """Per-token losses [N, L] of next-token prediction over the rows of tokens_NxL1 [N, L+1]."""
    model = nnx.merge(graphdef, params)
    logits = model(tokens_NxL1[:, :-1], Degrade.of(degraded), bases, remat)
    loss = getattr(model, 'loss', None) or contract.Model.loss.__get__(model)
    return loss(logits, tokens_NxL1[:, 1:])

  def loss_sum(self, graphdef, params, tokens_NxL1, degraded, bases, remat):
    """Summed token loss over the rows of tokens_NxL1."""
    return self.token_losses(graphdef, params, tokens_NxL1, degraded, bases, remat).sum()

  @functools.cached_property
  def tree_digest(self) -> str:
    """16 hex digits over the params' paths, shapes, dtypes and axes, the attention branch and
    the basis layers: the same for the same model (run_state.json's `model`)."""
    h = hashlib.sha256()
    for path, shape in sorted(_flat(self.shapes).items(), key=lambda kv: str(kv[0])):
      h.update(f'{path}|{shape.shape}|{shape.dtype}|{self._param_axes.get(path)}|'
               f'{path in self.attention}\n'.encode())
    h.update(repr([(layer.path, layer.kernel) for layer in self.basis_layers]).encode())
    return h.hexdigest()[:16]

  def _param(self, path) -> tuple | None:
    """The params path that `path` (of params or a tree holding them: moments, grads) ends
    with; None for a leaf of no parameter (an optimizer count)."""
    keys = keys_of(path)
    for n in self._lengths:
      if keys[len(keys) - n:] in self._param_axes:
        return keys[len(keys) - n:]
    return None

  @functools.cached_property
  def _param_axes(self) -> dict:
    return _flat_axes(self.axes)

  @functools.cached_property
  def _lengths(self) -> tuple:
    return tuple(sorted({len(p) for p in self._param_axes}, reverse=True))

  def is_attention(self, path) -> bool:
    """True for the attention branch's leaves (params, grads, moments): docs/algorithm.md §2.1."""
    return self._param(path) in self.attention

  def is_stacked(self, path) -> bool:
    """True for leaves of stacked blocks (leading 'layers' axis)."""
    param = self._param(path)
    return param is not None and self._param_axes[param][:1] == (contract.LAYERS,)


def _flat_axes(axes) -> dict:
  return {keys_of(p): tuple(v) for p, v in
          jax.tree_util.tree_leaves_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))}


def _name(path) -> str:
  return '/'.join(map(str, path))


def _basis_layers(kind, model, flat_shapes, flat_axes, basis_kernels) -> tuple:
  """The model's BasisLayers: its bases_table's, or each marked kernel's at its layer's path."""
  table = getattr(model, 'bases_table', None)
  if table is None:
    table = {k[:-1]: k[:-1] for k in basis_kernels}
  layers = []
  for basis_path, layer_path in table.items():
    kernel = (*layer_path, 'kernel')
    if kernel not in basis_kernels:
      raise ContractError(f'model {kind!r} breaks the contract: its basis {_name(basis_path)} is '
                          f'on layer {_name(layer_path)}, which is no MeCeFOLinear marked to take '
                          'a basis (contract.mark_ffn / FFNBranch) in its parameters')
    layers.append(BasisLayer(tuple(basis_path), kernel, tuple(flat_shapes[kernel].shape),
                             flat_axes[kernel]))
  return tuple(layers)


def _check_axes(kind, flat_axes, flat_shapes) -> None:
  for path, shape in flat_shapes.items():
    axes = flat_axes.get(path)
    if axes is None or len(axes) != len(shape.shape):
      raise ContractError(f'model {kind!r} breaks the contract: parameter {_name(path)} has no '
                          f'logical_axes metadata of its rank {len(shape.shape)}')
    unknown = [a for a in axes if a not in LOGICAL_RULES]
    if unknown:
      raise ContractError(f'model {kind!r}: parameter {_name(path)} has logical axes {unknown} '
                          f"outside sharding.LOGICAL_RULES ({', '.join(LOGICAL_RULES)})")


@functools.lru_cache(maxsize=32)
def spec(cfg: ModelConfig) -> Spec:
  """The model cfg.kind names, built abstractly and checked against the contract (a
  ContractError naming what is missing)."""
  make = factory(cfg.kind)
  try:
    model = nnx.eval_shape(lambda: make(cfg, nnx.Rngs(params=0)))
  except (TypeError, ValueError) as err:
    raise ContractError(f'model {cfg.kind!r}: its factory failed: {err}') from err
  graphdef, state = nnx.split(model)
  meta = lambda key, default=None: _metadata_tree(
      state, lambda v: v.get_metadata().get(key, default))
  shapes = _metadata_tree(state, lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype))
  axes = meta('logical_axes')
  flat_shapes = _flat(shapes)
  flat_axes = {p: a for p, a in _flat_axes(axes).items() if p in flat_shapes}
  _check_axes(cfg.kind, flat_axes, flat_shapes)
  attention = frozenset(p for p, v in _flat(meta(contract.ATTENTION_TAG, False)).items() if v)
  if not attention:
    raise ContractError(f'model {cfg.kind!r} breaks the contract: no parameter is marked as its '
                        'attention branch (contract.mark_attention / AttentionBranch)')
  basis_kernels = [p for p, v in _flat(meta(contract.BASIS_TAG, False)).items() if v]
  layers = _basis_layers(cfg.kind, model, flat_shapes, flat_axes, basis_kernels)
  if not layers:
    raise ContractError(f'model {cfg.kind!r} breaks the contract: no layer takes a basis '
                        '(contract.mark_ffn / FFNBranch over its MeCeFOLinear layers)')
  return Spec(cfg.kind, cfg, make, graphdef, shapes, axes, attention, layers)
