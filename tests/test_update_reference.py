"""The parameter update under failure, against an independent reference of docs/algorithm.md §2-§3."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.data import order, synthetic
from mecefo_jax.fault.controller import Controller
from mecefo_jax.core.failures import FailureSchedule
from mecefo_jax.model import layout, llama
from mecefo_jax.core import takeover
from mecefo_jax.step import initializer
from procs import suite_store

pytestmark = pytest.mark.usefixtures('devices')

N, B, L, FSDP = 4, 4, 16, 2
# rank 24 with d_model 32 / ffn 48: the randomized SVD's sketch spans min(d_in, d_out) columns,
# so the project's svd bases are the exact top-24 singular subspaces the reference computes.
TINY = ['model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=48', f'model.seq_len={L}',
        'model.n_layers=1', 'model.vocab_size=64', f'train.micro_batch={B}', 'train.steps=8',
        'optimizer.warmup_steps=1', 'mecefo.rank=24', f'mesh.slice={N}', f'mesh.fsdp={FSDP}']
CORPUS = synthetic.SyntheticCorpus(vocab_size=64, seq_len=L, seed=0)
ATTENTION_BRANCH = ('attn', 'attn_norm')
TOL = 2e-5


def _cfg(*extra):
  return load_config(None, [*TINY, *extra])


# --- the reference: its own forward, degraded backward, §3 rule and AdamW -------------------

def _rms_norm(x_BxLxD, scale_D, eps):
  return x_BxLxD * jax.lax.rsqrt(jnp.mean(x_BxLxD * x_BxLxD, -1, keepdims=True) + eps) * scale_D


def _rope(x_BxLxHxK, theta):
  half = x_BxLxHxK.shape[-1] // 2
  angle_LxK2 = jnp.arange(x_BxLxHxK.shape[1])[:, None] * theta ** (-jnp.arange(half) / half)
  cos, sin = jnp.cos(angle_LxK2)[None, :, None], jnp.sin(angle_LxK2)[None, :, None]
  x1, x2 = x_BxLxHxK[..., :half], x_BxLxHxK[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _attention(p, x_BxLxD, m):
  b, l, d = x_BxLxD.shape
  heads = lambda name: (x_BxLxD @ p[name]['kernel']).reshape(b, l, m.n_heads, d // m.n_heads)
  q, k, v = _rope(heads('q'), m.rope_theta), _rope(heads('k'), m.rope_theta), heads('v')
  s_BxHxLxL = jnp.einsum('blhk,bmhk->bhlm', q, k) / jnp.sqrt(d // m.n_heads)
  s_BxHxLxL = jnp.where(jnp.tril(jnp.ones((l, l), bool)), s_BxHxLxL, -1e30)
  out_BxLxHxK = jnp.einsum('bhlm,bmhk->blhk', jax.nn.softmax(s_BxHxLxL, -1), v)
  return out_BxLxHxK.reshape(b, l, d) @ p['o']['kernel']


def _loss_sum(params, tokens_NxL1, m, cut_attention):
  """Summed token cross-entropy; `cut_attention`: §2.1, the attention output under stop_gradient.
  The reference loops over per-block params; the project's stacked ones are cut per layer slice."""
  if 'blocks' in params:
    params = layout.per_block(params, m.n_layers)
  h = params['embed'][tokens_NxL1[:, :-1]]
  for i in range(m.n_layers):
    p = params[f'block{i}']
    a = _attention(p['attn'], _rms_norm(h, p['attn_norm']['scale'], m.norm_eps), m)
    h = h + (jax.lax.stop_gradient(a) if cut_attention else a)
    x, f = _rms_norm(h, p['ffn_norm']['scale'], m.norm_eps), p['ffn']
    h = h + (jax.nn.silu(x @ f['gate']['kernel']) * (x @ f['up']['kernel'])) @ f['down']['kernel']
  logits = _rms_norm(h, params['final_norm']['scale'], m.norm_eps) @ params['head']['kernel']
  picked = jnp.take_along_axis(logits, tokens_NxL1[:, 1:, None], -1)[..., 0]
  return (jax.nn.logsumexp(logits, -1) - picked).sum()


_row_grads = jax.jit(jax.grad(_loss_sum), static_argnums=(2, 3))


def _grad_sum(params, rows_NxL1, m, cut_attention):
  """Summed gradients, one row at a time (one compiled shape whatever the row count)."""
  total = jax.tree.map(jnp.zeros_like, params)
  for row in rows_NxL1:
    total = jax.tree.map(jnp.add, total, _row_grads(params, jnp.asarray(row[None]), m, cut_attention))
  return total


