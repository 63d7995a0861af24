"""Normal and degraded steps: gradients, the §3 combine rule, sharding, compiled memory."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.layers import MeCeFOLinear
from mecefo_jax.model import llama, models, train_state
from mecefo_jax.model.bases import svd_bases
from mecefo_jax.core.roles import Role, split_passes
from mecefo_jax.step import initializer, slice_steps, train_step
from procs import suite_store
from test_update_reference import _loss_sum as reference_loss_sum

TINY = ['model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=48', 'model.seq_len=16',
        'model.vocab_size=64', 'train.micro_batch=4']


def _cfg(*extra):
  return load_config(None, [*TINY, *extra])


def _tokens(cfg, shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.model.vocab_size, shape), jnp.int32)


def _state(cfg, mesh):
  return initializer.create(cfg, mesh, suite_store())


def _compiled(lowered, mesh):
  """`lowered` compiled, or loaded from the suite's program store (procs.suite_store)."""
  return initializer.compile_or_load(lambda: lowered, list(mesh.devices.flat), suite_store())[0]


# Jitted, one program per (role, config, degrade): op by op, each of a step's ~200 small ops
# would be compiled on its own, again for every new shape.
_contribute = jax.jit(train_step.contribution, static_argnames=('role', 'graphdef', 'cfg',
                                                                'degrade'))
_reference = jax.jit(jax.value_and_grad(reference_loss_sum), static_argnums=(2, 3))


def _contribution(cfg, params, bases, tokens, role):
  graphdef, _, _ = llama.abstract(cfg.model)
  return _contribute(params, bases, tokens, jax.random.PRNGKey(1), role=role, graphdef=graphdef,
                     cfg=cfg)


@pytest.mark.parametrize('remat', ['dots', 'full'])
def test_degraded_grads_match_dense_projected_reference(remat):
  cfg = _cfg(f'mecefo.ffn_remat={remat}')
  _, params = llama.create(cfg.model, 0)
  bases = svd_bases(params, cfg, jax.random.PRNGKey(3))
  tokens = _tokens(cfg, (6, cfg.model.seq_len + 1))
  grads, loss, exact_tok, deg_tok = _contribution(cfg, params, bases, tokens, Role(degraded=6))
  ref_loss, ref = _reference(params, tokens, cfg.model, True)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert (float(exact_tok), float(deg_tok)) == (0.0, 6.0 * cfg.model.seq_len)
  for i in range(cfg.model.n_layers):  # per layer slice of the stacked blocks
    g, r = llama.layer(grads, i), llama.layer(ref, i)
    for name in ('q', 'k', 'v', 'o'):  # attention branch: exactly zero, not just small
      assert not np.any(np.asarray(g['attn'][name]['kernel']))
    assert not np.any(np.asarray(g['attn_norm']['scale']))
    for name in ('gate', 'up', 'down'):
      v = llama.layer(bases, i)[name]
      projected = v @ (v.T @ r['ffn'][name]['kernel'])
      np.testing.assert_allclose(g['ffn'][name]['kernel'], projected, rtol=2e-4, atol=1e-6)
      # The projection must actually bite: the exact gradient is different.
      assert not np.allclose(projected, r['ffn'][name]['kernel'], rtol=1e-2, atol=1e-4)
    np.testing.assert_allclose(g['ffn_norm']['scale'], r['ffn_norm']['scale'], rtol=2e-4, atol=1e-6)
  for name in ('embed', 'final_norm', 'head'):
    np.testing.assert_allclose(jax.tree.leaves(grads[name])[0], jax.tree.leaves(ref[name])[0],
                               rtol=2e-4, atol=1e-6)


def test_normal_grads_and_losses_match_reference():
  cfg = _cfg()
  _, params = llama.create(cfg.model, 0)
  tokens = _tokens(cfg, (4, cfg.model.seq_len + 1))
  grads, loss, exact_tok, _ = _contribution(cfg, params, {}, tokens, Role(exact=4))
  ref_loss, ref = _reference(params, tokens, cfg.model, False)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=1e-6)
  bases = svd_bases(params, cfg, jax.random.PRNGKey(3))
  _, d_loss, _, _ = _contribution(cfg, params, bases, tokens, Role(degraded=4))
  np.testing.assert_allclose(d_loss, loss, rtol=1e-6)  # the degraded forward is exact


