"""Normal and degraded train steps as pure functions, compiled ahead of time per slice plan."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from mecefo_jax.config import Config
from mecefo_jax.model import models
from mecefo_jax.model.bases import kind as basis_kind
from mecefo_jax.model.contract import FULL, Degrade
from mecefo_jax.model.train_state import (ATTENTION, TrainState, abstract_state, make_optimizer,
                                          state_shardings)
from mecefo_jax.ops.schedule import Schedule, abstract_schedule
from mecefo_jax.core.roles import Role
from mecefo_jax.sharding import batch_sharding, replicated


def _loss_sum(params, tokens_NxL1, graphdef, degraded, bases, remat, model: models.Spec):
  return model.loss_sum(graphdef, params, tokens_NxL1, degraded, bases, remat)


def contribution(params, bases, tokens_RxL1, key, *, role: Role, graphdef, cfg: Config,
                 degrade: Degrade = FULL):
  """Summed loss and gradients of one slice's rows; degraded rows give attention no gradient.

  Returns (grads, loss_sum, exact_tokens, degraded_tokens); gradients are sums over tokens.
  `degrade` picks the §2 techniques of the degraded rows (all of them outside the ablation).
  """
  seq = tokens_RxL1.shape[-1] - 1
  model = models.spec(cfg.model)
  grad_fn = jax.value_and_grad(functools.partial(_loss_sum, model=model))
  loss, grads = jnp.zeros((), jnp.float32), None
  if role.exact:
    loss, grads = grad_fn(params, tokens_RxL1[:role.exact], graphdef, False, None, None)
  if role.degraded:
    bases = basis_kind(cfg).for_step(bases, cfg, key)
    rows = tokens_RxL1[role.exact:role.rows]
    d_loss, d_grads = _degraded_passes(grad_fn, params, rows, bases, role.passes, graphdef, cfg,
                                       degrade)
    loss = loss + d_loss
    grads = d_grads if grads is None else jax.tree.map(jnp.add, grads, d_grads)
  counts = (jnp.asarray(role.exact * seq, jnp.float32), jnp.asarray(role.degraded * seq, jnp.float32))
  return grads, loss, *counts


def _degraded_passes(grad_fn, params, rows_DxL1, bases, passes, graphdef, cfg, degrade):
  """Degraded grads in `passes` sequential chunks (a lax.scan, then one shorter remainder)."""
  run = lambda r: grad_fn(params, r, graphdef, degrade, bases, cfg.mecefo.ffn_remat)
  rows = rows_DxL1.shape[0]
  if passes == 1:
    return run(rows_DxL1)
  chunk = -(-rows // passes)
  n_full = rows // chunk
  full = rows_DxL1[:n_full * chunk].reshape(n_full, chunk, rows_DxL1.shape[-1])

  def one_pass(acc, chunk_rows):
    return jax.tree.map(jnp.add, acc, run(chunk_rows)), None

  zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  acc = jax.lax.scan(one_pass, zeros, full)[0]
  if n_full * chunk < rows:
    acc = jax.tree.map(jnp.add, acc, run(rows_DxL1[n_full * chunk:]))
  return acc


def count_attention_tokens(exact_tokens, degraded_tokens, degrade: Degrade = FULL):
  """Tokens that gave the attention branch a gradient: exact rows, and degraded rows whose
  pass left attention's backward on (docs/algorithm.md §2.1 off, the ablation's variants)."""
  return exact_tokens if Degrade.of(degrade).skip_attention else exact_tokens + degraded_tokens


def combine(grads_sum, attention_tokens, total_tokens, model: models.Spec):
  """docs/algorithm.md §3: the model's attention-branch grads average over the tokens that gave
  them one (the exact ones in a MeCeFO step: count_attention_tokens), the rest over all tokens."""
  def mean(path, g):
    denom = attention_tokens if model.is_attention(path) else total_tokens
    return g / jnp.maximum(denom, 1.0)
  return jax.tree_util.tree_map_with_path(mean, grads_sum)


def _frozen_with_attention(path, model: models.Spec) -> bool:
  """Attention-branch params and moments, and the attention partition's whole optimizer state
  (its count with them: make_optimizer)."""
  keys = models.keys_of(path)
  # optax.multi_transform's state: inner_states[label]; a parameter's own name is no label.
  partition = next((keys[i + 1] for i, k in enumerate(keys[:-1]) if k == 'inner_states'), None)
  return model.is_attention(path) or partition == ATTENTION


def _freeze_attention(new, old, frozen, model: models.Spec):
  """Keep attention leaves (params, or the attention optimizer partition) at `old` when frozen."""
  pick = lambda path, n, o: jnp.where(frozen, o, n) if _frozen_with_attention(path, model) else n
  return jax.tree_util.tree_map_with_path(pick, new, old)


def apply_gradients(state: TrainState, grads, attention_tokens, tx,
                    model: models.Spec) -> tuple[TrainState, jax.Array]:
  """One optimizer step; attention is frozen when no token gave it a gradient."""
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  # No row gave attention a gradient (no exact micro-batch in a MeCeFO step): attention gets no
  # update at all, not a zero-grad one, and its AdamW count stays with its own updates, so that
  # its next update is bias-corrected (and scheduled) by the updates it actually had.
  frozen = attention_tokens == 0
  params = _freeze_attention(params, state.params, frozen, model)
  opt_state = _freeze_attention(opt_state, state.opt_state, frozen, model)
  return state._replace(step=state.step + 1, params=params, opt_state=opt_state), optax.tree.norm(grads)


def _uniform_sums(state, tokens_SxRxL1, key, role, graphdef, cfg, degrade):
  """Every slice has the same role: one plain SPMD program, no per-slice branching."""
  s, l1 = tokens_SxRxL1.shape[0], tokens_SxRxL1.shape[2]
  if role.passes != 1:
    raise ValueError('multi-pass roles run per slice (slice_steps), not in the fused step')
  # All slices' exact rows first, then all degraded rows, as one flat batch.
  exact = tokens_SxRxL1[:, :role.exact].reshape(-1, l1)
  degraded = tokens_SxRxL1[:, role.exact:role.rows].reshape(-1, l1)
  return contribution(state.params, state.bases, jnp.concatenate([exact, degraded]), key,
                      role=Role(role.exact * s, role.degraded * s), graphdef=graphdef, cfg=cfg,
                      degrade=degrade)


def make_step_fn(cfg: Config, role: Role, graphdef, degrade: Degrade = FULL):
  """The pure step `(state, tokens_SxRxL1, schedule) -> (state, metrics)`: every slice plays
  `role`; `schedule`: the learning rate's numbers (train_state.schedule_numbers).

  Role(exact=B) is the normal step; Role(degraded=k*B) a slice doing its own and k-1 extra
  micro-batches degraded. Slices with different roles run separate per-slice programs
  (a collective inside a per-slice branch of one SPMD program deadlocks, docs/algorithm.md §8).
  `degrade` narrows the degraded rows' techniques for the ablation benchmark.
  """
  def step(state: TrainState, tokens_SxRxL1, schedule: Schedule):
    key = jax.random.fold_in(state.rng, state.step)
    sums = _uniform_sums(state, tokens_SxRxL1, key, role, graphdef, cfg, degrade)
    return finish_step(state, sums, make_optimizer(cfg, schedule), models.spec(cfg.model),
                       degrade)

  return step


def finish_step(state: TrainState, sums, tx, model: models.Spec,
                degrade: Degrade = FULL) -> tuple[TrainState, dict]:
  """From summed (grads, loss, exact tokens, degraded tokens): §3 rule, optimizer, metrics.
  `degrade`: the techniques the degraded rows used (which of them gave attention a gradient)."""
  grads_sum, loss_sum, exact_tokens, degraded_tokens = sums
  total = exact_tokens + degraded_tokens
  attention = count_attention_tokens(exact_tokens, degraded_tokens, degrade)
  grads = combine(grads_sum, attention, total, model)
  new_state, grad_norm = apply_gradients(state, grads, attention, tx, model)
  metrics = {'loss': loss_sum / jnp.maximum(total, 1.0), 'grad_norm': grad_norm,
             'exact_tokens': exact_tokens, 'degraded_tokens': degraded_tokens}
  return new_state, metrics


def batch_shape(cfg: Config, n_slices: int, role: Role) -> tuple[int, int, int]:
  return n_slices, role.rows, cfg.model.seq_len + 1


def lower_step(cfg: Config, mesh: Mesh, role: Role, graphdef,
               degrade: Degrade = FULL) -> jax.stages.Lowered:
  """The step for `role` on `mesh`, lowered: state donated, identical state in/out shardings."""
  state_sh = state_shardings(cfg, mesh)
  jitted = jax.jit(make_step_fn(cfg, role, graphdef, degrade), donate_argnums=0,
                   in_shardings=(state_sh, batch_sharding(mesh), replicated(mesh)),
                   out_shardings=(state_sh, replicated(mesh)))
  tokens = jax.ShapeDtypeStruct(batch_shape(cfg, mesh.shape['slice'], role), jnp.int32)
  return jitted.lower(abstract_state(cfg), tokens, abstract_schedule())


def lower_eval(cfg: Config, mesh: Mesh, rows: int, graphdef) -> jax.stages.Lowered:
  """`(params, tokens_SxRxL1) -> {'loss_sum', 'tokens'}` (forward only); rows whose
  first token is negative are padding and count for nothing."""
  model = models.spec(cfg.model)

  def evaluate(params, tokens_SxRxL1):
    flat_NxL1 = tokens_SxRxL1.reshape(-1, tokens_SxRxL1.shape[-1])
    valid_N = (flat_NxL1[:, 0] >= 0).astype(jnp.float32)
    flat_NxL1 = jnp.maximum(flat_NxL1, 0)
    loss_N = model.token_losses(graphdef, params, flat_NxL1, False, None, None).sum(axis=1)
    return {'loss_sum': (loss_N * valid_N).sum(), 'tokens': valid_N.sum() * (flat_NxL1.shape[1] - 1)}

  params_sh = state_shardings(cfg, mesh).params
  jitted = jax.jit(evaluate, in_shardings=(params_sh, batch_sharding(mesh)),
                   out_shardings=replicated(mesh))
  tokens = jax.ShapeDtypeStruct((mesh.shape['slice'], rows, cfg.model.seq_len + 1), jnp.int32)
  return jitted.lower(abstract_state(cfg).params, tokens)


def lower_refresh(cfg: Config, mesh: Mesh, warm: bool = False) -> jax.stages.Lowered:
  """`state -> state` recomputing the svd bases; run every tau degraded steps.
  `warm`: one subspace iteration from the state's bases instead of a randomized SVD."""
  state_sh = state_shardings(cfg, mesh)

  def refresh(state: TrainState) -> TrainState:
    key = jax.random.fold_in(jax.random.fold_in(state.rng, state.step), 1)
    bases = basis_kind(cfg).refresh(state.params, cfg, key, state.bases if warm else None)
    return state._replace(bases=bases, bases_step=state.step)

  jitted = jax.jit(refresh, donate_argnums=0, in_shardings=(state_sh,), out_shardings=state_sh)
  return jitted.lower(abstract_state(cfg))


def memory_summary(compiled) -> dict:
  """Bytes from XLA's compiled memory analysis (per device); {} where the backend has none."""
  mem = compiled.memory_analysis()
  if mem is None:
    return {}
  return {'argument_bytes': int(mem.argument_size_in_bytes),
          'output_bytes': int(mem.output_size_in_bytes),
          'temp_bytes': int(mem.temp_size_in_bytes), 'alias_bytes': int(mem.alias_size_in_bytes),
          'generated_code_bytes': int(mem.generated_code_size_in_bytes)}
