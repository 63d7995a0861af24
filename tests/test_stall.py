"""Stalls: the progress marks each process writes, the deadlines the supervisor derives from
them, and real stalled jobs (a worker blocked inside a step with its heartbeat running; a
SIGSTOPped one is tests/test_benchmark_smoke.py's stall_recovery) that end as a death does: the
job retrains without the stuck process, no sample dropped, the records naming it and each
process's phase; and a job with evals, snapshots and a cold compile that never stalls."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mecefo_jax import watch
from mecefo_jax.records import deadlines, history, progress_marks
from mecefo_jax.records.history import HistoryLine, Kind
from mecefo_jax.records.progress_marks import MARK_BYTES, Marks, mark_path, read_mark
from mecefo_jax.run import rundir
from mecefo_jax.run.stop import TEST_BLOCK_ENV
from procs import TINY, kill, report, wait_for


def test_a_mark_is_one_checked_write_and_a_torn_one_is_not_read(tmp_path):
  marks = Marks(mark_path(tmp_path, 2))
  assert read_mark(tmp_path / 'host2.mark').phase == 'starting'
  marks.enter('compiling', 'the fused program')
  marks.dispatched(0)
  marks.dispatched(1)
  with_save = marks.enter('saving', 'step 2', 'durable')
  assert with_save == ('training', '', '')
  marks.enter(*with_save)
  mark = read_mark(tmp_path / 'host2.mark')
  assert (mark.pid, mark.step, mark.in_step, mark.phase) == (os.getpid(), 1, 2, 'training')
  assert mark.steps_timed == 1 and set(mark.longest) == {
      'starting', 'compiling', 'start-up', 'saving/durable'}
  assert (tmp_path / 'host2.mark').stat().st_size == MARK_BYTES
  data = bytearray((tmp_path / 'host2.mark').read_bytes())
  data[40] ^= 1  # a read that caught half of a write
  (tmp_path / 'host2.mark').write_bytes(bytes(data))
  assert read_mark(tmp_path / 'host2.mark') is None
  marks.close()


def test_without_a_supervisor_marks_are_not_written(tmp_path, monkeypatch):
  monkeypatch.delenv(progress_marks.MARKS_ENV, raising=False)
  monkeypatch.setattr(progress_marks, '_marks', None)
  progress_marks.open_marks(0)
  progress_marks.dispatched(3)
  with progress_marks.during('evaluating'):
    pass
  assert progress_marks._marks is None


def test_deadlines_follow_what_was_measured():
  # A step of 0.3 s: 10x, at least 10 s; 2 s: 20 s.
  assert deadlines.allowance('training', {}, 0.3, None) == (10.0, 'measured')
  assert deadlines.allowance('training', {}, 2.0, None) == (20.0, 'measured')
  # Steps not timed yet: the start-up's allowance; the first start's is the default.
  assert deadlines.allowance('training', {}, None, None) == (deadlines.START_FIRST_S, 'first')
  assert deadlines.allowance('training', {'start-up': 40.0}, None, None) == (120.0, 'measured')
  # An eval or a durable save: 5x the longest seen, each kind of save apart.
  measured = {'evaluating': 6.0, 'saving/in-memory': 0.05}
  assert deadlines.allowance('evaluating', measured, 0.3, None) == (30.0, 'measured')
  assert deadlines.allowance('saving/in-memory', measured, 0.3, None) == (10.0, 'measured')
  assert deadlines.allowance('saving/durable', measured, 0.3, None) == (deadlines.PHASE_FIRST_S,
                                                                    'first')
  assert deadlines.allowance('saving/durable', measured, 0.3, 7.0) == (7.0, '--stall-s')
  # A wait for the saves in flight is never bounded by an earlier one (a write of any size).
  assert deadlines.allowance('saving/wait', {'saving/wait': 0.01}, 0.3, None) == (
      deadlines.PHASE_FIRST_S, 'first')


def _mark(phase='training', since=None, step_s=0.3, steps_timed=5, longest=None, step=7):
  return progress_marks.ProgressMark(
      pid=os.getpid(), step=step, in_step=0, phase=phase, key=phase, detail='',
      since=time.time() if since is None else since, step_s=step_s, steps_timed=steps_timed,
      longest=longest or {})


def test_a_process_alone_allows_itself_what_its_own_mark_measured():
  assert deadlines.own_deadline(_mark(step_s=2.0)) == 20.0
  assert deadlines.own_deadline(_mark(steps_timed=2, longest={'start-up': 40.0})) == 120.0
  assert deadlines.own_deadline(_mark('ending')) == deadlines.PHASE_FIRST_S
  assert deadlines.own_deadline(None) == deadlines.START_FIRST_S  # no marks asked for


def test_a_process_whose_supervisor_is_gone_ends_only_once_stuck_past_its_deadline(monkeypatch):
  """The watch of run/supervised.py, after the supervisor's end: a process whose mark moves
  goes on (the stop request ends it); one whose mark stands still past its deadline is ended;
  nothing is ended while the supervisor runs."""
  from mecefo_jax.records.job import Handoff
  from mecefo_jax.run.supervised import Watch
  monkeypatch.setattr(deadlines, 'own_deadline', lambda mark: 1.0)
  still, moving = _mark(since=time.time() - 60), [True]
  watches = {'moving': lambda: _mark() if moving[0] else still, 'still': lambda: still,
             'supervised': lambda: still}
  seen = {name: ([], []) for name in watches}
  ends = {}
  for name, mark in watches.items():
    read_fd, ends[name] = os.pipe()
    Watch(Handoff(read_fd, os.getpid()), *(l.append for l in seen[name]), mark=mark)
  os.close(ends['moving'])
  os.close(ends['still'])
  wait_for(lambda: seen['still'][1], 10, 'the still process ended')
  time.sleep(1.5)  # the moving one's deadline, passed since the supervisor's end
  [stuck] = seen['still'][1]
  assert stuck.startswith(f'the supervisor (pid {os.getpid()}) is gone and this process has '
                          'made no progress for '), stuck
  assert stuck.endswith('(in training at step 7; its own deadline 1 s)'), stuck
  assert seen['moving'] == ([f'the supervisor (pid {os.getpid()}) is gone'], [])
  assert seen['supervised'] == ([], [])
  os.close(ends['supervised'])
  moving[0] = False  # the watches' threads end too (past the real deadline: 10 s)


def _job(tmp_path, hosts=3) -> tuple[watch.StallWatch, list[Marks]]:
  """A watch of `hosts` processes whose marks this process writes (all with its pid)."""
  sw = watch.StallWatch(tmp_path)
  sw.start({h: os.getpid() for h in range(hosts)})
  return sw, [Marks(mark_path(tmp_path, h)) for h in range(hosts)]


class _States:
  """A reader of a job whose host 1's process is stopped (SIGSTOP) and which wrote no marks."""
  stopped = {1}

  def mark(self, host, pid):
    return None

  def state(self, host, pid):
    return 'T' if host in self.stopped else 'S'

  def cpu_seconds(self, host, pid):
    return None


