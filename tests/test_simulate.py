"""Failure replay simulation: failure process, roles per live set, cost model, time accounting,
the programs the real decider's plans build, and the background worker that moves them early."""
import numpy as np
import pytest

from benchmarks import quality_runs
from mecefo_jax.core import programs
from mecefo_jax.core.decider import Decider
from mecefo_jax.core.failures import FailureEvent, FailureSchedule
from mecefo_jax.core.programs import ProgramKey, RunPrograms
from mecefo_jax.core.roles import Role
from mecefo_jax.core.takeover import Planner
from mecefo_jax.plan import simulate
from mecefo_jax.plan.ledger import Premover, ProgramLedger
from mecefo_jax.plan.simulate import CHECKPOINT, ClusterCosts, Event, PolicyModel, replay

N, B = 4, 8
FREE = {'update': 0.0, 'refresh_cold': 0.0, 'refresh_warm': 0.0, 'eval': 0.0}


def _costs(**kw):
  group = {Role(B): 1.0, Role(2 * B): 2.0, Role(0, 2 * B): 1.5, Role(0, 3 * B, 2): 2.5}
  base = dict(normal_s=1.0, update_s=0.0, group_s=group, group_compile_s=dict.fromkeys(group, 10.0),
              fused_compile_s=5.0, compile_s_by_kind={**FREE, 'update': 1.0})
  return ClusterCosts(**{**base, **kw})


def _model(policy, costs=None, **kw):
  costs = costs or _costs()
  planner = Planner(N, B, policy)
  costs.complete(simulate.needed_roles([planner] if policy != CHECKPOINT else []))
  return PolicyModel(planner, costs, **kw)


def test_fault_free_replay_loses_nothing():
  t = replay([], N, 1000.0, _model('neighbor'))
  assert t.samples == pytest.approx(1000.0 * N * B) and t.steps == 1000
  assert t.failed_s == 0 and t.live_slice_s == pytest.approx(N * 1000.0)
  assert t.goodput['normal_productive'] == pytest.approx(1000.0)


def test_drop_loses_the_failed_slices_rows():
  t = replay([Event(0.0, 1, 'fail')], N, 1000.0, _model('drop'))
  # The fused program of the new live set compiles first (5 s), then 995 steps of N-1 slices.
  assert t.samples == pytest.approx(995.0 * (N - 1) * B)
  assert t.builds.compile_s == 5.0 and t.failed_s == pytest.approx(1000.0)
  assert t.goodput['lost'] == pytest.approx(995.0 / N)  # the failed slice's share of each step


def test_neighbor_step_is_the_slowest_carrier_and_compiles_once_per_live_set():
  events = [Event(0.0, 1, 'fail'), Event(100.0, 1, 'repair'), Event(200.0, 1, 'fail')]
  model = _model('neighbor', _costs(rejoin_s=3.0))
  t = replay(events, N, 1000.0, model)
  # live (0,2,3): groups Role(B) + Role(0,2B) compiled once (20 s) + update (1 s).
  assert t.builds.compile_s == 21.0 and t.goodput['rejoin'] == 3.0
  step_s = lambda *down: simulate.step_seconds(_plan(model, down), model.costs, Role(B))
  assert (step_s(1), step_s(1, 2), step_s()) == (1.5, 2.5, 1.0)


def _plan(model, down):
  decider = model.decider()
  for s in down:
    decider.apply(FailureEvent(0, s, 'fail'))
  return decider.decide(0)


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
  assert t.lost_steps == 30 and t.restarts == 1 and t.goodput['restart'] == 2.0
  assert t.builds.compile_s == 5.0
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
  assert quality_runs.live_counts(out, 2, 10) == [2, 2, 1, 1, 1, 1, 2, 2, 2, 1]
  assert simulate.stall_all_down(sched, 2, 12) is None  # all down from step 13 on


def test_stalled_preset_never_has_every_slice_down_and_covers_every_step():
  plain = simulate.preset_schedule('high', 2, 400, 1800.0, seed=1, interval_scale=4.0)
  stalled = simulate.preset_schedule('high', 2, 400, 1800.0, seed=1, interval_scale=4.0,
                                     stall=True)
  assert 0 in quality_runs.live_counts(plain, 2, 400)  # the plain preset does take both down
  live = quality_runs.live_counts(stalled, 2, 400)
  assert min(live) == 1 and max(e.step for e in stalled.all_events()) > 380
  first_stop = quality_runs.live_counts(plain, 2, 400).index(0)
  assert live[:first_stop] == quality_runs.live_counts(plain, 2, 400)[:first_stop]


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


