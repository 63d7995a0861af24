"""Failure replay simulation: failure process, roles per live set, cost model, time accounting."""
import numpy as np
import pytest

from benchmarks import quality, simulate
from benchmarks.simulate import CHECKPOINT, ClusterCosts, Event, PolicyModel, replay
from mecefo_jax.fault.failures import FailureSchedule
from mecefo_jax.plan.roles import Role
from mecefo_jax.plan.takeover import Planner

N, B = 4, 8


def _costs(**kw):
  group = {Role(B): 1.0, Role(2 * B): 2.0, Role(0, 2 * B): 1.5, Role(0, 3 * B, 2): 2.5}
  base = dict(normal_s=1.0, update_s=0.0, group_s=group, group_compile_s=dict.fromkeys(group, 10.0),
              fused_compile_s=5.0, update_compile_s=1.0)
  return ClusterCosts(**{**base, **kw})


def _model(policy, costs=None):
  costs = costs or _costs()
  planner = Planner(N, B, policy)
  costs.complete(simulate.needed_roles([planner] if policy != CHECKPOINT else []))
  return PolicyModel(planner, costs)


def test_fault_free_replay_loses_nothing():
  t = replay([], N, 1000.0, _model('neighbor'))
  assert t.samples == pytest.approx(1000.0 * N * B) and t.steps == 1000
  assert t.failed_s == 0 and t.live_slice_s == pytest.approx(N * 1000.0)


def test_drop_loses_the_failed_slices_rows():
  t = replay([Event(0.0, 1, 'fail')], N, 1000.0, _model('drop'))
  # The fused program of the new live set compiles first (5 s), then 995 steps of N-1 slices.
  assert t.samples == pytest.approx(995.0 * (N - 1) * B)
  assert t.compile_s == 5.0 and t.failed_s == pytest.approx(1000.0)


def test_neighbor_step_is_the_slowest_carrier_and_compiles_once_per_live_set():
  events = [Event(0.0, 1, 'fail'), Event(100.0, 1, 'repair'), Event(200.0, 1, 'fail')]
  costs = _costs(rejoin_s=3.0)
  t = replay(events, N, 1000.0, _model('neighbor', costs))
  # live (0,2,3): groups Role(B) + Role(0,2B) compiled once (20 s) + update (1 s).
  assert t.compile_s == 21.0 and t.rejoin_s == 3.0
  model = _model('neighbor', costs)
  assert model.step((0, 2, 3)) == (1.5, N * B)
  assert model.step((0, 3)) == (2.5, N * B)


def test_all_slices_down_is_lost_time():
  events = [Event(10.0, s, 'fail') for s in range(N)] + [Event(60.0, 0, 'repair')]
  t = replay(events, N, 1000.0, _model('spread'))
  assert t.all_down_s == pytest.approx(50.0)
  assert t.samples < (1000.0 - 50.0) * N * B


def test_checkpoint_restart_rewinds_to_the_last_checkpoint():
  costs = _costs(restore_s=2.0)
  t = replay([Event(130.0, 0, 'fail'), Event(500.0, 0, 'repair')], N, 1000.0,
             _model(CHECKPOINT, costs), checkpoint_every=50)
  # 130 steps run, 30 since the checkpoint at 100 are lost; restart = restore 2 + compile 5;
  # a spare replaces slice 0, so 863 full-speed steps follow; the repair restarts nothing.
  assert t.lost_steps == 30 and t.restarts == 1 and t.rejoin_s == 2.0 and t.compile_s == 5.0
  assert t.samples == pytest.approx((130 - 30 + 863) * N * B)


def test_checkpoint_restart_runs_on_spares_when_every_slice_is_down():
  events = [Event(10.0, s, 'fail') for s in range(N)]
  t = replay(events, N, 1000.0, _model(CHECKPOINT, _costs()), checkpoint_every=1000)
  assert t.all_down_s == 0.0 and t.restarts == 1 and t.lost_steps == 10
  assert t.samples == pytest.approx((1000.0 - 10.0 - 5.0) * N * B)