def test_a_stopped_process_that_its_peers_lost_is_their_stall_before_its_deadline(
    tmp_path, monkeypatch):
  """Seen in the Ray soak: a worker SIGSTOPped just after a fresh start, whose deadlines were
  still the unmeasured ones; its peers' collectives timed out first (PEER_LOST), and the
  supervisor waited for a death that never came, then restarted the whole job, recording no
  stall. The stopped process is the peer they lost: a stall of it, at once."""
  from mecefo_jax import launch
  from mecefo_jax.records.job import PEER_LOST
  from mecefo_jax.supervisor import Supervisor
  sw = watch.StallWatch(tmp_path, reader=_States())
  sw.start({0: 100, 1: 101, 2: 102})
  assert sw.deadline()[0] >= deadlines.START_FLOOR_S  # far off: nothing measured yet
  stall = sw.stopped_peer({0: PEER_LOST, 2: PEER_LOST})
  assert stall.host == 1 and stall.stopped == (1,) and stall.deadline_from == 'its peers lost it'
  assert 'host 1 stopped first' in stall.line() and 'SIGSTOP' in stall.line()
  assert sw.stopped_peer({1: PEER_LOST}) is None  # the stopped one has left: not it
  _States.stopped = set()
  assert sw.stopped_peer({0: PEER_LOST}) is None  # none stopped: their peer's death is awaited
  _States.stopped = {1}
  sup = Supervisor(launch.parse_args(['-n', '3', '--', '--out', str(tmp_path / 'run')]))
  sup.watch = sw
  stalls = []
  monkeypatch.setattr(sup, '_stall', stalls.append)
  sup._lost_peer({0: PEER_LOST, 2: PEER_LOST})
  assert [s.host for s in stalls] == [1]


