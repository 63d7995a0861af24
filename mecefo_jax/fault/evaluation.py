"""Held-out loss on fixed rows: the same rows whichever slices are live (docs/algorithm.md §5)."""
from __future__ import annotations

import numpy as np

from mecefo_jax import multihost, sharding
from mecefo_jax.data import order


def held_out_loss(controller, n_batches: int) -> float:
  """Mean token loss over `n_batches` global batches of held-out ids (disjoint from training)
  of all the run's slices, computed on the slices that hold the state now."""
  live, b = controller.state_slices, controller.micro_batch
  mesh = controller.submesh(live)
  program = controller.evaluator(live)
  ids = np.concatenate([order.sample_ids(i, controller.n_slices, b, 'eval').ravel()
                        for i in range(n_batches)])
  per_call, loss_sum, tokens = len(live) * b, 0.0, 0.0
  for start in range(0, len(ids), per_call):
    chunk = ids[start:start + per_call]
    out = None
    if multihost.is_local(mesh):  # each process reads the rows of its own slices only
      batch = multihost.put_batch(
          lambda ss, chunk=chunk: np.stack([_rows(controller.corpus, chunk[i * b:(i + 1) * b], b)
                                            for i in ss]),
          (len(live), b, controller.corpus.seq_len + 1), sharding.batch_sharding(mesh))
      out = program(controller.state.params, batch)
    values = multihost.fetch(out, mesh, keys=('loss_sum', 'tokens'))
    loss_sum, tokens = loss_sum + values['loss_sum'], tokens + values['tokens']
  return loss_sum / tokens


def _rows(corpus, ids: np.ndarray, b: int) -> np.ndarray:
  """The rows of `ids`, then rows of -1 up to `b` (padding, which counts for nothing)."""
  rows = corpus.sequences(ids)
  return np.concatenate([rows, np.full((b - len(ids), rows.shape[1]), -1, rows.dtype)])
