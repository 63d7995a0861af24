"""Relative error ‖G̃ − G‖/‖G‖ of the degraded gradient over a training run, per basis and rank.

Run: python -m benchmarks.gradient_error --config configs/tiny.yaml --json OUT.json
Trains with normal steps; every --every steps, on a fresh batch, compares the exact gradient G
with the degraded gradient G̃ for each basis (svd with bases --tau steps old, as the trainer
keeps them; gaussian fresh) and rank fraction. Reports the error over all non-attention
parameters (what degraded micro-batches contribute to) and over the FFN matrices alone, and
the part due to the projection only (vs the exact gradient of the attention-cut graph).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.data.order import sample_ids
from mecefo_jax.data.synthetic import SyntheticCorpus
from mecefo_jax.model import models, train_state
from mecefo_jax.model.bases import svd_bases
from mecefo_jax.core.roles import Role
from mecefo_jax.step import train_step


def _norm(tree) -> float:
  return float(jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree))))


def _select(tree, keep):
  flat = jax.tree_util.tree_leaves_with_path(tree)
  return [x for path, x in flat if keep(path)]


def _ffn_matrix(model: models.Spec):
  """Whether a path is one of the model's basis-taking (FFN) kernels."""
  kernels = {layer.kernel for layer in model.basis_layers}
  return lambda path: models.keys_of(path) in kernels


def _rel(a, b) -> float:
  diff = [x - y for x, y in zip(a, b)]
  return _norm(diff) / max(_norm(b), 1e-30)


def main(argv=None) -> dict:
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--every', type=int, default=50)
  p.add_argument('--fractions', default='0.125,0.25,0.5,1.0')
  p.add_argument('--tau', type=int, default=10)
  p.add_argument('--bases', default='svd,svd-warm,gaussian',
                 help='svd: randomized SVD at every refresh (mecefo.refresh=full); svd-warm: one '
                 'subspace iteration from the last bases (refresh=warm, the default); gaussian')
  args = p.parse_args(argv)
  cfg = load_config(args.config, ['mesh.slice=1', *args.overrides])
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  graphdef = models.spec(cfg.model).graphdef
  b = cfg.train.micro_batch
  corpus = SyntheticCorpus(cfg.model.vocab_size, cfg.model.seq_len, cfg.train.seed)
  normal = train_step.lower_step(cfg, mesh, Role(exact=b), graphdef).compile()
  schedule = train_state.schedule_on(cfg, mesh)
  state = train_state.create_sharded(cfg, mesh)
  fractions = [float(f) for f in args.fractions.split(',')]
  kinds = [k.strip() for k in args.bases.split(',')]
  variants = [(k, f) for k in kinds for f in fractions]
  grad_fns = {v: _grad_fn(cfg, graphdef, *v) for v in variants}
  refreshers = {v: _refresh_fn(cfg, *v) for v in variants if v[0] != 'gaussian'}
  exact_fn = jax.jit(lambda params, tokens: train_step.contribution(
      params, {}, tokens, jax.random.PRNGKey(0), role=Role(exact=b), graphdef=graphdef,
      cfg=cfg)[0])
  cut_fn = _grad_fn(cfg, graphdef, 'none', 1.0)
  bases, rows = dict.fromkeys(variants), []
  for step in range(cfg.train.steps):
    tokens = corpus.sequences(sample_ids(step, 1, b)[0])
    if step % args.tau == 0:  # svd bases are up to tau steps old, as the trainer keeps them
      key = jax.random.PRNGKey(10_000 + step)
      bases.update({v: fn(state.params, key, bases[v]) for v, fn in refreshers.items()})
    if step % args.every == 0 or step == cfg.train.steps - 1:
      rows.append(_measure(step, state.params, bases, tokens, exact_fn, cut_fn, grad_fns,
                           models.spec(cfg.model)))
    state, _ = normal(state, jnp.asarray(tokens)[None], schedule)
  result = {**common.run_info(__spec__.name, argv), 'config': args.config,
            'overrides': args.overrides, 'tau': args.tau, 'rows': rows, 'mean': _means(rows, variants)}
  table = [{'basis': k, 'rank_fraction': f, **{m: result['mean'][f'{k}:{f}'][m]
            for m in ('non_attention', 'ffn', 'projection_only')}} for k, f in variants]
  common.emit(result, common.markdown_table(table, list(table[0])), args.json)
  return result


def _variant_cfg(cfg, basis, fraction):
  mc = dataclasses.replace(cfg.mecefo, basis='gaussian' if basis == 'gaussian' else 'svd',
                           rank_fraction=fraction, rank=0)
  return dataclasses.replace(cfg, mecefo=mc)


def _refresh_fn(cfg, basis, fraction):
  """jitted (params, key, previous bases or None) -> the svd bases of that variant."""
  vcfg = _variant_cfg(cfg, basis, fraction)
  full = jax.jit(lambda params, key: svd_bases(params, vcfg, key))
  warm = jax.jit(lambda params, key, prev: svd_bases(params, vcfg, key, prev))
  return lambda params, key, prev: (
      warm(params, key, prev) if basis == 'svd-warm' and prev is not None else full(params, key))


def _grad_fn(cfg, graphdef, basis, fraction):
  """jitted (params, bases, tokens, key) -> degraded grads with that basis and rank."""
  vcfg = _variant_cfg(cfg, basis, fraction)
  n = cfg.train.micro_batch

  def fn(params, bases, tokens, key):
    if basis == 'none':  # attention cut, exact FFN weight gradients
      return jax.grad(models.spec(vcfg.model).loss_sum, argnums=1)(
          graphdef, params, tokens, True, None, vcfg.mecefo.ffn_remat)
    return train_step.contribution(params, bases or {}, tokens, key, role=Role(degraded=n),
                              graphdef=graphdef, cfg=vcfg)[0]
  return jax.jit(fn)


def _measure(step, params, bases, tokens, exact_fn, cut_fn, grad_fns, model):
  tokens = jnp.asarray(tokens)
  key = jax.random.PRNGKey(step)
  exact = exact_fn(params, tokens)
  cut = cut_fn(params, None, tokens, key)
  non_attn = lambda path: not model.is_attention(path)
  is_ffn = _ffn_matrix(model)
  row = {'step': step}
  for (kind, frac), fn in grad_fns.items():
    approx = fn(params, bases[(kind, frac)], tokens, key)
    row[f'{kind}:{frac}'] = {
        'non_attention': _rel(_select(approx, non_attn), _select(exact, non_attn)),
        'ffn': _rel(_select(approx, is_ffn), _select(exact, is_ffn)),
        'projection_only': _rel(_select(approx, is_ffn), _select(cut, is_ffn)),
    }
  return row


def _means(rows, variants) -> dict:
  out = {}
  for kind, frac in variants:
    key = f'{kind}:{frac}'
    out[key] = {m: float(np.mean([r[key][m] for r in rows]))
                for m in ('non_attention', 'ffn', 'projection_only')}
  return out


if __name__ == '__main__':
  main()
