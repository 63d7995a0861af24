"""The renderers of the recovery results (restart, stall, stop): one line per JSON file, for
benchmarks/results.py's tables."""
from __future__ import annotations

import statistics


def _recovery(d: dict) -> str:
  kills = ', '.join(f"{x['kill_to_first_step_s']:.1f}" for x in d['deaths'])
  return (f"{d['processes']} processes: SIGKILL to the first step trained again {kills} s "
          f"(cold start {d['cold_start']['first_step_s']:.1f} s)")


_FAILURE = {False: 'SIGKILL of host 1', True: "host 1's node removed",
            'graceful': "host 1's node removed", 'hard': "host 1's node killed (raylet SIGKILLed)"}


def _restart_time(d: dict) -> str:
  """Per backend (local supervisor, Ray driver): the failure to the first step trained again."""
  over = ' '.join(d['overrides']) or 'defaults'
  failure = _FAILURE[d.get('remove_node', False)]
  runs = d.get('by_backend') or {'local': {'median': d['median'], 'runs': d['runs']}}
  return (f"{d['processes']} processes ({over}), {failure} after step {d['kill_at']}, medians "
          f"of {d['repeats']}: " + '; '.join(
              (f'{backend}: ' if 'by_backend' in d else '') + _restart_figures(r['median'], r['runs'])
              for backend, r in runs.items()))


def _restart_figures(m: dict, runs: list[dict]) -> str:
  phases = ', '.join(f"{k} {m[k + '_s']:.1f}" for k in (
      'detect', 'stop', 'spawn', 'imports', 'distributed', 'setup', 'restore', 'programs',
      'first_step'))
  seen = f"seen in {m['seen_s']:.1f} s, " if 'seen_s' in m else ''
  return (f"{seen}to the first step trained again {m['kill_to_first_step_s']:.1f} s, cold start "
          f"{m['cold_start_s']:.1f} s, ratio {m['ratio']:.2f} ({_restart_case(runs)}); "
          f"phases (s): {phases}")


def _restart_case(runs: list[dict]) -> str:
  """Which case a restart is: whether the dead job's background builds had stored the survivors'
  programs (loaded) or the survivors compiled them (a death in a job's first steps)."""
  median = lambda key: statistics.median(r['programs'][key] for r in runs)
  return (f"the survivors' job loaded {median('loaded'):g} programs from the store and compiled "
          f"{median('compiled'):g}")


def _stall_recovery(d: dict) -> str:
  over = ' '.join(d['overrides']) or 'defaults'
  seen = (f"seen as a death in {d['detect_s']:.1f} s" if d['deadline_s'] is None else
          f"detected in {d['detect_s']:.1f} s (deadline {d['deadline_s']:.0f} s, "
          f"{d['deadline_from']}), host {d['named_host']} named")
  return (f"{d['processes']} processes ({over}), host {d['host']} {d['how']} at step "
          f"{d['step_at_stop']}: {seen}; stop to the first step trained again "
          f"{d['stop_to_first_step_s']:.1f} s; dropped {d['samples']['dropped']}")


def _late_death(d: dict) -> str:
  rule = 'an abort alone counted after 5 s (last words ignored)' if d['ignore_words'] else (
      "each abort's last words read")
  said = '; '.join(f'host {h}: {(w or "?").split("] ", 1)[-1][:70]}'
                   for h, w in d['survivors_said'].items())
  return (f"3 processes, host {d['victim']} SIGKILLed, its exit seen {d['late_s']:g} s after "
          f"its survivors' ({said}); {rule}: the job restarted for host(s) {d['deaths']}, "
          + ('the victim' if d['restarted_for_victim'] else 'a survivor, not the victim'))


def _stall_clean_runs(d: dict) -> str:
  walls = [r['wall_s'] for r in d['clean_runs']]
  return (f"{d['runs_ok']} of {len(walls)} runs of the README's multi-process example (evals, "
          f"both snapshot tiers, an empty compile cache each) ended with exit 0; false stalls "
          f"{d['false_stalls']}; {min(walls):.0f}-{max(walls):.0f} s each")


