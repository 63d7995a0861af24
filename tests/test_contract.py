"""The model contract (mecefo_jax/model/contract.py) for both built-in models: the degraded
step's gradients against a dense projected reference of their own math, the markers as read, a
model that breaks the contract refused in one line, and no LLaMA name outside its own modules."""
import ast
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mecefo_jax import config
from mecefo_jax.config import load_config
from mecefo_jax.core.roles import Role
from mecefo_jax.layers import MeCeFOLinear
from mecefo_jax.model import contract, gpt2 as gpt2_model, llama, models
from mecefo_jax.model.bases import svd_bases
from mecefo_jax.step import train_step
from test_update_reference import _loss_sum as llama_reference

ROOT = Path(__file__).resolve().parents[1]
L, ROWS = 8, 3
# rank 24 of d_model 32 / ffn 48: the svd bases are exact top singular subspaces.
TINY = ['model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=48', f'model.seq_len={L}',
        'model.n_layers=2', 'model.vocab_size=64', 'mecefo.rank=24']


def _cfg(kind):
  return load_config(None, [*TINY, f'model.kind={kind}'])


# --- an independent GPT-2 reference: its own math on the params dict --------------------------

def _ln(x, p, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + eps) * p['scale'] + p['bias']


def _affine(x, p):
  return x @ p['kernel'] + p['bias']


def _gelu(x):
  return 0.5 * x * (1 + jnp.tanh(jnp.sqrt(2 / jnp.pi) * (x + 0.044715 * x ** 3)))


def gpt2_reference(params, tokens_NxL1, m, cut_attention):
  """Summed token cross-entropy of GPT-2 (pre-LN, learned positions, tied head)."""
  tokens = tokens_NxL1[:, :-1]
  n, l = tokens.shape
  h = params['wte'][tokens] + params['wpe'][:l]
  for i in range(m.n_layers):
    p = jax.tree.map(lambda x: x[i], params['h'])
    a_p, x = p['attn']['inner'], _ln(h, p['attn']['norm'], m.norm_eps)
    heads = lambda name: _affine(x, a_p[name]).reshape(n, l, m.n_heads, -1)
    s = jnp.einsum('blhk,bmhk->bhlm', heads('q'), heads('k')) / jnp.sqrt(m.d_model // m.n_heads)
    s = jnp.where(jnp.tril(jnp.ones((l, l), bool)), s, -1e30)
    a = _affine(jnp.einsum('bhlm,bmhk->blhk', jax.nn.softmax(s, -1), heads('v')).reshape(n, l, -1),
                a_p['proj'])
    h = h + (jax.lax.stop_gradient(a) if cut_attention else a)
    f = p['mlp']['inner']
    h = h + _affine(_gelu(_affine(_ln(h, p['mlp']['norm'], m.norm_eps), f['fc'])), f['proj'])
  logits = _ln(h, params['ln_f'], m.norm_eps) @ params['wte'].T
  picked = jnp.take_along_axis(logits, tokens_NxL1[:, 1:, None], -1)[..., 0]
  return (jax.nn.logsumexp(logits, -1) - picked).sum()


REFERENCES = {'llama': llama_reference, 'gpt2': gpt2_reference}


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


@pytest.mark.parametrize('kind', ['llama', 'gpt2'])
def test_degraded_step_gradients_are_the_projected_cut_gradients(kind):
  """Exact rows: the reference's gradients. Degraded rows: the same forward, no gradient into
  the attention branch, and every basis layer's kernel gradient V Vᵀ G of the cut graph's G."""
  cfg = _cfg(kind)
  model = models.spec(cfg.model)
  graphdef, params = model.create(0)
  tokens = jax.random.randint(jax.random.key(1), (ROWS, L + 1), 0, cfg.model.vocab_size)
  key = jax.random.key(2)
  bases = svd_bases(params, cfg, key)
  run = lambda role: jax.jit(functools.partial(
      train_step.contribution, role=role, graphdef=graphdef, cfg=cfg))(params, bases, tokens, key)
  reference = jax.jit(jax.value_and_grad(REFERENCES[kind]), static_argnums=(2, 3))
  exact_grads, exact_loss, _, _ = run(Role(exact=ROWS))
  ref_loss, ref_grads = reference(params, tokens, cfg.model, False)
  np.testing.assert_allclose(exact_loss, ref_loss, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6),
               exact_grads, ref_grads)

  degraded_grads, degraded_loss, _, _ = run(Role(degraded=ROWS))
  cut_loss, want = reference(params, tokens, cfg.model, True)
  np.testing.assert_allclose(degraded_loss, cut_loss, rtol=1e-5)  # the forward is exact
  for layer in model.basis_layers:
    v, g = _get(bases, layer.path), _get(want, layer.kernel)
    project = lambda v, g: v @ (v.T @ g)
    projected = jax.vmap(project)(v, g) if layer.stacked else project(v, g)
    _get(want, layer.kernel[:-1])['kernel'] = projected
  flat = jax.tree_util.tree_leaves_with_path(degraded_grads)
  assert sum(model.is_attention(path) for path, _ in flat) >= 4
  for (path, got), ref in zip(flat, jax.tree.leaves(want)):
    if model.is_attention(path):
      assert not np.any(np.asarray(got)), path
    else:
      np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-6, err_msg=str(path))


