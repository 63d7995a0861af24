"""Recovery from real process deaths under the supervisor (python -m mecefo_jax.launch).

Run: python -m benchmarks.recovery [--processes 4] [--devices-per-process 2] [--steps 600]
    [--kill-at 150,300] [--rejoin-after 60] [--json OUT] [overrides...]

Two supervised runs of the same config: one fault-free (cold start, fault-free wall time) and
one where host 1 and then host 2 are SIGKILLed once the run has logged steps --kill-at, each
replaced --rejoin-after seconds after its death. Every supervisor and trainer line is stamped on
arrival, so each death is cut into: detect (SIGKILL -> the supervisor sees the exit),
restart (-> the survivors' job is spawned), startup (-> jax.distributed is up), restore
(-> state built, snapshot restored), build (-> fault-free program compiled), first_step
(-> the first step trained again, programs of the new live set compiled). Goodput =
fault-free wall / this run's wall. Waiting for a replacement instead stalls the job for the
repair time plus a restart of the whole job (measured here as the rejoin restarts). The
survivors' step rate relative to fault-free is recorded too (on a CPU that the processes
oversubscribe, fewer processes step faster: not what accelerators do).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common

RESUMED = re.compile(r'resumed from the .* of (\d+) step\(s\);.* so (\d+) step\(s\) are trained')


def _args(argv):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--processes', type=int, default=4)
  p.add_argument('--devices-per-process', type=int, default=2)
  p.add_argument('--steps', type=int, default=600)
  p.add_argument('--kill-at', default='150,300', help='steps after which hosts 1, 2, ... die')
  p.add_argument('--rejoin-after', type=float, default=60.0)
  args = p.parse_intermixed_args(argv)
  args.kill_at = [int(x) for x in args.kill_at.split(',') if x]
  return args


class Job(common.JobOutput):
  """One supervised run; every output line kept with its arrival time."""

  def __init__(self, args, tmp: Path, name: str, rejoin: bool):
    self.out, self.events_path = tmp / name, tmp / f'{name}_events.jsonl'
    n, k = args.processes, args.devices_per_process
    env = {k_: v for k_, v in os.environ.items() if k_ != 'XLA_FLAGS'}
    # Each job starts with an empty compilation cache and program store of its own: its
    # restarts load only what the job itself stored.
    env.update(JAX_COMPILATION_CACHE_DIR=str(tmp / f'{name}_cache'), PYTHONUNBUFFERED='1')
    cmd = [sys.executable, '-m', 'mecefo_jax.launch', '-n', str(n), '--devices-per-process',
           str(k), '--events', str(self.events_path),
           *(['--rejoin-after', str(args.rejoin_after)] if rejoin else []),
           '--', '--config', args.config, '--out', str(self.out), f'snapshot.dir={tmp / "shm"}',
           f'mesh.slice={n * k}', 'mesh.fsdp=1', f'train.steps={args.steps}', 'train.log_every=1',
           'snapshot.every=1', 'train.eval_every=0', 'train.plot=false', *args.overrides]
    self.start(cmd, env)


def cold_start(job: Job) -> dict:
  first = job.first_after(job.t0)
  return {'first_step_s': first[0] - job.t0, 'wall_s': job.lines[-1][0] - job.t0}


def recovery(job: Job, t_kill: float, step_at_kill: int) -> dict:
  """Where the time from one SIGKILL to the first step trained again went."""
  death = next(e for e in job.events() if e['kind'] == 'death' and e['t'] >= t_kill)
  start = next(e for e in job.events() if e['kind'] == 'start' and e['t'] >= death['t'])
  up = job.first_after(start['t'], re.compile(r'process 0 of \d+:'))
  resumed = job.first_after(start['t'], RESUMED)
  built = job.first_after(start['t'], re.compile(r'\| compile [\d.]+s'))
  first = job.first_after(start['t'])
  marks = {'detect': death['t'], 'restart': start['t'], 'startup': up[0], 'restore': resumed[0],
           'build': built[0], 'first_step': first[0]}
  previous, split = t_kill, {}
  for name, when in marks.items():
    split[f'{name}_s'] = when - previous
    previous = when
  return {'step_at_kill': step_at_kill, 'resumed_after_step': int(resumed[1].group(1)),
          'steps_trained_again': int(resumed[1].group(2)), 'kill_to_first_step_s':
          first[0] - t_kill, **split}


def step_rate(job: Job, t_from: float, t_to: float) -> float:
  """Steps per second logged in (t_from, t_to], first to last step line of that window."""
  times = [when for when, line in job.lines
           if t_from < when <= t_to and common.STEP_LINE.search(line)]
  return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 2 else float('nan')


def survivor_rates(job: Job, deaths: list[dict], kills) -> list[float]:
  """Step rate of each survivors' job, from its first step to its stop (a rejoin or a death)."""
  stops = [e['t'] for e in job.events() if e['kind'] in ('rejoin-ready', 'death')]
  rates = []
  for (t, _), d in zip(kills, deaths):
    start = t + d['kill_to_first_step_s'] - 0.01
    rates.append(step_rate(job, start, next((x for x in stops if x > start), float('inf'))))
  return rates


