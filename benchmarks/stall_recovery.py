"""Recovery from a stalled process under the supervisor: a worker SIGSTOPped (or blocked) mid-run.

Run: python -m benchmarks.stall_recovery [--processes 3] [--steps 150] [--stop-at 50]
    [--host 1] [--block] [--keep-cache] [--json OUT] [overrides...]
     python -m benchmarks.stall_recovery --clean-runs N [--json OUT]

One supervised job (`python -m mecefo_jax.launch -n P --devices-per-process 1 -- mesh.slice=P
train.steps=S snapshot.every=1 train.log_every=1 train.eval_every=0`, the config's defaults
otherwise); once it has logged step --stop-at and said 'background builds done' (the
restarts' programs in the program store), host --host is SIGSTOPped (with --block: it blocks
itself inside that step, its heartbeat thread running: run/stop.py TEST_BLOCK_ENV). Every line
is stamped on arrival, so the stall is cut into: detect (stop -> the supervisor's stall line),
restart (-> the survivors' job is spawned), first_step (-> the first step trained again). The
stall's history.jsonl record (the process named, each one's phase) and the report's samples
are kept; the job must end with exit 0.

--clean-runs N: the README's multi-process example instead (`-n 4 --devices-per-process 2
--rejoin-after 120 -- mesh.slice=8 mesh.fsdp=1`, the config's evals, snapshots and durable
checkpoints, an empty compile cache each), N times one after the other, with no fault: each
run's exit code and the stalls the supervisor declared (a false stall is one).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common
from mecefo_jax.records import history
from mecefo_jax.records.history import Kind
from mecefo_jax.records.progress_marks import mark_path, read_mark
from mecefo_jax.run.stop import TEST_BLOCK_ENV

# README ("A process that really dies"): the supervisor's arguments, then train.py's.
README_EXAMPLE = (['-n', '4', '--devices-per-process', '2', '--rejoin-after', '120'],
                  ['mesh.slice=8', 'mesh.fsdp=1'])


def _args(argv):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--processes', type=int, default=3)
  p.add_argument('--steps', type=int, default=150)
  p.add_argument('--stop-at', type=int, default=50, help='the logged step after which it stops')
  p.add_argument('--wait-builds', action=argparse.BooleanOptionalAction, default=True,
                 help="the fault waits for the job's 'background builds done' too (none says it "
                 'with faults.precompile=never: --no-wait-builds)')
  p.add_argument('--host', type=int, default=1, help='the logical host that stops')
  p.add_argument('--block', action='store_true',
                 help='the host blocks itself inside step --stop-at instead of a SIGSTOP')
  p.add_argument('--kill', action='store_true',
                 help='SIGKILL instead of SIGSTOP: a death, its restart for comparison')
  p.add_argument('--timeout', type=float, default=1800.0, help='seconds the job may take')
  common.add_keep_cache(p)
  p.add_argument('--clean-runs', type=int, default=0,
                 help="run the README's multi-process example this many times, no fault")
  return p.parse_intermixed_args(argv)


class Job(common.JobOutput):
  """One supervised run in a session of its own; every output line kept with its arrival time."""

  def __init__(self, args, tmp: Path, readme: bool = False):
    """`readme`: the README's example instead of the stall scenario."""
    self.out, self.events_path, n = tmp / 'run', tmp / 'events.jsonl', args.processes
    env = common.job_env(args.keep_cache, args.keep_cache, PYTHONUNBUFFERED='1')
    if not args.keep_cache:
      env['JAX_COMPILATION_CACHE_DIR'] = str(tmp / 'cache')
    if args.block:
      env[TEST_BLOCK_ENV] = f'{args.host}:{args.stop_at}'
    launch = [sys.executable, '-m', 'mecefo_jax.launch', '--events', str(self.events_path)]
    train = ['--config', args.config, '--out', str(self.out), f'snapshot.dir={tmp / "shm"}']
    if readme:
      cmd = [*launch, *README_EXAMPLE[0], '--', *train, *README_EXAMPLE[1], *args.overrides]
    else:
      cmd = [*launch, '-n', str(n), '--devices-per-process', '1', '--', *train,
             f'mesh.slice={n}', f'train.steps={args.steps}', 'snapshot.every=1',
             'train.log_every=1', 'train.eval_every=0', *args.overrides]
    self.start(cmd, env)


def _dispatched(mark: Path) -> int:
  """The last step the process of progress mark `mark` dispatched (-1: none yet)."""
  seen = read_mark(mark)
  return seen.step if seen else -1