def test_llamas_markers_are_the_branch_and_layers_it_had_by_name():
  """The declaration replaced a name rule: the same parameters as before, from the markers."""
  model = models.spec(_cfg('llama').model)
  old_rule = {p for p in models._flat(model.shapes) if {'attn', 'attn_norm'} & set(p)}
  assert model.attention == old_rule and len(old_rule) == 5
  assert [(layer.path, layer.kernel) for layer in model.basis_layers] == [
      (('blocks', n), ('blocks', 'ffn', n, 'kernel')) for n in ('gate', 'up', 'down')]
  gpt2 = models.spec(_cfg('gpt2').model)
  assert gpt2.attention == {p for p in models._flat(gpt2.shapes) if p[:2] == ('h', 'attn')}
  assert [layer.kernel[-2] for layer in gpt2.basis_layers] == ['fc', 'proj']
  assert sorted(models.BUILTIN) == sorted(config.MODELS)
  assert models.factory('gpt2') is gpt2_model.GPT2 and models.factory('llama') is llama.LLaMA


# --- models that break the contract -----------------------------------------------------------

class _Plain(contract.Model):
  """Attention and MLP unmarked unless asked."""

  def __init__(self, cfg, rngs, mark_attention=True, mark_ffn=True):
    linear = lambda a, b, axes: MeCeFOLinear(a, b, rngs=rngs, kernel_metadata={'logical_axes': axes},
                                             bias_metadata={'logical_axes': axes[-1:]})
    self.attn = linear(cfg.d_model, cfg.d_model, ('embed', 'heads'))
    self.mlp = linear(cfg.d_model, cfg.d_model, ('embed', 'mlp'))
    self.embed = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.d_model)), logical_axes=('vocab', 'embed'))
    if mark_attention:
      contract.mark_attention(self.attn)
    if mark_ffn:
      contract.mark_ffn(self.mlp)

  def __call__(self, tokens, degrade, bases=None, remat='dots'):
    return self.embed[...][tokens] @ self.embed[...].T


class _MissingLayer(_Plain):
  bases_table = {('mlp',): ('mlp',), ('fc2',): ('fc2',)}


def _no_attention(cfg, rngs):
  return _Plain(cfg, rngs, mark_attention=False)


def _no_basis(cfg, rngs):
  return _Plain(cfg, rngs, mark_ffn=False)


def _no_axes(cfg, rngs):
  model = _Plain(cfg, rngs)
  model.extra = nnx.Param(jnp.zeros((3,)))
  return model


@pytest.mark.parametrize('factory, missing', [
    (_no_attention, 'no parameter is marked as its attention branch'),
    (_MissingLayer, 'its basis fc2 is on layer fc2, which is no MeCeFOLinear marked to take a basis'),
    (_no_basis, 'no layer takes a basis'),
    (_no_axes, 'parameter extra has no logical_axes metadata')])
