"""benchmarks/requeue_pool.py: the seeds of several requeue quality files pooled into one interval,
only where the files share their settings and agree on any seed they share."""
import copy
import json

import pytest

from benchmarks import requeue_pool
from benchmarks.quality_runs import t_interval
from procs import ROOT

FILES = [ROOT / 'docs' / 'results' / f'requeue_quality_infinitehbd_tiny_pydoc_32slices_{s}.json'
         for s in ('seeds0-4', 'seeds5-9')]


@pytest.fixture(scope='module')
def files():
  return {path.name: json.loads(path.read_text()) for path in FILES}


def _increases(d):
  return d['summary']['requeue']['eval_increase_pct']['per_seed']


def test_the_seeds_of_every_file_make_one_interval(files):
  pooled = requeue_pool.pool(files)
  values = [v for d in files.values() for v in _increases(d)]
  assert pooled['seeds'] == list(range(10)) and pooled['reproduced'] == []
  assert pooled['eval_increase_pct']['ci95'] == t_interval(values)
  low, high = t_interval(values)
  assert pooled['within_bound'] == (-0.3 <= low and high <= 0.3)
  assert [s['file'] for s in pooled['sources']] == list(files)


def test_a_seed_trained_again_counts_once_and_must_agree(files):
  name, d = next(iter(files.items()))
  again = copy.deepcopy(d)
  again['seeds'], _increases(again)[:] = d['seeds'][:1], [_increases(d)[0] + 0.009]
  pooled = requeue_pool.pool({**files, 'again.json': again})
  assert len(pooled['seeds']) == 10
  assert pooled['per_seed'][str(d['seeds'][0])] == _increases(d)[0]  # the first file's value
  assert pooled['reproduced'] == [{'seed': d['seeds'][0], 'file': 'again.json',
                                   'value': _increases(d)[0] + 0.009, 'kept': _increases(d)[0]}]
  _increases(again)[0] += 0.002  # 0.011 points apart
  with pytest.raises(ValueError, match=f'seed {d["seeds"][0]} gives'):
    requeue_pool.pool({**files, 'again.json': again})


@pytest.mark.parametrize('change', [
    ('steps', 2000), ('slices', 8), ('overrides', ['optimizer.lr=1e-3']), ('mode', 'presets')])
def test_files_that_differ_in_more_than_their_seeds_are_refused(files, change):
  other = copy.deepcopy(next(iter(files.values())))
  other[change[0]] = change[1]
  with pytest.raises(ValueError, match='differ|not a --trace'):
    requeue_pool.pool({**files, 'other.json': other})
