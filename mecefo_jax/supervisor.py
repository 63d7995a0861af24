"""The supervisor's loop: runs a job's processes, restarts them on the survivors after a death or
a stall, grows the job back on a rejoin (the command line: launch.py)."""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from mecefo_jax import spawn
from mecefo_jax.job_rules import (Outputs, blamed, dead, error_lines, exit_text,
                                  failed_in_start_up, resuming, starts, tpu_slice)
from mecefo_jax.records import history
from mecefo_jax.records.history import Kind
from mecefo_jax.records.job import (ALL_DOWN, BAD_INPUT, LAUNCH_ENV, PEER_LOST, STOP_FILE, STOPPED,
                                    SUPERVISOR_ENV, Handoff)
from mecefo_jax.records.progress_marks import MARKS_ENV
from mecefo_jax.records.recovery import RestartClock, describe
from mecefo_jax.records.run_state import RUN_STATE
from mecefo_jax.watch import Stall, StallWatch, kill_group

# The directory holding this package: the processes import the same one from any cwd.
PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
_POLL_S, _GRACE_S = 0.1, 60.0
# A survivor that lost a peer (PEER_LOST, or an abort whose last words say so) is no death:
# the dead process shows within this long (a remote one once its transport notices: Ray's
# health checks take up to half a minute), else the whole job restarts.
_PEER_WAIT_S = 45.0
_ABORT_WAIT_S = 5.0  # other aborts wait this long for a death behind them (job_rules.ABORTED)


def free_port(address: str = '127.0.0.1') -> int:
  """A TCP port free on this machine's `address` now (a job's coordinator; '': every one)."""
  with socket.socket() as s:
    s.bind((address, 0))
    return s.getsockname()[1]


