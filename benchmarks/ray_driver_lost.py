"""A Ray driver SIGKILLed mid-run: the actors' lease stops the job at a step; the command resumes it.

Run: python -m benchmarks.ray_driver_lost [--processes 3] [--steps 1000] [--kill-at 10]
    [--stopped-s 30] [--keep-cache] [--json OUT] [overrides...]

On a Ray cluster of this machine (benchmarks/ray_cluster.py: a 0-CPU head, one 1-CPU node per
host), `mecefo-launch --backend ray -n 3 --stopped-s S -- --config tiny mesh.slice=3
snapshot.every=1 ...` trains; once step --kill-at is logged, the driver alone is SIGKILLed (its
actors are detached: the trainers go on). Timed from the kill: the job's `stop` in
history.jsonl (the lease S, then the step the trainers agree on, snapshotted) and the end of
every trainer; then the same command again (with `--stop-after 3`: a few steps, then a stop)
from its launch to its first step. Checked, else it fails: the stop names the gone driver (or
the job, where a trainer other than process 0 saw it first), the second job resumes from the
stopped step with nothing thrown away, and no trainer, actor mark or raylet is left.
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common, ray_cluster
from benchmarks.restart_time import load
from mecefo_jax.records import history
from mecefo_jax.records.history import HistoryLine, Kind
from mecefo_jax.records.job import STOPPED, process_state
from mecefo_jax.run.saving import AGREED_STOP


def _args(argv):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--processes', type=int, default=3)
  p.add_argument('--steps', type=int, default=1000, help='more than the job trains here')
  p.add_argument('--kill-at', type=int, default=10, help='the step after which the driver dies')
  p.add_argument('--stopped-s', type=float, default=30.0, help="the actors' lease")
  common.add_keep_cache(p)  # the lease and the resume are timed, not the compiles
  return p.parse_intermixed_args(argv)


class Job(common.JobOutput):
  """One driver's job on the cluster; `more`: train.py arguments appended."""

  def __init__(self, args, tmp: Path, cluster, name: str, more: tuple[str, ...] = ()):
    self.out, self.events_path = tmp / 'run', tmp / f'{name}-events.jsonl'
    env = common.job_env(args.keep_cache, args.keep_cache, HOME=str(tmp / 'home'),
                         PYTHONUNBUFFERED='1')
    n = args.processes
    self.start([sys.executable, '-m', 'mecefo_jax.launch', '--backend', 'ray', '--address',
                cluster.address, '-n', str(n), '--stopped-s', f'{args.stopped_s:g}',
                '--events', str(self.events_path), '--', '--config', args.config, '--out',
                str(self.out), f'mesh.slice={n}', f'train.steps={args.steps}', 'snapshot.every=1',
                'train.log_every=1', 'train.eval_every=0', 'train.plot=false', *more,
                *args.overrides], env)


def _after(out: Path, kind: Kind, t: float) -> HistoryLine | None:
  return next((line for line in history.read(out, warn=False)
               if line.kind is kind and line.t > t), None)


def lost_driver(args, tmp: Path, cluster) -> dict:
  first = Job(args, tmp, cluster, 'first')
  try:
    first.wait_for(lambda: first.last_step() >= args.kill_at, 900, f'step {args.kill_at}')
    pids = [p for e in first.events() if e['kind'] == 'start' for p in e['pids'].values()]
    t_kill = time.time()
    os.kill(first.proc.pid, signal.SIGKILL)  # the driver alone: the trainers are Ray's
    first.proc.wait()
    stop = _wait(lambda: _after(first.out, Kind.STOP, t_kill), args.stopped_s + 300, 'the stop')
    _wait(lambda: all(process_state(p) in (None, 'Z') for p in pids), 120, 'the trainers to end')
    ended = time.time()
    _wait(lambda: not [m for d in cluster.tmps.values() for m in d.iterdir()], 60,
          "the actors' marks gone")
  finally:
    first.kill()
  t_again = time.time()
  second = Job(args, tmp, cluster, 'second', ('--stop-after', '3'))
  try:
    first_step, _ = second.wait_for(lambda: second.first_after(t_again), 900, 'a step again')
    code = second.wait(300)
  finally:
    second.kill()
  start = _after(second.out, Kind.START, t_again)
  if not (stop.why == AGREED_STOP or stop.why.startswith('the supervisor (pid') and
          stop.why.endswith('is gone')):
    raise RuntimeError(f'the stop names neither the gone driver nor the job: {stop}')
  if start.step != stop.step or _after(second.out, Kind.THROWN_AWAY, t_again):
    raise RuntimeError(f'the second job did not resume from the stopped step: {stop} {start}')
  if code != STOPPED:
    raise RuntimeError(f'the second job ended with {code}, not a stop:\n{second.tail()}')
  return {'kill_step': args.kill_at, 'stop_step': stop.step, 'why': stop.why,
          'kill_to_stop_s': stop.t - t_kill, 'kill_to_trainers_gone_s': ended - t_kill,
          'resumed_step': start.step, 'relaunch_to_first_step_s': first_step - t_again}


def _wait(condition, timeout: float, what: str):
  deadline = time.time() + timeout
  while not (value := condition()):
    if time.time() > deadline:
      raise RuntimeError(f'no {what} within {timeout:.0f} s')
    time.sleep(0.1)
  return value


def main(argv=None) -> dict:
  args = _args(argv)
  info, before = common.run_info(__spec__.name, argv), load()
  with tempfile.TemporaryDirectory(prefix='mecefo-ray-driver-lost-') as tmp:
    (Path(tmp) / 'home').mkdir()
    with ray_cluster.local_cluster(args.processes, Path(tmp), {'HOME': str(Path(tmp) / 'home'),
                                                              'XLA_FLAGS': ''}) as cluster:
      measured = lost_driver(args, Path(tmp), cluster)
  result = {**info, 'processes': args.processes, 'stopped_s': args.stopped_s,
            'load_before': before, 'load_after': load(), **measured, 'config': args.config,
            'overrides': args.overrides}
  row = {k: measured[k] for k in ('kill_step', 'stop_step', 'kill_to_stop_s',
                                  'kill_to_trainers_gone_s', 'relaunch_to_first_step_s')}
  table = common.markdown_table([{'lease_s': args.stopped_s, **row}], ['lease_s', *row])
  table += f'\n\nload before: {before}\nload after: {load()}'
  common.emit(result, table, args.json)
  return result


if __name__ == '__main__':
  main()
