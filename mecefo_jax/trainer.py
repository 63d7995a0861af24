"""The training loop: mesh, sharded state, AOT-compiled step, data, logging and report.json."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import jax
import numpy as np

from mecefo_jax import model, sharding, steps, train_state
from mecefo_jax.config import Config, to_dict
from mecefo_jax.data import SyntheticCorpus, global_batch

log = logging.getLogger('mecefo')


def params_sha256(params) -> str:
  """SHA-256 over every parameter's path, dtype, shape and bytes: equal iff bit-identical."""
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(params))
  for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
    arr = np.ascontiguousarray(leaf)
    h.update(f'{jax.tree_util.keystr(path)}|{arr.dtype}|{arr.shape}|'.encode())
    h.update(arr.tobytes())
  return h.hexdigest()


def param_count(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


class Trainer:
  """Builds everything once (compiled ahead of time), then runs `cfg.train.steps` steps."""

  def __init__(self, cfg: Config):
    self.cfg = cfg
    self.mesh = sharding.make_mesh(cfg.mesh)
    self.n_slices = self.mesh.shape['slice']
    m = cfg.model
    self.corpus = SyntheticCorpus(vocab_size=m.vocab_size, seq_len=m.seq_len, seed=cfg.train.seed)
    self.graphdef, _, _ = model.abstract(m)
    t0 = time.perf_counter()
    shardings = train_state.state_shardings(cfg, self.mesh)
    self.state = jax.jit(lambda: train_state.init_state(cfg), out_shardings=shardings)()
    self.normal_step = steps.compile_step(cfg, self.mesh, steps.Role(exact=cfg.train.micro_batch),
                                          self.graphdef)
    self.compile_s = time.perf_counter() - t0
    self.memory = steps.memory_summary(self.normal_step)

  def batch(self, step: int) -> jax.Array:
    tokens = global_batch(self.corpus, step, self.n_slices, self.cfg.train.micro_batch)
    return jax.device_put(tokens, sharding.batch_sharding(self.mesh))

  def describe(self) -> str:
    n = param_count(self.state.params)
    return (f'model {n / 1e6:.2f}M params | mesh {dict(self.mesh.shape)} on {jax.device_count()} '
            f'{jax.devices()[0].platform} device(s) | global batch {self.n_slices}x'
            f'{self.cfg.train.micro_batch}x{self.cfg.model.seq_len} tokens | compile '
            f'{self.compile_s:.1f}s | step memory {self.memory}')

  def run(self, out_dir: Path) -> dict:
    cfg = self.cfg
    out_dir.mkdir(parents=True, exist_ok=True)
    losses = []
    tokens_per_step = self.n_slices * cfg.train.micro_batch * cfg.model.seq_len
    t_start = time.perf_counter()
    with open(out_dir / 'metrics.jsonl', 'w') as metrics_file:
      for step in range(cfg.train.steps):
        self.state, metrics = self.normal_step(self.state, self.batch(step))
        if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1:
          row = {'step': step, **{k: float(v) for k, v in metrics.items()},
                 'wall_s': time.perf_counter() - t_start}
          losses.append((step, row['loss']))
          metrics_file.write(json.dumps(row) + '\n')
          log.info('step %d/%d loss %.4f grad_norm %.3f tok/s %.0f', step, cfg.train.steps,
                   row['loss'], row['grad_norm'], tokens_per_step * (step + 1) / row['wall_s'])
    jax.block_until_ready(self.state)
    wall_s = time.perf_counter() - t_start
    report = {
        'steps': cfg.train.steps, 'first_loss': losses[0][1], 'final_loss': losses[-1][1],
        'tokens': tokens_per_step * cfg.train.steps, 'wall_s': wall_s,
        'tokens_per_s': tokens_per_step * cfg.train.steps / wall_s, 'compile_s': self.compile_s,
        'params_sha256': params_sha256(self.state.params),
        'param_count': param_count(self.state.params),
        'entropy_floor': self.corpus.entropy_floor(), 'losses': losses,
        'mesh': dict(self.mesh.shape), 'device': jax.devices()[0].device_kind,
        'step_memory': self.memory, 'config': to_dict(cfg),
    }
    (out_dir / 'report.json').write_text(json.dumps(report, indent=2))
    return report