def test_normal_step_equals_jax_grad_and_optax(devices):
  cfg = _cfg('mesh.slice=4', 'mesh.fsdp=2')
  mesh = sharding.make_mesh(cfg.mesh)
  graphdef, _, _ = llama.abstract(cfg.model)
  step = _compiled(train_step.lower_step(cfg, mesh, Role(exact=4), graphdef), mesh)
  state = _state(cfg, mesh)
  params0 = jax.device_get(state.params)
  tokens = _tokens(cfg, (4, 4, cfg.model.seq_len + 1))
  new_state, metrics = step(state, tokens, train_state.schedule_on(cfg, mesh))

  def mean_loss(p):
    logits = llama.forward(graphdef, p, tokens.reshape(16, -1)[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens.reshape(16, -1)[:, 1:]).mean()

  @jax.jit  # one program, not op by op
  def reference(p):
    loss, grads = jax.value_and_grad(mean_loss)(p)
    tx = train_state.make_optimizer(cfg)
    updates, _ = tx.update(grads, tx.init(p), p)
    return loss, optax.apply_updates(p, updates)
  loss, expected = reference(params0)
  np.testing.assert_allclose(metrics['loss'], loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert int(new_state.step) == 1


def test_combine_rule_attention_over_exact_only():
  model = models.spec(load_config(None, []).model)
  grads = jax.tree.map(lambda s: jnp.full(s.shape, 6.0), model.shapes)
  out = train_step.combine(grads, attention_tokens=jnp.float32(2.0), total_tokens=jnp.float32(6.0),
                           model=model)
  np.testing.assert_allclose(out['blocks']['attn']['q']['kernel'], 3.0)
  np.testing.assert_allclose(out['blocks']['attn_norm']['scale'], 3.0)
  np.testing.assert_allclose(out['blocks']['ffn']['up']['kernel'], 1.0)
  np.testing.assert_allclose(out['blocks']['ffn_norm']['scale'], 1.0)
  np.testing.assert_allclose(out['head']['kernel'], 1.0)


def _run(cfg, mesh, n_steps):
  graphdef, _, _ = llama.abstract(cfg.model)
  normal = _compiled(train_step.lower_step(cfg, mesh, Role(exact=8 // mesh.shape['slice']),
                                           graphdef), mesh)
  state, schedule = _state(cfg, mesh), train_state.schedule_on(cfg, mesh)
  for t in range(n_steps):
    tokens = _tokens(cfg, (8, cfg.model.seq_len + 1), seed=t).reshape(mesh.shape['slice'], -1,
                                                                       cfg.model.seq_len + 1)
    state, _ = normal(state, tokens, schedule)
  return jax.device_get(state.params)


def test_sharded_and_unsharded_runs_agree(devices):
  base = _cfg('mesh.slice=1')
  ref = _run(base, sharding.make_mesh(base.mesh, devices[:1]), 3)
  for shape in [(2, 2, 2), (8, 1, 1)]:  # every axis at once; data parallel only
    cfg = _cfg(*(f'mesh.{a}={n}' for a, n in zip(sharding.MESH_AXES, shape)))
    got = _run(cfg, sharding.make_mesh(cfg.mesh), 3)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(shape))


def test_group_programs_and_the_update_equal_the_fused_step(devices):
  """One role on both slices: the per-slice group program, its sums stacked by device and the
  cross-slice update give the fused SPMD step's loss and params (up to summation order)."""
  cfg = _cfg('mesh.slice=2', 'mesh.fsdp=2')
  mesh = sharding.make_mesh(cfg.mesh, devices[:4])
  graphdef, _, _ = llama.abstract(cfg.model)
  role = Role(exact=4)
  tokens = _tokens(cfg, (2, 4, cfg.model.seq_len + 1))
  fused_step = _compiled(train_step.lower_step(cfg, mesh, role, graphdef), mesh)
  schedule = train_state.schedule_on(cfg, mesh)
  fused_state, fused = fused_step(_state(cfg, mesh), tokens, schedule)
  state = _state(cfg, mesh)
  sums = _compiled(slice_steps.lower_group(cfg, mesh, role, graphdef), mesh)(state, tokens)
  stacked = slice_steps.stack_groups([sums], cfg, mesh)
  state, metrics = _compiled(slice_steps.lower_update(cfg, mesh), mesh)(state, stacked, schedule)
  np.testing.assert_allclose(metrics['loss'], fused['loss'], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(fused_state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_steps_share_state_shardings_and_degraded_memory_fits(devices):
  cfg = _cfg('mesh.slice=2', 'mesh.fsdp=2', 'mesh.tensor=2')
  mesh = sharding.make_mesh(cfg.mesh)
  graphdef, _, _ = llama.abstract(cfg.model)
  normal = train_step.lower_step(cfg, mesh, Role(exact=4), graphdef).compile()
  degraded = train_step.lower_step(cfg, mesh, Role(degraded=8), graphdef).compile()
  expected = jax.tree.leaves(train_state.state_shardings(cfg, mesh))
  ndims = [leaf.ndim for leaf in jax.tree.leaves(train_state.abstract_state(cfg))]
  for compiled in (normal, degraded):
    (state_in, *_), _ = compiled.input_shardings
    state_out, _ = compiled.output_shardings
    for got_in, got_out, want, ndim in zip(jax.tree.leaves(state_in), jax.tree.leaves(state_out),
                                           expected, ndims):
      assert got_in.is_equivalent_to(want, ndim) or got_in.spec == want.spec
      assert got_out.is_equivalent_to(want, ndim) or got_out.spec == want.spec


def test_compiled_memory_degraded_two_fits_in_normal_one(devices):
  cfg = load_config('configs/tiny.yaml', ['mesh.slice=1'])
  mesh = sharding.make_mesh(cfg.mesh, devices[:1])
  graphdef, _, _ = llama.abstract(cfg.model)
  b = cfg.train.micro_batch
  temp = {name: train_step.memory_summary(train_step.lower_step(cfg, mesh, role, graphdef).compile())['temp_bytes']
          for name, role in [('normal', Role(exact=b)), ('degraded', Role(degraded=2 * b)),
                             ('naive', Role(exact=2 * b))]}
  assert temp['degraded'] <= temp['normal'] < temp['naive'], temp


def test_degraded_passes_with_remainder_equal_one_pass():
  cfg = _cfg()
  _, params = llama.create(cfg.model, 0)
  bases = svd_bases(params, cfg, jax.random.PRNGKey(3))
  tokens = _tokens(cfg, (7, cfg.model.seq_len + 1))
  assert split_passes(7, 3) == 3  # chunks of 3, 3 and a remainder of 1
  one = _contribution(cfg, params, bases, tokens, Role(degraded=7))
  three = _contribution(cfg, params, bases, tokens, Role(degraded=7, passes=3))
  np.testing.assert_allclose(three[1], one[1], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(three[0]), jax.tree.leaves(one[0])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# --- Degrade: each §2 technique on its own (the ablation's variants) ---

def _ablated(degrade, remat='dots', contribute=_contribute):
  cfg = _cfg(f'mecefo.ffn_remat={remat}')
  _, params = llama.create(cfg.model, 0)
  bases = svd_bases(params, cfg, jax.random.PRNGKey(3))
  tokens = _tokens(cfg, (4, cfg.model.seq_len + 1))
  graphdef, _, _ = llama.abstract(cfg.model)
  grads, loss, _, _ = contribute(params, bases, tokens, jax.random.PRNGKey(1),
                                 role=Role(degraded=4), graphdef=graphdef, cfg=cfg,
                                 degrade=degrade)
  return cfg, params, bases, tokens, grads, loss


def _ffn_kernel(path):
  keys = [getattr(k, 'key', None) for k in path]
  return 'ffn' in keys and 'kernel' in keys


def test_degrade_skip_attention_only_is_the_cut_graph_with_exact_ffn_grads():
  cfg, params, _, tokens, grads, loss = _ablated(llama.Degrade(skip_attention=True))
  ref_loss, ref = _reference(params, tokens, cfg.model, True)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)  # the forward is exact
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref)):
    if models.spec(cfg.model).is_attention(path):
      assert not np.any(np.asarray(g)), path  # no gradient from this pass at all
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=1e-6, err_msg=str(path))
  # The last block's FFN sees no attention downstream: its grads equal the uncut ones.
  _, exact = _reference(params, tokens, cfg.model, False)
  last = cfg.model.n_layers - 1
  for a, b in zip(jax.tree.leaves(llama.layer(grads, last)['ffn']),
                  jax.tree.leaves(llama.layer(exact, last)['ffn'])):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize('remat', ['dots', 'full'])
def test_degrade_remat_only_changes_no_gradient(remat):
  cfg, params, _, tokens, grads, loss = _ablated(llama.Degrade(remat_ffn=True), remat)
  ref_loss, ref = _reference(params, tokens, cfg.model, False)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
    np.testing.assert_allclose(g, r, rtol=2e-4, atol=1e-6)


def test_degrade_lowrank_only_projects_ffn_kernels_and_keeps_the_rest_exact():
  cfg, params, bases, tokens, grads, loss = _ablated(llama.Degrade(lowrank=True))
  ref_loss, ref = _reference(params, tokens, cfg.model, False)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)  # loss identical: only Wgrad changes
  flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref))
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    r = flat_ref[path]
    if not _ffn_kernel(path):  # dgrad is exact, so attention and norms get exact grads
      np.testing.assert_allclose(g, r, rtol=2e-4, atol=1e-6, err_msg=str(path))
      continue
    v = bases[path[0].key][path[2].key]  # [layers, d_in, r], like the stacked kernels
    projected = jnp.einsum('lir,ljr,ljo->lio', v, v, r)  # per layer: V Vᵀ G
    np.testing.assert_allclose(g, projected, rtol=2e-4, atol=1e-6, err_msg=str(path))
    assert not np.allclose(g, r, rtol=1e-2, atol=1e-4), path


