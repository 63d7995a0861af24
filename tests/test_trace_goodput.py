"""The fault-log replay: rejoin batching, checkpoint-restart and takeover charged by hand, and the
benchmark end to end at a tiny scale (slow)."""
import math

import pytest

from mecefo_jax.core import programs
from mecefo_jax.core.roles import Role
from mecefo_jax.core.takeover import Planner
from mecefo_jax.core.timed import TimedEvent as E
from mecefo_jax.plan import loss_equivalent
from mecefo_jax.plan.cost_model import ClusterCosts
from mecefo_jax.plan.log_replay import Rejoin, batched, checkpoint_restart, takeover
from mecefo_jax.plan.simulate import PolicyModel

H = 3600.0


def test_the_default_is_named_as_a_policy_spec():
  from benchmarks.trace_goodput import default_policy
  from mecefo_jax.config import load_config
  assert default_policy(load_config(None, ['faults.takeover=budget',
                                           'faults.time_budget=1.05'])) == 'budget:1.05'
  assert default_policy(load_config(None, ['faults.takeover=exact'])) == 'exact'


def test_repairs_wait_for_the_rejoin_policy_and_a_node_failing_meanwhile_never_rejoined():
  events = [E(1 * H, 0, 'fail'), E(2 * H, 0, 'repair'), E(3 * H, 1, 'fail'), E(4 * H, 1, 'repair'),
            E(10 * H, 0, 'fail'), E(30 * H, 2, 'fail'), E(31 * H, 2, 'repair')]
  assert batched(events, Rejoin.parse('now')) == events
  # every 24 h: slice 0 fails again before its rejoin at 24 h, so it stays down (both go).
  assert batched(events, Rejoin.parse('every:24')) == [
      E(1 * H, 0, 'fail'), E(3 * H, 1, 'fail'), E(24 * H, 1, 'repair'), E(30 * H, 2, 'fail'),
      E(48 * H, 2, 'repair')]
  # when 2 wait: slices 0 and 1 rejoin together once the second is back; slice 2 waits alone.
  assert batched(events, Rejoin.parse('count:2')) == [
      E(1 * H, 0, 'fail'), E(3 * H, 1, 'fail'), E(4 * H, 0, 'repair'), E(4 * H, 1, 'repair'),
      E(10 * H, 0, 'fail'), E(30 * H, 2, 'fail')]
  for bad in ('later', 'every:0', 'count:1.5', 'every:x'):
    with pytest.raises(ValueError, match='rejoin policy must be now, every:HOURS or count:K'):
      Rejoin.parse(bad)


def test_checkpoint_restart_loses_the_work_since_its_checkpoint_and_waits_without_a_spare():
  events = [E(250.0, 2, 'fail'), E(600.0, 2, 'repair')]
  # Nodes 1, 2 train, node 0 is the spare: 250 s trained, 200 kept, then 10 s of restart.
  out = checkpoint_restart(events, 3, 1, 1000.0, 1.0, 1, 10.0, 100.0)
  assert out.samples == pytest.approx(2 * (200 + 740)) and out.restarts == 1
  assert out.lost_s['since_checkpoint'] == pytest.approx(50.0)
  # No spare: the job waits for the repair at 600 s, then restarts.
  out = checkpoint_restart(events, 3, 0, 1000.0, 1.0, 1, 10.0, 100.0)
  assert out.samples == pytest.approx(3 * (200 + 390))
  assert out.lost_s['waiting_for_repair'] == pytest.approx(350.0)


def test_takeover_restarts_on_a_death_and_on_the_return():
  b, n = 2, 4
  costs = ClusterCosts(normal_s=1.0, update_s=0.0, group_s={Role(b): 1.0},
                       group_compile_s={Role(b): 0.0}, fused_compile_s=0.0,
                       compile_s_by_kind=dict.fromkeys(programs.KINDS, 0.0))
  model = PolicyModel(Planner(n, b, 'drop'), costs)
  events = [E(100.0, 1, 'fail'), E(300.0, 1, 'repair')]
  out, _ = takeover(events, 1000.0, model, 10.0, 1.0)
  # 100 steps on 4, a death (10 s + the step in flight), 189 on 3, a return (10 s), 690 on 4.
  assert out.restarts == 2 and out.samples == pytest.approx(b * (4 * 100 + 3 * 189 + 4 * 690))
  assert out.dropped == pytest.approx(b * 189)
  assert out.lost_s == {'restart': 20.0, 'step_in_flight': 1.0, 'since_checkpoint': 0.0,
                        'waiting_for_repair': 0.0}
  # In loss: the 189 steps of 6 rows of 8 each make 0.75 of a full step at r -> inf, and at
  # r = 1 2 * 0.75 / 1.75 of one; the fault-free run makes 1000 steps in the time.
  assert out.mix == pytest.approx({(8, 0): 790.0, (6, 0): 189.0})
  assert loss_equivalent.percent(out.mix, 8, 1000.0, 0.5, math.inf) == pytest.approx(
      (790 + 189 * 0.75) / 10)
  assert loss_equivalent.percent(out.mix, 8, 1000.0, 0.5, 1.0) == pytest.approx(
      (790 + 189 * 1.5 / 1.75) / 10)
  # The limit: slice 1 down 200 s of 1000, nothing else lost.
  assert loss_equivalent.mean_progress_of_live(events, n, 1000.0, math.inf) == pytest.approx(0.95)
  assert loss_equivalent.mean_progress_of_live(events, n, 1000.0, 1.0) == pytest.approx(
      (800 + 200 * 1.5 / 1.75) / 1000)


