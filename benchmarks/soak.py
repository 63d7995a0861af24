"""A soak: a supervised job hit at random by every fault it claims to survive, then checked.

Run: python -m benchmarks.soak --minutes M | --rounds N [--backend local|ray] [--seed S]
    [--processes 3] [--busy 2] [--gap-s 5:20] [--rejoin-after 10] [--kinds kill,stop_worker,...]
    [--program-store DIR] [--keep DIR] [--json OUT] [overrides...]

One job (`python -m mecefo_jax.launch -n P --devices-per-process 1 --rejoin-after R
--stopped-s 5 -- mesh.slice=P mesh.ordered_reduce=true snapshot.every=1 train.log_every=1
train.eval_every=0`, --config tiny, overrides appended) in a fresh HOME (an empty program store,
unless --program-store names one: the suite's, for its short test), its in-memory snapshots
on a tmpfs of its own (mounted here where this process may: a full one is then made without
touching /dev/shm), beside --busy processes that keep a core busy each (`yes`). Every --gap-s
seconds of training (seeded) one fault, each kind once in every round of the kinds in a seeded
order: a worker SIGKILLed, a worker SIGSTOPped (SIGCONT once the stall is seen), the supervisor
SIGSTOPped past --stopped-s (SIGCONT once the job has stopped itself), the tmpfs full for a few
seconds, a Ctrl-C to the job's group and the same command again, a divergence made for one
attempt of one step (run/hooks.TEST_POISON_ENV) and the same command again, which goes back to a
snapshot before it. After each, the soak waits for the job to train again with every host.
With --backend ray the job runs on a Ray cluster of this machine (benchmarks/ray_cluster.py: a
0-CPU head, one 1-CPU node per host, each node's snapshot directory on the soak's tmpfs; the
command gains `--backend ray --address ...`), and one more kind of fault hits it: a host's node
removed from the cluster, a fresh node added (the host rejoins on that spare). At the end the
cluster is shut down and none of its processes or its actors' marks may be left.

Its own log of what it injected is the ground truth: every fault must show in history.jsonl
with its kind, and no fault record may show that it did not inject (`disagreements`). Its own
watchdog counts a hang where no step is logged for 3x the stall watch's start-up floor
(records/deadlines.py START_FLOOR_S: the largest deadline short of a cold start's); the job is
then killed and started again by the same command. At the end: a Ctrl-C, then `params_sha256`
and samples against the one-process replay of failures.txt (--stop-after the step it stopped
at), the records against each other (report samples = metrics rows' tokens / seq_len,
steps_lost_total = the thrown_away lines, failures.txt = the report's failure events,
run_state status = the exit), nothing left behind (a process of the job, a tmpfs part of no
host, an unfinished save), what grew, and how each restart got its programs (compiled,
loaded: the `recovered` lines).
A failed check keeps every artifact (--keep, or the temporary directory, named in the JSON).
"""
from __future__ import annotations

if not __package__:  # `python benchmarks/NAME.py`: benchmarks/, not the repository, is on sys.path
  raise SystemExit('error: run it from the repository root as python -m benchmarks.'
                   + __file__.rpartition('/')[2].removesuffix('.py'))

import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import common, soak_checks, soak_faults
from benchmarks.soak_faults import KINDS, RAY_KINDS, Injected
from mecefo_jax.records import history
from mecefo_jax.records.history import HistoryLine, Kind
from mecefo_jax.run.hooks import TEST_POISON_ENV
from mecefo_jax.records.deadlines import START_FLOOR_S

HANG_S = 3 * START_FLOOR_S
WAIT_LIMIT_S = 3 * HANG_S  # a fault's outcome that never comes (the job trains on regardless)
STOPPED_S = 5
LINGER_S = 20.0  # a process alive this long after its run's end line: its stacks are kept


def _args(argv):
  p = common.parser(__doc__.splitlines()[0])
  p.add_argument('--minutes', type=float, default=0.0, help='how long faults are injected')
  p.add_argument('--rounds', type=int, default=0, help='or: this many rounds of every kind')
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--processes', type=int, default=3)
  p.add_argument('--busy', type=int, default=2, help='cores kept busy (`yes` processes)')
  p.add_argument('--gap-s', default='5:20', help='seconds of training between faults: A:B')
  p.add_argument('--rejoin-after', type=float, default=10.0,
                 help="seconds a host that died or stalled waits before it rejoins (launch's)")
  p.add_argument('--backend', choices=('local', 'ray'), default='local',
                 help="the job's transport (launch's --backend); ray: on a cluster of this machine")
  p.add_argument('--kinds', default=None, help=f'the faults injected (default: {",".join(KINDS)}; '
                 f'ray: {",".join(RAY_KINDS)})')
  p.add_argument('--tmpfs-mib', type=int, default=256, help="the snapshots' tmpfs")
  p.add_argument('--program-store', default='', help="the job's and the replay's compilation "
                 "cache directory (its programs/: step/program_store.py); default: an empty one")
  p.add_argument('--keep', default=None, help='the soak directory (kept); default: a temporary '
                 'one, removed unless a check failed')
  return p.parse_intermixed_args(argv)