def test_degrade_true_is_all_techniques_and_static_under_jit():
  assert llama.Degrade.of(True) == llama.FULL == llama.Degrade(True, True, True)
  assert llama.Degrade.of(False) == llama.NONE and not llama.NONE and llama.Degrade(lowrank=True)
  *_, grads, loss = _ablated(llama.FULL)
  cfg, params, bases, tokens, _, _ = _ablated(llama.NONE)
  graphdef, _, _ = llama.abstract(cfg.model)
  default = _contribute(params, bases, tokens, jax.random.PRNGKey(1), role=Role(degraded=4),
                        graphdef=graphdef, cfg=cfg)
  assert float(default[1]) == float(loss)
  for a, b in zip(jax.tree.leaves(default[0]), jax.tree.leaves(grads)):
    np.testing.assert_array_equal(a, b)
  # Hashable and static: one trace per distinct Degrade.
  fwd = jax.jit(llama.forward, static_argnums=(0, 3))
  out = fwd(graphdef, params, tokens[:, :-1], llama.Degrade(skip_attention=True))
  np.testing.assert_allclose(out, llama.forward(graphdef, params, tokens[:, :-1]), rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize('degrade', [llama.FULL, llama.Degrade(lowrank=True),
                                     llama.Degrade(remat_ffn=True), llama.NONE])
def test_ffn_trains_through_the_published_layer_with_its_bases(degrade, monkeypatch):
  # The FFN must call its MeCeFOLinear layers (what users import), given the bases exactly when
  # the low-rank technique is on, not run a private copy of their math.
  calls, layer_call = [], MeCeFOLinear.__call__

  def spy(self, inputs, basis=None, **kwargs):
    calls.append(((self.in_features, self.out_features), None if basis is None else basis.shape))
    return layer_call(self, inputs, basis, **kwargs)

  monkeypatch.setattr(MeCeFOLinear, '__call__', spy)
  cfg, _, bases, *_ = _ablated(degrade, contribute=train_step.contribution)  # traced here
  d, f = cfg.model.d_model, cfg.model.ffn_dim
  # Each layer's slice of the stacked bases reaches its layer: [d_in, r], not [layers, d_in, r].
  basis = lambda name: bases['blocks'][name].shape[1:] if degrade.lowrank else None
  per_block = [((d, f), basis('gate')), ((d, f), basis('up')), ((f, d), basis('down'))]
  ffn_calls = [c for c in calls if c[0] in ((d, f), (f, d))]
  # One forward of n_layers = 2: the scan traces the one block body once, whatever the depth.
  assert cfg.model.n_layers == 2 and ffn_calls == per_block
  # Attention and the head are MeCeFOLinear too, always exact.
  assert {b for c, b in calls if c not in ((d, f), (f, d))} == {None}
