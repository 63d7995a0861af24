"""Training state (params, AdamW state, low-rank bases, step, RNG), its optimizer and shardings."""
from __future__ import annotations

import contextlib
import functools
import hashlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax._src import config as jax_config  # the context manager of a jax.config option
from jax.sharding import Mesh

from mecefo_jax.config import Config
from mecefo_jax.model import bases, models
from mecefo_jax.ops.schedule import Schedule, learning_rate, schedule_of
from mecefo_jax.sharding import replicated, tree_shardings


class TrainState(NamedTuple):
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # pure dict of arrays (models.Spec.create)
  opt_state: Any
  bases: Any  # {basis path: [[layers,] d_in, r]} kept between steps (bases.py); {} when drawn per step
  bases_step: jax.Array  # int32: step the svd bases were computed at, -1 before the first
  rng: jax.Array  # uint32[2] raw PRNG key


# Optimizer partitions: attention-branch leaves, which skip steps without an exact row
# (docs/algorithm.md §3), and the rest. Each has its own AdamW state, count included.
ATTENTION, REST = 'attention', 'rest'


def partition_labels(params, model: models.Spec):
  """ATTENTION for the model's attention-branch leaves, REST for the others (params' tree)."""
  label = lambda path, _: ATTENTION if model.is_attention(path) else REST
  return jax.tree_util.tree_map_with_path(label, params)


def decays(path, leaf, model: models.Spec) -> bool:
  """Weight decay applies to matrices (per layer: a stacked leaf's layer axis does not count),
  not to norm scales or biases."""
  return leaf.ndim - model.is_stacked(path) >= 2


def make_optimizer(cfg: Config, schedule: Schedule | None = None) -> optax.GradientTransformation:
  """AdamW with linear warmup and cosine decay; weight decay only on matrices.

  `schedule`: the schedule's numbers, traced where a program takes them as an argument
  (schedule_numbers; default: cfg's, as constants). Attention-branch params get their own
  AdamW (same hyperparameters) so that a step which freezes them can keep their count too:
  their bias correction and schedule then follow their own updates. Both counts move together
  without failures, so that path is plain AdamW.
  """
  o = cfg.optimizer
  schedule = schedule_numbers(cfg) if schedule is None else schedule
  model = models.spec(cfg.model)
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, leaf: decays(path, leaf, model), params)
  adamw = lambda: optax.adamw(lambda count: learning_rate(count, schedule), b1=o.b1, b2=o.b2,
                              eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask)
  parts = optax.multi_transform({ATTENTION: adamw(), REST: adamw()},
                                lambda params: partition_labels(params, model))
  # Clipping stays outside the partitions: one global norm over every gradient.
  return optax.chain(optax.clip_by_global_norm(o.grad_clip), parts) if o.grad_clip > 0 else parts


def schedule_numbers(cfg: Config) -> Schedule:
  """The learning-rate schedule's numbers (host scalars): warmup, then cosine decay over
  train.steps; step 0 starts at lr / (warmup + 1), not 0, so that it already trains."""
  o = cfg.optimizer
  return schedule_of(o.lr, o.warmup_steps, cfg.train.steps, o.min_lr_ratio)


def schedule_on(cfg: Config, mesh: Mesh) -> Schedule:
  """cfg's schedule numbers on every device of `mesh`, the argument of its step programs (each
  process places its own copies)."""
  put = lambda v: jax.make_array_from_callback((), replicated(mesh), lambda _: np.asarray(v))
  return jax.tree.map(put, schedule_numbers(cfg))


def _is_schedule(x) -> bool:
  return isinstance(x, optax.ScaleByScheduleState)


def schedule_count(opt_state) -> jax.Array:
  """The learning-rate schedule's position (its count; both AdamW partitions hold one)."""
  return next(x for x in jax.tree.leaves(opt_state, is_leaf=_is_schedule) if _is_schedule(x)).count


def at_schedule_count(opt_state, count_of):
  """`opt_state` with every schedule count replaced by `count_of(count)` (the AdamW moments and
  their bias-correction counts kept)."""
  return jax.tree.map(lambda x: x._replace(count=count_of(x.count)) if _is_schedule(x) else x,
                      opt_state, is_leaf=_is_schedule)