class Supervisor:
  """Runs the job, restarts it on the survivors after a death or a stall, grows it back on a
  rejoin."""
  watches_stalls = True  # the processes' progress marks are files on this machine

  def __init__(self, args):
    self.args, self.t0 = args, time.monotonic()
    self.hosts = list(range(args.num_processes))  # the logical hosts in the job
    self.ready_at: dict[int, float] = {}  # dead host -> when its replacement is ready
    self.procs: dict[int, subprocess.Popen] = {}
    self.outputs = Outputs(args.log_dir)  # every process's output, its last words
    self.deaths = self.rejoins = self.restarts = 0
    self.stopping = False  # the job was asked to stop (to grow, or the supervisor's SIGTERM)
    self.settle_since = self.abort_since = None  # since when exits wait for others (start())
    self.interrupted: str | None = None  # the signal that stops the job
    self.signals = 0  # SIGINT/SIGTERM received: a second one ends the job at once
    self.away, self.looked_at = False, time.monotonic()  # stopped (SIGSTOP) since a start
    self.resume = False
    # Each process holds the read end; the write end is ours alone (os.pipe's fds are not
    # inherited): however the supervisor ends, its processes see end-of-file and stop the job
    # at an agreed step (run/supervised.py).
    self.watched_fd, self._alive_fd = os.pipe()
    self.clock = RestartClock(args.out)
    self.stalls = 0
    self.watch = (StallWatch(args.log_dir / 'marks', args.stall_s) if self.watches_stalls
                  else None)

  def tell(self, message: str) -> float:
    """Prints a line of the supervisor's; the seconds since it started."""
    elapsed = time.monotonic() - self.t0
    print(f'launch [{elapsed:7.1f}s]: {message}', file=sys.stderr, flush=True)
    return elapsed

  def say(self, kind: Kind, message: str, **fields) -> None:
    """Prints an event; appends it to --events and to the run's history.jsonl (its `fields`)."""
    elapsed = self.tell(message)
    history.append(self.args.out, kind, elapsed_s=round(elapsed, 3), events=self.args.events,
                   **fields)

  def _train_args(self) -> list[str]:
    if not self.resume:
      return list(self.args.train_args)
    # A restart continues the run: never --fresh again (it would delete the run's snapshots).
    # A run that does not exist yet (its first start stopped before run_state.json, e.g. a
    # start-up stall) is started anew: a --resume of nothing would be refused.
    return [a for a in self.args.train_args if a not in ('--fresh', '--resume')] + (
        ['--resume'] if self._run_exists() else [])

  def _run_exists(self) -> bool:
    """Whether the run directory holds a run (its run_state.json)."""
    return (self.args.out / RUN_STATE).exists()

  def start(self) -> None:
    self.clock.spawning()  # a transport's start of its hosts (Ray: their actors) included
    port, n = self._port(), len(self.hosts)
    self.procs, self.stopping, self.settle_since, self.abort_since = {}, False, None, None
    self.away, self.looked_at = False, time.monotonic()
    self._clear_stop_request()
    self.outputs.new_job(self.hosts)
    self.starts = starts(self.args.out)
    for pid, host in enumerate(self.hosts):
      self.procs[host] = self.spawn(pid, host, n, port)
    pids = {h: p.pid for h, p in self.procs.items()}
    if self.watch:
      self.watch.start(pids)
    self.say(Kind.LAUNCH_START,
             f'started hosts {self.hosts} as a {n}-process job'
             f'{" resuming the run" if self._resuming() else ""} (pids {pids})',
             hosts=self.hosts, pids=pids, **self.clock.spawned())

  def _resuming(self) -> bool:
    """Whether the job started resumes the run (a restart, --resume, an unfinished run)."""
    return resuming(self._train_args(), self.args.out)

  def _log(self, host: int) -> Path:
    return self.outputs.log(host)

  # The transport: the hooks a driver of processes elsewhere replaces (deploy/pod_controller.py,
  # ray_driver.py); the rules above and below are the same for all.
  def spawn(self, pid: int, host: int, n: int, port: int):
    """Starts process `pid` (logical host `host`) of an n-process job; its handle: a Popen, or
    what answers as one (pid, returncode, poll, wait, send_signal, kill)."""
    cmd, env = self.command(pid, host, n, port)
    env = {**env, SUPERVISOR_ENV: Handoff(self.watched_fd, os.getpid(),
                                          self.args.stopped_s).to_env()}
    # Every process logs the same events to its file (its last words: words()); process 0
    # speaks for the job on the terminal too.
    return self.outputs.spawn(host, cmd, env, echo=pid == 0, fork=self.args.spawn == 'fork',
                              pass_fds=(self.watched_fd,))

  def words(self, host: int) -> str:
    """The last words of `host`'s process in this job (it exited): the tail of its output."""
    return self.outputs.words(host)

  def kill_first(self, host: int) -> None:
    """Kills the stalled process of `host` (and what it started) before the others."""
    kill_group(self.procs[host])

  def _port(self) -> int:
    return free_port()

  def _clear_stop_request(self) -> None:
    (self.args.out / STOP_FILE).unlink(missing_ok=True)  # a request no job honoured

  def command(self, pid: int, host: int, n: int, port: int) -> tuple[list[str], dict]:
    """The command and environment of process `pid` (logical host `host`) of an n-process job."""
    k = self.args.devices_per_process
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    env[LAUNCH_ENV] = shlex.join(self.args.argv)  # for the hints it prints: rerun this
    if self.watch:
      env[MARKS_ENV] = str(self.watch.directory)
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get('PYTHONPATH')]))
    cmd = [sys.executable, *spawn.WORKER, f'--coordinator=127.0.0.1:{port}',
           f'--num-processes={n}', f'--process-id={pid}', f'--host-slot={host}']
    if self.args.gpus:
      env['CUDA_VISIBLE_DEVICES'] = ','.join(str(host * k + i) for i in range(k))
      env.setdefault('JAX_PLATFORMS', 'cuda')  # no silent fall-back to the CPU
    else:
      env.setdefault('JAX_PLATFORMS', 'cpu')
      cmd.append(f'--host-devices={k}')
    return cmd + self._train_args(), env

  def _ready(self) -> list[int]:
    """The dead hosts whose replacement is ready now."""
    return sorted(h for h, t in self._coming().items() if time.monotonic() >= t)

  def _coming(self) -> dict[int, float]:
    """{dead host: when its replacement is ready}, of those whose replacement is coming."""
    return self.ready_at

  def kill_all(self) -> None:
    for p in self.procs.values():
      if p.poll() is None:
        p.kill()
    for p in self.procs.values():
      p.wait()
    self.outputs.end()

  def stop_all(self) -> None:
    """The supervisor leaves (an error of its own): a job still running is asked to stop at an
    agreed step (snapshotted, resumable), killed only past the grace period."""
    if any(p.poll() is None for p in self.procs.values()):
      self._ask_stop()
      deadline = time.monotonic() + _GRACE_S
      while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    self.kill_all()

  def run(self) -> int:
    self.start()
    while True:
      code = self._watch()
      if code is not None:
        return code

  def _watch(self) -> int | None:
    """One look at the job; an exit code when the supervisor is done."""
    time.sleep(_POLL_S)
    # A look long after the last one: this supervisor was stopped (SIGSTOP, Ctrl-Z) or the
    # machine suspended; past --stopped-s its processes stop the job themselves.
    self.away |= time.monotonic() - self.looked_at > self.args.stopped_s
    self.looked_at = time.monotonic()
    self.clock.look()
    codes = {h: p.poll() for h, p in self.procs.items()}
    done = self.clock.recovered()
    if done:  # the restarted job's first step: where the restart's time went (its own line
      self.tell(describe(done))  # in history.jsonl: `recovered`)
    exited = {h: c for h, c in codes.items() if c is not None}
    if self.stopping:
      return self._stopped(exited, codes)
    failed = self._failed_start(exited)
    if failed is not None:
      return self._start_failed(failed, exited[failed])
    peer_aborted = self.outputs.peer_aborts(exited, self.words)
    died = dead(exited, peer_aborted)
    if died:
      return self._first_death(died, exited)
    if PEER_LOST in exited.values() or peer_aborted:
      return self._lost_peer(exited)
    if exited and len(exited) == len(codes):
      away = self._stopped_while_away(exited)
      return self._finished(exited) if away is None else self._take_back(away)
    if exited:  # others finish or stop with it: wait for them, within bounds
      return self._settle(exited)
    stall = self.watch.look() if self.watch else None
    if stall is not None:
      return self._stall(stall)
    ready = self._ready()
    if ready:
      self.say(Kind.LAUNCH_REJOIN_READY,
               f'replacement for host(s) {ready} ready: stopping the job after its current step '
               f'to grow back to {len(self.hosts) + len(ready)} hosts', hosts=ready)
      self._ask_stop(f'the grow-back of host(s) {ready}')
    return None

  def _failed_start(self, exited: dict) -> int | None:
    """A host whose process failed in start-up: it exited with an input error, or (the run
    directory being here) with an error of its own before the job trained (no new start in
    history.jsonl) and no process was killed (a death: restarted). A restart would fail alike:
    the job ends. Host 0 first (its lines are on the terminal)."""
    failed = failed_in_start_up(exited, self.hosts[0], self.args.out.is_dir())
    if not failed or (exited[failed[0]] != BAD_INPUT and starts(self.args.out) > self.starts):
      return None
    return failed[0]

  def _start_failed(self, host: int, code: int) -> int:
    """Shows that host's `error:` lines (host 0's are on the terminal already), stops the job."""
    if host != self.hosts[0]:
      for line in error_lines(self._log(host), self.outputs.sizes.get(host, 0)):
        print(line, file=sys.stderr, flush=True)
    self.kill_all()
    self.say(Kind.LAUNCH_END,
             f'host {host} failed in start-up ({exit_text(code)}; its output: '
             f'{self._log(host) if host != self.hosts[0] else "above"}): the job is stopped',
             code=code, host=host)
    return code

  def _ask_stop(self, reason: str | None = None) -> None:
    """Asks the job to stop after its current step: through the run's stop request file
    (run/stop.py: honoured at a step whenever it is written, by every process after the same
    step); without a reason, or before the run exists (a start-up: nothing to honour it yet),
    by SIGTERM to every process."""
    self.stopping, self.stop_asked_at = True, time.monotonic()
    if reason is not None and self._run_exists():
      (self.args.out / STOP_FILE).write_text(reason)
      return
    for p in self.procs.values():
      if p.poll() is None:
        p.send_signal(signal.SIGTERM)

  def _stopped(self, exited: dict, codes: dict) -> int | None:
    """The job was asked to stop: wait for every process, then grow it or leave."""
    if len(exited) < len(codes):
      if time.monotonic() - self.stop_asked_at > _GRACE_S:
        self.kill_all()  # a process stuck in a collective with one that already left
      return None
    if self.interrupted:
      code = max(exited.values(), key=abs) or 0
      self.say(Kind.LAUNCH_END,
               f'job stopped by {self.interrupted} ({exit_text(code)}) after {self.deaths} '
               f'death(s){self._stalls()}, {self.rejoins} rejoin(s), {self.restarts} restart(s); '
               'resume it with the same command', code=code)
      return code
    if all(c == 0 for c in exited.values()):
      return self._finished(exited)
    ready = self._ready()
    for h in ready:
      del self.ready_at[h]
    self.hosts = sorted(self.hosts + ready)
    self.rejoins += len(ready)
    self.say(Kind.LAUNCH_REJOIN, f'host(s) {ready} rejoin', hosts=ready)
    return self._restart()

  def _first_death(self, died: list[int], exited: dict) -> int | None:
    """The death the restart is for; where each one seen is an abort (a survivor's, maybe), the
    death that caused it is waited for, within _ABORT_WAIT_S, before the first abort counts."""
    host = blamed(died, exited)
    if host is None:
      self.abort_since = self.abort_since or time.monotonic()
      if time.monotonic() - self.abort_since <= _ABORT_WAIT_S:
        return None
      host = died[0]
    return self._death(host, exited[host])

  def _death(self, host: int, code: int) -> int | None:
    self.deaths += 1
    # A failure seen at this look: the restart is timed from here (a stall alike).
    self.clock.failure('death', host, self.clock.since_last_look())
    self.say(Kind.LAUNCH_DEATH,
             f'host {host} (pid {self.procs[host].pid}) died ({exit_text(code)}): stopping the '
             f'survivors {self._survivors(host)}', host=host, code=code)
    return self._without(host)

  def _stall(self, stall: Stall) -> int | None:
    """A stall (watch.py): the job is stopped and restarted without the process that stopped
    first, killed first, as after its death; where none is singled out, with every host, from
    the last snapshot."""
    self.stalls += 1
    # Timed from this look as a death is; detection took the deadline that ran out.
    self.clock.failure('stall', stall.host, stall.waited_s)
    self.say(Kind.LAUNCH_STALL, stall.line(), **stall.record())
    if stall.host is None:
      self.kill_all()
      self.clock.stopped()
      return self._restart()
    self.kill_first(stall.host)  # before the others: none may see it leave first
    return self._without(stall.host)

  def _stalls(self) -> str:
    return f', {self.stalls} stall(s)' if self.stalls else ''  # the end lines' count

  def unit_of(self, host: int) -> list[int]:
    """The hosts that leave and rejoin with `host`: its TPU slice (--slice-hosts)."""
    return tpu_slice(host, self.args.slice_hosts)

  def _survivors(self, host: int) -> list[int]:
    return [h for h in self.hosts if h not in self.unit_of(host)]

  def _without(self, host: int) -> int | None:
    """The job stopped and restarted without `host` (dead or stalled) and its TPU slice."""
    self.kill_all()  # they would wait in the next collective for the dead one
    self.clock.stopped()
    if not self._run_exists():  # no snapshot holds its slices for the others: a fresh start
      self.say(Kind.LAUNCH_START_AGAIN,
               f'the run does not exist yet (no {RUN_STATE}): starting the whole job again, '
               f'host {host} included', host=host)
      return self._restart()
    self.hosts = self._survivors(host)
    if self.args.rejoin_after is not None:
      self.ready_at.update(dict.fromkeys(self.unit_of(host),
                                         time.monotonic() + self.args.rejoin_after))
    while len(self.hosts) < 2:
      coming = self._coming()
      if not coming:
        self.say(Kind.LAUNCH_GIVE_UP,
                 f'{len(self.hosts)} host left and no replacement coming (--rejoin-after): the '
                 'run stops here; resume it with the same command once hosts are back')
        return ALL_DOWN
      host, at = min(coming.items(), key=lambda kv: kv[1])
      back = [h for h in self.unit_of(host) if h in coming]  # a TPU slice comes back whole
      self.say(Kind.LAUNCH_WAIT,
               f'{len(self.hosts)} host left: waiting {max(0, at - time.monotonic()):.0f} s '
               f'for the replacement of host(s) {back}')
      time.sleep(max(0.0, at - time.monotonic()))
      for h in back:
        del self.ready_at[h]
      self.hosts, self.rejoins = sorted(self.hosts + back), self.rejoins + len(back)
    return self._restart()

  def _lost_peer(self, exited: dict) -> int | None:
    """Processes left with PEER_LOST: a peer stopped (SIGSTOP) is the stall it is; else their
    peer's death shows next (waited for, bounded); if none does, no process can be singled out
    and the whole job restarts from its snapshot."""
    stopped = self.watch.stopped_peer(exited) if self.watch else None
    if stopped is not None:
      return self._stall(stopped)
    self.settle_since = self.settle_since or time.monotonic()
    if time.monotonic() - self.settle_since <= _PEER_WAIT_S:
      return None
    lost = sorted(h for h, c in exited.items() if c == PEER_LOST or h in self.outputs.peer_aborted)
    self.say(Kind.LAUNCH_PEER_LOST,
             f'host(s) {lost} lost a peer and no process died within {_PEER_WAIT_S:.0f} s: '
             'restarting the whole job from its last snapshot', hosts=lost)
    self.clock.failure('peer-lost', None, None)
    self.kill_all()
    self.clock.stopped()
    return self._restart()

  def _restart(self) -> int | None:
    self.restarts += 1
    if self.restarts > self.args.max_restarts:
      self.say(Kind.LAUNCH_GIVE_UP,
               f'more than --max-restarts={self.args.max_restarts} restarts: giving up')
      return 1
    self.resume = True
    self.start()
    return None

  def _settle(self, exited: dict) -> int | None:
    """Some processes left on their own (finished, or a job-wide stop): the others follow."""
    self.settle_since = self.settle_since or time.monotonic()
    if time.monotonic() - self.settle_since > _GRACE_S:
      self.say(Kind.LAUNCH_STUCK,
               f'hosts {sorted(exited)} left ({exited}); the others did not: killing them')
      self.kill_all()
      return self._finished({h: p.returncode for h, p in self.procs.items()})
    return None

  def _stopped_while_away(self, exited: dict) -> int | None:
    """The step after which the job stopped itself because this supervisor was stopped
    (SIGSTOP, a suspended terminal: run/supervised.py): it saw a gap in its own looks, or the
    stop record names it (the record is process 0's: where another process's watch asked
    first, it reads 'a stop agreed by the job'); None for any other end."""
    if any(c != STOPPED for c in exited.values()) or not self._run_exists():
      return None
    stops = [line for line in history.read(self.args.out, warn=False) if line.kind is Kind.STOP]
    named = stops and (stops[-1].why or '').startswith(f'the supervisor (pid {os.getpid()})')
    return stops[-1].step if stops and (named or self.away) else None

  def _take_back(self, step: int) -> int | None:
    """The job stopped itself after `step` while this supervisor was stopped; the supervisor
    runs again: it restarts the job from that step."""
    self.say(Kind.LAUNCH_TAKE_BACK,
             f'the job stopped itself after step {step} while this supervisor was stopped '
             f'(longer than {self.args.stopped_s:g} s): restarting it from there', step=step)
    return self._restart()

  def _finished(self, exited: dict) -> int:
    code = next((c for c in exited.values() if c != 0), 0)
    what = 'stopped' if code == STOPPED else 'ended'  # a stop (--stop-after) is resumable
    self.say(Kind.LAUNCH_END,
             f'job {what} ({exit_text(code)}) after {self.deaths} death(s){self._stalls()}, '
             f'{self.rejoins} rejoin(s), {self.restarts} restart(s); the failure history is '
             'failures.txt in the run directory' + (
                 '; resume it with the same command' if code == STOPPED else ''),
             code=code)
    return code