def _project(grads, bases):
  """§2.3: every FFN weight gradient G [d_in, d_out] becomes V Vᵀ G (input side)."""
  out = jax.tree.map(lambda g: g, grads)
  for block, vs in bases.items():
    for name, v in vs.items():
      g = grads[block]['ffn'][name]['kernel']
      out[block]['ffn'][name]['kernel'] = v @ (v.T @ g)
  return out


def _is_attention(path):
  return any(getattr(k, 'key', None) in ATTENTION_BRANCH for k in path)


def _combine(grads_sum, exact_tokens, total_tokens):
  """§3: attention-branch grads over exact tokens, everything else over all processed tokens."""
  mean = lambda path, g: g / max(exact_tokens if _is_attention(path) else total_tokens, 1)
  return jax.tree_util.tree_map_with_path(mean, grads_sum)


def _split(tree):
  """(attention-branch subtree, the rest) of a params-shaped dict."""
  blocks = [k for k in tree if k.startswith('block')]
  attn = {b: {k: tree[b][k] for k in ATTENTION_BRANCH} for b in blocks}
  rest = {k: ({n: v for n, v in sub.items() if n not in ATTENTION_BRANCH} if k in blocks else sub)
          for k, sub in tree.items()}
  return attn, rest


def _merge(attn, rest):
  return {k: ({**sub, **attn[k]} if k in attn else sub) for k, sub in rest.items()}


def _adamw(o, steps, at=lambda count: count):
  """optax AdamW from the optimizer config `o`: warmup then cosine over `steps`, weight decay on
  matrices only; the schedule read at `at(count)`."""
  warmup = min(o.warmup_steps, steps)
  schedule = optax.warmup_cosine_decay_schedule(o.lr / (warmup + 1), o.lr, warmup,
                                                max(steps, warmup + 1),
                                                end_value=o.lr * o.min_lr_ratio)
  return optax.adamw(lambda count: schedule(at(count)), b1=o.b1, b2=o.b2, eps=o.eps,
                     weight_decay=o.weight_decay,
                     mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))


def _bump_counts(opt_state):
  """AdamW state with every count + 1 and the moments kept: what a shared count did."""
  bump = lambda path, x: x + 1 if 'count' in jax.tree_util.keystr(path) else x
  return jax.tree_util.tree_map_with_path(bump, opt_state)


