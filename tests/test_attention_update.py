"""Attention's share of the update: averaged over the rows that gave it a gradient (defect a),
and its AdamW count advancing only with its own updates (defect b), against the reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mecefo_jax.model import layout, llama, models, train_state
from mecefo_jax.core.roles import Role
from mecefo_jax.step import train_step
from test_update_reference import (CORPUS, L, TOL, RefOptimizer, _assert_close, _cfg, _grad_sum,
                                   _max_diff)  # the independent reference of the update

pytestmark = pytest.mark.usefixtures('devices')


# --- defect (a): attention averaged over the rows that gave it a gradient --------------------

ATTENTION_ON = llama.Degrade(skip_attention=False, remat_ffn=True)  # degraded rows, exact grads


@functools.lru_cache(maxsize=None)
def _one_slice():
  cfg = _cfg()
  tokens_4xL1 = CORPUS.sequences(np.arange(4))
  return cfg, train_state.init_state(cfg), llama.abstract(cfg.model)[0], tokens_4xL1


def _adam_counts(opt_state):
  """Each optimizer partition's AdamW count (the state is chain(clip, partitions))."""
  parts = opt_state[1].inner_states
  return {name: int(part.inner_state[0].count) for name, part in parts.items()}


def _sums(state, tokens, graphdef, cfg, exact, degrade):
  """The project's per-slice sums: `exact` rows exact, the rest degraded with `degrade`."""
  role = Role(exact, len(tokens) - exact)
  run = functools.partial(train_step.contribution, role=role, graphdef=graphdef, cfg=cfg,
                          degrade=degrade)
  return jax.jit(run)(state.params, state.bases, jnp.asarray(tokens), jax.random.PRNGKey(0))


@pytest.mark.parametrize('exact', [2, 0])
def test_attention_averages_over_every_row_that_gave_it_a_gradient(exact):
  """Degraded rows with attention's backward on (an ablation variant) count for attention:
  the combined gradient is the true mean over all rows, and attention is not frozen."""
  cfg, state, graphdef, tokens = _one_slice()
  sums = _sums(state, tokens, graphdef, cfg, exact, ATTENTION_ON)
  want = jax.tree.map(lambda g: g / (4 * L), _grad_sum(state.params, tokens, cfg.model, False))
  n_attention = train_step.count_attention_tokens(sums[2], sums[3], ATTENTION_ON)
  got = train_step.combine(sums[0], n_attention, sums[2] + sums[3], models.spec(cfg.model))
  _assert_close(got, want)
  tx = train_state.make_optimizer(cfg)
  new, metrics = jax.jit(functools.partial(train_step.finish_step, tx=tx,
                                           model=models.spec(cfg.model),
                                           degrade=ATTENTION_ON))(state, sums)
  np.testing.assert_allclose(metrics['grad_norm'], optax.tree.norm(want), rtol=1e-5)
  q0, q1 = state.params['blocks']['attn']['q']['kernel'], new.params['blocks']['attn']['q']['kernel']
  assert not np.allclose(q0, q1)
  assert _adam_counts(new.opt_state)[train_state.ATTENTION] == 1


def test_fused_step_with_attention_backward_on_averages_over_every_row():
  cfg, state, graphdef, tokens = _one_slice()
  step = train_step.make_step_fn(cfg, Role(2, 2), graphdef, ATTENTION_ON)
  _, metrics = jax.jit(step)(state, jnp.asarray(tokens)[None], train_state.schedule_numbers(cfg))
  want = _grad_sum(state.params, tokens, cfg.model, False)
  np.testing.assert_allclose(metrics['grad_norm'], optax.tree.norm(want) / (4 * L), rtol=1e-5)


# --- defect (b): attention's AdamW count advances only with attention's updates --------------

def test_update_after_a_frozen_step_uses_attentions_own_adam_count():
  cfg, state, _, _ = _one_slice()
  tx = train_state.make_optimizer(cfg)
  rng = np.random.default_rng(0)
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(0, 0.05, p.shape), p.dtype), state.params)
           for _ in range(3)]
  attention_tokens = [L, 0, L]  # step 1 has no exact row: attention frozen
  per_block = lambda tree: layout.per_block(tree, cfg.model.n_layers)  # the reference's layout
  ref = RefOptimizer(cfg, per_block(state.params))
  for g, n in zip(grads, attention_tokens):
    state, _ = train_step.apply_gradients(state, g, jnp.float32(n), tx, models.spec(cfg.model))
    ref.update(per_block(g), attention_updated=n > 0)
  _assert_close(per_block(state.params), ref.params)
  assert _adam_counts(state.opt_state) == {train_state.ATTENTION: 2, train_state.REST: 3}
  shared = RefOptimizer(cfg, per_block(_one_slice()[1].params), shared_count=True)
  for g, n in zip(grads, attention_tokens):
    shared.update(per_block(g), attention_updated=n > 0)
  assert _max_diff(per_block(state.params), shared.params) > 10 * TOL
