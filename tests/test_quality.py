"""Quality under failures: MeCeFO's final eval loss stays within 3% of the fault-free run."""
import pytest

from benchmarks import quality, quality_runs


def test_neighbor_takeover_loss_within_3pct_of_fault_free(launcher, tmp_path):
  # Slice 1 of 4 is down for half of the run (>= a third, as the issue asks). No plot and no
  # evals but the final one: the same losses, 14% less CPU. 150 steps, not tiny.yaml's 300: the
  # same claim at half the steps (eval increase 1.02% at 150, 1.48% at 300, 1.08% at 100; one
  # run each, 2026-12-02), and a sharper one: degraded rows' low-rank kernel gradients made -3x
  # (a defect injected into ops/lowrank.py) gave +4.12% at 150 steps, +2.01% at 300.
  result = launcher.benchmark('quality', '--policies', 'neighbor', '--fail-at', '0.2',
                              '--repair-at', '0.7', 'model.n_layers=1', 'train.plot=false',
                              'train.eval_every=0', 'train.steps=150',
                              json_path=tmp_path / 'q.json', optimized=True)
  assert result['device']['device_count'] == 4  # one fake CPU device per slice
  runs = result['runs']
  assert runs['neighbor']['samples']['degraded'] > 0
  assert runs['neighbor']['samples'].get('dropped', 0) == 0
  assert runs['neighbor']['params_sha256'] != runs['fault-free']['params_sha256']
  assert abs(runs['neighbor']['eval_increase_pct']) < 3.0, runs


def test_live_counts_apply_a_steps_events_first():
  from mecefo_jax.core.failures import FailureSchedule
  sched = FailureSchedule(4).fail_at(1, 2).fail_at(3, 3).repair_at(1, 5).repair_at(3, 5)
  assert quality_runs.live_counts(sched, 4, 7) == [4, 4, 3, 2, 2, 4, 4]
  stats = quality_runs.schedule_stats(sched, 4, 7)
  assert stats['failures'] == 2 and stats['min_live'] == 2
  assert stats['steps_with_failure_frac'] == pytest.approx(3 / 7)
  assert stats['mean_down_slices'] == pytest.approx(5 / 7)


def test_presets_mode_runs_the_preset_schedule_and_reports_the_floor(launcher, tmp_path):
  small = ['model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=64', 'model.seq_len=32',
           'model.n_layers=1', 'train.steps=30', 'train.log_every=2', 'train.plot=false']
  result = launcher.benchmark('quality', '--presets', 'high', '--policies', 'neighbor',
                              '--cluster-step-s', '7200', '--eval-batches', '2',
                              '--figure', tmp_path / 'q.png', *small,
                              json_path=tmp_path / 'q.json')
  high = result['presets']['high']
  assert high['schedule']['failures'] > 0 and result['simulated_hours'] == 60.0
  run = high['runs']['neighbor']
  assert run['samples']['degraded'] > 0 and run['samples'].get('dropped', 0) == 0
  assert result['floor_2pct_at_high']['neighbor']['eval_increase_pct'] == run['eval_increase_pct']
  assert (tmp_path / 'q.png').stat().st_size > 0


def test_seed_summary_and_its_figure(tmp_path):
  increases = {0: (1.0, 4.0), 1: (3.0, -2.0), 2: (2.0, 1.0)}  # seed: (neighbor, drop)
  per_seed = {s: {'presets': {'high': {'runs': {'neighbor': {'eval_increase_pct': n},
                                                'drop': {'eval_increase_pct': d}}}}}
              for s, (n, d) in increases.items()}
  summary = quality.seed_summary(per_seed)
  neighbor, drop = summary['high']['neighbor'], summary['high']['drop']
  assert neighbor['mean'] == pytest.approx(2.0) and neighbor['std'] == pytest.approx(1.0)
  assert neighbor['sem'] == pytest.approx(1.0 / 3 ** 0.5)
  assert (drop['min'], drop['max'], drop['per_seed']) == (-2.0, 4.0, [4.0, -2.0, 1.0])
  result = {'summary': summary, 'seeds': [0, 1, 2], 'config': 'configs/tiny.yaml',
            'overrides': [], 'data': 'synthetic', 'slices': 4}
  quality.plot_seeds(result, str(tmp_path / 's.png'))
  assert (tmp_path / 's.png').stat().st_size > 0


def test_the_interval_of_paired_differences_is_students_t():
  # Three seeds: mean 1, sample std 1, t(0.975, 2) = 4.3027: 1 +- 4.3027 / sqrt(3).
  low, high = quality_runs.t_interval([0.0, 1.0, 2.0])
  assert (low, high) == (pytest.approx(1 - 2.48414, abs=1e-4), pytest.approx(1 + 2.48414, abs=1e-4))
  assert quality_runs.t_interval([0.5]) is None
  assert quality_runs.mean_std_sem([0.0, 1.0, 2.0])['ci95'] == [low, high]


def test_requeue_trains_on_to_the_fault_free_runs_samples():
  from benchmarks import quality_trace
  fault_free = {'samples': {'exact': 640, 'degraded': 0, 'dropped': 0}}
  assert quality_trace.equal_samples('requeue', fault_free) == ('train.samples=640',)
  assert quality_trace.equal_samples('spread', fault_free) == ()


def test_budget_specs_set_the_time_budget():
  from mecefo_jax.plan.runs import policy_spec
  assert policy_spec('budget:1.05') == ('budget', 1.05)
  assert policy_spec('spread') == ('spread', None)
  with pytest.raises(ValueError, match='time budget'):
    policy_spec('budget:fast')
  args = quality._args(['--presets', 'high', '--policies', 'budget:1.05', 'train.steps=5'])
  cfg = quality._cfg(args, 'budget:1.05')
  assert (cfg.faults.takeover, cfg.faults.time_budget) == ('budget', 1.05)
  assert quality._cfg(args, 'fault-free').faults.takeover == 'neighbor'