# One program per (config, attention_updated) for the whole module: run op by op, the
# reference's optimizer compiled ~120 small programs in the first test. `samples` < 0: the
# schedule reads the count; `shared` is traced (no program of its own for the contrast run).
@functools.partial(jax.jit, static_argnames=('o', 'steps', 'attention_updated'))
def _ref_update(params, attn_state, rest_state, grads, samples, shared, *, o, steps,
                attention_updated):
  tx = _adamw(o, steps, lambda count: jnp.where(samples < 0, count, samples // (N * B)))
  if o.grad_clip > 0:
    grads, _ = optax.clip_by_global_norm(o.grad_clip).update(grads, optax.EmptyState())
  (g_attn, g_rest), (p_attn, p_rest) = _split(grads), _split(params)
  u, rest_state = tx.update(g_rest, rest_state, p_rest)
  p_rest = optax.apply_updates(p_rest, u)
  if attention_updated:
    u, attn_state = tx.update(g_attn, attn_state, p_attn)
    p_attn = optax.apply_updates(p_attn, u)
  else:
    attn_state = jax.tree.map(lambda bumped, kept: jnp.where(shared, bumped, kept),
                              _bump_counts(attn_state), attn_state)
  return _merge(p_attn, p_rest), attn_state, rest_state


class RefOptimizer:
  """Global-norm clipping over all grads, then one AdamW for attention (advanced only on steps
  that update it) and one for the rest. `shared_count`: the old behaviour, for contrast."""

  def __init__(self, cfg, params, shared_count=False):
    self.o, self.steps, self.shared = cfg.optimizer, cfg.train.steps, shared_count
    self.samples = None  # requeue: the samples trained, where the schedule is read (else steps)
    tx = _adamw(self.o, self.steps)
    attn, rest = _split(params)
    self.params, self.attn_state, self.rest_state = params, tx.init(attn), tx.init(rest)

  def update(self, grads, attention_updated: bool):
    samples = jnp.int32(-1 if self.samples is None else self.samples)
    self.params, self.attn_state, self.rest_state = _ref_update(
        self.params, self.attn_state, self.rest_state, grads, samples, jnp.bool_(self.shared),
        o=self.o, steps=self.steps, attention_updated=attention_updated)


class SvdBases:
  """Exact top-r left singular vectors, recomputed every tau steps that run degraded rows:
  from scratch the first time (and with refresh=full), else span(W Wᵀ V_prev) (warm)."""

  def __init__(self, cfg):
    self.cfg, self.bases, self.at = cfg, None, -1

  def __call__(self, step, params):
    mc = self.cfg.mecefo
    if self.at < 0 or step - self.at >= mc.tau:
      self.bases = {b: {n: self._one(params[b]['ffn'][n]['kernel'], b, n)
                        for n in ('gate', 'up', 'down')}
                    for b in params if b.startswith('block')}
      self.at = step
    return self.bases

  def _one(self, w, block, name):
    w = np.asarray(w, np.float64)
    if self.bases is None or self.cfg.mecefo.refresh == 'full':
      return jnp.asarray(np.linalg.svd(w, full_matrices=False)[0][:, :self.cfg.mecefo.rank],
                         jnp.float32)
    v = np.asarray(self.bases[block][name], np.float64)
    return jnp.asarray(np.linalg.qr(w @ (w.T @ v))[0], jnp.float32)


class GaussianBases:
  """Fresh N(0, 1/r) bases every degraded step. They live nowhere in the state, so the
  reference re-derives them: the key is the project's derivation (fold_in(PRNGKey(seed), step),
  then per layer fold_in(., i) split over gate, up, down), the draws are plain jax.random."""

  def __init__(self, cfg):
    self.cfg = cfg

  def __call__(self, step, params):
    m, r = self.cfg.model, self.cfg.mecefo.rank
    key = jax.random.fold_in(jax.random.PRNGKey(self.cfg.train.seed), step)
    d_in = {'gate': m.d_model, 'up': m.d_model, 'down': m.ffn_dim}
    out = {}
    for i in range(m.n_layers):
      keys = jax.random.split(jax.random.fold_in(key, i), 3)
      out[f'block{i}'] = {n: jax.random.normal(k, (d_in[n], r), jnp.float32) / np.sqrt(r)
                          for n, k in zip(('gate', 'up', 'down'), keys)}
    return out


def _rows(work, ids_SxB, kind):
  ids = [ids_SxB[r.owner, r.start:r.stop] for w in work.values() for r in getattr(w, kind)]
  return CORPUS.sequences(np.concatenate(ids)) if ids else np.zeros((0, L + 1), np.int32)


def _planner(cfg):
  """The controller's planner (granule: the fsdp size), for who runs which rows how."""
  return takeover.Planner.from_config(cfg, N, granule=FSDP)


def reference_run(cfg, params0, live_sets, shared_count=False):
  """Params after one step per live set; the plan (who runs which rows how) is the project's,
  what it does with them is the reference's."""
  opt = RefOptimizer(cfg, params0, shared_count)
  bases = (GaussianBases if cfg.mecefo.basis == 'gaussian' else SvdBases)(cfg)
  trained = 0  # requeue: the samples trained so far, the stream's next id
  for step, live in enumerate(live_sets):
    work = _planner(cfg).plan(live).work
    ids_SxB = order.sample_ids(step, N, B)
    if cfg.faults.takeover == 'requeue':  # the live slices take the next ids, in slice order
      ids_SxB = np.zeros((N, B), np.int64)
      ids_SxB[sorted(live)] = trained + np.arange(len(live) * B).reshape(len(live), B)
      opt.samples = trained
      trained += len(live) * B
    exact, degraded = _rows(work, ids_SxB, 'exact'), _rows(work, ids_SxB, 'degraded')
    grads = _grad_sum(opt.params, exact, cfg.model, False)
    if len(degraded):
      d_grads = _grad_sum(opt.params, degraded, cfg.model, True)
      grads = jax.tree.map(jnp.add, grads, _project(d_grads, bases(step, opt.params)))
    n_exact, n_all = len(exact) * L, (len(exact) + len(degraded)) * L
    opt.update(_combine(grads, n_exact, n_all), attention_updated=n_exact > 0)
  return opt.params


# --- the controller ---------------------------------------------------------------------------



def _host(params, cfg):
  """Host copies of `params` in the reference's per-block layout (each block a layer slice)."""
  per_block = layout.per_block(jax.device_get(params), cfg.model.n_layers)
  return jax.tree.map(lambda x: np.array(x, copy=True), per_block)


def controller_run(cfg, events, steps):
  """(params before, params after `steps` steps, live sets, exact tokens per step).
  events: (step, slice, 'fail' | 'repair')."""
  mesh = sharding.make_mesh(cfg.mesh)
  schedule = FailureSchedule(N)
  for step, s, kind in events:
    (schedule.fail_at if kind == 'fail' else schedule.repair_at)(s, step)
  # Programs an earlier test built come from the suite's store (procs.suite_store).
  c = Controller(cfg, mesh, llama.abstract(cfg.model)[0], CORPUS, schedule,
                 initializer.create(cfg, mesh, suite_store()), program_store=suite_store())
  params0, live_sets, exact_tokens = _host(c.state.params, cfg), [], []
  for step in range(steps):
    exact_tokens.append(float(c.step(step)['exact_tokens']))
    live_sets.append(c.live())
  return params0, _host(c.state.params, cfg), live_sets, exact_tokens


def _max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _assert_close(got, want):
  flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
  for path, g in jax.tree_util.tree_leaves_with_path(got):
    np.testing.assert_allclose(g, flat_want[path], rtol=TOL, atol=TOL,
                               err_msg=jax.tree_util.keystr(path))


ONE_DOWN = [(1, 2, 'fail')]


@pytest.mark.parametrize('policy', list(takeover.REGISTRY))
def test_update_under_one_failure_matches_reference(policy):
  cfg = _cfg(f'faults.takeover={policy}')
  params0, params, live_sets, _ = controller_run(cfg, ONE_DOWN, 4)
  assert live_sets == [(0, 1, 2, 3)] + 3 * [(0, 1, 3)]
  want = reference_run(cfg, params0, live_sets)
  _assert_close(params, want)
  plan = _planner(cfg).plan(live_sets[-1])
  if plan.dropped or any(w.degraded for w in plan.work.values()):  # else fault-free math
    fault_free = reference_run(cfg, params0, 4 * [(0, 1, 2, 3)])
    assert _max_diff(want, fault_free) > 50 * TOL


def test_update_with_no_exact_slice_freezes_attention_and_its_adam_count():
  """Slices 0 and 2 down: each survivor carries a neighbour, all rows degraded, attention
  frozen for steps 1-2; slice 2 back at step 3, attention's update uses its own count (2)."""
  cfg = _cfg('faults.takeover=neighbor')
  events = [(1, 0, 'fail'), (1, 2, 'fail'), (3, 2, 'repair')]
  params0, params, live_sets, exact_tokens = controller_run(cfg, events, 5)
  assert live_sets == [(0, 1, 2, 3), (1, 3), (1, 3), (1, 2, 3), (1, 2, 3)]
  assert exact_tokens == [4 * B * L, 0.0, 0.0, 2 * B * L, 2 * B * L]
  _assert_close(params, reference_run(cfg, params0, live_sets))
  # The scenario tells the two rules apart: a count shared with the rest misses by far.
  shared = reference_run(cfg, params0, live_sets, shared_count=True)
  assert _max_diff(params, shared) > 50 * TOL


def test_update_with_gaussian_bases_matches_reference():
  cfg = _cfg('faults.takeover=spread', 'mecefo.basis=gaussian', 'mecefo.rank=8')
  params0, params, live_sets, _ = controller_run(cfg, ONE_DOWN, 4)
  _assert_close(params, reference_run(cfg, params0, live_sets))
  # Other draws give another update: the test pins the bases, not only the rule.
  other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=1))
  assert _max_diff(params, reference_run(other, params0, live_sets)) > 5 * TOL


@pytest.mark.parametrize('refresh', ['warm', 'full'])
def test_update_with_tau_scheduled_svd_refreshes_matches_reference(refresh):
  """tau=2: the svd bases are computed at step 1 and refreshed at steps 3 and 5."""
  cfg = _cfg('faults.takeover=neighbor', 'mecefo.tau=2', f'mecefo.refresh={refresh}')
  params0, params, live_sets, _ = controller_run(cfg, ONE_DOWN, 6)
  _assert_close(params, reference_run(cfg, params0, live_sets))
  # Stale bases (no refresh after step 1) give a different update: the refreshes are pinned.
  stale = reference_run(dataclasses.replace(cfg, mecefo=dataclasses.replace(cfg.mecefo, tau=99)),
                        params0, live_sets)
  assert _max_diff(params, stale) > 5 * TOL
