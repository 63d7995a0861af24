"""Seeded synthetic corpus (sparse Markov chain + induction copies) and step-indexed sample ids.

Generator. Tables built once from `seed`: every token `a` has `n_successors` distinct successors
`succ[a]`, drawn within `successor_window` of `a` on the token ring (so walks revisit tokens and
copies fire often; 0 = anywhere), with Dirichlet(`dirichlet_alpha`) probabilities `P[a]`. A
sequence starts with a uniform token; then, with `c` the current token, if `c` occurred earlier in
the sequence the next token is, with probability `p_copy`, the token that followed its most recent
earlier occurrence (an induction copy, which needs attention to find); otherwise it is drawn from
`P[c]`. A copied token always follows `c` somewhere, so by induction it is in `succ[c]`: the
conditional law of every position is the exact mixture `(1 - p_copy * has_prev) * P[c] + p_copy *
has_prev * onehot(target)`, whose entropy is computed in closed form. `entropy_floor` averages
these exact per-position entropies over a fixed seeded sample of sequences (the only estimate is
that Monte-Carlo average over contexts; its standard error is reported by `describe`).

Determinism. Row `i` of `sequences(ids)` uses only a Philox stream keyed by `(seed, ids[i])`, so a
sample is a pure function of `(seed, id)`; `sample_ids` makes the ids of `(step, slice)` a pure
function of `(step, n_slices, micro_batch)`, so any slice can take over another's micro-batch and a
resumed run continues exactly.
"""
from __future__ import annotations

import math

import numpy as np

from mecefo_jax.data import philox
from mecefo_jax.data.order import check_int, check_sample_ids

_FLOOR_BASE = 1 << 63  # floor-estimate rows use [2^63, 2^64), never seen in training or eval
_FLOOR_CHUNK = 512     # rows per floor rollout: bounds the [rows, vocab] follower table


def _entr(p: np.ndarray) -> np.ndarray:
  """Elementwise -p log p with 0 log 0 = 0 (Dirichlet draws can underflow to exact zeros)."""
  return -p * np.log(np.where(p > 0, p, 1.0))


