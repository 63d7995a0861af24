"""Takeover plans (every row once, on the right slice, with the right step) and failure schedules."""
import collections
import logging
import re

import numpy as np
import pytest

from mecefo_jax.config import ConfigError
from mecefo_jax.core.failures import PRESETS, FailureSchedule
from mecefo_jax.core import takeover


def _traces(count=100, seed=0):
  """(n_slices, micro_batch, granule, live) for random failed subsets; some with no fault."""
  rng = np.random.default_rng(seed)
  for _ in range(count):
    n, b, granule = int(rng.choice([2, 4, 8])), int(rng.choice([4, 8])), int(rng.choice([1, 2]))
    failed = set(rng.choice(n, int(rng.integers(0, n)), replace=False).tolist())
    yield n, b, granule, [s for s in range(n) if s not in failed]


def _processed(work):
  """(owner, row) -> [(slice, 'exact' | 'degraded')] over every row the plan processes."""
  seen = collections.defaultdict(list)
  for s, w in work.items():
    for kind in ('exact', 'degraded'):
      for r in getattr(w, kind):
        assert 0 <= r.start < r.stop, r
        for i in range(r.start, r.stop):
          seen[r.owner, i].append((s, kind))
  return seen


def _carrier(f, live, n):
  """The next live slice after f on the ring (written out independently of takeover.ring_next)."""
  return next((f + k) % n for k in range(1, n) if (f + k) % n in live)


@pytest.mark.parametrize('policy', list(takeover.REGISTRY))
def test_every_row_processed_once_on_a_live_slice(policy):
  for n, b, granule, live in _traces():
    work, dropped = takeover.plan(live, n, b, policy, granule)
    failed = [s for s in range(n) if s not in live]
    seen = _processed(work)
    assert sorted(work) == live
    assert all(len(v) == 1 for v in seen.values()), (n, live)
    dropped_rows = {(r.owner, i) for r in dropped for i in range(r.start, r.stop)}
    assert sum(r.n for r in dropped) == len(dropped_rows)
    # requeue leaves the failed slices' rows to later steps: in a step's plan they are not taken
    # (data/order.stream_ids gives the live slices the next ids of the stream instead).
    left = policy in ('drop', 'requeue')
    expect_dropped = {(f, i) for f in failed for i in range(b)} if left else set()
    assert dropped_rows == expect_dropped
    assert set(seen) == {(o, i) for o in range(n) for i in range(b)} - expect_dropped


@pytest.mark.parametrize('policy', ['neighbor', 'naive'])
def test_orphans_go_to_next_live_slice(policy):
  for n, b, granule, live in _traces():
    work, _ = takeover.plan(live, n, b, policy, granule)
    owner_of = {s: s if s in live else _carrier(s, live, n) for s in range(n)}
    for (owner, _), [(s, _)] in _processed(work).items():
      assert s == owner_of[owner]
    for s, w in work.items():
      # neighbor: a carrier runs everything degraded, everyone else exact; naive: all exact.
      rows = b * sum(c == s for c in owner_of.values())
      carrier = rows > b
      assert w.counts() == ((0, rows) if policy == 'neighbor' and carrier else (rows, 0)), (n, live)


def test_neighbor_of_a_neighbor_carries_more_than_two():
  work, _ = takeover.plan([0, 3], 4, 4, 'neighbor')
  assert [r.owner for r in work[3].degraded] == [3, 1, 2] and not work[3].exact
  assert work[0].counts() == (4, 0)
  work, _ = takeover.plan([0], 4, 4, 'neighbor')
  assert sorted(r.owner for r in work[0].degraded) == [0, 1, 2, 3]
  work, _ = takeover.plan([1], 4, 4, 'naive')
  assert work[1].counts() == (16, 0)


def test_spread_own_rows_exact_extra_share_degraded_and_even():
  for n, b, granule, live in _traces():
    work, _ = takeover.plan(live, n, b, 'spread', granule)
    per_orphan = collections.defaultdict(collections.Counter)
    for (owner, _), [(s, kind)] in _processed(work).items():
      assert kind == ('exact' if owner == s else 'degraded')
      if owner != s:
        per_orphan[owner][s] += 1
    for owner, shares in per_orphan.items():
      counts = [shares[s] for s in live]
      assert all(c % granule == 0 for c in counts) and max(counts) - min(counts) <= granule
    extra = [work[s].counts()[1] for s in live]
    assert max(extra) - min(extra) <= granule, (n, b, granule, live, extra)