def test_the_process_behind_the_others_is_named_after_the_deadline(tmp_path):
  sw, marks = _job(tmp_path)
  for step in range(6):
    for m in marks:
      m.dispatched(step)
  for m in marks[:2]:  # hosts 0 and 1 dispatch step 6 and wait in it for host 2
    m.dispatched(6)
  t = time.monotonic()
  assert sw.look(t) is None
  assert sw.deadline() == (10.0, 'measured')
  assert sw.look(t + 9.9) is None
  stall = sw.look(t + 10.1)
  assert stall.host == 2 and stall.why == 'it never reached the point the others wait in'
  assert not stall.start_up and stall.stopped == ()
  assert 'host 2 stopped first, in training at step 5' in stall.line()
  assert stall.record()['phases']['0'] == {'phase': 'training', 'detail': '', 'step': 6,
                                            'pid': os.getpid()}


def test_a_long_eval_has_its_own_allowance_and_a_tie_names_no_one(tmp_path):
  sw, marks = _job(tmp_path, 2)
  for m in marks:
    m.dispatched(0)
    m.enter('evaluating', 'after step 0')
  t = time.monotonic()
  assert sw.look(t) is None
  assert sw.deadline() == (deadlines.PHASE_FIRST_S, 'first')  # no eval has ended yet
  assert sw.look(t + 100) is None
  stall = sw.look(t + deadlines.PHASE_FIRST_S + 1)
  assert stall.host is None and 'no process could be singled out' in stall.line()
  assert 'restarting the whole job from its last snapshot' in stall.line()


def test_a_start_up_that_hangs_is_named_with_its_phase(tmp_path):
  sw, marks = _job(tmp_path, 2)
  for m in marks:
    m.enter('starting', 'jax.distributed.initialize')
  marks[1].enter('starting', 'the run: data, snapshots, state')  # host 0 never got past it
  t = time.monotonic()
  sw.look(t)
  stall = sw.look(t + deadlines.START_FIRST_S + 1)
  assert stall.start_up and stall.host == 0
  assert stall.line().startswith('the job hung in start-up: no progress for ')
  assert 'host 0 stopped first, in starting (jax.distributed.initialize)' in stall.line()


def test_a_start_up_is_booked_once_whole_never_in_parts(tmp_path):
  """The start-up an allowance is measured on ends at the first dispatch: a part of one (the
  imports before a long cold compile) would set a deadline that the compile runs past."""
  marks = Marks(mark_path(tmp_path, 0))
  marks.enter('starting', 'jax.distributed.initialize')
  marks.enter('compiling', 'the fused program')
  assert 'start-up' not in read_mark(mark_path(tmp_path, 0)).longest
  marks.dispatched(0)
  assert 'start-up' in read_mark(mark_path(tmp_path, 0)).longest
  marks.close()


def test_a_busy_start_up_is_progress_and_an_idle_one_is_not(tmp_path):
  """A process starting or compiling that uses CPU (a cold compile under load) is making
  progress without a new mark; one that uses none (waiting for a peer that never comes) is
  named after the deadline. Real processes, their CPU time read from /proc. A deadline shorter
  than CPU_WINDOW_S is sampled in half-deadline windows from the process's start, however late
  the first look comes (a supervisor on a loaded machine: a start-up stall test failed so)."""
  busy = subprocess.Popen([sys.executable, '-c', 'while True: pass'])
  idle = subprocess.Popen(['sleep', '600'])
  try:
    for pid, stalls in ((busy.pid, False), (idle.pid, True)):
      sw = watch.StallWatch(tmp_path, stall_s=1.0)
      sw.start({0: pid})
      time.sleep(0.4)  # the first look, late
      seen, until = None, time.monotonic() + 3.0
      while seen is None and time.monotonic() < until:
        seen = sw.look()
        time.sleep(0.05)
      assert (seen is not None) is stalls, seen
    assert seen.start_up and seen.host is None and seen.waited_s > seen.deadline_s
  finally:
    for proc in (busy, idle):
      proc.kill()
      proc.wait()


def test_a_watch_at_zero_never_declares_one(tmp_path):
  sw = watch.StallWatch(tmp_path, stall_s=0)
  sw.start({0: os.getpid()})
  assert sw.look(time.monotonic() + 1e6) is None


# ---- real jobs -----------------------------------------------------------------------------

STEPS = 14
ARGS = [*TINY, 'mesh.slice=3', f'train.steps={STEPS}', 'train.log_every=1', 'snapshot.every=1',
        'train.eval_every=0']


