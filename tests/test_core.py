"""core/ without devices: no jax below it, the programs a live set needs, the decider's plans."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mecefo_jax import sections
from mecefo_jax.core import programs
from mecefo_jax.core.decider import Decider, DeciderMeta, DeciderState, StreamMismatch
from mecefo_jax.core.failures import FailureEvent, FailureSchedule
from mecefo_jax.core.programs import (EVAL, FUSED, GROUP, REFRESH_COLD, REFRESH_WARM, UPDATE,
                                      Kind, Need, ProgramKey, RunPrograms, programs_for)
from mecefo_jax.core.roles import Role, slice_list
from mecefo_jax.core.takeover import Planner

ROOT = Path(__file__).resolve().parents[1]
N, B = 4, 4
SVD = RunPrograms(refresh='warm', eval_every=5)

_BLOCKED = '''
import importlib, pkgutil, sys
BLOCKED = ('jax', 'jaxlib', 'flax', 'optax', 'orbax')
class Block:
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in BLOCKED:
      raise ImportError(f'core/ imported {name}')
sys.meta_path.insert(0, Block())
import mecefo_jax.core as core
names = [m.name for m in pkgutil.walk_packages(core.__path__, 'mecefo_jax.core.')]
for name in names:
  importlib.import_module(name)
print(len(names))
'''


def test_core_imports_no_jax_flax_optax_or_orbax():
  done = subprocess.run([sys.executable, '-c', _BLOCKED], cwd=ROOT, capture_output=True,
                        text=True, timeout=60)
  assert done.returncode == 0, done.stderr[-2000:]
  assert int(done.stdout) >= 7  # every module of core/ was imported


# --- programs ----------------------------------------------------------------------------------

def _keys(live, roles, run=SVD, refreshed=False):
  return [(k.kind, k.slices, k.variant) for k in programs_for(Need(live, roles, run, refreshed))]


def test_a_uniform_single_pass_step_is_one_fused_program():
  roles = dict.fromkeys((0, 1, 3), Role(B))
  assert _keys((0, 1, 3), roles) == [(FUSED, (0, 1, 3), Role(B)), (EVAL, (0, 1, 3), None)]
  ordered = RunPrograms(ordered_reduce=True)
  assert _keys((0, 1, 3), roles, ordered) == [(GROUP, (0, 1, 3), Role(B)),
                                              (UPDATE, (0, 1, 3), None)]


def test_a_degraded_step_lists_groups_update_refreshes_eval_in_the_order_they_are_needed():
  roles = {0: Role(B), 1: Role(0, 2 * B), 3: Role(B)}
  groups = [(GROUP, (0, 3), Role(B)), (GROUP, (1,), Role(0, 2 * B)), (UPDATE, (0, 1, 3), None)]
  refreshes = [(REFRESH_COLD, (0, 1, 3), None), (REFRESH_WARM, (0, 1, 3), None)]
  assert _keys((0, 1, 3), roles) == groups + refreshes + [(EVAL, (0, 1, 3), None)]
  # Refreshed before: warm only; full refreshes: cold only; no refresh, no eval: the step's.
  assert _keys((0, 1, 3), roles, refreshed=True) == groups + refreshes[1:] + [(EVAL, (0, 1, 3), None)]
  full = RunPrograms(refresh='full')
  assert _keys((0, 1, 3), roles, full, refreshed=True) == groups + refreshes[:1]
  assert _keys((0, 1, 3), roles, RunPrograms()) == groups


def test_a_program_key_has_a_shape_and_kinds_compare_by_name():
  a = ProgramKey(GROUP, (0, 3), Role(B))
  assert a.shape == ProgramKey(GROUP, (1, 2), Role(B)).shape == ('group', 2, Role(B))
  assert a.shape != ProgramKey(GROUP, (1,), Role(B)).shape
  assert ProgramKey(Kind('group', 'step'), (0, 3), Role(B)) == a
  assert str(ProgramKey(EVAL, (0, 1))) == 'eval program for slices [0, 1]'
  with pytest.raises(ValueError, match='registered already'):
    programs.register(Kind('eval', 'eval'))
  with pytest.raises(ValueError, match='stage must be one of'):
    programs.register(Kind('x', 'sometimes'))


def test_next_live_sets_are_repairs_then_failures():
  assert list(programs.next_live_sets((0, 2), 3)) == [(0, 1, 2), (2,), (0,)]
  assert list(programs.next_live_sets((1,), 3, down=(2, 0))) == [(1, 2), (0, 1)]


# --- the decider -----------------------------------------------------------------------------

def test_the_slice_down_longest_comes_back_first_also_after_a_resume():
  d = _decider(FailureSchedule(8))
  for step, s, kind in [(1, 5, 'fail'), (2, 2, 'fail'), (3, 5, 'repair'), (4, 7, 'fail'),
                        (5, 5, 'fail')]:
    d.apply(FailureEvent(step, s, kind))
  assert d.down_longest_first() == [2, 7, 5]
  back = [tuple(sorted((*d.live(), s))) for s in (2, 7, 5)]
  assert list(d.next_live_sets())[:4] == back + [d.live()[1:]]
  resumed = _decider(FailureSchedule(8), state=DeciderState.from_meta(d.state.to_meta()))
  assert resumed.down_longest_first() == [2, 7, 5]
  resumed.state.failed = {7, 1}  # set from outside the events: known first, then slice order
  assert resumed.down_longest_first() == [7, 1]


def _decider(schedule=None, policy='neighbor', run=SVD, tau=3, **kw) -> Decider:
  schedule = schedule or FailureSchedule(N)
  return Decider(Planner(schedule.n_slices, B, policy), run, schedule, tau, **kw)


def _plans(decider, stop, start=0):
  out = []
  for step in range(start, stop):
    decider.advance(step)
    plan = decider.decide(step)
    decider.commit(plan)
    out.append(plan)
  return out


def test_plans_follow_the_failures_refresh_every_tau_degraded_steps_and_count_samples():
  d = _decider(FailureSchedule(N).fail_at(2, 1).repair_at(2, 6))
  plans = _plans(d, 8)
  assert [p.live for p in plans] == [(0, 1, 2, 3)] + 5 * [(0, 1, 3)] + 2 * [(0, 1, 2, 3)]
  assert [p.fused for p in plans] == [True] + 5 * [False] + 2 * [True]
  assert plans[1].roles[3] == Role(0, 2 * B) and plans[1].programs[-1].kind is UPDATE
  # The first degraded step refreshes from scratch, then warm every tau=3 degraded steps.
  assert [p.refresh and p.refresh.kind for p in plans] == [
      None, REFRESH_COLD, None, None, REFRESH_WARM, None, None, None]
  assert plans[6].rejoins == (2,) and not plans[7].rejoins
  assert [p.eval is not None for p in plans] == [s % 5 == 4 for s in range(8)]
  assert d.state.samples == {'exact': 3 * N * B + 5 * 2 * B, 'degraded': 5 * 2 * B, 'dropped': 0}
  assert d.next_change(7) == 9  # no degraded work: the next eval (after step 9)


def test_requeue_trains_each_sample_of_the_stream_once_in_order_and_drops_none():
  """Two slices down for a while, one of them twice: the ids of every step (data/order.py's
  stream_ids of the plan's first id) cover the stream once, in order; a resumed decider goes on
  from the same place."""
  import numpy as np
  from mecefo_jax.data.order import stream_ids
  schedule = (FailureSchedule(N).fail_at(1, 2).repair_at(1, 5).fail_at(3, 4).repair_at(3, 9)
              .fail_at(1, 7).repair_at(1, 8))
  decider = _decider(schedule, 'requeue')
  plans = _plans(decider, 6)
  resumed = _decider(schedule, 'requeue', state=DeciderState.from_meta(decider.state.to_meta()))
  resumed.check_stream(6)  # the carried position is the one the events give
  plans += _plans(resumed, 12, start=6)  # on from a snapshot after step 5
  trained = np.concatenate([stream_ids(p.first_id, p.live, N, B)[list(p.live)].ravel()
                            for p in plans])
  assert trained.tolist() == list(range(trained.size))
  assert [len(p.live) for p in plans] == [4, 4, 3, 3, 2, 3, 3, 2, 3, 4, 4, 4]
  assert dict(resumed.state.samples) == {'exact': trained.size, 'degraded': 0, 'dropped': 0}
  assert _plans(_decider(schedule, 'drop'), 12)[-1].first_id is None  # ids by step: unchanged


@pytest.mark.parametrize('policy', ['requeue', 'spread'])
def test_a_snapshots_stream_position_is_checked_against_its_failure_events(policy):
  """c at a start is recomputed from the live-set history (the events the meta carries): a
  counter that disagrees is refused, naming both figures."""
  schedule = FailureSchedule(N).fail_at(1, 2).fail_at(2, 2).repair_at(1, 5).fail_at(3, 7)
  decider = _decider(schedule, policy)
  _plans(decider, 9)
  live = [4, 4, 2, 2, 2, 3, 3, 2, 2] if policy == 'requeue' else [N] * 9
  assert decider.stream_position_of_events(9) == decider.stream_position() == sum(live) * B
  for step in range(9):  # a snapshot after every step: its meta's events up to that step
    meta = decider.state.to_meta()
    meta.events[:] = [e for e in meta.events if e['step'] < step]
    meta.samples.clear()
    meta.samples['exact'] = sum(live[:step]) * B
    _decider(schedule, policy, state=DeciderState.from_meta(meta)).check_stream(step)
  meta = decider.state.to_meta()
  meta.samples['exact'] += B  # one micro-batch miscounted
  with pytest.raises(StreamMismatch, match=f'counts {sum(live) * B + B} samples trained, but its '
                     f'failure events give {sum(live) * B}'):
    _decider(schedule, policy, state=DeciderState.from_meta(meta)).check_stream(9)


def test_next_change_is_the_next_refresh_or_eval():
  d = _decider(FailureSchedule(N).fail_at(2, 0))
  d.advance(0)
  d.commit(d.decide(0))
  assert d.bases_step == 0 and d.next_change(0) == 3  # tau=3
  assert d.next_change(3) == 4 and d.eval_due(4)  # the eval after step 4


def test_refreshes_from_is_the_cadence_the_plans_refresh_at():
  """Decider.refreshes_from (the replay's refresh clock) names the steps whose plans refresh."""
  d = _decider(FailureSchedule(N).fail_at(2, 0))
  d.advance(0)
  assert d.refreshes_from(0) == (0, 3)  # no refresh yet: due now
  plans = _plans(d, 8)
  assert [p.step for p in plans if p.refresh] == [0, 3, 6] and d.refreshes_from(8) == (9, 3)
  assert _decider().refreshes_from(0) == (None, 3)  # nothing degraded: no refresh


def test_every_process_makes_the_same_plans():
  sched = FailureSchedule(N).fail_at(1, 1).fail_at(2, 2).repair_at(1, 4).fail_at(3, 4)
  one, two = (_plans(_decider(sched, 'budget'), 7) for _ in range(2))
  assert [p.digest() for p in one] == [p.digest() for p in two]
  assert len({p.digest() for p in one}) == 7  # the step number alone makes each one differ
  other = _plans(_decider(FailureSchedule(N).fail_at(1, 1), 'budget'), 7)
  assert one[2].digest() != other[2].digest()


def test_a_repair_before_a_failure_in_one_step_places_the_state_first():
  d = _decider(FailureSchedule(2).fail_at(1, 0).repair_at(1, 1).fail_at(0, 1))
  d.advance(0)
  d.commit(d.decide(0))
  placements, changed = d.advance(1)
  assert placements == [(0, 1)] and changed and d.live() == (1,)


def test_absent_slices_fail_and_come_back_present():
  d = _decider(present=(0, 1))
  d.apply_presence(5)
  assert d.live() == (0, 1) and [e['source'] for e in d.state.events] == ['absent', 'absent']
  assert not d.apply(FailureEvent(6, 2, 'repair'))  # no devices: a repair waits for a start
  back = _decider(present=(0, 1, 2, 3), state=DeciderState.from_meta(d.state.to_meta()))
  back.apply_presence(7)
  assert back.live() == (0, 1, 2, 3) and back.state.events[-1]['source'] == 'present'


def test_the_state_is_the_snapshot_meta_written_before_the_decider_key_for_key():
  """The meta of a snapshot written at d33af66 (tests/fixtures/old_layout) reads back into the
  decider and is written again with the same keys and values, plus the goodput's `restart`
  bucket (added since, read as 0)."""
  path = ROOT / 'tests/fixtures/old_layout/run/checkpoints/e872a0074c09/3/meta/metadata'
  old = json.loads(path.read_text())['controller']
  again = sections.to_json(DeciderState.from_meta(sections.from_json(DeciderMeta, old)).to_meta())
  assert again == {**old, 'goodput': {**old['goodput'], 'restart': 0.0}}
  assert list(again) == ['failed', 'events', 'goodput', 'samples']
  assert json.loads(json.dumps(again)) == again


def test_the_failure_schedule_keeps_its_old_import_path():
  from mecefo_jax.fault.failures import FailureSchedule as old_home
  assert old_home is FailureSchedule


def test_a_slice_list_in_a_log_line_writes_runs_of_three_or_more_as_ranges():
  assert [slice_list(s) for s in [(), (3,), (0, 1, 4, 5), (5, 7, 8, 9, 20), range(256)]] == [
      '[]', '[3]', '[0, 1, 4, 5]', '[5, 7-9, 20]', '[0-255]']
  assert str(ProgramKey(EVAL, tuple(s for s in range(32) if s != 3))) == (
      'eval program for slices [0-2, 4-31]')
