"""A worker's SIGKILL under the supervisor against a cold start, phase by phase, over repeats.

Run: python -m benchmarks.restart_time [--repeats 3] [--processes 3] [--steps 150]
    [--kill-at 40] [--backends local,ray] [--remove-node] [--keep-xla-flags] [--json OUT]
    [overrides...]

Each repeat is one supervised run of the issue's scenario (`python -m mecefo_jax.launch -n 3
--devices-per-process 1 -- mesh.slice=3 train.steps=150 snapshot.every=1 train.log_every=1
train.eval_every=0`, --config tiny, overrides appended) in a fresh HOME (an empty program store
and compilation cache). Cold start: the launch to its first logged step. Once step --kill-at is
logged and the job has said 'background builds done' (the programs of the jobs that restart
after a death are in the program store), the process of host 1 is SIGKILLed; restart: the kill to
the first step logged by the survivors' job; `programs_built`: how that job's first step got
its programs (compiled, loaded). The supervisor then stops the job (SIGTERM: an agreed step),
and the report's `recovery` section gives where the restart went (detection, the survivors'
stop, the spawn, the processes' start: imports, jax.distributed, set-up, restore, programs, the
first step). Medians over the repeats; the machine's load (`uptime`) before and after.

--backends local,ray: each repeat runs the job under each backend in turn (alternately), the
Ray one (`--backend ray`) on a Ray cluster of this machine (benchmarks/ray_cluster.py: a 0-CPU
head, one 1-CPU node per host, started for the repeat and not timed); medians per backend.
`first_step_again_s`: the kill to the `recovered` line of history.jsonl (process 0's first
step trained again, written by it: no terminal's or Ray's log forwarding in it).
--remove-node [graceful|hard] (Ray): host 1's node is removed instead of its process killed
(hard: its raylet SIGKILLed, as a machine lost); `seen_s`: the removal's start to the driver's
`death` event (Ray's detection).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common, ray_cluster
from mecefo_jax.records import history
from mecefo_jax.records.history import Kind

PHASES = ('detect_s', 'stop_s', 'spawn_s', 'process_start_s', 'imports_s', 'distributed_s',
          'setup_s', 'restore_s', 'programs_s', 'first_step_s', 'total_s')


def _args(argv):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--processes', type=int, default=3)
  p.add_argument('--steps', type=int, default=150)
  p.add_argument('--kill-at', type=int, default=40, help='the step after which host 1 dies')
  p.add_argument('--wait-builds', action=argparse.BooleanOptionalAction, default=True,
                 help="the fault waits for the job's 'background builds done' too (none says it "
                 'with faults.precompile=never: --no-wait-builds)')
  p.add_argument('--backends', default='local', help='local, ray, or both in turn: local,ray')
  common.add_keep_xla_flags(p)  # HOME stays empty: the store and claims under test are cold
  p.add_argument('--remove-node', nargs='?', const='graceful', choices=('graceful', 'hard'),
                 help='ray: remove host 1\'s node instead of killing its process (hard: its '
                      'raylet SIGKILLed, no goodbye to the cluster)')
  return p.parse_intermixed_args(argv)


def load() -> str:
  return subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()


class Run(common.JobOutput):
  """One supervised run; every line of its terminal output kept with its arrival time."""

  def __init__(self, args, tmp: Path, cluster=None):
    self.out, self.events_path = tmp / 'run', tmp / 'events.jsonl'
    env = common.job_env(args.keep_xla_flags, HOME=str(tmp / 'home'), PYTHONUNBUFFERED='1')
    n = args.processes
    # On Ray each node has its own snapshot directory (ray_cluster.py); its HOME is tmp's too.
    where = ['--backend', 'ray', '--address', cluster.address] if cluster else []
    cmd = [sys.executable, '-m', 'mecefo_jax.launch', *where, '-n', str(n),
           '--devices-per-process', '1', '--events', str(self.events_path), '--', '--config',
           args.config, '--out', str(self.out),
           *([] if cluster else [f'snapshot.dir={tmp / "shm"}']), f'mesh.slice={n}',
           f'train.steps={args.steps}',
           'snapshot.every=1', 'train.log_every=1', 'train.eval_every=0', 'train.plot=false',
           *args.overrides]
    self.start(cmd, env)


def one(args, tmp: Path, backend: str) -> dict:
  (tmp / 'home').mkdir()
  nodes = (ray_cluster.local_cluster(args.processes, tmp, {'HOME': str(tmp / 'home'),
                                                           'XLA_FLAGS': ''})
           if backend == 'ray' else contextlib.nullcontext())
  with nodes as cluster:
    return _kill_and_time(args, Run(args, tmp, cluster), cluster)


def _kill_and_time(args, run: Run, cluster) -> dict:
  try:
    first, _ = run.wait_for(lambda: run.first_after(run.t0), 900, 'first step')
    run.wait_for(lambda: run.last_step() >= args.kill_at, 900, f'step {args.kill_at}')
    # As a user would: once the job says its programs for a restart are built (process 0's
    # line, on the terminal), whatever the other processes are doing then.
    if args.wait_builds:
      run.wait_for(lambda: run.said(common.BUILT), 900, common.BUILT)
    t_kill = time.time()
    if cluster is not None and args.remove_node:
      place = [e for e in run.events() if e['kind'] == 'place'][-1]
      ray_cluster.remove_node(cluster, place['nodes']['1'], args.remove_node == 'graceful')
    else:
      os.kill(run.host_pid(1), signal.SIGKILL)
    # The first step logged after the survivors' job started (none of the old job's lines).
    restarted = run.wait_for(lambda: next((when for when, line in list(run.lines)
                                           if when > t_kill and 'started hosts' in line), None),
                             300, "the survivors' job")
    again, _ = run.wait_for(lambda: run.first_after(restarted), 900, 'step after the kill')
    said = lambda line: line.startswith('launch [') and 'trained again' in line
    until = time.time() + 120  # (a job that ends first prints it no more: None then)
    while not (recovered := any(said(line) for _, line in run.lines)) and \
        run.proc.poll() is None and time.time() < until:
      time.sleep(0.05)
    run.proc.send_signal(signal.SIGTERM)  # the job stops at an agreed step: its report
    run.proc.wait(timeout=300)
  finally:
    run.kill()
  report = json.loads((run.out / 'report.json').read_text())
  back = next((line.t for line in history.read(run.out)
               if line.kind is Kind.RECOVERED and line.t > t_kill), None)
  death = next(e['t'] for e in run.events() if e['kind'] == 'death' and e['t'] > t_kill)
  cold, restart = first - run.t0, again - t_kill
  return {'cold_start_s': cold, 'kill_to_first_step_s': restart, 'ratio': restart / cold,
          'first_step_again_s': back and back - t_kill, 'seen_s': death - t_kill,
          'recovery': report['recovery'], 'programs': report['programs'],
          'supervisor_line': next(line for _, line in run.lines if said(line))
          if recovered else None}


def _built(recovery: dict) -> str:
  """'loaded 3', 'compiled 1 loaded 2': how the first step trained again got its programs."""
  return ' '.join(f'{how} {n}' for how, n in sorted(recovery.get('programs_built', {}).items()))


def _medians(runs: list[dict]) -> dict:
  median = lambda values: statistics.median(values)
  keys = ('cold_start_s', 'kill_to_first_step_s', 'ratio', 'first_step_again_s', 'seen_s')
  return {**{k: median([r[k] for r in runs if r[k] is not None] or [0.0]) for k in keys},
          **{p: median([r['recovery'][p] or 0.0 for r in runs]) for p in PHASES}}


def main(argv=None) -> dict:
  args = _args(argv)
  backends = args.backends.split(',')
  info = common.run_info(__spec__.name, argv)
  before, runs = load(), {b: [] for b in backends}
  for i in range(args.repeats):
    for backend in backends:  # alternately: a load that changes affects each alike
      with tempfile.TemporaryDirectory(prefix='mecefo-restart-time-') as tmp:
        runs[backend].append(one(args, Path(tmp), backend))
      r = runs[backend][-1]
      print(f'repeat {i + 1} ({backend}): cold {r["cold_start_s"]:.1f} s, restart '
            f'{r["kill_to_first_step_s"]:.1f} s ({r["ratio"]:.2f}x), first step again '
            f'{r["first_step_again_s"]} s; {load()}', file=sys.stderr)
  medians = {b: _medians(rs) for b, rs in runs.items()}
  first = backends[0]
  result = {**info, 'processes': args.processes, 'steps': args.steps, 'kill_at': args.kill_at,
            'repeats': args.repeats, 'load_before': before, 'load_after': load(),
            'median': medians[first], 'runs': runs[first], 'config': args.config,
            'overrides': args.overrides}
  if backends != ['local'] or args.remove_node:
    result.update(backends=backends, remove_node=args.remove_node, by_backend={
        b: {'median': medians[b], 'runs': runs[b]} for b in backends})
  rows = [{'backend': b, 'run': i + 1, 'cold_s': r['cold_start_s'],
           'restart_s': r['kill_to_first_step_s'], 'again_s': r['first_step_again_s'],
           'seen_s': r['seen_s'], **{p: r['recovery'][p] for p in PHASES},
           'programs_built': _built(r['recovery'])}
          for b in backends for i, r in enumerate(runs[b])]
  rows += [{'backend': b, 'run': 'median', 'cold_s': m['cold_start_s'],
            'restart_s': m['kill_to_first_step_s'], 'again_s': m['first_step_again_s'],
            'seen_s': m['seen_s'], **{p: m[p] for p in PHASES}, 'programs_built': ''}
           for b, m in medians.items()]
  table = common.markdown_table(rows, list(rows[0]))
  table += f'\n\nload before: {before}\nload after: {load()}'
  common.emit(result, table, args.json)
  return result


if __name__ == '__main__':
  main()