def init_state(cfg: Config, seed: int | jax.Array | None = None) -> TrainState:
  """Fresh state from `seed` (cfg.train.seed by default; may be traced); jit it with
  out_shardings=state_shardings(...) to create it sharded (lower_init)."""
  seed = cfg.train.seed if seed is None else seed
  _, params = models.spec(cfg.model).create(seed)
  return _state_around(cfg, params, jax.random.PRNGKey(seed))


def _state_around(cfg: Config, params, rng) -> TrainState:
  """A fresh state holding `params`: the optimizer's initial state, zero bases, step 0."""
  opt_state = make_optimizer(cfg).init(params)
  stored = jax.eval_shape(lambda: bases.kind(cfg).stored(params, cfg, rng))
  state_bases = jax.tree.map(jnp.zeros_like, stored)  # computed at the first degraded step
  return TrainState(jnp.zeros((), jnp.int32), params, opt_state, state_bases,
                    jnp.full((), -1, jnp.int32), rng)


@functools.lru_cache(maxsize=64)
def abstract_state(cfg: Config) -> TrainState:
  """The train state's shapes and dtypes, without allocating (cached per config). The params'
  are the model spec's: tracing the model's initialisers again cost ~0.1-0.3 CPU s a process."""
  shapes = models.spec(cfg.model).shapes
  return jax.eval_shape(lambda: _state_around(
      cfg, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes),
      jax.random.PRNGKey(cfg.train.seed)))


def _threefry_kernel():
  """jax's context for `jax_threefry_gpu_kernel_lowering`, or nothing where a jax lacks it."""
  option = getattr(jax_config, 'threefry_gpu_kernel_lowering', None)
  return option(True) if option is not None else contextlib.nullcontext()


def lower_init(cfg: Config, mesh: Mesh) -> jax.stages.Lowered:
  """The initializer `() -> TrainState`, lowered to create the state directly in its shardings
  on `mesh` (no host copy, no unsharded copy). Its random draws are one block's, vmapped over
  the layers (contract.stack); on GPU threefry lowers to XLA's kernel, not to unrolled
  rounds at each draw (jax's `jax_threefry_gpu_kernel_lowering`; no effect elsewhere)."""
  # The seed is an argument, not a constant: with every input constant XLA would fold the whole
  # random initialisation at compile time (compile time then grows with the parameter count).
  jitted = jax.jit(lambda seed: init_state(cfg, seed), in_shardings=replicated(mesh),
                   out_shardings=state_shardings(cfg, mesh))
  with _threefry_kernel():
    return jitted.lower(jax.ShapeDtypeStruct((), jnp.int32))


def init_seed(cfg: Config, mesh: Mesh) -> jax.Array:
  """The initializer's argument: cfg.train.seed on `mesh`."""
  return jax.device_put(np.int32(cfg.train.seed), replicated(mesh))


def create_sharded(cfg: Config, mesh: Mesh) -> TrainState:
  """A fresh state created directly in its shardings on `mesh`."""
  return _initializer(cfg, mesh)(init_seed(cfg, mesh))


@functools.lru_cache(maxsize=8)
def _initializer(cfg: Config, mesh: Mesh) -> jax.stages.Compiled:
  """The initializer of (cfg, mesh), compiled once: a benchmark creates a state per arm (its
  steps donate them), and each compile of it traces the model and its SVD bases again."""
  return lower_init(cfg, mesh).compile()


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
  model = models.spec(cfg.model)
  param_shapes, param_axes = model.shapes, model.axes
  shapes = abstract_state(cfg)  # traced once per config, not once per (sub)mesh
  param_sh = tree_shardings(param_axes, param_shapes, mesh)
  # Each partition's moments hold MaskedNode where the other partition's params are: kept as is.
  masked = lambda x: isinstance(x, optax.MaskedNode)
  opt_sh = optax.tree_map_params(make_optimizer(cfg), lambda v, s: v if masked(v) else s,
                                 shapes.opt_state, param_sh,
                                 transform_non_params=lambda _: replicated(mesh),
                                 is_leaf=lambda x: isinstance(x, jax.sharding.Sharding) or masked(x))
  bases_axes = bases.axes(model) if shapes.bases else {}
  return TrainState(replicated(mesh), param_sh, opt_sh,
                    tree_shardings(bases_axes, shapes.bases, mesh),
                    replicated(mesh), replicated(mesh))