def test_adjacent_failures_spread_evenly():
  # Two adjacent failures: remainders must not pile up on the same slices (8 rows over 6).
  work, _ = takeover.plan([2, 3, 4, 5, 6, 7], 8, 4, 'spread', granule=2)
  assert sorted(w.counts()[1] for w in work.values()) == [0, 0, 2, 2, 2, 2]


def test_plan_rejects_bad_degraded_cost():
  for bad in (0.0, 1.0, -0.5):
    with pytest.raises(ValueError, match=r"'faults.degraded_cost' must be in \(0, 1\)"):
      takeover.plan([0], 2, 4, 'budget', degraded_cost=bad)


@pytest.mark.parametrize('policy', list(takeover.REGISTRY))
def test_no_fault_every_slice_its_own_rows_exact(policy):
  for n in (2, 4, 8):
    work, dropped = takeover.plan(range(n), n, 8, policy, 2)
    assert not dropped
    assert {s: (w.exact, w.degraded) for s, w in work.items()} == {
        s: ([takeover.Rows(s, 0, 8)], []) for s in range(n)}


def test_plan_rejects_bad_arguments():
  with pytest.raises(ValueError, match='granule 3 must divide'):
    takeover.plan([0], 2, 4, 'spread', 3)
  with pytest.raises(ValueError, match='takeover policy must be one of'):
    takeover.plan([0], 2, 4, 'steal')
  with pytest.raises(ValueError, match='no live slice'):
    takeover.plan([], 2, 4, 'neighbor')


# --- failure schedules -----------------------------------------------------------------------

def test_api_events_repairs_first_and_bounds_checked():
  sched = FailureSchedule(4).fail_at(1, 5).repair_at(2, 5).fail_at(2, 5).repair_at(1, 9)
  assert [(e.slice, e.kind) for e in sched.events_at(5)] == [(2, 'repair'), (1, 'fail'), (2, 'fail')]
  assert [e.step for e in sched.all_events()] == [5, 5, 5, 9] and sched.events_at(6) == []
  with pytest.raises(ConfigError, match=r'slice 4 out of range \[0, 4\)'):
    sched.fail_at(4, 1)
  with pytest.raises(ConfigError, match='step must be >= 0'):
    sched.repair_at(0, -1)


def _replay(sched):
  """Applies events step by step, checking fails hit live slices and repairs failed ones.

  Returns (steps from each fail to its repair, fail steps of slices never repaired).
  """
  fail_step, durations = {}, []
  for step in sorted({e.step for e in sched.all_events()}):
    for e in sched.events_at(step):
      if e.kind == 'fail':
        assert e.slice not in fail_step, e
        fail_step[e.slice] = e.step
      else:
        assert e.slice in fail_step, e
        durations.append(e.step - fail_step.pop(e.slice))
  return durations, list(fail_step.values())


@pytest.mark.parametrize('name', PRESETS)
def test_presets_seeded_live_victims_fixed_repair(name):
  make = lambda seed: FailureSchedule.preset(name, 4, 3000, cluster_step_s=60.0, seed=seed)
  sched = make(0)
  assert sched.all_events() == make(0).all_events() != make(1).all_events()
  assert {e.source for e in sched.all_events()} == {f'preset:{name}'}
  repair_steps = PRESETS[name][1] * 3600 / 60.0
  durations, unrepaired = _replay(sched)
  assert len(durations) > 5
  assert all(abs(d - repair_steps) <= 1 for d in durations), (repair_steps, durations)
  # Only repairs past the horizon are left out.
  assert all(step + repair_steps >= 3000 - 1 for step in unrepaired), unrepaired


@pytest.mark.parametrize('name', PRESETS)
def test_preset_mean_interarrival(name):
  # Many slices, so a failure almost never finds every slice down (and is skipped).
  sched = FailureSchedule.preset(name, 64, 200_000, cluster_step_s=60.0, seed=3)
  fails = [e.step for e in sched.all_events() if e.kind == 'fail']
  mean_h = (fails[-1] - fails[0]) / (len(fails) - 1) * 60.0 / 3600
  assert len(fails) > 1000 and mean_h == pytest.approx(PRESETS[name][0], rel=0.1)