def rejoin_restarts(job: Job) -> list[float]:
  """Seconds from each stop asked for a rejoin to the first step trained by the grown job (none
  where the job finished first)."""
  out, events = [], job.events()
  for e in events:
    start = next((x['t'] for x in events if x['kind'] == 'start' and x['t'] > e['t']), None)
    if e['kind'] == 'rejoin-ready' and start is not None:
      out.append(job.first_after(start)[0] - e['t'])
  return out


def run(args, tmp: Path) -> dict:
  free = Job(args, tmp, 'fault_free', rejoin=False)
  assert free.wait(3600) == 0, free.tail()
  faulty = Job(args, tmp, 'deaths', rejoin=True)
  kills = []
  for host, at in enumerate(args.kill_at, start=1):
    while faulty.last_step() < at:
      assert faulty.proc.poll() is None, faulty.tail()
      time.sleep(0.05)
    step, t_kill = faulty.last_step(), time.time()
    os.kill(faulty.host_pid(host), signal.SIGKILL)
    kills.append((t_kill, step))
    time.sleep(1.0)
  assert faulty.wait(3600) == 0, faulty.tail()
  report = json.loads((faulty.out / 'report.json').read_text())
  cold, wall = cold_start(free), faulty.lines[-1][0] - faulty.t0
  own_cold = cold_start(faulty)['first_step_s']  # the same run's launch -> first step
  rejoins = rejoin_restarts(faulty)
  deaths = [{**d, 'vs_cold_start': d['kill_to_first_step_s'] / own_cold}
            for d in (recovery(faulty, t, s) for t, s in kills)]
  free_rate = step_rate(free, free.t0, float('inf'))
  return {'processes': args.processes, 'devices_per_process': args.devices_per_process,
          'steps': args.steps, 'rejoin_after_s': args.rejoin_after, 'cold_start': cold,
          'cold_start_of_deaths_run_s': own_cold, 'programs': report['programs'],
          'deaths': deaths, 'fault_free_steps_per_s': free_rate,
          'survivor_rate_ratio': [r / free_rate for r in survivor_rates(faulty, deaths, kills)],
          'rejoin_restart_s': rejoins, 'wall_s': wall, 'goodput': cold['wall_s'] / wall,
          # What each death cost here (restart, degraded steps, the rejoin's restart), against
          # a job that waits for the replacement: idle for the repair, then a restart.
          'lost_per_death_s': (wall - cold['wall_s']) / len(kills),
          'waiting_per_death_s': args.rejoin_after + sum(rejoins) / max(len(rejoins), 1),
          'samples': report['samples'],
          'failure_events': report['failure_events']}


def main(argv=None) -> dict:
  args = _args(argv)
  info = common.run_info(__spec__.name, argv)
  with tempfile.TemporaryDirectory(prefix='mecefo-recovery-') as tmp:
    try:
      result = {**info, **run(args, Path(tmp)), 'config': args.config, 'overrides': args.overrides}
    finally:
      subprocess.run(['pkill', '-9', '-f', tmp], check=False)  # no process outlives the run
  rows = [{'death': i + 1, **{k: round(v, 2) if isinstance(v, float) else v
                              for k, v in d.items()}} for i, d in enumerate(result['deaths'])]
  table = common.markdown_table(rows, list(rows[0]))
  table += (f"\n\ncold start to first step: {result['cold_start']['first_step_s']:.1f} s "
            f"(the deaths run's own: {result['cold_start_of_deaths_run_s']:.1f} s); "
            f"rejoin restarts: {[round(x, 1) for x in result['rejoin_restart_s']]} s; "
            f"goodput {result['goodput']:.3f} (fault-free {result['cold_start']['wall_s']:.1f} s "
            f"vs {result['wall_s']:.1f} s); lost per death {result['lost_per_death_s']:.1f} s vs "
            f"{result['waiting_per_death_s']:.1f} s waiting for the replacement")
  common.emit(result, table, args.json)
  return result


if __name__ == '__main__':
  main()
