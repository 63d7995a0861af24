"""Your own Flax model, trained through failures the MeCeFO way: copy this file, change the model.

  python own_model.py --host-devices 4 --failures high --out runs/own     # the Python API
  python own_model.py --out runs/own --resume                             # on from its snapshot
  python -m mecefo_jax --model own_model:TinyLM --host-devices 4 --failures high --out runs/own2

(the last from this file's folder: train.py's processes, and the supervisor's, import the model
by its `module:factory` name). The contract (mecefo_jax/model/contract.py): the factory takes
the `model:` config section and an nnx.Rngs; the forward takes the tokens, a `Degrade` and the
bases; the attention branch and the FFN's MeCeFOLinear layers are marked (here by the
AttentionBranch and FFNBranch blocks); every parameter has logical axes.
"""
import argparse
import logging
import os

import jax
import jax.numpy as jnp
from flax import nnx

from mecefo_jax.layers import MeCeFOLinear
from mecefo_jax.model import contract


def dense(d_in, d_out, axes, rngs, std=0.02):
  """A linear layer whose kernel and bias carry logical axes (names of sharding.LOGICAL_RULES)."""
  return MeCeFOLinear(d_in, d_out, rngs=rngs, kernel_init=nnx.initializers.normal(std),
                      kernel_metadata={'logical_axes': axes},
                      bias_metadata={'logical_axes': axes[-1:]})


class Norm(nnx.Module):
  def __init__(self, dim):
    self.scale = nnx.Param(jnp.ones((dim,)), logical_axes=('norm',))

  def __call__(self, x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]


class SelfAttention(nnx.Module):
  def __init__(self, d, heads, rngs):
    self.qkv = dense(d, 3 * d, ('embed', 'heads'), rngs)
    self.out = dense(d, d, ('heads', 'embed'), rngs)
    self.heads = heads

  def __call__(self, x):
    b, l, d = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(b, l, 3, self.heads, d // self.heads), 3, axis=2)
    y = jax.nn.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], is_causal=True)
    return self.out(y.reshape(b, l, d))


class MLP(nnx.Module):
  """Its MeCeFOLinear layers take the bases {'w_in', 'w_out'} in degraded passes."""

  def __init__(self, d, hidden, rngs):
    self.w_in, self.w_out = dense(d, hidden, ('embed', 'mlp'), rngs), dense(hidden, d, ('mlp', 'embed'), rngs)

  def __call__(self, x, bases=None):
    h = jax.nn.relu(self.w_in(x, basis=contract.basis(bases, 'w_in')))
    return self.w_out(h, basis=contract.basis(bases, 'w_out'))


class Block(nnx.Module):
  def __init__(self, cfg, rngs):
    self.attention = contract.AttentionBranch(Norm(cfg.d_model), SelfAttention(cfg.d_model, cfg.n_heads, rngs))
    self.mlp = contract.FFNBranch(Norm(cfg.d_model), MLP(cfg.d_model, cfg.ffn_dim, rngs))

  def __call__(self, x, degrade, bases, remat):
    x = x + self.attention(x, degrade)
    return x + self.mlp(x, degrade, contract.basis(bases, 'mlp'), remat)


class TinyLM(contract.Model):
  """Embeddings, a plain list of blocks (no scan), a norm and a head; `cfg` is the model: section."""

  def __init__(self, cfg, rngs):
    init = nnx.initializers.normal(0.02)
    self.tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.d_model)), logical_axes=('vocab', 'embed'))
    self.positions = nnx.Param(init(rngs.params(), (cfg.seq_len, cfg.d_model)), logical_axes=('position', 'embed'))
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.norm = Norm(cfg.d_model)
    self.head = dense(cfg.d_model, cfg.vocab_size, ('embed', 'vocab'), rngs)

  def __call__(self, tokens, degrade, bases=None, remat='dots'):
    # `bases` (None in exact passes) mirrors the marked layers' paths, here
    # {'layers': {i: {'mlp': {'inner': {'w_in': [d_model, rank], 'w_out': [ffn_dim, rank]}}}}}
    x = self.tokens[...][tokens] + self.positions[:tokens.shape[1]]
    for i, block in enumerate(self.layers):
      x = block(x, degrade, bases and bases['layers'][i], remat)
    return self.head(self.norm(x))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--host-devices', type=int, default=4, help='simulated CPU devices = slices')
  p.add_argument('--failures', default='high', help='none | low | mid | high | trace:FILE')
  p.add_argument('--out', default='runs/own_model')
  p.add_argument('--resume', action='store_true')
  p.add_argument('overrides', nargs='*', help='dotted config overrides, e.g. train.steps=300')
  args = p.parse_args()
  # Before jax starts its backend (at the first array): the simulated devices.
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count={args.host_devices}')
  logging.basicConfig(format='%(asctime)s %(message)s', datefmt='%H:%M:%S')
  from mecefo_jax.config import load_config
  from mecefo_jax.run.trainer import Trainer
  cfg = load_config(None, [f'mesh.slice={args.host_devices}', f'faults.failures={args.failures}',
                           'model.n_layers=2', 'train.steps=300', *args.overrides])
  trainer = Trainer(cfg, args.out, model=TinyLM, resume=args.resume, progress='plain')
  try:
    report = trainer.run()
  finally:
    trainer.close()
  print(f"eval loss {report['eval_loss']}, samples {report['samples']}, "
        f"params {report['params_sha256'][:12]}")


if __name__ == '__main__':
  main()