@pytest.mark.parametrize('n', [4, 8, 64])
def test_per_device_rate_keeps_the_papers_down_fraction(n):
  """per_device: the interval scales with 32 / n, so the mean fraction of slices down is the
  same at any size (and all of them down is rare); cluster: n/32 times that."""
  fraction = lambda rate: np.mean([len(f) / n for f in FailureSchedule.from_spec(
      'high', n, 20_000, 60.0, 0, rate).failed_sets(20_000)])
  per_device = fraction('per_device')
  # high: one failure per 0.5 h per 32 devices, repaired in 2 h: about 2 / 0.5 / 32 = 1/8 down.
  assert per_device == pytest.approx(0.125, rel=0.3)
  if n == 4:
    assert fraction('cluster') > 0.5  # the old reading: most of a small cluster down
  assert FailureSchedule.from_spec('high', n, 100, 60.0, 0, 'per_device').all_events() == \
      FailureSchedule.preset('high', n, 100, 60.0, 0, interval_scale=32 / n).all_events()


def test_a_repair_within_its_failures_step_lands_on_the_next_step():
  # 3 h per step > high's 2 h repair: every failure and its repair fall in one step; one
  # failure per 4 h (interval x8), so each costs its slice one step and then it is back.
  sched = FailureSchedule.preset('high', 4, 400, 3 * 3600.0, seed=0, interval_scale=8.0)
  fails = [e for e in sched.all_events() if e.kind == 'fail']
  repairs = {(e.slice, e.step) for e in sched.all_events() if e.kind == 'repair'}
  assert len(fails) > 100
  assert all((e.slice, e.step + 1) in repairs for e in fails[:-1]), fails[:8]
  slice_steps_down = sum(len(f) for f in sched.failed_sets(400))
  assert slice_steps_down <= len(fails)  # never longer than its one step


def test_preset_unknown_name():
  with pytest.raises(ConfigError, match='failure preset must be one of low, mid, high'):
    FailureSchedule.preset('extreme', 4, 10, 60.0)


def test_trace_file_with_comments(tmp_path):
  path = tmp_path / 'trace.txt'
  path.write_text('# step slice kind\n\n3 1 fail   # a comment\n  7 1 repair\n3 2 fail\n')
  sched = FailureSchedule.from_trace(path, 4)
  assert [(e.step, e.slice, e.kind) for e in sched.all_events()] == [
      (3, 1, 'fail'), (3, 2, 'fail'), (7, 1, 'repair')]
  assert {e.source for e in sched.all_events()} == {'trace:trace.txt'}
  assert FailureSchedule.from_spec(f'trace:{path}', 4, 10, 60.0, 0).all_events() == sched.all_events()
  assert FailureSchedule.from_spec('none', 4, 10, 60.0, 0).all_events() == []


def test_trace_warns_of_a_fail_of_a_failed_slice_and_a_repair_of_a_live_one(tmp_path, caplog):
  path = tmp_path / 'trace.txt'
  path.write_text('3 1 fail\n5 1 fail\n5 2 repair\n7 1 repair\n7 1 fail\n')
  with caplog.at_level(logging.WARNING, logger='mecefo'):
    sched = FailureSchedule.from_trace(path, 4)
  assert caplog.messages == [
      f'failure trace {path}: step 5: repair of slice 2, which is live: ignored',
      f'failure trace {path}: step 5: fail of slice 1, which is already down: ignored']
  assert list(sched.failed_sets(8))[-1] == {1}  # step 7: repaired, then failed again
  caplog.clear()
  path.write_text('3 1 fail\n7 1 repair\n')
  with caplog.at_level(logging.WARNING, logger='mecefo'):
    FailureSchedule.from_trace(path, 4)
  assert caplog.messages == []


@pytest.mark.parametrize('bad', ['3 1 explode', '3 1', '-3 1 fail', 'x 1 fail', '3 1 fail extra'])
def test_trace_bad_line_names_file_and_line(tmp_path, bad):
  path = tmp_path / 'trace.txt'
  path.write_text(f'# header\n1 0 fail\n{bad}\n')
  with pytest.raises(ConfigError, match=re.escape(f'{path}:3: expected')):
    FailureSchedule.from_trace(path, 4)


def test_trace_slice_out_of_range_and_missing_file(tmp_path):
  path = tmp_path / 'trace.txt'
  path.write_text('1 4 fail\n')
  with pytest.raises(ConfigError, match='slice 4 out of range'):
    FailureSchedule.from_trace(path, 4)
  with pytest.raises(ConfigError, match='not found'):
    FailureSchedule.from_trace(tmp_path / 'nope.txt', 4)
