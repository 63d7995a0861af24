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
    rows = controller.corpus.sequences(chunk)
    rows = np.concatenate([rows, np.full((per_call - len(chunk), rows.shape[1]), -1, rows.dtype)])
    rows_SxBxL1 = rows.reshape(len(live), b, -1)  # padding rows (-1) count for nothing
    out = None
    if multihost.is_local(mesh):
      batch = multihost.put_batch(rows_SxBxL1.__getitem__, rows_SxBxL1.shape,
                                  sharding.batch_sharding(mesh))
      out = program(controller.state.params, batch)
    values = multihost.fetch(out, mesh, keys=('loss_sum', 'tokens'))
    loss_sum, tokens = loss_sum + values['loss_sum'], tokens + values['tokens']
  return loss_sum / tokens