def test_compile_seconds_by_kind():
  costs = _costs(compile_s_by_kind={**FREE, 'refresh_cold': 3.0, 'refresh_warm': 2.0})
  live = (0, 2, 3)
  assert costs.compile_of(ProgramKey(programs.GROUP, (2,), Role(0, 2 * B))) == 10.0
  assert costs.compile_of(ProgramKey(programs.FUSED, live, Role(2 * B))) == 5.0
  assert [costs.compile_of(ProgramKey(k, live)) for k in (programs.REFRESH_COLD,
                                                           programs.REFRESH_WARM)] == [3.0, 2.0]


# --- the programs a replay builds ---------------------------------------------------------------

def _group(slices, role):
  return ProgramKey(programs.GROUP, slices, role)


def test_ledger_compiles_a_shape_once_then_moves_it_and_builds_a_program_once():
  compile_s = {'group': 10.0, 'update': 1.0}
  keys = lambda live, carrier: [_group(tuple(s for s in live if s != carrier), Role(B)),
                                _group((carrier,), Role(0, 2 * B)),
                                ProgramKey(programs.UPDATE, live)]
  for move, want in ((True, (3, 3, 21.0 + 3 * 0.5)), (False, (6, 0, 42.0))):
    ledger = ProgramLedger(lambda key: compile_s[key.kind.name], 0.5, move)
    spent = [sum(ledger.build(k)[1] for k in keys(live, carrier))
             for live, carrier in (((0, 2, 3), 2), ((0, 1, 3), 3), ((0, 1, 3), 3))]
    s = ledger.stats
    assert (s.compiled, s.moved, s.compile_s + s.move_s) == want
    assert spent[2] == 0.0 and sum(spent) == want[2]
  fused = lambda live: ProgramKey(programs.FUSED, live, Role(B))
  ledger = ProgramLedger(lambda key: 5.0, 0.5, True, built=[fused((0, 1))])
  assert [ledger.build(fused((0, 1))), ledger.build(fused((2, 3)))] == [(None, 0.0), ('moved', 0.5)]
  ledger.forget()  # a fresh process
  assert ledger.build(fused((0, 1))) == ('compiled', 5.0)


def test_replay_moves_the_programs_of_a_second_live_set_of_one_shape():
  costs = _costs(move_s=0.25)
  events = [Event(0.0, 1, 'fail'), Event(100.0, 1, 'repair'), Event(200.0, 2, 'fail')]
  t = replay(events, N, 1000.0, _model('neighbor', costs))
  # (0, 2, 3) compiles its groups Role(B) and Role(0, 2B) (20 s) and update (1 s); (0, 1, 3)
  # has the same shape: its three programs move.
  b = t.builds
  assert (b.compiled, b.moved, b.compile_s, b.move_s) == (3, 3, 21.0, 0.75)
  off = replay(events, N, 1000.0, _model('neighbor', costs, move=False)).builds
  assert (off.compiled, off.moved, off.compile_s) == (6, 0, 42.0)


def test_refresh_compiles_cold_once_then_warm_and_runs_every_tau_degraded_steps():
  costs = _costs(compile_s_by_kind={**FREE, 'refresh_cold': 3.0, 'refresh_warm': 2.0},
                 refresh_s=0.5)
  model = _model('neighbor', costs, run=RunPrograms(refresh='warm'), tau=10)
  sched = FailureSchedule(N).fail_at(1, 5).repair_at(1, 40).fail_at(2, 60)
  decider = Decider(model.planner, model.run, sched, model.tau)
  records = simulate.replay_trace(decider, 100, costs, built=model.fault_free())
  refreshes = [r['step'] for r in records if any(k.kind.stage == 'refresh' for k in r['programs'])]
  # Degraded steps 5-39 and 60-99; the clock of tau steps runs on from the last refresh.
  assert refreshes == [5, 15, 25, 35, 60, 70, 80, 90]
  kinds = [k.kind.name for r in records for k in r['built'] if k.kind.stage == 'refresh']
  assert kinds == ['refresh_cold', 'refresh_warm', 'refresh_warm']  # (0,2,3) twice, (0,1,3)