class Soak:
  """The soak's job, its directory and its log of faults."""

  def __init__(self, args, root: Path):
    self.args, self.root = args, root
    self.run, self.events, self.shm = root / 'run', root / 'events.jsonl', root / 'shm'
    self.poison, self.home = root / 'poison', root / 'home'
    self.home.mkdir(parents=True, exist_ok=True)
    self.mount_note = soak_faults.mount_tmpfs(self.shm, args.tmpfs_mib)
    self.mounted = self.mount_note is None
    self.faults: list[Injected] = []
    self.hangs: list[dict] = []
    self.exits: list[dict] = []  # jobs that ended on their own (started again)
    self.lingering: list[str] = []  # stacks of processes that outlived their run's end
    self.pids: set[int] = set()
    self.jobs = 0
    self.job: common.JobOutput | None = None
    self.cluster = None  # --backend ray: the cluster (benchmarks/ray_cluster.py)
    self._history: tuple[tuple | None, list[HistoryLine]] = (None, [])  # (its stat, its lines)

  def command(self) -> list[str]:
    n = self.args.processes
    ray = ['--backend', 'ray', '--address', self.cluster.address] if self.cluster else []
    return [sys.executable, '-m', 'mecefo_jax.launch', *ray, '-n', str(n),
            '--devices-per-process', '1', '--rejoin-after', str(self.args.rejoin_after),
            '--stopped-s', str(STOPPED_S), '--events', str(self.events), '--',
            '--config', self.args.config, '--out', str(self.run),
            f'snapshot.dir={self.shm}', f'mesh.slice={n}', 'mesh.ordered_reduce=true',
            'train.steps=100000000', 'snapshot.every=1', 'train.log_every=1',
            'train.eval_every=0', 'train.plot=false', *self.args.overrides]

  def env(self) -> dict:
    """The job's and its replay's environment: an empty program store (a HOME of its own) or
    --program-store's, the caller's XLA flags (the suite's compile faster; the job and the
    replay share them)."""
    env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}
    return {**env, 'HOME': str(self.home), 'PYTHONUNBUFFERED': '1',
            TEST_POISON_ENV: str(self.poison), **self.store_env()}

  def store_env(self) -> dict:
    return {'JAX_COMPILATION_CACHE_DIR': self.args.program_store} if self.args.program_store else {}

  def store(self) -> Path:
    """Where the job's programs go (growth counts its bytes)."""
    return Path(self.args.program_store or self.home / '.cache' / 'mecefo-jax')

  def launch(self) -> None:
    """The job's command, started (again: it resumes the run)."""
    if self.job is not None:
      self._keep_output()
    self.jobs += 1
    self.job = common.JobOutput()
    self.job.events_path = self.events
    self.job.start(self.command(), self.env())

  def _keep_output(self) -> None:
    with open(self.root / 'supervisor.log', 'a') as f:
      f.write(f'==== job {self.jobs}\n' + '\n'.join(line for _, line in self.job.lines) + '\n')

  # --- waiting ----------------------------------------------------------------------------
  def history(self) -> list[HistoryLine]:
    """history.jsonl's lines (a line being written: left out), parsed again only once the
    file changed: the waits look ten times a second (parsing it each time was ~40% of this
    process's CPU)."""
    try:
      stat = (self.run / history.HISTORY).stat()
    except FileNotFoundError:
      return []
    if self._history[0] != (stat.st_size, stat.st_mtime_ns):
      self._history = (stat.st_size, stat.st_mtime_ns), history.read(self.run, warn=False)
    return self._history[1]

  def history_since(self, t: float, kind: Kind) -> list[HistoryLine]:
    return [line for line in self.history() if line.t >= t and line.kind is kind]

  def wait_for(self, condition, what: str, watch: bool = True) -> None:
    """Polls `condition`; `watch`: a hang is counted where no step is logged for HANG_S (the
    job is then killed and started again). A job that ends meanwhile is started again. What
    never comes within WAIT_LIMIT_S, steps or not, is a hang too (the soak goes on)."""
    last_step_t = t0 = time.time()
    while not condition():
      if time.time() - t0 > WAIT_LIMIT_S:
        self.hangs.append({'t': time.time(), 'waiting_for': what, 'limit_s': WAIT_LIMIT_S,
                           'tail': self.job.tail(20)})
        return
      self._dump_lingering()
      step = self.job.first_after(last_step_t)
      last_step_t = step[0] if step else last_step_t
      if watch and time.time() - last_step_t > HANG_S:
        self.hangs.append({'t': time.time(), 'waiting_for': what, 'tail': self.job.tail(20)})
        self.job.kill()
        self.launch()
        last_step_t = time.time()
      elif self.job.proc.poll() is not None and watch:
        self.exits.append({'t': time.time(), 'code': self.job.proc.poll(), 'waiting_for': what,
                           'tail': self.job.tail(20)})
        self.launch()
      time.sleep(0.1)

  def _dump_lingering(self) -> None:
    """The stacks (py-spy, where installed) of a process of the job still alive LINGER_S after
    the run's `end` line: kept with the artifacts, once per process."""
    ends = [line.t for line in self.history() if line.kind is Kind.END]
    starts = [e for e in self.job.events() if e['kind'] == 'start']
    if not ends or not starts or time.time() - ends[-1] < LINGER_S or not shutil.which('py-spy'):
      return
    for pid in starts[-1]['pids'].values():
      path = self.root / f'stacks-{pid}.txt'
      if ends[-1] > starts[-1]['t'] and not path.exists() and soak_checks.alive(pid):
        with open(path, 'w') as f:
          subprocess.run(['py-spy', 'dump', '--pid', str(pid)], stdout=f,
                         stderr=subprocess.STDOUT, timeout=60)
        self.lingering.append(str(path))

  def whole_and_training(self, since: float, restarted: bool = False) -> bool:
    """Every host in the job started last (`restarted`: after `since`), which has logged a
    step since `since`."""
    starts = [e for e in self.job.events() if e['kind'] == 'start']
    if not starts or len(starts[-1]['hosts']) != self.args.processes or (
        restarted and starts[-1]['t'] <= since):
      return False
    self.pids.update(starts[-1]['pids'].values())
    return self.job.first_after(max(since, starts[-1]['t'])) is not None

  # --- the soak -----------------------------------------------------------------------------
  def inject_all(self, rng: random.Random) -> None:
    kinds = self.args.kinds
    lo, hi = (float(x) for x in self.args.gap_s.split(':'))
    end = time.time() + self.args.minutes * 60.0
    order: list[str] = []
    rounds = 0
    while time.time() < end or order or rounds < self.args.rounds:
      if not order:
        if time.time() >= end and rounds >= self.args.rounds:
          break
        rounds += 1
        order = rng.sample(kinds, len(kinds))  # every kind once a round, in a seeded order
      kind = order.pop()
      quiet = time.time() + rng.uniform(lo, hi)
      self.wait_for(lambda: time.time() > quiet, 'a quiet spell')
      fault = soak_faults.INJECT[kind](self, rng.randrange(self.args.processes))
      restarts = kind not in soak_faults.IN_PLACE
      self.wait_for(lambda: self.whole_and_training(fault.t, restarts),
                    f'training again after {kind}')
      self.faults.append(fault := self._recovered(fault))
      print(f'{kind}: {fault.recovery_s and round(fault.recovery_s, 1)} s {fault.note}',
            file=sys.stderr)

  def _recovered(self, fault: Injected) -> Injected:
    """`fault` with the first step logged by the first job started after it (None where it
    stopped none: the full tmpfs)."""
    again = [e['t'] for e in self.job.events() if e['kind'] == 'start' and e['t'] > fault.t]
    first = self.job.first_after(again[0]) if again else None
    return dataclasses.replace(fault, recovered_t=first[0] if first else None)

  def stop(self) -> tuple[Injected, int]:
    """The soak's end: a Ctrl-C to the job's group; (the stop as a fault of kind 'end', the
    supervisor's exit)."""
    end = Injected('end', time.time(), self.job.last_step())
    os.killpg(self.job.proc.pid, signal.SIGINT)
    code = self.job.wait(600)
    self._keep_output()
    return end, code