def test_a_degraded_row_counts_v_of_an_exact_one_and_a_shrunk_batch_loses_less_at_r1():
  mix = {(6, 2): 10.0}  # 10 steps of 6 exact and 2 degraded rows of 8
  assert loss_equivalent.percent(mix, 8, 10.0, 1.0, math.inf) == pytest.approx(100.0)
  assert loss_equivalent.percent(mix, 8, 10.0, 0.0, math.inf) == pytest.approx(75.0)
  assert loss_equivalent.percent(mix, 8, 20.0, 0.5, math.inf, keep=0.9) == pytest.approx(
      100 * 0.9 * 7 / 8 / 2)
  assert loss_equivalent.progress(0.75, 1.0) == pytest.approx(1.5 / 1.75)  # > 0.75
  # Checkpoint-restart's steps are the job's rows, all exact: 2 of 3 nodes' rows.
  out = checkpoint_restart([], 3, 1, 100.0, 1.0, 1, 10.0, 100.0)
  assert out.mix == {(2, 0): pytest.approx(100.0)}


@pytest.mark.slow
def test_the_benchmark_replays_a_window_of_the_real_log(launcher, tmp_path):
  result = launcher.benchmark(
      'trace_goodput', '--trace', 'benchmarks/traces/infinitehbd_days0-174.5.json', '--days',
      '20:40', '--slices', '16', '--seeds', '2', '--policies', 'spread,budget:1.0', '--spares',
      '0,4', '--sweep-restart-s', '30', '--sweep-checkpoint-min', '10,60', '--rejoin-levers',
      'every:24', '--slice-hosts', '2', '--hot-spares', '2', '--figure', tmp_path / 'f.png',
      json_path=tmp_path / 'tg.json')
  from benchmarks.trace_goodput import default_policy
  from mecefo_jax.config import Config
  default = default_policy(Config())  # replayed whether --policies names it or not
  assert result['default'] == default and result['slices'] == 16 and result['nodes'] == 400
  names = {'spread', 'budget:1.0', default, 'elastic-restart', 'checkpoint-restart-0-spares',
           'checkpoint-restart-4-spares'}  # servers: 4 are two slices of 2 hosts
  assert set(result['approaches']) == names
  for r in result['approaches'].values():
    assert {'goodput_pct', 'dropped_pct', 'degraded_pct', 'restarts'} <= set(r)
    assert 0.0 <= r['goodput_pct'] <= 100.0 and len(r['goodput_pct_per_seed']) == 2
    assert r['loss_equivalent_pct'] <= r['loss_equivalent_r1_pct']  # a shrunk batch: r = 1
  model, limit = result['loss_model'], result['limit_pct']
  assert model['source'].startswith('docs/results/row_value_tiny.json') and 0 < model['v'] < 1
  elastic = result['approaches']['elastic-restart']  # the limit less the snapshot tax, at most
  assert elastic['loss_equivalent_pct'] <= limit['r_inf'] and \
      elastic['loss_equivalent_r1_pct'] <= limit['r1'] <= 100.0
  # 2 of 16 slices (2 hosts each) are spares: checkpoint-restart keeps at most 14/16 of them.
  assert result['approaches']['checkpoint-restart-4-spares']['goodput_pct'] <= 100 * 14 / 16
  assert result['slice_hosts'] == 2 and result['micro_batch'] == 2 * result['rows_per_host']
  # Two of the 32 servers hot spares: 15 slices train, the hardware counts all 32 servers.
  hot = result['hot_spares']['2']
  assert (hot['servers'], hot['slices'], hot['spares']) == (32, 15, 2)
  for r in hot['approaches'].values():
    assert r['of_hardware_pct'] == pytest.approx(r['goodput_pct'] * 30 / 32)
  assert set(result['what_if']) == {f'{default}+peers', 'elastic-restart+peers'}
  assert set(result['sensitivity']['goodput_pct']) == names
  assert result['sweep']['restart_s'][0] == 30.0 and (tmp_path / 'f.png').stat().st_size > 0
  assert set(result['profiles']) == {'fast', 'FlashRecovery', 'slow'}