def test_bulk_replay_agrees_with_the_step_by_step_trace():
  """With free programs and 1 s steps the bulk replay's windows are the trace's steps: the same
  programs built, samples and refreshes, the eval built at the first step that runs it."""
  costs = _costs(group_s=dict.fromkeys(simulate.needed_roles([Planner(N, B, 'neighbor')]), 1.0),
                 fused_compile_s=0.0, compile_s_by_kind=FREE)
  costs.group_compile_s = dict.fromkeys(costs.group_s, 0.0)
  run = RunPrograms(refresh='warm', eval_every=7)
  model = _model('neighbor', costs, run=run, tau=3)
  # (0, 1) lives 2 steps between evals (at steps 20 and 27): its eval is never built.
  steps = [(4, 1, 'fail'), (9, 2, 'fail'), (17, 1, 'repair'), (21, 3, 'fail'), (23, 3, 'repair'),
           (30, 2, 'repair'), (31, 0, 'fail')]
  sched = FailureSchedule(N)
  for step, s, kind in steps:
    (sched.fail_at if kind == 'fail' else sched.repair_at)(s, step)
  records = simulate.replay_trace(Decider(model.planner, run, sched, 3), 50, costs,
                                  built=model.fault_free())
  t = replay([Event(float(step), s, kind) for step, s, kind in steps], N, 50.0, model)
  built = [k for r in records for k in r['built']]
  assert len(built) == t.builds.compiled + t.builds.moved > 0
  assert {k.kind.name for k in built} >= {'group', 'update', 'refresh_warm', 'eval'}
  assert t.samples == sum(r['samples']['exact'] + r['samples']['degraded'] for r in records)
  assert t.refreshes == sum(r['programs'][0].kind.stage == 'refresh' for r in records)
  assert t.steps == 50 and all(r['built'] == r['blocked'] for r in records)


# --- the background worker ----------------------------------------------------------------------

def _premoves(cap, move_s, second_failure_s):
  """Neighbor on 4 slices: slice 1 fails (its programs compile: new shapes), is repaired (the
  worker queues the one-down sets' programs: 3 each of (1,2,3), (0,1,3), (0,1,2), as (0,2,3)
  is built), then slice 2 fails: (0,1,3) takes the moves done, waits for the one in flight."""
  events = [Event(0.0, 1, 'fail'), Event(100.0, 1, 'repair'), Event(second_failure_s, 2, 'fail')]
  return replay(events, N, 1000.0, _model('neighbor', _costs(move_s=move_s, rejoin_s=3.0),
                                          premove_cap=cap)).builds


def test_background_worker_moves_the_next_live_sets_programs_and_never_compiles():
  b = _premoves(64, 0.25, 200.0)
  assert (b.compiled, b.moved, b.premoved, b.premove_wait_s) == (3, 0, 3, 0.0)
  off = _premoves(0, 0.25, 200.0)
  assert (off.compiled, off.moved, off.premoved) == (3, 3, 0)


def test_a_move_in_flight_is_waited_for_and_one_not_started_runs_in_the_foreground():
  # The repair takes effect at 100.5 (53 steps of 1.5 s after 21 s of compiles), the rejoin
  # ends at 103.5: moves of 10 s end at 113.5, 123.5, ... The failure takes effect at 148.5,
  # after the 45th 1 s step: (0,1,3)'s first group (done 143.5) is taken, its second is in
  # flight (done 153.5: 5 s wait), its update not started (a 10 s move).
  b = _premoves(64, 10.0, 148.0)
  assert (b.premoved, b.moved) == (2, 1)
  assert b.premove_wait_s == pytest.approx(5.0) and b.move_s == 10.0
  capped = _premoves(4, 10.0, 148.0)  # the queue ends after (0,1,3)'s first program
  assert (capped.premoved, capped.moved, capped.premove_wait_s) == (1, 2, 0.0)


def test_the_worker_finishes_its_move_in_flight_then_starts_the_next_queue():
  update = lambda *live: ProgramKey(programs.UPDATE, live)
  ledger = ProgramLedger(lambda key: 1.0, 10.0, True, built=[update(0, 1)])  # shape known
  worker = Premover(ledger, cap=8)
  worker.queue(0.0, [(0, 2), (1, 2)], lambda live: [update(*live)])
  # At 15 the move for (0, 2) is done (then evicted), that for (1, 2) in flight until 20.
  assert worker.arrive(15.0, (1, 2), [update(1, 2)]) == {update(1, 2): 20.0}
  worker.queue(15.0, [(0, 3)], lambda live: [update(*live)])
  assert worker.arrive(25.0, (0, 3), [update(0, 3), update(0, 2)]) == {update(0, 3): 30.0}