def _stop_time(d: dict) -> str:
  return (f"{d['processes']} process(es): SIGTERM to exit {d['stop_s']} s, both tiers saved "
          f"{d['both_tiers']}, exit {d['exit_code']}")


def _ray_driver_lost(d: dict) -> str:
  over = ' '.join(d['overrides']) or 'defaults'
  return (f"{d['processes']} processes on Ray ({over}), the driver SIGKILLed after step "
          f"{d['kill_step']}, lease {d['stopped_s']:g} s: the job stopped itself after step "
          f"{d['stop_step']}, {d['kill_to_stop_s']:.1f} s after the kill (every trainer gone at "
          f"{d['kill_to_trainers_gone_s']:.1f} s); the same command resumed at step "
          f"{d['resumed_step']}, its first step {d['relaunch_to_first_step_s']:.1f} s after its "
          "launch")


def _soak(d: dict) -> str:
  """What was injected, how fast each kind recovered, and whether every check held."""
  g0, g1 = d['growth']['start'], d['growth']['end']
  mib = lambda b: f'{b / 2 ** 20:.0f}'
  length = f"{d['minutes']:g} min" if d['minutes'] else f"{d.get('rounds', 1)} round(s)"
  recovery = ', '.join(f"{k} {r['median']:.1f}/{r['max']:.1f}" for k, r in d['recovery_s'].items())
  restarts = d['programs_per_restart']
  compiled = sum(r['compiled'] for r in restarts)
  on = ' on a Ray cluster of this machine' if d.get('backend') == 'ray' else ''
  return (f"{d['processes']} processes{on}, {length} beside {d['busy']} busy cores, seed "
          f"{d['seed']}: {sum(d['faults'].values())} faults ("
          + ', '.join(f'{k} {n}' for k, n in d['faults'].items()) + f"); recovery median/max (s): "
          f"{recovery}; {compiled} programs compiled at {len(restarts)} restarts after a failure "
          f"(the rest loaded); hangs {d['hangs']}, disagreements {len(d['disagreements'])}, params equal "
          f"to the replay: {'yes' if d['sha_equal'] else 'no'}, leftovers {len(d['leftovers'])}; "
          f"RSS {mib(g0['rss_bytes'])} -> {mib(g1['rss_bytes'])} MiB, tmpfs "
          f"{mib(g0['shm_bytes'])} -> {mib(g1['shm_bytes'])} MiB, {d['steps']} steps")


def _job_cpu(d: dict) -> str:
  """Each tree's median CPU and wall seconds of one supervised job, against the first tree's."""
  trees = d['trees']
  return (f"a {d['processes']}-process job of {d['steps']} steps, warm program store, "
          f"{len(next(iter(d['runs'].values())))} runs per tree, alternately: " + '; '.join(
              f"`{t['commit']}` {t['cpu_s']:.1f} CPU s, {t['wall_s']:.1f} s wall"
              + ('' if i == 0 else
                 f" ({t['cpu_vs_first']:.3f}x CPU, {t['wall_vs_first']:.3f}x wall)")
              for i, t in enumerate(trees)) +
          f"; load {d['load_before'][0]:.1f} before, {d['load_after'][0]:.1f} after")


def _save_matrix(d: dict) -> str:
  """Each cell's stalls and deaths, steps and exit, beside how many busy cores."""
  cells = '; '.join(
      f"{c['processes']}p every {c['durable_every']}: {c['steps']} steps, {c['stalls']} stall(s)"
      f", {c['deaths']} death(s)" + ('' if c['clean'] else f", exit {c['exit_code']}, NOT clean")
      for c in d['cells'])
  return (f"{len(d['cells'])} jobs of {d['minutes']:g} min beside {d['busy']} busy cores, "
          f"snapshot.durable_every per job: {cells}; {d['stalls']} stall(s) in all")