class SyntheticCorpus:
  """Built-in corpus with learnable structure and a known entropy floor; no download."""
  has_eval = True  # held-out rows are drawn from the same process, any number of them

  def __init__(self, vocab_size: int = 256, seq_len: int = 64, seed: int = 0,
               n_successors: int = 6, successor_window: int = 8, dirichlet_alpha: float = 0.5,
               p_copy: float = 0.7, n_floor_samples: int = 4096):
    check_int('vocab_size', vocab_size, 8)
    check_int('seq_len', seq_len, 2)
    check_int('seed', seed, 0)
    check_int('n_successors', n_successors, 1)
    check_int('successor_window', successor_window, 0)
    check_int('n_floor_samples', n_floor_samples, 2)
    # Offsets must stay distinct mod V, so the window is clamped to the ring; 0 means anywhere.
    window = min(successor_window, (vocab_size - 1) // 2)
    span = 2 * window if window else vocab_size
    if n_successors > span:
      raise ValueError(f'n_successors must be <= {span} (2 * successor_window, or vocab_size if '
                       f'the window is 0), got {n_successors}')
    if seed >= 1 << 64:
      raise ValueError(f'seed must be < 2**64, got {seed}')
    if not dirichlet_alpha > 0:
      raise ValueError(f'dirichlet_alpha must be > 0, got {dirichlet_alpha}')
    if not 0.0 <= p_copy < 1.0:
      raise ValueError(f'p_copy must be in [0, 1), got {p_copy}')
    self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
    self.n_successors, self.successor_window = n_successors, window
    self.dirichlet_alpha, self.p_copy = dirichlet_alpha, p_copy
    self.n_floor_samples = n_floor_samples
    # A separate SeedSequence stream for the tables; rows use Philox keyed by (seed, id).
    rng = np.random.default_rng([seed, 0x7AB1E5])
    v, k = vocab_size, n_successors
    # K distinct values in [0, span) per token, vectorised: sorted draws in [0, span-K] + arange(K).
    pick_VxK = np.sort(rng.integers(0, span - k + 1, (v, k)), axis=1) + np.arange(k)
    if window:  # successors within +-window on the token ring (no self-loops): walks revisit tokens
      offset_VxK = np.where(pick_VxK < window, pick_VxK - window, pick_VxK - window + 1)
      pick_VxK = np.arange(v)[:, None] + offset_VxK
    self.succ_VxK = (pick_VxK % v).astype(np.int32)
    self.probs_VxK = rng.dirichlet(np.full(k, dirichlet_alpha), size=v)
    self.cum_VxK = np.cumsum(self.probs_VxK, axis=1)
    self.cum_VxK[:, -1] = 1.0  # rounding must never leave u in [cum[-1], 1) unassigned
    self._floor: tuple[float, float] | None = None

  def sequences(self, sample_ids: np.ndarray) -> np.ndarray:
    """int32 [len(ids), seq_len + 1]; row i is a pure function of (seed, sample_ids[i])."""
    return self._rollout(self._uniforms(sample_ids))[0]

  def log_probs(self, tokens_NxL1: np.ndarray) -> np.ndarray:
    """float64 [N, seq_len]: true log p(x_t | x_<t) for t = 1..seq_len (-inf where impossible)."""
    tokens_NxL1 = np.asarray(tokens_NxL1)
    if tokens_NxL1.ndim != 2 or tokens_NxL1.shape[1] != self.seq_len + 1:
      raise ValueError(f'tokens must have shape [N, {self.seq_len + 1}], got {tokens_NxL1.shape}')
    if tokens_NxL1.size and (tokens_NxL1.min() < 0 or tokens_NxL1.max() >= self.vocab_size):
      raise ValueError(f'tokens must be in [0, {self.vocab_size})')
    return self._rollout(None, tokens_NxL1.astype(np.int32), score=True)[1]

  def entropy_floor(self) -> float:
    """Nats/token: Bayes-optimal expected next-token cross-entropy over positions 1..seq_len."""
    return self._floor_stats()[0]

  def describe(self) -> str:
    mean, stderr = self._floor_stats()
    where = f'within +-{self.successor_window}' if self.successor_window else 'anywhere'
    return (f'synthetic corpus: sparse Markov (V={self.vocab_size}, {self.n_successors} successors '
            f'{where}, Dirichlet {self.dirichlet_alpha:g}) + induction copy p={self.p_copy:g}, '
            f'seq_len={self.seq_len}, seed={self.seed}; entropy floor {mean:.4f} +- {stderr:.4f} '
            f'nats/token (exact per-position entropies averaged over {self.n_floor_samples} '
            f'seeded sequences; uniform = {math.log(self.vocab_size):.4f})')

  def _floor_stats(self) -> tuple[float, float]:
    if self._floor is None:
      ids = np.uint64(_FLOOR_BASE) + np.arange(self.n_floor_samples, dtype=np.uint64)
      # Mean per sequence first: sequences are i.i.d., positions within one are not.
      per_seq_N = np.concatenate([
          self._rollout(self._uniforms(ids[i:i + _FLOOR_CHUNK]), score=True)[2].mean(axis=1)
          for i in range(0, len(ids), _FLOOR_CHUNK)])
      stderr = per_seq_N.std(ddof=1) / math.sqrt(len(per_seq_N))
      self._floor = (float(per_seq_N.mean()), float(stderr))
    return self._floor

  def _uniforms(self, sample_ids: np.ndarray) -> np.ndarray:
    """float64 [N, 2 * seq_len + 1] from one Philox stream per row, keyed by (seed, id)."""
    ids = check_sample_ids(sample_ids)
    # Explicit uint64 keys: a list holding ints >= 2**63 would go through float64 and collide.
    keys_Nx2 = np.stack([np.full(len(ids), self.seed, np.uint64), ids.astype(np.uint64)], axis=1)
    return philox.uniforms(keys_Nx2, 2 * self.seq_len + 1)  # numpy's Philox, all rows at once

  def _rollout(self, u_NxU: np.ndarray | None, tokens_NxL1: np.ndarray | None = None,
               score: bool = False):
    """Sample (u given) or teacher-force (tokens given); optionally score each position.

    Returns (tokens [N, L+1] int32, log p of each token [N, L], entropy of each position [N, L]).
    """
    sampling = tokens_NxL1 is None
    n, length = (len(u_NxU) if sampling else len(tokens_NxL1)), self.seq_len
    rows = np.arange(n)
    if sampling:
      tokens_NxL1 = np.empty((n, length + 1), np.int32)
      tokens_NxL1[:, 0] = np.minimum((u_NxU[:, 0] * self.vocab_size).astype(np.int32),
                                     self.vocab_size - 1)
    # follower[r, a]: token that followed the latest earlier occurrence of a in row r (-1: none).
    follower_NxV = np.full((n, self.vocab_size), -1, np.int32)
    logp_NxL = np.zeros((n, length)) if score else None
    ent_NxL = np.zeros((n, length)) if score else None
    for t in range(1, length + 1):
      cur_N = tokens_NxL1[:, t - 1]
      tgt_N = follower_NxV[rows, cur_N]
      has_N = tgt_N >= 0
      if sampling:
        copy_N = has_N & (u_NxU[:, 2 * t - 1] < self.p_copy)
        slot_N = (self.cum_VxK[cur_N] <= u_NxU[:, 2 * t, None]).sum(axis=1)  # < K: cum[-1] = 1
        tokens_NxL1[:, t] = np.where(copy_N, tgt_N, self.succ_VxK[cur_N, slot_N])
      nxt_N = tokens_NxL1[:, t]
      follower_NxV[rows, cur_N] = nxt_N
      if score:
        w_N = self.p_copy * has_N
        succ_NxK = self.succ_VxK[cur_N]
        # Mixture law on succ[cur] (+ target, which lies in succ[cur] for any sampled sequence).
        probs_NxK = self.probs_VxK[cur_N]
        q_NxK = (1.0 - w_N)[:, None] * probs_NxK + w_N[:, None] * (succ_NxK == tgt_N[:, None])
        ent_NxL[:, t - 1] = _entr(q_NxK).sum(axis=1)
        p_N = ((1.0 - w_N) * (probs_NxK * (succ_NxK == nxt_N[:, None])).sum(axis=1)
               + w_N * (nxt_N == tgt_N))
        with np.errstate(divide='ignore'):
          logp_NxL[:, t - 1] = np.log(p_N)
    return tokens_NxL1, logp_NxL, ent_NxL
