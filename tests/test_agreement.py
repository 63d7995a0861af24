"""The executor and the failure simulator over one trace: per step the same live slices, roles,
programs built and builds waited for (both ask core/'s decider; the simulator's stand-in
program cache applies the executor's ProgramKey shape rule)."""
import pytest
from test_controller import CORPUS, MESHES, TINY, _mesh

from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.core import programs
from mecefo_jax.core.decider import Decider
from mecefo_jax.core.failures import FailureSchedule
from mecefo_jax.core.roles import Role
from mecefo_jax.fault.controller import Controller
from mecefo_jax.plan.replay import replay_trace
from mecefo_jax.plan.simulate import ClusterCosts
from mecefo_jax.step import lowering

pytestmark = pytest.mark.usefixtures('devices')
STEPS, B = 12, 4
# 11 events on 4 slices: two down at once, repairs, a repair and a failure in one step.
TRACE = [(1, 1, 'fail'), (2, 2, 'fail'), (4, 1, 'repair'), (5, 3, 'fail'), (6, 2, 'repair'),
         (6, 3, 'repair'), (7, 0, 'fail'), (7, 2, 'fail'), (9, 0, 'repair'), (10, 2, 'repair'),
         (10, 1, 'fail')]


def _schedule() -> FailureSchedule:
  schedule = FailureSchedule(4)
  for step, s, kind in TRACE:
    (schedule.fail_at if kind == 'fail' else schedule.repair_at)(s, step)
  return schedule


def _costs() -> ClusterCosts:
  group = {Role(B): 1.0, Role(2 * B): 2.0, Role(0, 2 * B): 1.5, Role(B, B): 1.8, Role(0, B): 0.7}
  return ClusterCosts(normal_s=1.0, update_s=0.1, group_s=group,
                      group_compile_s=dict.fromkeys(group, 3.0), fused_compile_s=3.0,
                      compile_s_by_kind={'update': 1.0, 'refresh_cold': 1.0,
                                         'refresh_warm': 1.0, 'eval': 1.0},
                      refresh_s=0.2, move_s=0.05, rejoin_s=0.1)


def test_the_executor_and_the_simulator_agree_step_by_step_on_what_they_build():
  cfg = load_config(None, [*TINY, *MESHES['4x2'], 'faults.takeover=spread',
                           'train.eval_every=5', 'faults.precompile=never'])
  mesh, init, graphdef = _mesh('4x2')
  c = Controller(cfg, mesh, graphdef, CORPUS, _schedule(), init())  # compiles its own programs
  d = c.decider
  twin = Decider(d.planner, d.run, _schedule(), d.tau)
  records = replay_trace(twin, STEPS, _costs())
  assert c.programs.move  # programs move between sets of one shape, in both
  moved = 0
  for step, record in zip(range(STEPS), records):
    before = len(c.programs.built)
    c.step(step)
    if d.eval_due(step):
      c.evaluator(c.live())
    built = c.programs.built[before:]
    assert record['live'] == c.live(), step
    assert record['roles'] == c.last_plan.roles, step
    assert set(record['built']) == {key for key, _, _ in built}, step
    assert set(record['blocked']) == {key for key, _, ahead in built if not ahead}, step
    moved += sum(how == 'moved' for _, how, _ in built)
  assert moved > 0 and len({len(r['live']) for r in records}) == 3


def test_a_new_kind_of_program_is_one_registration_plus_its_lowering(monkeypatch):
  """A dummy kind registered in core/ is listed by programs_for, lowered through the kind
  dispatch and priced by the simulator's cost lookup by its name."""
  monkeypatch.setattr(programs, 'KINDS', dict(programs.KINDS))  # the registry, restored after
  dummy = programs.register(programs.Kind('dummy', 'eval', lambda need: [(need.live, None)]))
  monkeypatch.setitem(lowering.LOWER, 'dummy', lowering.LOWER['eval'])
  live = (0, 1)
  need = programs.Need(live, dict.fromkeys(live, Role(B)), programs.RunPrograms())
  key = programs.ProgramKey(dummy, live)
  assert programs.programs_for(need)[-1] == key
  cfg = load_config(None, [*TINY, *MESHES['4x2']])
  mesh, _, graphdef = _mesh('4x2')
  lowered = lowering.lower(key, cfg, sharding.PresentSlices(mesh, (0, 1, 2, 3)).sub(live), graphdef)
  assert 'main' in lowered.as_text()
  costs = _costs()
  costs.compile_s_by_kind['dummy'] = 7.0
  assert costs.compile_of(key) == 7.0
  with pytest.raises(ValueError, match="no lowering for program kind 'other'"):
    lowering.lower(programs.ProgramKey(programs.Kind('other', 'eval'), live), cfg, mesh, graphdef)