def _recovery(faults: list[Injected]) -> dict:
  by = {}
  for f in faults:
    if f.recovery_s is not None:
      by.setdefault(f.kind, []).append(f.recovery_s)
  return {k: {'median': statistics.median(v), 'max': max(v), 'n': len(v)} for k, v in by.items()}


def _busy(n: int) -> list[subprocess.Popen]:
  return [subprocess.Popen(['yes'], stdout=subprocess.DEVNULL, start_new_session=True)
          for _ in range(n)]


def soak(args, root: Path) -> dict:
  s = Soak(args, root)
  hogs = _busy(args.busy)
  raylets = []
  with contextlib.ExitStack() as stack:
    if args.backend == 'ray':
      from benchmarks import ray_cluster  # Ray's: imported by a Ray soak only
      # The trainers' HOME (their program store) is their node's: the soak's, as the job's.
      s.cluster = stack.enter_context(ray_cluster.local_cluster(
          args.processes, root,
          env={'HOME': str(s.home), 'JAX_COMPILATION_CACHE_DIR': '', **s.store_env()},
          shm_root=s.shm))
    try:
      s.launch()
      s.wait_for(lambda: s.whole_and_training(0.0), 'the first steps')
      store = s.store()
      grown = {'start': soak_checks.growth([s.job.proc.pid, *s.pids], s.shm, store, s.run)}
      s.inject_all(random.Random(args.seed))
      last = [e for e in s.job.events() if e['kind'] == 'start'][-1]
      pids = [s.job.proc.pid, *last['pids'].values()]
      grown['end'] = soak_checks.growth(pids, s.shm, store, s.run)
      end, code = s.stop()
    finally:
      for hog in hogs:
        hog.kill()
      if s.job is not None:
        s.job.kill()
      if s.cluster is not None:  # its processes, checked once it is shut down
        raylets = [p for node in (s.cluster.head_node, *s.cluster.worker_nodes)
                   for ps in node.all_processes.values() for p in ps]
  disagreements = soak_checks.attribute(s.history(), [*s.faults, end])
  disagreements += [f"the job ended on its own (exit {e['code']}) while the soak waited for "
                    f"{e['waiting_for']}" for e in s.exits]
  disagreements += soak_checks.records(s.run, code)
  replayed = soak_checks.replay(s.run, root, {**s.env(), 'PYTHONPATH': str(common.REPO)})
  left = soak_checks.leftovers(s.pids | {s.job.proc.pid}, str(s.run), s.shm, args.processes)
  if s.cluster is not None:
    left += soak_checks.ray_leftovers(s.cluster, raylets)
  faults = {k: sum(f.kind == k for f in s.faults) for k in _all_kinds(args)}
  return {'faults': faults, 'injected': [dataclasses.asdict(f) for f in s.faults],
          'programs_per_restart': soak_checks.programs_per_restart(s.history()),
          'hangs': len(s.hangs), 'hang_details': s.hangs, 'disagreements': disagreements,
          'sha_equal': replayed['sha_equal'], 'replay': replayed, 'leftovers': left,
          'recovery_s': _recovery(s.faults), 'growth': grown, 'exit_code': code,
          'jobs_started': s.jobs, 'exits': s.exits, 'lingering': s.lingering,
          'tmpfs': 'mounted' if s.mounted else f'not mounted: {s.mount_note}',
          'steps': json.loads((s.run / 'report.json').read_text())['steps']}


