"""Failure replay simulation: failure process, roles per live set, cost model, time accounting,
and the programs it charges against those the controller builds."""
import numpy as np
import pytest
from test_controller import CORPUS, MESHES, TINY, _mesh

from benchmarks import quality, simulate
from benchmarks.ledger import ProgramLedger, RunPrograms
from benchmarks.simulate import CHECKPOINT, ClusterCosts, Event, PolicyModel, replay
from mecefo_jax.config import load_config
from mecefo_jax.fault.controller import Controller
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
def test_live_sets_of_one_shape_have_the_same_roles_and_a_place_the_same_role(policy, granule):
  # PolicyModel plans once per shape of live set, and once per place of a slice (_places);
  # every live set and every slice must get its own plan's roles.
  rng = np.random.default_rng(0)
  planner = Planner(12, 4, policy, granule)
  model = PolicyModel(planner, _costs())
  for _ in range(300):
    live = tuple(sorted(rng.choice(12, rng.integers(1, 13), replace=False).tolist()))
    want = planner.plan(live).roles
    assert model._roles(live) == set(want.values()), live
    assert model.roles(live) == want, live


# --- the programs a replay charges ------------------------------------------------------------

def test_ledger_compiles_a_shape_once_then_moves_it_and_charges_a_request_once():
  compile_s = {'group': 10.0, 'update': 1.0}
  keys = lambda live, carrier: [('group', tuple(s for s in live if s != carrier), Role(B)),
                                ('group', (carrier,), Role(0, 2 * B)), ('update', live)]
  for move, want in ((True, (3, 3, 21.0 + 3 * 0.5)), (False, (6, 0, 42.0))):
    ledger = ProgramLedger(lambda key: compile_s[key[0]], 0.5, move)
    spent = [ledger.charge(keys((0, 2, 3), 2)), ledger.charge(keys((0, 1, 3), 3)),
             ledger.charge(keys((0, 1, 3), 3))]
    s = ledger.stats
    assert (s['compiled'], s['moved'], s['compiled_s'] + s['moved_s']) == want
    assert spent[2] == 0.0 and sum(spent) == want[2]
  ledger = ProgramLedger(lambda key: 5.0, 0.5, True, built=[('fused', (0, 1), Role(B))])
  assert ledger.charge([('fused', (0, 1), Role(B)), ('fused', (2, 3), Role(B))]) == 0.5
  ledger.forget()  # a fresh process
  assert ledger.charge([('fused', (0, 1), Role(B))]) == 5.0 and not ledger.refreshed


def test_program_requests_refresh_from_scratch_once_then_warm_and_eval():
  roles = {0: Role(B), 2: Role(0, 2 * B), 3: Role(B)}
  live = (0, 2, 3)
  warm = RunPrograms(refresh='warm', evals=True)
  step = [('group', (0, 3), Role(B)), ('group', (2,), Role(0, 2 * B)), ('update', live)]
  assert simulate.program_requests(live, roles, warm, refreshed=False) == [
      *step, ('refresh', live, False), ('refresh', live, True), ('eval', live)]
  assert simulate.program_requests(live, roles, warm, refreshed=True)[3:] == [
      ('refresh', live, True), ('eval', live)]
  full = RunPrograms(refresh='full', ordered_reduce=True)
  assert simulate.program_requests(live, roles, full, refreshed=True)[3:] == [
      ('refresh', live, False)]
  normal = dict.fromkeys(live, Role(B))
  assert simulate.program_requests(live, normal, warm, True) == [('fused', live, Role(B)),
                                                                 ('eval', live)]
  assert simulate.program_requests(live, normal, full, True) == [
      ('group', live, Role(B)), ('update', live)]  # mesh.ordered_reduce: never fused


def test_replay_moves_the_programs_of_a_second_live_set_of_one_shape():
  costs = _costs(move_s=0.25)
  events = [Event(0.0, 1, 'fail'), Event(100.0, 1, 'repair'), Event(200.0, 2, 'fail')]
  t = replay(events, N, 1000.0, _model('neighbor', costs))
  # (0, 2, 3) compiles its groups Role(B) and Role(0, 2B) (20 s) and update (1 s); (0, 1, 3)
  # has the same shape: its three programs move.
  assert (t.compiled, t.moved, t.compile_s, t.move_s) == (3, 3, 21.0, 0.75)
  off = replay(events, N, 1000.0, PolicyModel(Planner(N, B, 'neighbor'), costs, move=False))
  assert (off.compiled, off.moved, off.compile_s) == (6, 0, 42.0)


def test_replay_charges_the_compiles_and_moves_of_the_controller():
  """The real controller on 8 slices under one failure trace; the replay of the same trace
  with the controller's planner predicts its compiles and moves after the fault-free step.
  Slice 3 carries slice 2 both when only 2 is down and when 2, 5 and 6 are: that group
  program is built once (a replay counting per live set would move it again)."""
  cfg = load_config(None, [*TINY, *MESHES['8x1'], 'train.move_programs=always',
                           'faults.precompile=never', 'mecefo.tau=1', 'train.eval_every=0'])
  sched = (FailureSchedule(8).fail_at(2, 1).fail_at(5, 3).fail_at(6, 4).repair_at(2, 5)
           .repair_at(5, 5).repair_at(6, 5).fail_at(4, 6))
  mesh, init, graphdef, _ = _mesh('8x1')
  c = Controller(cfg, mesh, graphdef, CORPUS, sched, init())
  c.step(0)
  fault_free = dict(c.programs.stats)
  for t in range(1, 7):
    c.step(t)
  built = {k: c.programs.stats[k] - fault_free[k] for k in ('compiled', 'moved')}
  # Every step costs 1 s and every program nothing, so the replay's steps are the controller's.
  roles = simulate.needed_roles([c.planner])
  costs = _costs(group_s=dict.fromkeys(roles, 1.0), group_compile_s=dict.fromkeys(roles, 0.0),
                 fused_compile_s=0.0, update_compile_s=0.0)
  events = [Event(float(e.step), e.slice, e.kind) for e in sched.all_events()]
  runs = {move: replay(events, 8, 7.0, PolicyModel(c.planner, costs, RunPrograms.of(cfg), move))
          for move in (True, False)}
  assert built == {'compiled': 13, 'moved': 4}
  assert (runs[True].compiled, runs[True].moved) == (built['compiled'], built['moved'])
  # Moving off, every program the controller holds is compiled (less the fault-free step).
  assert (runs[False].compiled, runs[False].moved) == (len(c.programs.keys()) - 1, 0)