def test_preset_schedule_is_the_preset_and_scales_the_interval_only():
  same = simulate.preset_schedule('high', 8, 5000, 60.0, seed=3)
  assert same.all_events() == FailureSchedule.preset('high', 8, 5000, 60.0, seed=3).all_events()
  scaled = simulate.preset_schedule('high', 4, 300, 600.0, seed=0, interval_scale=8.0)
  fails = [e for e in scaled.all_events() if e.kind == 'fail']
  assert 3 <= len(fails) < len([e for e in same.all_events() if e.kind == 'fail'])
  down_since = {}
  for e in sorted(scaled.all_events(), key=lambda e: (e.step, e.kind == 'fail')):
    if e.kind == 'fail':
      down_since[e.slice] = e.step
    else:  # 2 h repairs = 12 steps of 600 s (11 to 13 once quantised)
      assert e.step - down_since.pop(e.slice) in (11, 12, 13)


def test_stall_all_down_waits_out_steps_with_every_slice_down():
  sched = (FailureSchedule(2).fail_at(0, 2).fail_at(1, 4).repair_at(1, 7).repair_at(0, 9)
           .fail_at(1, 12).fail_at(0, 13))
  out = simulate.stall_all_down(sched, 2, 10)
  # Steps 4-6 have both down and are waited out; step 7 repairs slice 1, so trained step 4
  # sees the same failed set as step 3 and gets no event. The rest moves 3 steps earlier.
  assert [(e.step, e.slice, e.kind) for e in out.all_events()] == [
      (2, 0, 'fail'), (6, 0, 'repair'), (9, 1, 'fail')]
  assert quality.live_counts(out, 2, 10) == [2, 2, 1, 1, 1, 1, 2, 2, 2, 1]
  assert simulate.stall_all_down(sched, 2, 12) is None  # all down from step 13 on


def test_stalled_preset_never_has_every_slice_down_and_covers_every_step():
  plain = simulate.preset_schedule('high', 2, 400, 1800.0, seed=1, interval_scale=4.0)
  stalled = simulate.preset_schedule('high', 2, 400, 1800.0, seed=1, interval_scale=4.0,
                                     stall=True)
  assert 0 in quality.live_counts(plain, 2, 400)  # the plain preset does take both down
  live = quality.live_counts(stalled, 2, 400)
  assert min(live) == 1 and max(e.step for e in stalled.all_events()) > 380
  first_stop = quality.live_counts(plain, 2, 400).index(0)
  assert live[:first_stop] == quality.live_counts(plain, 2, 400)[:first_stop]


def test_needed_roles_cover_carriers_and_spread_shares():
  roles = simulate.needed_roles([Planner(4, 8, p) for p in ('neighbor', 'spread', 'naive')])
  assert {Role(8), Role(0, 16), Role(0, 24, 2), Role(0, 32, 2), Role(16), Role(32)} <= roles
  assert Role(8, 3) in roles and Role(8, 8) in roles  # one orphan over 3 live; two over 2 live


def test_fit_recovers_a_linear_cost_and_marks_modelled_roles():
  coef = np.array([0.5, 0.1, 0.2, 0.05])
  roles = [Role(8), Role(16), Role(0, 16), Role(0, 24, 2), Role(8, 2)]
  costs = _costs(group_s={r: simulate.predict(coef, r) for r in roles},
                 group_compile_s=dict.fromkeys(roles, 4.0))
  costs.complete({Role(0, 40, 4)})
  assert costs.group_s[Role(0, 40, 4)] == pytest.approx(simulate.predict(coef, Role(0, 40, 4)))
  assert costs.modelled == {Role(0, 40, 4)}
  assert [r['modelled'] for r in costs.to_json()['roles']].count(True) == 1


@pytest.mark.parametrize('policy', ['neighbor', 'spread', 'exact', 'budget', 'drop', 'naive'])
@pytest.mark.parametrize('granule', [1, 2])
def test_live_sets_of_one_shape_have_the_same_roles(policy, granule):
  # PolicyModel plans once per shape of live set; every live set must get its own plan's roles.
  rng = np.random.default_rng(0)
  planner = Planner(12, 4, policy, granule)
  model = PolicyModel(planner, _costs())
  for _ in range(300):
    live = tuple(sorted(rng.choice(12, rng.integers(1, 13), replace=False).tolist()))
    assert model._roles(live) == set(planner.plan(live).roles.values()), live