def test_a_model_that_breaks_the_contract_is_refused_in_one_line(factory, missing):
  kind = models.register(factory)
  with pytest.raises(models.ContractError) as err:
    models.spec(load_config(None, [*TINY, f'model.kind={kind}']).model)
  assert missing in str(err.value) and '\n' not in str(err.value), str(err.value)
  assert f'model {kind!r}' in str(err.value)


# --- the built-in model's names live in its own modules ---------------------------------------

# Generic Flax and logical-axis names that LLaMA's parameters use too ('embed' is both).
GENERIC = {'kernel', 'scale', 'bias', 'embed'}
OWN = {'mecefo_jax/model/llama.py', 'mecefo_jax/model/layout.py'}


def test_no_name_of_the_built_in_models_parameters_outside_its_own_modules():
  """The trainer, the step, the faults, the bases and the combine know no LLaMA parameter by
  name: those names are string constants only in model/llama.py (with its bases table) and
  model/layout.py (old runs' layout)."""
  names = {str(k) for p in models._flat(models.spec(_cfg('llama').model).shapes) for k in p}
  # One-letter names (q, k, v, o) say nothing: matplotlib's 'o' marker is no attention output.
  names = {n for n in names - GENERIC if len(n) > 1}
  assert {'attn', 'attn_norm', 'ffn', 'gate', 'up', 'down', 'head', 'blocks'} <= names
  found = []
  for path in sorted([*(ROOT / 'mecefo_jax').rglob('*.py'), ROOT / 'train.py']):
    where = str(path.relative_to(ROOT))
    if where in OWN:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and node.value in names:
        found.append(f'{where}:{node.lineno} {node.value!r}')
  assert not found, found


def test_a_models_logical_axes_shard_its_state_and_its_bases(devices):
  """gpt2's parameters, moments and bases are sharded by the axes it declares (mesh.fsdp and
  mesh.tensor > 1), as LLaMA's are."""
  from jax.sharding import PartitionSpec as P

  from mecefo_jax import sharding
  from mecefo_jax.model import train_state
  cfg = load_config(None, [*TINY, 'model.kind=gpt2', 'mesh.slice=2', 'mesh.fsdp=2',
                           'mesh.tensor=2', 'train.micro_batch=4'])
  shardings = train_state.state_shardings(cfg, sharding.make_mesh(cfg.mesh, devices))
  params = shardings.params
  assert params['wte'].spec == P('tensor', 'fsdp')
  assert params['h']['mlp']['inner']['fc']['kernel'].spec == P(None, 'fsdp', 'tensor')
  assert params['h']['attn']['inner']['proj']['kernel'].spec == P(None, 'tensor', 'fsdp')
  assert shardings.bases['h']['mlp']['inner']['proj'].spec == P(None, 'tensor', None)


@pytest.mark.parametrize('kind, extra', [('llama', ()), ('gpt2', ()),
                                         ('llama', ('optimizer.grad_clip=0',))])
def test_the_abstract_state_is_the_initialisers_to_the_dtype_and_weak_type(kind, extra):
  """train_state.abstract_state builds it from the spec's parameter shapes, not by tracing the
  model's initialisers again: the same tree, shapes, dtypes and weak types."""
  from mecefo_jax.model import train_state
  cfg = load_config(None, [*TINY, f'model.kind={kind}', *extra])
  want = jax.eval_shape(lambda: train_state.init_state(cfg))
  got = train_state.abstract_state(cfg)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  key = lambda x: (x.shape, x.dtype, x.weak_type)
  assert [key(x) for x in jax.tree.leaves(got)] == [key(x) for x in jax.tree.leaves(want)]


def test_train_py_refuses_a_broken_model_in_one_error_line_and_leaves_nothing(capsys, tmp_path):
  from mecefo_jax.run import cli
  from mecefo_jax.records.job import BAD_INPUT
  from procs import error_lines
  out = tmp_path / 'run'
  assert cli.main(['--model', 'test_contract:_no_attention', '--out', str(out), *TINY,
                   'snapshot.enabled=false']) == BAD_INPUT
  lines = error_lines(capsys.readouterr().err)
  assert len(lines) == 1 and "model 'test_contract:_no_attention' breaks the contract" in lines[0]
  assert not out.exists()
