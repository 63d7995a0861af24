"""Controller on 8 fake devices: takeover, rejoin, equivalence with the fault-free step, goodput."""
import dataclasses
import functools
import math

import jax
import numpy as np
import optax
import pytest

from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.data import order, synthetic
from mecefo_jax.core import goodput
from mecefo_jax.fault import executor
from mecefo_jax.fault.controller import Controller, SliceFailure
from mecefo_jax.core.failures import FailureSchedule
from mecefo_jax.model import llama, train_state
from mecefo_jax.core.programs import KINDS, ProgramKey, next_live_sets
from mecefo_jax.core.roles import Role
from mecefo_jax.step.cache import ProgramCache
from mecefo_jax.step import initializer
from mecefo_jax.step.precompile import Precompiler
from procs import suite_store

pytestmark = pytest.mark.usefixtures('devices')

# The tests below count the paper's neighbour takeover's rows unless they name a policy.
TINY = ['model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=48', 'model.seq_len=16',
        'model.n_layers=1', 'model.vocab_size=256', 'train.micro_batch=4',
        'faults.takeover=neighbor']
MESHES = {'4x2': ('mesh.slice=4', 'mesh.fsdp=2'), '8x1': ('mesh.slice=8',),
          '2x4': ('mesh.slice=2', 'mesh.tensor=4')}
B, L = 4, 16
CORPUS = synthetic.SyntheticCorpus(vocab_size=256, seq_len=L, seed=0)
ALL4 = (0, 1, 2, 3)


def K(kind: str, slices, variant=None) -> ProgramKey:
  return ProgramKey(KINDS[kind], slices, variant)


@functools.lru_cache(maxsize=None)
def _mesh(name):
  """(mesh, a fresh sharded initial state each call, graphdef)."""
  cfg = load_config(None, [*TINY, *MESHES[name]])
  mesh = sharding.make_mesh(cfg.mesh)
  return mesh, lambda: initializer.create(cfg, mesh, suite_store()), llama.abstract(cfg.model)[0]


def _controller(name='4x2', *faults, schedule=None):
  """A fresh controller (fresh state) whose programs come from the suite's program store
  where an earlier test built them (procs.suite_store)."""
  cfg = load_config(None, [*TINY, *MESHES[name], *faults])
  mesh, init, graphdef = _mesh(name)
  schedule = schedule or FailureSchedule(mesh.shape['slice'])
  return Controller(cfg, mesh, graphdef, CORPUS, schedule, init(), program_store=suite_store())


def _host(tree):
  """A real host copy (on CPU device_get can alias buffers that the next step donates)."""
  return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(tree))


@functools.lru_cache(maxsize=None)
def _fault_free_step0():
  """(params before, loss, params after) of the fault-free fused step 0 on 4x2."""
  c = _controller()
  params0 = _host(c.state.params)
  loss = float(c.step(0)['loss'])
  return params0, loss, _host(c.state.params)


