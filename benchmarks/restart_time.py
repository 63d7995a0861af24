"""A worker's SIGKILL under the supervisor against a cold start, phase by phase, over repeats.

Run: python -m benchmarks.restart_time [--repeats 3] [--processes 3] [--steps 150]
    [--kill-at 40] [--json OUT] [overrides...]

Each repeat is one supervised run of the issue's scenario (`python -m mecefo_jax.launch -n 3
--devices-per-process 1 -- mesh.slice=3 train.steps=150 snapshot.every=1 train.log_every=1
train.eval_every=0`, --config tiny, overrides appended) in a fresh HOME (an empty program store
and compilation cache). Cold start: the launch to its first logged step. Once step --kill-at is
logged, the process of host 1 is SIGKILLed; restart: the kill to the first step logged by the
survivors' job. The supervisor then stops the job (SIGTERM: an agreed step), and the report's
`recovery` section gives where the restart went (detection, the survivors' stop, the spawn,
the processes' start: imports, jax.distributed, set-up, restore, programs, the first step).
Medians over the repeats; the machine's load (`uptime`) before and after.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common

PHASES = ('detect_s', 'stop_s', 'spawn_s', 'process_start_s', 'imports_s', 'distributed_s',
          'setup_s', 'restore_s', 'programs_s', 'first_step_s', 'total_s')


def _args(argv):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--processes', type=int, default=3)
  p.add_argument('--steps', type=int, default=150)
  p.add_argument('--kill-at', type=int, default=40, help='the step after which host 1 dies')
  return p.parse_intermixed_args(argv)


def load() -> str:
  return subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()


class Run(common.JobOutput):
  """One supervised run; every line of its terminal output kept with its arrival time."""

  def __init__(self, args, tmp: Path):
    self.out, self.events_path = tmp / 'run', tmp / 'events.jsonl'
    (tmp / 'home').mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ('XLA_FLAGS', 'JAX_COMPILATION_CACHE_DIR')}
    env.update(HOME=str(tmp / 'home'), PYTHONUNBUFFERED='1')
    n = args.processes
    cmd = [sys.executable, '-m', 'mecefo_jax.launch', '-n', str(n), '--devices-per-process', '1',
           '--events', str(self.events_path), '--', '--config', args.config, '--out', str(self.out),
           f'snapshot.dir={tmp / "shm"}', f'mesh.slice={n}', f'train.steps={args.steps}',
           'snapshot.every=1', 'train.log_every=1', 'train.eval_every=0', 'train.plot=false',
           *args.overrides]
    self.start(cmd, env)


def one(args, tmp: Path) -> dict:
  run = Run(args, tmp)
  try:
    first, _ = run.wait_for(lambda: run.first_after(run.t0), 900, 'first step')
    run.wait_for(lambda: run.last_step() >= args.kill_at, 900, f'step {args.kill_at}')
    t_kill = time.time()
    os.kill(run.host_pid(1), signal.SIGKILL)
    # The first step logged after the survivors' job started (none of the old job's lines).
    restarted = run.wait_for(lambda: next((when for when, line in list(run.lines)
                                           if when > t_kill and 'started hosts' in line), None),
                             120, "the survivors' job")
    again, _ = run.wait_for(lambda: run.first_after(restarted), 900, 'step after the kill')
    said = lambda line: line.startswith('launch [') and 'trained again' in line
    recovered = run.wait_for(lambda: any(said(line) for _, line in run.lines), 120,
                             "the supervisor's recovery line")
    run.proc.send_signal(signal.SIGTERM)  # the job stops at an agreed step: its report
    run.proc.wait(timeout=300)
  finally:
    run.kill()
  report = json.loads((run.out / 'report.json').read_text())
  cold, restart = first - run.t0, again - t_kill
  return {'cold_start_s': cold, 'kill_to_first_step_s': restart, 'ratio': restart / cold,
          'recovery': report['recovery'], 'programs': report['programs'],
          'supervisor_line': next(line for _, line in run.lines if said(line))
          if recovered else None}


def main(argv=None) -> dict:
  args = _args(argv)
  info = common.run_info(__spec__.name, argv)
  before, runs = load(), []
  for i in range(args.repeats):
    with tempfile.TemporaryDirectory(prefix='mecefo-restart-time-') as tmp:
      runs.append(one(args, Path(tmp)))
    print(f'repeat {i + 1}: cold {runs[-1]["cold_start_s"]:.1f} s, restart '
          f'{runs[-1]["kill_to_first_step_s"]:.1f} s ({runs[-1]["ratio"]:.2f}x)', file=sys.stderr)
  median = lambda values: statistics.median(values)
  medians = {'cold_start_s': median([r['cold_start_s'] for r in runs]),
             'kill_to_first_step_s': median([r['kill_to_first_step_s'] for r in runs]),
             'ratio': median([r['ratio'] for r in runs]),
             **{p: median([r['recovery'][p] or 0.0 for r in runs]) for p in PHASES}}
  result = {**info, 'processes': args.processes, 'steps': args.steps, 'kill_at': args.kill_at,
            'repeats': args.repeats, 'load_before': before, 'load_after': load(),
            'median': medians, 'runs': runs, 'config': args.config, 'overrides': args.overrides}
  rows = [{'run': i + 1, 'cold_s': r['cold_start_s'], 'restart_s': r['kill_to_first_step_s'],
           'ratio': r['ratio'], **{p: r['recovery'][p] for p in PHASES}}
          for i, r in enumerate(runs)]
  rows.append({'run': 'median', 'cold_s': medians['cold_start_s'],
               'restart_s': medians['kill_to_first_step_s'], 'ratio': medians['ratio'],
               **{p: medians[p] for p in PHASES}})
  table = common.markdown_table(rows, list(rows[0]))
  table += f'\n\nload before: {before}\nload after: {load()}'
  common.emit(result, table, args.json)
  return result


if __name__ == '__main__':
  main()
