"""Synthetic corpus: determinism per (seed, id), slice ownership of samples, entropy floor."""
import math
import time

import numpy as np
import pytest

from mecefo_jax.data import philox
from mecefo_jax.data.order import global_batch, sample_ids
from mecefo_jax.data.synthetic import SyntheticCorpus


@pytest.fixture(scope='module')
def corpus():
  return SyntheticCorpus(vocab_size=256, seq_len=64, seed=0)


def test_same_seed_and_ids_give_identical_rows(corpus):
  ids = np.arange(100, 132)
  again = SyntheticCorpus(vocab_size=256, seq_len=64, seed=0).sequences(ids)
  np.testing.assert_array_equal(corpus.sequences(ids), again)


def test_shape_dtype_and_range(corpus):
  tokens_NxL1 = corpus.sequences(np.arange(64))
  assert tokens_NxL1.shape == (64, 65) and tokens_NxL1.dtype == np.int32
  assert tokens_NxL1.min() >= 0 and tokens_NxL1.max() < 256


def test_different_ids_and_seeds_give_different_rows(corpus):
  # High ids too: eval ids sit at 2**62 and the floor's at 2**63, where sloppy keys collide.
  for base in (0, 1 << 62, 1 << 63):
    ids = np.uint64(base) + np.arange(16, dtype=np.uint64)
    rows = corpus.sequences(ids)
    assert len({r.tobytes() for r in rows}) == 16, base
  other = SyntheticCorpus(vocab_size=256, seq_len=64, seed=1).sequences(np.arange(16))
  assert all((a != b).any() for a, b in zip(corpus.sequences(np.arange(16)), other))


def test_row_does_not_depend_on_batch_company_or_order(corpus):
  ids = np.arange(1000, 1024)
  rows = corpus.sequences(ids)
  perm = np.random.default_rng(0).permutation(len(ids))
  np.testing.assert_array_equal(corpus.sequences(ids[perm]), rows[perm])
  np.testing.assert_array_equal(corpus.sequences(ids[5:6])[0], rows[5])
  mixed = corpus.sequences(np.array([7, 1003, 99999]))
  np.testing.assert_array_equal(mixed[1], rows[3])


def test_global_batch_is_the_slices_samples(corpus):
  n_slices, micro_batch = 4, 3
  for step in (0, 1, 57):
    batch_SxBxL1 = global_batch(corpus, step, n_slices, micro_batch)
    assert batch_SxBxL1.shape == (n_slices, micro_batch, 65) and batch_SxBxL1.dtype == np.int32
    ids_SxB = sample_ids(step, n_slices, micro_batch)
    for s in range(n_slices):  # a takeover recomputes exactly the failed slice's rows
      np.testing.assert_array_equal(batch_SxBxL1[s], corpus.sequences(ids_SxB[s]))
  assert (global_batch(corpus, 1, 4, 3) != global_batch(corpus, 2, 4, 3)).any()


def test_sample_ids_unique_and_train_eval_disjoint():
  n_slices, micro_batch, steps = 4, 8, 2000
  ids = {split: np.stack([sample_ids(t, n_slices, micro_batch, split) for t in range(steps)])
         for split in ('train', 'eval')}
  for split, ids_TxSxB in ids.items():
    assert ids_TxSxB.dtype == np.int64 and ids_TxSxB.shape == (steps, n_slices, micro_batch)
    assert len(np.unique(ids_TxSxB)) == ids_TxSxB.size, split
  assert not np.intersect1d(ids['train'], ids['eval']).size


def test_entropy_floor_bounds_and_describe(corpus):
  floor = corpus.entropy_floor()
  assert 0.1 < floor < 0.5 * math.log(256)
  assert floor == SyntheticCorpus(vocab_size=256, seq_len=64, seed=0).entropy_floor()
  line = corpus.describe()
  assert '\n' not in line and f'{floor:.4f}' in line and '4096' in line


def test_true_cross_entropy_on_fresh_samples_matches_floor(corpus):
  logp_NxL = corpus.log_probs(corpus.sequences(np.arange(5000, 7048)))
  assert np.isfinite(logp_NxL).all()  # the generator never leaves the documented support
  per_seq_N = -logp_NxL.mean(axis=1)
  stderr = per_seq_N.std(ddof=1) / math.sqrt(len(per_seq_N))
  _, floor_stderr = corpus._floor_stats()
  gap = abs(per_seq_N.mean() - corpus.entropy_floor())
  assert gap < 4 * math.hypot(stderr, floor_stderr) and gap < 0.03


def test_bigram_entropy_is_well_above_floor(corpus):
  tokens_NxL1 = corpus.sequences(np.arange(20000, 22048))
  prev, nxt = tokens_NxL1[:, :-1].ravel(), tokens_NxL1[:, 1:].ravel()
  counts_VxV = np.zeros((256, 256))
  np.add.at(counts_VxV, (prev, nxt), 1)
  cond_VxV = counts_VxV / np.maximum(counts_VxV.sum(axis=1, keepdims=True), 1)
  bigram = -(counts_VxV * np.log(np.where(cond_VxV > 0, cond_VxV, 1))).sum() / counts_VxV.sum()
  # Copies carry information a bigram model cannot see; 2048x64 counts bias this estimate < 0.01.
  assert bigram > corpus.entropy_floor() + 0.2


