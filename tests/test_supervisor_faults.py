"""Faults of the supervised job beyond a clean death: a supervisor that is killed or stopped, a
survivor's view of a peer's death, a SIGTERM during start-up, a dead host's tmpfs part, and the
recovery's breakdown (real processes, real signals, a tiny model)."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mecefo_jax.supervisor import free_port as launch_port
from mecefo_jax.records import history, recovery
from mecefo_jax.records.history import HistoryLine, Kind, SupervisorPart
from mecefo_jax.records.job import PEER_LOST, Handoff, process_state
from mecefo_jax.records.progress_marks import mark_path, read_mark
from mecefo_jax.records.run_dir import LOCK
from mecefo_jax.run import ending, recovery_time
from mecefo_jax.run.supervised import Watch
from mecefo_jax.records.run_state import read_run_state
from procs import TINY, busy_core, error_lines, wait_for

BASE = ['mesh.slice=3', *TINY, 'train.log_every=1', 'snapshot.every=1', 'train.eval_every=0']


def _gone(pid: int) -> bool:
  """The process has ended (a zombie that nobody reaps counts: it runs nothing)."""
  return process_state(pid) in (None, 'Z')


def _events(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _rows(run: Path) -> int:
  path = run / 'metrics.jsonl'
  return path.read_text().count('"step"') if path.exists() else 0


def test_a_killed_supervisor_stops_its_workers_at_one_agreed_step(launcher, tmp_path):
  run, events, shm = tmp_path / 'run', tmp_path / 'events.jsonl', tmp_path / 'shm'
  out = open(tmp_path / 'supervisor.log', 'wb')  # worker 0 writes here after the supervisor died
  sup = launcher.start([sys.executable, '-m', 'mecefo_jax.launch', '-n', '3', '--events',
                        events, '--', '--out', run, f'snapshot.dir={shm}', 'train.steps=100000',
                        *BASE], stdout=out, stderr=subprocess.STDOUT)
  out.close()
  wait_for(lambda: _rows(run) >= 3, 240, 'three trained steps', sup)
  # One core kept busy from the kill to the stop (the other fault tests here run on a quiet
  # machine; the job's start-up is no part of this test, and the hog's CPU is counted).
  with busy_core():
    pids = [e for e in _events(events) if e['kind'] == 'start'][-1]['pids']
    os.kill(sup.pid, signal.SIGKILL)  # the supervisor alone: its workers are left running
    sup.wait()
    wait_for(lambda: all(_gone(p) for p in pids.values()), 120, 'the workers to stop')
  assert read_run_state(run).status == 'stopped'
  [stop] = [line for line in history.read(run) if line.kind is Kind.STOP]
  why = f'the supervisor (pid {sup.pid}) is gone'
  assert stop.why == why, stop
  said = f'stopped by {why} after {stop.step} steps'
  # Worker 0's lines reach the supervisor's log through its tee (job_rules.spawn_logged),
  # which may copy them after the worker ended.
  sup_log = tmp_path / 'supervisor.log'
  wait_for(lambda: said in sup_log.read_text(), 30, f'{said!r} in {sup_log}')
  logs = [sup_log.read_text()] + [
      (run / 'logs' / f'host{h}.log').read_text() for h in (1, 2)]
  assert all(said in log for log in logs), [log[-2000:] for log in logs]
  # Every host's part of that step's in-memory snapshot, and the report of a stopped run.
  [memory] = shm.iterdir()
  assert all((memory / f'host{h}' / str(stop.step)).is_dir() for h in range(3))
  report = json.loads((run / 'report.json').read_text())
  assert report['preempted'] and report['steps'] == stop.step


def test_a_killed_supervisors_workers_stuck_in_a_step_end_past_their_own_deadline(launcher,
                                                                                 tmp_path):
  """Host 1 blocks inside step 4 for ever (its peer waits for it in that step's collective),
  then the supervisor is SIGKILLed: no step ends, so the stop request never comes due. Host 1
  ends by itself once its mark has stood still for its own deadline (10 s: the floor of a
  step's), exit 8, in one line; host 0, which holds the job's coordination service, allows
  itself 10 s more (its end would have jax abort host 1 before its line): it ends on host 1's
  exit (its lost peer's line) or past its own deadline, in one line too."""
  run, events = tmp_path / 'run', tmp_path / 'events.jsonl'
  out = open(tmp_path / 'supervisor.log', 'wb')  # worker 0 writes here after the supervisor died
  sup = launcher.start([sys.executable, '-m', 'mecefo_jax.launch', '-n', '2', '--events',
                        events, '--stall-s', '600', '--', '--out', run,
                        f'snapshot.dir={tmp_path / "shm"}', 'train.steps=100000', *BASE[1:],
                        'mesh.slice=2'], env=launcher.env(MECEFO_TEST_BLOCK='1:4'), stdout=out,
                       stderr=subprocess.STDOUT)
  out.close()
  mark = lambda: read_mark(mark_path(run / 'logs' / 'marks', 0))
  wait_for(lambda: getattr(mark(), 'step', -1) >= 4, 240, 'host 0 in step 4', sup)
  pids = [e for e in _events(events) if e['kind'] == 'start'][-1]['pids']
  os.kill(sup.pid, signal.SIGKILL)
  sup.wait()
  t0 = time.monotonic()
  wait_for(lambda: all(_gone(p) for p in pids.values()), 120, 'the workers to end')
  assert time.monotonic() - t0 >= 10.0  # not before its deadline
  gone = f'error: the supervisor (pid {sup.pid}) is gone and this process has made no progress '
  [line] = error_lines((run / 'logs' / 'host1.log').read_text())
  assert line.startswith(gone) and '(in training at step 3; its own deadline 10 s): exit 8 ' \
      'without a final snapshot' in line, line
  sup_log = tmp_path / 'supervisor.log'  # copied by worker 0's tee, maybe after it ended
  wait_for(lambda: error_lines(sup_log.read_text()), 30, f'an error line in {sup_log}')
  [line] = error_lines(sup_log.read_text())
  assert line.startswith('error: host 0: a collective failed, a peer process of the job is gone') \
      or line.startswith(gone) and '(in training at step 4; its own deadline 20 s): exit 8' in line
  assert read_run_state(run).status != 'stopped'  # no agreed stop: none was reached


def test_the_watch_sees_a_closed_pipe_and_a_stopped_supervisor(launcher):
  seen = []
  read_fd, write_fd = os.pipe()
  Watch(Handoff.from_env(f'fd:{read_fd}:{os.getpid()}'), seen.append, seen.append)
  time.sleep(1.5)
  assert seen == []  # an open pipe and a running supervisor: nothing
  os.close(write_fd)
  wait_for(lambda: seen, 5, 'the end of the pipe seen')
  assert seen == [f'the supervisor (pid {os.getpid()}) is gone']
  os.close(read_fd)
  # A stand-in supervisor, stopped: gone once stopped for stopped_s, not before.
  stand_in = launcher.start(['sleep', '60'])
  read_fd, write_fd = os.pipe()
  stopped = []
  Watch(Handoff(read_fd, stand_in.pid, stopped_s=2.0), stopped.append, stopped.append)
  os.kill(stand_in.pid, signal.SIGSTOP)
  time.sleep(1.0)
  assert stopped == []
  wait_for(lambda: stopped, 10, 'the stopped supervisor seen')
  assert stopped == [f'the supervisor (pid {stand_in.pid}) has been stopped for 2 s']
  os.kill(stand_in.pid, signal.SIGKILL)
  os.close(write_fd)


def test_sigterm_during_start_up_is_one_line_and_leaves_nothing(launcher, tmp_path):
  """SIGTERM once the run is locked (data, state and first programs being built, a cold
  compile): one line saying where, exit 143, no lock, no directory of its own left."""
  run, shm = tmp_path / 'new' / 'run', tmp_path / 'shm'
  proc = launcher.start([sys.executable, 'train.py', '--out', run, f'snapshot.dir={shm}',
                         'train.steps=5', *TINY], env=launcher.env(compile_cache=False),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  wait_for(lambda: (run / LOCK).exists(), 120, 'the run locked', proc)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  lines = [line for line in err.splitlines() if 'error' in line.lower() or 'Traceback' in line]
  assert proc.returncode == 143 and len(lines) == 1, err[-3000:]
  assert lines[0].startswith('error: stopped by SIGTERM during start-up ('), lines
  assert 'nothing of this start is kept' in lines[0]
  assert not (tmp_path / 'new').exists()  # train.py made it: gone with the lock
  assert not shm.exists() or not any(shm.rglob('*')), sorted(shm.rglob('*'))


def test_a_survivor_of_a_peers_death_says_so_in_one_line(launcher, tmp_path):
  """Three processes without a supervisor (nothing kills the survivors): host 1 dies after
  step 2; hosts 0 and 2 fail in their next collective and each says so in one line, unless gloo's
  own check aborts it first (a torn message from the dying peer: C++, nothing to catch)."""
  run, port = tmp_path / 'run', launch_port()
  env = launcher.env(MECEFO_TEST_SIGKILL='1:2')
  procs = [launcher.start([sys.executable, '-m', 'mecefo_jax', f'--coordinator=127.0.0.1:{port}',
                           '--num-processes=3', f'--process-id={p}', '--host-devices=1',
                           '--out', run, f'snapshot.dir={tmp_path / "shm"}', 'train.steps=50',
                           *BASE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) for p in range(3)]
  ended = [p.communicate(timeout=240) for p in procs]
  assert procs[1].returncode == -signal.SIGKILL, ended[1][1][-3000:]
  for host in (0, 2):
    err = ended[host][1]
    if procs[host].returncode == -signal.SIGABRT and 'gloo::EnforceNotMet' in err:
      continue  # gloo's own check aborted it mid-collective (C++; docs/errors.md says so)
    assert procs[host].returncode == PEER_LOST, (host, procs[host].returncode, err[-3000:])
    assert 'Traceback' not in err, err[-3000:]
    [line] = error_lines(err)
    assert line.startswith(f'error: host {host}: a collective failed, a peer process of the job '
                           'is gone ('), line


def test_a_death_is_timed_phase_by_phase_and_its_tmpfs_part_freed(launcher, tmp_path):
  """Host 1 dies after step 3; the survivors' job resumes, stops after step 6 (--stop-after)
  and then finishes at 8. Its report and the supervisor's line break the restart down; host 1's
  tmpfs part goes once the survivors' own snapshot is complete, and nothing is left in tmpfs
  once the run is finished."""
  run, events, shm = tmp_path / 'run', tmp_path / 'events.jsonl', tmp_path / 'shm'
  cmd = [sys.executable, '-m', 'mecefo_jax.launch', '-n', '3', '--events', events, '--',
         '--out', run, f'snapshot.dir={shm}', 'train.steps=8', *BASE]
  first = launcher.run([*cmd, '--stop-after', '6'], timeout=400,
                       env=launcher.env(MECEFO_TEST_SIGKILL='1:3'))
  assert first.returncode == 143, first.stderr[-4000:]
  recovery = json.loads((run / 'report.json').read_text())['recovery']
  assert (recovery['cause'], recovery['host']) == ('death', 1), recovery
  phases = ['stop_s', 'spawn_s', 'process_start_s', 'imports_s', 'distributed_s', 'setup_s',
            'restore_s', 'programs_s', 'first_step_s']
  # (How fast a death is seen is the restart benchmark's figure, not a bound here.)
  assert all(recovery[p] >= 0 for p in phases) and recovery['detect_s'] >= 0, recovery
  assert abs(sum(recovery[p] for p in phases) - recovery['total_s']) < 0.01, recovery
  assert recovery['imports_s'] > 0 and recovery['programs_s'] > 0, recovery
  lines = history.read(run)
  death = next(line.t for line in lines if line.kind is Kind.LAUNCH_DEATH)
  recovered = next(line for line in lines if line.kind is Kind.RECOVERED)
  assert recovered.recovered.total_s == recovery['total_s'] <= recovered.t - death + 0.01
  assert 'trained again' in first.stderr and 'after the death of host 1 was seen' in \
      first.stderr, first.stderr[-3000:]
  [memory] = shm.iterdir()
  assert sorted(p.name for p in memory.iterdir()) == ['host0', 'host2'], list(memory.iterdir())
  second = launcher.run(cmd, timeout=400)
  assert second.returncode == 0, second.stderr[-4000:]
  assert not shm.exists() or not any(shm.iterdir()), sorted(shm.rglob('*'))
  pids = [p for e in _events(events) if e['kind'] == 'start' for p in e['pids'].values()]
  assert all(_gone(p) for p in pids)


def test_processes_sharing_a_store_take_turns_to_fill_an_entry(tmp_path):
  """The restarts' programs are compiled once per store: a second claim on an entry is refused
  while the first holds it; a claim whose process is gone, or too old, is taken over."""
  import socket

  from mecefo_jax.step.program_store import CLAIM_S, ProgramStore
  store = ProgramStore(tmp_path, 1 << 20)
  with store.claim('k') as first:
    with store.claim('k') as second:
      assert first and not second
  with store.claim('k') as again:  # released
    assert again
  claim = tmp_path / 'k.claim'
  claim.write_text(f'{socket.gethostname()} {2 ** 22 + 12345}')  # no such pid on Linux
  with store.claim('k') as taken:
    assert taken and f' {os.getpid()}' in claim.read_text()
  claim.write_text(f'another-host {os.getpid()}')  # another machine's: fresh, then too old
  with store.claim('k') as held_elsewhere:
    assert not held_elsewhere
  os.utime(claim, (time.time() - CLAIM_S - 1,) * 2)
  with store.claim('k') as stale:
    assert stale
  assert not claim.exists()


def test_a_process_waits_for_a_peers_claimed_entry_and_takes_over_a_dead_peers_claim(
    launcher, tmp_path):
  """'background builds done' means the store holds the restart's programs: a process whose
  peer claimed an entry waits for it (or gives up when told), and compiles it itself once
  that peer dies holding the claim (it used to skip it: a kill then left a compile to the
  survivors' job)."""
  import socket
  import threading

  from mecefo_jax.step.program_store import ProgramStore
  store, compiled = ProgramStore(tmp_path, 1 << 20), []
  compile_into = lambda: (compiled.append(1), store.path('k').write_bytes(b'entry'))
  peer = launcher.start(['sleep', '60'])
  (tmp_path / 'k.claim').write_text(f'{socket.gethostname()} {peer.pid}')
  assert not store.fill('k', compile_into)  # no waiting asked for: left to the peer
  threading.Timer(0.5, lambda: store.path('k').write_bytes(b'peer')).start()
  assert store.fill('k', compile_into, give_up=lambda: False) and not compiled
  assert store.path('k').read_bytes() == b'peer'
  store.path('k').unlink()
  threading.Timer(0.5, lambda: (peer.kill(), peer.wait())).start()  # dies holding the claim
  assert store.fill('k', compile_into, give_up=lambda: False) and compiled == [1]
  assert not (tmp_path / 'k.claim').exists()


def test_the_restart_benchmark_measures_a_kill_against_a_cold_start(launcher, tmp_path):
  """benchmarks.restart_time on a tiny job: its cold start, the restart after a real SIGKILL
  once the job has said its background builds are done, and the report's breakdown, in its
  JSON: the survivors' first step compiles nothing (it once compiled a program whose claim
  died with the killed process)."""
  # An empty HOME still (the claims and the store under test), at the suite's XLA flags: the
  # cold compiles, most of this run, take less time.
  result = launcher.benchmark('restart_time', '--repeats', '1', '--steps', '100000', '--kill-at',
                              '4', '--keep-xla-flags', *TINY, json_path=tmp_path / 'out.json')
  [run] = result['runs']
  assert 0 < run['kill_to_first_step_s'] and 0 < run['cold_start_s']
  assert run['ratio'] == run['kill_to_first_step_s'] / run['cold_start_s']
  assert run['recovery']['cause'] == 'death' and run['recovery']['host'] == 1
  built = run['recovery']['programs_built']
  assert built and 'compiled' not in built, built
  assert run['supervisor_line'] and 'trained again' in run['supervisor_line']
  assert result['median']['ratio'] == run['ratio'] and 'load average' in result['load_before']


class JaxRuntimeError(RuntimeError):  # named as jax names a collective's failure
  pass


def test_a_collectives_failure_is_a_lost_peer_in_one_line(capsys):
  gloo = JaxRuntimeError('[external/gloo/pair.cc:589] Gloo AllGather failed: Read error '
                         '[127.0.0.1]:40604: Connection reset by peer\nmore lines')
  assert ending.peer_lost(gloo) and not ending.peer_lost(ValueError(str(gloo)))
  # The metrics' fetch (process_allgather) raises the runtime's status as a ValueError (seen
  # beside a busy core: host 0 printed its traceback, not its line); a user's ValueError is not.
  allgather = ValueError('UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/'
                         'pair.cc:547] Connection closed by peer [127.0.0.1]:17796')
  assert ending.peer_lost(allgather) and not ending.peer_lost(ValueError('UNKNOWN: a bad value'))
  assert not ending.peer_lost(JaxRuntimeError('RESOURCE_EXHAUSTED: out of memory'))
  assert ending.lost_peer(2, gloo) == PEER_LOST
  [line] = capsys.readouterr().err.splitlines()
  assert line.startswith('error: host 2: a collective failed, a peer process of the job is gone '
                         '(Gloo AllGather failed: Read error') and 'pair.cc' not in line, line


def test_the_coordination_services_host_lingers_after_its_lost_peer_line(monkeypatch, capsys):
  """Process 0 holds the job's coordination service: when it exits, jax aborts the processes
  still connected (SIGABRT, not their one line: seen at load 6). Process 0 of 3 or more stays
  SERVICE_LINGER_S with SIGTERM at its default (a supervisor's stop ends it); no other does."""
  import jax
  slept, previous = [], signal.getsignal(signal.SIGTERM)
  monkeypatch.setattr(ending.time, 'sleep', lambda s: slept.append(
      (s, signal.getsignal(signal.SIGTERM))))
  gloo = JaxRuntimeError('Gloo all-reduce failed: Connection closed by peer')
  try:
    for index, count in ((1, 3), (0, 2), (0, 3)):
      monkeypatch.setattr(jax, 'process_index', lambda: index)
      monkeypatch.setattr(jax, 'process_count', lambda: count)
      assert ending.lost_peer(index, gloo) == PEER_LOST
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert slept == [(ending.SERVICE_LINGER_S, signal.SIG_DFL)]
  assert len(capsys.readouterr().err.splitlines()) == 3


def test_a_restarts_phases_add_up_to_its_whole_and_the_last_launch_start_is_its_own():
  part = SupervisorPart('death', 1, 0.1, detected_t=100.0, stopped_t=100.5, spawned_t=101.0)
  marks = {'jax_imported': 103.0, 'distributed': 103.5, 'imported': 104.5}
  seconds = {'restore_s': 0.5, 'first_programs_s': 2.0, 'first_step_run_s': 1.0}
  r = recovery_time.measure(part, origin=101.25, marks=marks, seconds=seconds,
                            first_step_end=110.0, programs_built={'loaded': 2, 'compiled': 1})
  assert (r.stop_s, r.spawn_s, r.process_start_s, r.imports_s, r.distributed_s) == (
      0.5, 0.5, 0.25, 2.75, 0.5)
  assert r.total_s == 10.0 and r.setup_s == 10.0 - (0.5 + 0.5 + 0.25 + 2.75 + 0.5 + 0.5 + 2.0 +
                                                   1.0)
  line = recovery.describe(r)
  assert line.startswith('trained again 10.0 s after the death of host 1 was seen: detect <= '
                         '0.10 s, stop 0.5 s')
  assert 'programs 2.0 s (1 compiled, 2 loaded), first step 1.0 s' in line
  lines = [HistoryLine(1.0, Kind.LAUNCH_START, recovery=dataclasses.replace(part, host=0)),
           HistoryLine(2.0, Kind.START), HistoryLine(3.0, Kind.LAUNCH_DEATH),
           HistoryLine(4.0, Kind.LAUNCH_START, recovery=part)]
  assert recovery_time.restarted_by(lines) == part
  assert recovery_time.restarted_by(lines[:2]) is None  # a first start: no restart