def _all_kinds(args) -> tuple[str, ...]:
  return RAY_KINDS if args.backend == 'ray' else KINDS


def main(argv=None) -> dict:
  args = _args(argv)
  if not (args.minutes > 0) ^ (args.rounds > 0):
    raise SystemExit('error: give --minutes M or --rounds N (one of them)')
  args.kinds = [k for k in (args.kinds or ','.join(_all_kinds(args))).split(',') if k]
  if unknown := [k for k in args.kinds if k not in _all_kinds(args)]:
    raise SystemExit(f'error: --kinds {",".join(unknown)}: not a fault of --backend '
                     f'{args.backend} (one of {", ".join(_all_kinds(args))})')
  info, before = common.run_info(__spec__.name, argv), os.getloadavg()
  root = Path(args.keep or tempfile.mkdtemp(prefix='mecefo-soak-'))
  t0 = time.time()
  try:
    result = soak(args, root)
  finally:
    soak_faults.unmount(root / 'shm')
  ok = (not result['hangs'] and not result['disagreements'] and result['sha_equal'] and
        not result['leftovers'])
  if ok and not args.keep:
    shutil.rmtree(root, ignore_errors=True)
  result = {**info, 'seed': args.seed, 'minutes': args.minutes, 'rounds': args.rounds,
            'processes': args.processes, 'rejoin_after_s': args.rejoin_after,
            'busy': args.busy, 'backend': args.backend, 'config': args.config,
            'overrides': args.overrides, 'load_before': before, 'load_after': os.getloadavg(),
            'wall_s': time.time() - t0, 'ok': ok, 'artifacts': None if ok and not args.keep
            else str(root), **result}
  rows = [{'kind': k, 'n': n, **{f'recovery_{q}_s': result['recovery_s'].get(k, {}).get(q)
                                for q in ('median', 'max')}} for k, n in result['faults'].items()]
  table = common.markdown_table(rows, list(rows[0])) + (
      f"\n\nhangs {result['hangs']}, disagreements {len(result['disagreements'])}, sha_equal "
      f"{result['sha_equal']}, leftovers {len(result['leftovers'])}, ok {ok}")
  common.emit(result, table, args.json)
  return result


if __name__ == '__main__':
  main()
