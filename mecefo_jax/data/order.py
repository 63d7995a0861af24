"""Sample ids: which samples every slice's micro-batch holds at every step.

Slice s owns the contiguous block [s*B, (s+1)*B) of step t's ids, a pure function of
(step, n_slices, micro_batch): any slice can take over another's micro-batch and a resumed
run continues exactly. Under takeover `requeue` the ids follow the samples trained instead
(`stream_ids`): the live slices hold the next ones of the stream. Train, eval and
floor-estimate ids come from disjoint ranges.
"""
from __future__ import annotations

import numpy as np

EVAL_BASE = 1 << 62   # eval ids live in [2^62, 2^63), train ids in [0, 2^62): disjoint ranges
_SPLITS = {'train': 0, 'eval': EVAL_BASE}


def check_int(name: str, value, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f'{name} must be an integer >= {minimum}, got {value!r}')


def check_sample_ids(sample_ids) -> np.ndarray:
  """The ids as a 1-D integer array, or ValueError."""
  ids = np.asarray(sample_ids)
  if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f'sample_ids must be a 1-D integer array, got {ids.dtype} {ids.shape}')
  if ids.size and np.issubdtype(ids.dtype, np.signedinteger) and ids.min() < 0:
    raise ValueError('sample_ids must be >= 0')
  return ids


def sample_ids(step: int, n_slices: int, micro_batch: int, split: str = 'train') -> np.ndarray:
  """int64 [n_slices, micro_batch]: global sample ids of every slice's micro-batch at `step`.

  'eval' ids come from a disjoint range. Slice s owns the contiguous block [s*B, (s+1)*B) of the
  step's ids, so they do not depend on which slice processes them.
  """
  check_int('step', step, 0)
  check_int('n_slices', n_slices, 1)
  check_int('micro_batch', micro_batch, 1)
  if split not in _SPLITS:
    raise ValueError(f'split must be one of {sorted(_SPLITS)}, got {split!r}')
  per_step = n_slices * micro_batch
  if (step + 1) * per_step > EVAL_BASE:
    raise ValueError(f'step {step} * batch {per_step} overflows the {split} id range')
  ids = _SPLITS[split] + step * per_step + np.arange(per_step, dtype=np.int64)
  return ids.reshape(n_slices, micro_batch)


def stream_ids(first: int, live, n_slices: int, micro_batch: int) -> np.ndarray:
  """int64 [n_slices, micro_batch]: the ids of a step that trains the stream from sample `first`
  (takeover `requeue`): the k-th live slice holds [first + k*B, first + (k+1)*B), a failed
  slice's row is -1 (it trains nothing; its samples come in the steps after)."""
  check_int('first', first, 0)
  check_int('micro_batch', micro_batch, 1)
  ids_SxB = np.full((n_slices, micro_batch), -1, np.int64)
  for k, s in enumerate(sorted(live)):
    ids_SxB[s] = first + k * micro_batch + np.arange(micro_batch, dtype=np.int64)
  if ids_SxB.max() >= EVAL_BASE:
    raise ValueError(f'sample {int(ids_SxB.max())} overflows the train id range')
  return ids_SxB


def global_batch(corpus, step: int, n_slices: int, micro_batch: int,
                 split: str = 'train') -> np.ndarray:
  """int32 [n_slices, micro_batch, seq_len + 1] tokens for the whole step."""
  ids_SxB = sample_ids(step, n_slices, micro_batch, split)
  return corpus.sequences(ids_SxB.reshape(-1)).reshape(n_slices, micro_batch, corpus.seq_len + 1)