def test_log_probs_of_impossible_transition_is_minus_inf(corpus):
  tokens_NxL1 = corpus.sequences(np.arange(1))
  nxt = tokens_NxL1[0, 1]
  tokens_NxL1[0, 1] = next(a for a in range(256) if a not in corpus.succ_VxK[tokens_NxL1[0, 0]])
  assert corpus.log_probs(tokens_NxL1)[0, 0] == -np.inf and nxt != tokens_NxL1[0, 1]


@pytest.mark.parametrize('n', [1, 4, 5, 33, 129])
def test_rows_draw_numpys_philox_stream_keyed_by_seed_and_id(n):
  """data/philox.py runs every row's Philox at once: each row is still the stream of numpy's
  Generator(Philox(key=(seed, id))), to the bit (a seed or id past 2**63, a partial block)."""
  seeds = np.array([0, 1, 7, (1 << 63) + 5, (1 << 64) - 1], np.uint64)
  ids = np.array([0, 3, 4, 9, 1 << 62, (1 << 63) + 11, (1 << 64) - 2, (1 << 64) - 1], np.uint64)
  keys_Nx2 = np.stack(np.meshgrid(seeds, ids, indexing='ij'), axis=-1).reshape(-1, 2)
  want = np.stack([np.random.Generator(np.random.Philox(key=key)).random(n) for key in keys_Nx2])
  assert len(keys_Nx2) >= philox._FEW  # all rows through the rounds; a few, one by one
  np.testing.assert_array_equal(philox.uniforms(keys_Nx2, n), want)
  np.testing.assert_array_equal(philox.uniforms(keys_Nx2[:3], n), want[:3])
  corpus = SyntheticCorpus(vocab_size=256, seq_len=max(2, (n - 1) // 2), seed=7)
  np.testing.assert_array_equal(corpus._uniforms(ids)[:, :n], want[16:24])


def test_generation_is_vectorised_over_rows():
  """64 rows of 256 tokens: ~4 ms of this process's CPU time here, bounded at 25x that. CPU
  time, not wall time, so that other work on a shared machine cannot fail it."""
  corpus = SyntheticCorpus(vocab_size=256, seq_len=256, seed=0)
  ids = np.arange(64)
  best = min(_cpu_seconds(corpus.sequences, ids + 64 * i) for i in range(3))
  assert best < 0.1, best


def _cpu_seconds(fn, *args):
  start = time.process_time()
  fn(*args)
  return time.process_time() - start


@pytest.mark.parametrize('kwargs, name', [
    ({'vocab_size': 7}, 'vocab_size'), ({'vocab_size': 256.0}, 'vocab_size'),
    ({'seq_len': 1}, 'seq_len'), ({'seed': -1}, 'seed'), ({'seed': 1 << 64}, 'seed'),
    ({'n_successors': 0}, 'n_successors'), ({'n_successors': 17}, 'n_successors'),
    ({'successor_window': -1}, 'successor_window'), ({'dirichlet_alpha': 0.0}, 'dirichlet_alpha'),
    ({'p_copy': 1.0}, 'p_copy'), ({'p_copy': -0.1}, 'p_copy'),
    ({'n_floor_samples': 1}, 'n_floor_samples'),
])
def test_bad_corpus_args_raise(kwargs, name):
  with pytest.raises(ValueError, match=name):
    SyntheticCorpus(**kwargs)


@pytest.mark.parametrize('args, name', [
    ((-1, 2, 2), 'step'), ((0, 0, 2), 'n_slices'), ((0, 2, 0), 'micro_batch'),
    ((0, 2, 2, 'test'), 'split'), ((1 << 61, 2, 2), 'step'),
])
def test_bad_sample_ids_args_raise(args, name):
  with pytest.raises(ValueError, match=name):
    sample_ids(*args)


def test_bad_tokens_or_ids_raise(corpus):
  with pytest.raises(ValueError, match='sample_ids'):
    corpus.sequences(np.array([-1, 2]))
  with pytest.raises(ValueError, match='sample_ids'):
    corpus.sequences(np.zeros((2, 2), np.int64))
  with pytest.raises(ValueError, match='tokens'):
    corpus.log_probs(np.zeros((2, 10), np.int32))
  with pytest.raises(ValueError, match='tokens'):
    corpus.log_probs(np.full((1, 65), 256))


def test_stream_ids_give_the_live_slices_the_next_samples_in_slice_order():
  from mecefo_jax.data.order import stream_ids
  assert stream_ids(10, (0, 2), 3, 2).tolist() == [[10, 11], [-1, -1], [12, 13]]
  with pytest.raises(ValueError, match='first must be an integer >= 0'):
    stream_ids(-1, (0,), 1, 2)