def run(args, tmp: Path) -> dict:
  job = Job(args, tmp)
  try:
    # Blocked: from when another host dispatched step --stop-at (its progress mark), which the
    # blocked one dispatched too before it blocked.
    other = mark_path(job.out / 'logs' / 'marks', 0 if args.host else 1)
    # Else once the job has said its restarts' programs are built, as a user would see it.
    reached = ((lambda: _dispatched(other) >= args.stop_at) if args.block
               else lambda: job.last_step() >= args.stop_at and (
                   job.said(common.BUILT) or not args.wait_builds))
    while not reached():
      assert job.proc.poll() is None, job.tail()
      time.sleep(0.02)
    t_stop, step_at_stop, load = time.time(), job.last_step(), os.getloadavg()[0]
    if not args.block:
      os.kill(job.host_pid(args.host), signal.SIGKILL if args.kill else signal.SIGSTOP)
    code = job.wait(args.timeout)
    left = job.left()  # before the kill below ends them
  finally:
    job.kill()
  assert code == 0, job.tail()
  events = job.events()
  kind = 'death' if args.kill else 'stall'
  stall = next(e for e in events if e['kind'] == kind)
  start = next(e for e in events if e['kind'] == 'start' and e['t'] >= stall['t'])
  first, _ = job.first_after(start['t'])
  report = json.loads((job.out / 'report.json').read_text())
  named = Kind.LAUNCH_DEATH if args.kill else Kind.LAUNCH_STALL
  record = next(line for line in history.read(job.out) if line.kind is named)
  return {'processes': args.processes, 'steps': args.steps, 'how': 'block' if args.block
          else 'SIGKILL' if args.kill else 'SIGSTOP', 'host': args.host,
          'step_at_stop': step_at_stop, 'load_at_stop': load,
          'stop_to_first_step_s': first - t_stop, 'detect_s': stall['t'] - t_stop,
          'restart_s': start['t'] - stall['t'], 'first_step_s': first - start['t'],
          'deadline_s': stall.get('deadline_s'), 'deadline_from': stall.get('deadline_from'),
          'named_host': record.host, 'why': record.why, 'phases': record.phases,
          'stopped': record.stopped, 'waited_s': record.waited_s, 'note': record.note,
          'events': [e['kind'] for e in events], 'left': left,
          'samples': report['samples'], 'steps_lost_total': report['steps_lost_total'],
          'cold_start_s': job.first_after(job.t0)[0] - job.t0,
          'supervisor_lines': [line for _, line in job.lines if ' stopped first, in ' in line
                               or 'death(s)' in line],
          'failures_txt': (job.out / 'failures.txt').read_text().splitlines()[:3]}


def clean_runs(args, tmp: Path) -> dict:
  """The README's example `args.clean_runs` times, one after the other, with no fault."""
  runs = []
  for i in range(args.clean_runs):
    (tmp / f'run{i}').mkdir()
    job = Job(args, tmp / f'run{i}', readme=True)
    try:
      code = job.wait(args.timeout)
    finally:
      job.kill()
    events = job.events()
    runs.append({'run': i, 'code': code, 'wall_s': round(job.lines[-1][0] - job.t0, 1),
                 'stalls': sum(e['kind'] == 'stall' for e in events),
                 'kinds': [e['kind'] for e in events], 'load_average': os.getloadavg()[0]})
    print(json.dumps(runs[-1]), flush=True)
  return {'clean_runs': runs, 'false_stalls': sum(r['stalls'] for r in runs),
          'runs_ok': sum(r['code'] == 0 and not r['stalls'] for r in runs)}


def main(argv=None) -> dict:
  args = _args(argv)
  info = common.run_info(__spec__.name, argv)
  if args.clean_runs:
    with tempfile.TemporaryDirectory(prefix='mecefo-stall-') as tmp:
      result = {**info, **clean_runs(args, Path(tmp))}
    table = common.markdown_table(result['clean_runs'], ['run', 'code', 'wall_s', 'stalls',
                                                         'load_average'])
    table += (f"\n\n{result['runs_ok']} of {len(result['clean_runs'])} runs ended with exit 0 "
              f"and no stall; false stalls: {result['false_stalls']}")
    common.emit(result, table, args.json)
    return result
  with tempfile.TemporaryDirectory(prefix='mecefo-stall-') as tmp:
    result = {**info, **run(args, Path(tmp)), 'config': args.config,
              'overrides': args.overrides, 'load_average': os.getloadavg()}
  keys = ['how', 'host', 'step_at_stop', 'named_host', 'detect_s', 'restart_s', 'first_step_s',
          'stop_to_first_step_s', 'deadline_s']
  row = {k: round(result[k], 2) if isinstance(result[k], float) else result[k] for k in keys}
  table = common.markdown_table([row], keys)
  table += (f"\n\nsamples {result['samples']}; steps trained again "
            f"{result['steps_lost_total']}; cold start {result['cold_start_s']:.1f} s; "
            f"phases at the stall {result['phases']}")
  common.emit(result, table, args.json)
  return result


if __name__ == '__main__':
  main()