def _events(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _stalled_job(launcher, tmp_path, env) -> HistoryLine:
  """A 3-process job with `env` (where a worker blocks itself). Returns its launch-stall
  record; checks that it retrained to the end with no sample dropped
  and left no process. (A SIGSTOPped worker's job: tests/test_benchmark_smoke.py's
  stall_recovery, which asserts the same of it.)"""
  run, events = tmp_path / 'run', tmp_path / 'events.jsonl'
  proc = launcher.start([sys.executable, '-m', 'mecefo_jax.launch', '-n', '3', '--events',
                         events, '--', '--out', run, f'snapshot.dir={tmp_path / "shm"}', *ARGS],
                        env={**launcher.env(), **env}, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True)
  try:
    out, _ = proc.communicate(timeout=400)
  finally:
    kill(proc)
  starts = [e for e in _events(events) if e['kind'] == 'start']
  left = [pid for s in starts for pid in s['pids'].values() if Path(f'/proc/{pid}').exists()]
  assert not left, f'processes of the job left: {left}'
  assert proc.returncode == 0, out[-4000:]
  result = report(run)
  assert result['steps'] == STEPS and result['samples']['dropped'] == 0, result['samples']
  [stall] = [line for line in history.read(run) if line.kind is Kind.LAUNCH_STALL]
  assert [e['kind'] for e in _events(events)] == ['start', 'stall', 'start', 'end'], out[-3000:]
  failures = (run / 'failures.txt').read_text()
  assert f'# stall: {stall.note}\n' in failures
  return stall


def test_a_worker_blocked_inside_a_step_is_named_with_its_step(launcher, tmp_path):
  """Host 1 blocks between the dispatch of step 6 and its mark, its heartbeat thread alive
  (the coordination service never sees it go silent): the others wait for it in step 6."""
  stall = _stalled_job(launcher, tmp_path, {TEST_BLOCK_ENV: '1:6'})
  assert stall.host == 1 and stall.stopped == [], stall
  assert stall.why == 'it never reached the point the others wait in'
  assert stall.phases['1']['step'] == 5 and stall.phases['0']['step'] == 6, stall
  assert stall.phases['1']['phase'] == 'training', stall


def test_evals_snapshots_and_a_cold_compile_never_stall(launcher, tmp_path):
  """Default deadlines, an empty compile cache, evals, both snapshot tiers: no stall, and every
  phase was marked and timed (the marks the supervisor read)."""
  run, events = tmp_path / 'run', tmp_path / 'events.jsonl'
  proc = launcher.run([sys.executable, '-m', 'mecefo_jax.launch', '-n', '2', '--events', events,
                       '--', '--out', run, f'snapshot.dir={tmp_path / "shm"}', *TINY,
                       'mesh.slice=2', 'train.steps=12', 'train.log_every=1', 'snapshot.every=1',
                       'train.eval_every=4', f'snapshot.durable_dir={tmp_path / "ckpt"}',
                       'snapshot.durable_every=6'], timeout=400,
                      env=launcher.env(compile_cache=False))
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
  assert [e['kind'] for e in _events(events)] == ['start', 'end']
  for host in (0, 1):
    mark = read_mark(mark_path(run / 'logs' / 'marks', host))
    assert mark.phase == 'ending' and mark.step == 11, mark
    assert {'start-up', 'compiling', 'evaluating', 'saving/in-memory', 'saving/durable'} <= \
        set(mark.longest), mark


def test_a_stalls_restart_is_booked_as_a_deaths():
  """goodput.restart and the plot's time axis count from the stall line, as from a death's."""
  from mecefo_jax.run import restart
  lines = [HistoryLine(100.0, Kind.START), HistoryLine(130.0, Kind.LAUNCH_STALL, host=1),
           HistoryLine(130.2, Kind.LAUNCH_START)]
  assert restart.deaths(lines) == [130.0]
  assert restart.death_before_start(lines) == 130.0


def test_failures_txt_says_which_process_stalled_and_still_replays(tmp_path):
  from mecefo_jax.core.failures import FailureSchedule
  history.append(tmp_path, Kind.LAUNCH_STALL, host=2,
                 note='host 2 stopped first, in training at step 41; host 0 training at step '
                      '42, host 1 training at step 42, host 2 training at step 41')
  events = [{'step': 42, 'slice': 2, 'kind': 'fail', 'source': 'absent'}]
  rundir.write_failures(tmp_path, events, '`python -m mecefo_jax ...`')
  lines = (tmp_path / 'failures.txt').read_text().splitlines()
  assert lines[1] == ('# stall: host 2 stopped first, in training at step 41; host 0 training '
                      'at step 42, host 1 training at step 42, host 2 training at step 41')
  replay = FailureSchedule.from_trace(tmp_path / 'failures.txt', 3)
  assert [(e.step, e.slice, e.kind) for e in replay.events_at(42)] == [(42, 2, 'fail')]