def _assert_params_close(got, want):
  for a, b in zip(jax.tree.leaves(_host(got)), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# --- failure and rejoin on three meshes ---------------------------------------------------

RUNS = {'4x2': ('neighbor', 2), '8x1': ('spread', 2), '2x4': ('neighbor', 1)}


@functools.lru_cache(maxsize=None)
def _fail_and_rejoin(name):
  """Steps 0-3: normal, slice fails at 1, repaired (rejoins) at 3. Returns (controller, losses)."""
  policy, victim = RUNS[name]
  n = _mesh(name)[0].shape['slice']
  c = _controller(name, f'faults.takeover={policy}',
                  schedule=FailureSchedule(n).fail_at(victim, 1).repair_at(victim, 3))
  return c, [float(c.step(t)['loss']) for t in range(4)]


@pytest.mark.parametrize('name', RUNS)
def test_fail_and_rejoin_replicas_bit_identical(name):
  c, losses = _fail_and_rejoin(name)
  n, victim = c.n_slices, RUNS[name][1]
  assert [(e['step'], e['slice'], e['kind']) for e in c.events] == [(1, victim, 'fail'),
                                                                     (3, victim, 'repair')]
  hashes = c.replica_hashes()
  assert sorted(hashes) == list(range(n)) and len(set(hashes.values())) == 1
  assert all(map(math.isfinite, losses)), losses
  assert c.samples == {'exact': 4 * n * B - c.samples['degraded'], 'degraded': c.samples['degraded'],
                       'dropped': 0} and c.samples['degraded'] > 0


@pytest.mark.parametrize('name', ['8x1', '2x4'])  # meshes whose programs no other test compiles
def test_goodput_after_failures(name):
  c, _ = _fail_and_rejoin(name)
  g = c.goodput
  assert g['compile'] > 0 and g['degraded_productive'] > 0 and g['normal_productive'] > 0, g
  assert g['rejoin'] > 0 and g['lost'] == 0, g


# --- one slice down on 4x2: the same step as without faults --------------------------------

def test_no_fault_runs_only_the_fused_program():
  c = _controller()
  c.step(0)
  assert [key for key, _ in c.last_built] == [K('fused', ALL4, Role(exact=B))]
  c.step(1)
  assert c.last_built == ()  # built once, for the first step that needed it
  assert set(c.programs.keys()) == {K('fused', ALL4, Role(exact=B))}
  assert c.samples == {'exact': 2 * 4 * B, 'degraded': 0, 'dropped': 0}
  assert c.goodput['degraded_productive'] == c.goodput['lost'] == 0.0


def test_naive_takeover_equals_fault_free_step():
  params0, loss, params = _fault_free_step0()
  c = _controller('4x2', 'faults.takeover=naive', schedule=FailureSchedule(4).fail_at(2, 0))
  metrics = c.step(0)
  assert c.live() == (0, 1, 3) and K('group', (3,), Role(exact=2 * B)) in c.programs.keys()
  built = dict(c.last_built)  # what the step waited for: its group programs and the update
  assert K('group', (3,), Role(exact=2 * B)) in built and set(built.values()) <= {
      'compiled', 'loaded', 'moved'}
  assert c.samples == {'exact': 4 * B, 'degraded': 0, 'dropped': 0}
  assert float(metrics['exact_tokens']) == 4 * B * L and float(metrics['degraded_tokens']) == 0
  np.testing.assert_allclose(float(metrics['loss']), loss, rtol=1e-6)
  _assert_params_close(c.state.params, params)
  with pytest.raises(AssertionError):  # the step did move the params
    _assert_params_close(c.state.params, params0)


def test_neighbor_takeover_loss_equals_fault_free_loss():
  _, loss, _ = _fault_free_step0()
  c = _controller(schedule=FailureSchedule(4).fail_at(2, 0))
  metrics = c.step(0)
  assert K('group', (3,), Role(degraded=2 * B)) in c.programs.keys()
  assert c.samples == {'exact': 2 * B, 'degraded': 2 * B, 'dropped': 0}
  np.testing.assert_allclose(float(metrics['loss']), loss, rtol=1e-6)


def test_budget_takeover_degrades_fewest_rows_and_keeps_the_loss():
  _, loss, _ = _fault_free_step0()
  c = _controller('4x2', 'faults.takeover=budget', 'faults.degraded_cost=0.3',
                  schedule=FailureSchedule(4).fail_at(2, 0))
  metrics = c.step(0)
  # Slice 2's 4 rows over 3 live slices in granules of fsdp=2, each slice within a normal
  # step's cost (4): one slice degrading 6 rows (2 exact + 0.3 * 6 <= 4) beats two degrading 4.
  groups = {k.slices: k.variant for k in c.programs.keys() if k.kind.name == 'group'}
  assert groups == {(3,): Role(2, 6), (0, 1): Role(exact=B)}, groups
  assert c.samples == {'exact': 2 + 2 * B, 'degraded': 6, 'dropped': 0}
  np.testing.assert_allclose(float(metrics['loss']), loss, rtol=1e-6)


def _mean_loss(params, tokens_NxL1):
  logits = llama.forward(_mesh('4x2')[2], params, tokens_NxL1[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_NxL1[:, 1:]).mean()


def test_drop_loss_is_mean_over_live_samples():
  params0, loss, _ = _fault_free_step0()
  tokens = order.global_batch(CORPUS, 0, 4, B)
  full = float(jax.jit(_mean_loss)(params0, tokens.reshape(-1, L + 1)))
  np.testing.assert_allclose(full, loss, rtol=1e-5)  # the reference reproduces the controller
  live_only = float(jax.jit(_mean_loss)(params0, tokens[[0, 1, 3]].reshape(-1, L + 1)))
  c = _controller('4x2', 'faults.takeover=drop', schedule=FailureSchedule(4).fail_at(2, 0))
  metrics = c.step(0)
  np.testing.assert_allclose(float(metrics['loss']), live_only, rtol=1e-5)
  assert abs(live_only - full) > 1e-4
  assert c.samples == {'exact': 3 * B, 'degraded': 0, 'dropped': B}
  assert set(c.programs.keys()) == {K('fused', (0, 1, 3), Role(exact=B))}
  assert c.goodput['lost'] > 0


# --- several slices down -----------------------------------------------------------------

def test_neighbor_of_neighbor_then_last_slice_carries_all_then_all_down():
  sched = FailureSchedule(4).fail_at(1, 0).fail_at(2, 0).fail_at(3, 1).fail_at(0, 2)
  c = _controller('4x2', f'faults.max_degraded_rows={2 * B}', schedule=sched)
  # Step 0: slice 1's neighbour (2) is down too, so slice 3 carries 1, 2 and its own.
  m0 = c.step(0)
  assert K('group', (3,), Role(degraded=3 * B, passes=2)) in c.programs.keys()
  # Step 1: slice 0 alone carries all four micro-batches, in passes of at most 2B rows.
  m1 = c.step(1)
  assert K('group', (0,), Role(degraded=4 * B, passes=2)) in c.programs.keys()
  assert float(m1['exact_tokens']) == 0 and float(m1['degraded_tokens']) == 4 * B * L
  assert math.isfinite(float(m0['loss'])) and math.isfinite(float(m1['loss']))
  assert c.samples == {'exact': B, 'degraded': 7 * B, 'dropped': 0}
  with pytest.raises(executor.AllSlicesDown, match='all 4 slices are down at step 2'):
    c.step(2)


# --- errors raised while dispatching a slice's work ---------------------------------------

@pytest.mark.parametrize('error', [SliceFailure, lambda s: RuntimeError('device lost')],
                         ids=['slice_failure', 'any_exception'])
def test_error_hook_fails_the_slice_and_training_goes_on(error):
  c = _controller()

  def hook(s, step):
    if (s, step) == (2, 3):
      raise error(s)
  c.error_hooks.append(hook)
  losses = [float(c.step(t)['loss']) for t in range(5)]
  assert c.live() == (0, 1, 3) and all(map(math.isfinite, losses)), losses
  [event] = c.events
  assert (event['step'], event['slice'], event['kind']) == (3, 2, 'fail')
  assert event['source'].startswith('error: ')
  # Steps 0-2 normal; 3 and 4: slice 3 carries slice 2's micro-batch, degraded.
  assert c.samples == {'exact': 3 * 4 * B + 2 * 2 * B, 'degraded': 2 * 2 * B, 'dropped': 0}


def test_error_naming_a_failed_slice_is_raised_not_retried():
  c = _controller(schedule=FailureSchedule(4).fail_at(1, 0))

  def hook(s, step):
    raise SliceFailure(1)
  c.error_hooks.append(hook)
  with pytest.raises(SliceFailure):
    c.step(0)


def test_repair_and_failure_of_every_holder_in_one_step_hands_the_state_over():
  """Step 1: slice 1 is repaired while slice 0, the only holder of the state, fails. Repairs
  come first, so slice 1 receives the state before slice 0 goes down."""
  sched = FailureSchedule(2).fail_at(1, 0).repair_at(1, 1).fail_at(0, 1).repair_at(0, 2)
  c = _controller('2x4', schedule=sched)
  losses = [float(c.step(t)['loss']) for t in range(3)]
  assert all(map(math.isfinite, losses)), losses
  assert [(e['step'], e['slice'], e['kind']) for e in c.events] == [
      (0, 1, 'fail'), (1, 1, 'repair'), (1, 0, 'fail'), (2, 0, 'repair')]
  assert int(c.state.step) == 3 and c.state_slices == (0, 1)
  assert len(set(c.replica_hashes().values())) == 1
  assert c.samples == {'exact': 2 * B, 'degraded': 4 * B, 'dropped': 0}


def test_repair_after_every_holder_is_down_says_why():
  c = _controller('2x4', schedule=FailureSchedule(2).fail_at(0, 0).fail_at(1, 1).repair_at(0, 2))
  c.step(0)
  with pytest.raises(executor.AllSlicesDown, match='all 2 slices are down'):
    c.step(1)
  with pytest.raises(executor.AllSlicesDown, match='no live slice holds the training state'):
    c.step(2)


# --- precompile ------------------------------------------------------------------------------

def test_next_live_sets_one_failure_or_repair_away_likeliest_first():
  assert list(next_live_sets((0, 1, 2), 4)) == [(0, 1, 2, 3), (1, 2), (0, 2), (0, 1)]
  assert list(next_live_sets((2,), 3)) == [(0, 2), (1, 2)]  # the last live slice: repairs only


def _lone(live) -> set:
  """The programs of a lone live slice carrying both micro-batches: fused, refreshes, eval."""
  carrier = Role(degraded=2 * B)
  return {K('fused', live, carrier), K('refresh_cold', live), K('refresh_warm', live),
          K('eval', live)}


@pytest.mark.parametrize('move', ['never', 'always'])
def test_precompile_builds_the_next_live_sets_programs_in_the_background(move):
  """A fresh controller (no programs shared with other tests): the background thread builds
  both one-failure live sets' programs (with moves: compiles one set's shapes and moves them
  onto the other), so the failure step builds nothing on the training thread; the failure
  queues the set one event away from the new live set and drops the other one's programs."""
  mesh, init, graphdef = _mesh('2x4')
  cfg = load_config(None, [*TINY, *MESHES['2x4'], f'train.move_programs={move}'])
  c = Controller(cfg, mesh, graphdef, CORPUS, FailureSchedule(2).fail_at(1, 1), init())
  c.step(0)
  c.start_precompile()
  c.precompiler.wait()
  assert _lone((1,)) | _lone((0,)) <= c.programs.keys()
  assert c.precompiler.compiled == 2 and c.precompiler.seconds > 0
  stats = dataclasses.replace(c.programs.stats)
  assert (stats.compiled, stats.moved, stats.moved_ahead) == (
      (9, 0, 0) if move == 'never' else (5, 4, 4)), stats
  compile_s = c.goodput['compile']
  loss = float(c.step(1)['loss'])  # slice 1 fails: its programs are ready
  assert math.isfinite(loss) and c.live() == (0,)
  assert c.goodput['compile'] == compile_s  # nothing was built on the training thread
  c.precompiler.wait()  # the repair set (0, 1) was queued: its fused step exists already
  assert K('eval', (0, 1)) in c.programs.keys() and not _lone((1,)) & c.programs.keys()
  assert c.programs.stats.compiled == stats.compiled + 1  # that eval, in the background
  c.precompiler.stop()


def test_the_background_builder_builds_each_wanted_set_once_while_it_stays_wanted():
  built = []
  builder = Precompiler(built.append)
  builder.want([(0,), (1,)])
  builder.wait()
  builder.want([(1,), (2,)])  # (1,) is built and still wanted: not again
  builder.wait()
  builder.want([(0,)])  # (0,) was dropped when no longer wanted: built again
  builder.wait()
  builder.stop()
  assert built == [(0,), (1,), (2,), (0,)]


def test_precompile_keeps_at_most_precompile_max_programs_ahead_of_need():
  c = _controller('2x4', 'faults.precompile_max=2')
  c.step(0)
  c.start_precompile()
  c.precompiler.wait()
  assert len(c.programs.ahead) == 2 and c.programs.ahead < _lone((1,)), c.programs.ahead
  c.precompiler.stop()


# --- the program cache ---------------------------------------------------------------------

def test_program_cache_builds_a_key_once_and_books_only_the_waits_of_steps():
  mesh, _, graphdef = _mesh('4x2')
  booked = []
  cache = ProgramCache(load_config(None, [*TINY, *MESHES['4x2']]),
                       sharding.PresentSlices(mesh, ALL4), graphdef, booked.append)
  first, second = K('eval', (0,)), K('eval', (1,))
  built = cache.program(first, ahead=True)  # the background builder's request: no step waits
  assert booked == [] and cache.ahead == {first}
  assert cache.program(first) is built  # a step asks: built once, no longer ahead of need
  assert booked == [] and cache.ahead == set()
  cache.program(second)  # built for a step that waits for it
  assert len(booked) == 1 and cache.keys() == {first, second}
  assert [(key, ahead) for key, _, ahead in cache.built] == [(first, True), (second, False)]
  assert cache.stats.compiled + cache.stats.loaded + cache.stats.moved == 2


# --- the goodput ledger --------------------------------------------------------------------

def test_goodput_books_compiles_apart_and_splits_a_failed_step_by_its_rows(monkeypatch):
  clock = iter([0.0, 10.0, 16.0, 16.0, 19.0])
  monkeypatch.setattr(goodput.time, 'perf_counter', lambda: next(clock))
  g = goodput.Goodput()
  g.start_step()  # t=0
  g.book('compile', 3.0)
  g.end_step(8, 8, failed=False)  # t=10: 10 s less the 3 s compile
  g.exclude(2.0)  # an eval between the steps: the next step starts at 12
  g.start_step()
  g.end_step(6, 8, failed=True)  # t=16: 4 s, 6 of 8 rows processed
  g.restart_clock()  # a resume: the next step starts when it starts (t=16)
  g.start_step()
  g.end_step(8, 8, failed=False)  # t=19
  assert g.seconds == {'normal_productive': 7.0 + 3.0, 'degraded_productive': 3.0,
                       'compile': 3.0, 'rejoin': 0.0, 'lost': 1.0, 'restart': 0.0}
  assert goodput.Goodput(g.seconds).seconds == g.seconds  # restored from a snapshot's meta


# --- programs moved between sets of slices ---------------------------------------------------

def test_a_second_live_set_of_one_shape_moves_its_programs_and_trains_the_same_params():
  """Fresh controllers (no programs shared with other tests): slice 1 down at step 1, back at
  2, slice 2 down at 3. Live sets (0, 2, 3) and (0, 1, 3) have one shape: the second compiles
  nothing, and the params equal those of a run that compiles every program (move off)."""
  mesh, init, graphdef = _mesh('4x2')
  sched = FailureSchedule(4).fail_at(1, 1).repair_at(1, 2).fail_at(2, 3)
  runs = {}
  for move in ('always', 'never'):
    cfg = load_config(None, [*TINY, *MESHES['4x2'], f'train.move_programs={move}'])
    c = Controller(cfg, mesh, graphdef, CORPUS, sched, init())
    for t in range(3):
      c.step(t)
    before = dataclasses.replace(c.programs.stats)
    c.step(3)
    runs[move] = c, before
  c, before = runs['always']
  assert c.programs.move and before.moved == 0
  assert c.programs.stats.compiled == before.compiled, c.programs.stats
  assert c.programs.stats.moved == 3  # the groups (0, 1) and (3,), the update
  off, _ = runs['never']
  assert not off.programs.move and off.programs.stats.moved == 0
  assert train_state.params_sha256(c.state.params) == train_state.params_sha256(off.state.params)