def test_figure_needs_presets(capsys):
  with pytest.raises(SystemExit) as stop:
    quality.main(['--figure', 'x.png'])
  assert stop.value.code == 2 and '--figure needs --presets' in capsys.readouterr().err


LOG = 'benchmarks/traces/infinitehbd_days0-174.5.json'


def test_a_log_window_is_compressed_into_the_run_as_train_py_maps_it():
  import argparse
  from benchmarks import quality_trace
  args = argparse.Namespace(trace=LOG, days='20:40', trace_nodes=400, classes='all')
  log, where = quality_trace.mapping(args, steps=100, cluster_step_s=60.0, seed=3)
  assert where['days'] == [20.0, 40.0] and log.seed == 3 and log.start_day == 20.0
  assert where['log_s_per_step'] == pytest.approx(20 * 86400 / 100)  # 20 days in 100 steps
  assert log.compress * 60.0 == pytest.approx(where['log_s_per_step'])
  assert 'faults.trace_nodes=400' in where['train_py_settings']


def test_the_default_is_the_policy_with_most_goodput_within_the_loss_bound():
  from benchmarks import quality_trace
  loss = lambda mean, sem: {'mean': mean, 'sem': sem}
  assert quality_trace.within_bound(loss(0.3, 0.0)) and quality_trace.within_bound(loss(0.9, 1.0))
  assert not quality_trace.within_bound(loss(0.31, 0.2))
  summary = lambda ok: {'summary': {p: {'within_bound': v, 'eval_increase_pct': {'mean': 0.0}}
                                    for p, v in ok.items()}}
  quality = [summary({'spread': True, 'budget:1.0': False, 'exact': True, 'drop': True}),
             summary({'spread': True, 'budget:1.0': True, 'exact': True, 'drop': True})]
  replay = {'profile': 'fast', 'by_profile': {p: {'fast': {'goodput_pct': g}} for p, g in
                                              {'spread': 90.0, 'budget:1.0': 97.0,
                                               'exact': 88.0}.items()}}
  # budget:1.0 misses the bound at one slice count; drop is not replayed as a policy here.
  decision = quality_trace.decide(quality, replay)
  assert decision['default'] == 'spread' and decision['best_goodput'] == 'budget:1.0'
  assert decision['within_bound'] == {'spread': True, 'budget:1.0': False, 'exact': True,
                                      'drop': True}
  # None within the bound (drop aside): the frontier's recommendation stands.
  out = lambda means: {'summary': {p: {'within_bound': p == 'drop',
                                       'eval_increase_pct': {'mean': m}} for p, m in means.items()}}
  quality = [out({'spread': 0.9, 'budget:1.0': 2.0, 'drop': 0.1}),
             out({'spread': 0.5, 'budget:1.0': 0.8, 'drop': 0.2})]
  decision = quality_trace.decide(quality, replay, {'recommended': 'exact'})
  assert decision['default'] == 'exact' and decision['worst_mean_increase_pct']['budget:1.0'] == 2.0
  assert quality_trace.decide(quality, replay)['default'] is None


def test_trace_mode_trains_each_seed_through_its_own_draw_of_the_log(launcher, tmp_path):
  # One layer, no training.png per run: its runs' cost is building each live set's programs.
  small = ['model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=64', 'model.seq_len=32',
           'model.n_layers=1', 'train.steps=20', 'train.log_every=5', 'train.plot=false']
  # 4 slices, not 8: both seeds still draw failures, and fewer live sets to build (32 vs 56 CPU s).
  result = launcher.benchmark('quality', '--trace', LOG, '--slices', '4', '--seeds', '0,1',
                              '--policies', 'spread,drop', '--eval-batches', '2', *small,
                              json_path=tmp_path / 'q.json')
  assert result['mode'] == 'trace' and result['steps'] == 20
  s = result['summary']
  assert len(s['spread']['eval_increase_pct']['per_seed']) == 2
  for seed in result['per_seed'].values():
    sched, runs = seed['schedule'], seed['runs']
    assert sched['failures'] > 0, sched  # else the equality below would hold as 0 == 0
    # The policies of one seed train through one schedule: spread degrades the rows drop drops.
    assert runs['spread']['samples']['degraded'] == runs['drop']['samples']['dropped']
    assert (runs['spread']['degraded_pct'] > 0) == (sched['failures'] > 0)
    assert 0.0 <= sched['down_pct_in_steps'] <= 100.0
  draws = [tuple(e['slice'] for e in v['schedule']['events']) for v in result['per_seed'].values()]
  assert draws[0] != draws[1]  # each seed its own draw of nodes


def test_the_earlier_rule_picks_what_failures_md_says_and_its_block_is_current():
  """The rule of issue 52 (docs/failures.md, 'The earlier rule') on the JSON in docs/results:
  its pick, spread, was the default until the rule of 'How the default is chosen' (held by
  tests/test_plan.py) picked requeue; the block is the one benchmarks.results renders."""
  from pathlib import Path
  from benchmarks import quality_trace, results
  loaded = results.load()
  files = [d for n, d in loaded.items() if results.kind_of(n)[0] == 'quality_trace']
  assert {d['slices'] for d in files} >= {8, 32} and all(len(d['seeds']) >= 3 for d in files)
  replay = loaded[Path(files[0]['replay']).name]
  decision = quality_trace.decide(files, replay, loaded['frontier_32slices.json'])
  assert decision['default'] == 'spread'
  text = results.FAILURES.read_text()
  assert results.with_default_table(text, results.default_table(loaded)) == text, \
      'docs/failures.md default block is stale: run python -m benchmarks.results'
