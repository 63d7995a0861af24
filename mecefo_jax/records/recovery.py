"""The supervisor's side of where a restart's time went (run/recovery_time.py: process 0's).

The supervisor records its part in the `launch-start` line of history.jsonl that starts the
restarted job (`recovery`: the cause, the detection, the survivors' stop, the spawn); process 0
of that job adds its own start-up (imports, jax.distributed, restore, programs, the first
step), writes the whole as a `recovered` line once its first step is trained, and keeps it for
report.json (`recovery`). The supervisor prints that line (describe).
"""
from __future__ import annotations

import time
from pathlib import Path

from mecefo_jax.records.history import Follower, Kind, Recovery, SupervisorPart


def describe(r: Recovery) -> str:
  """The supervisor's line of a `recovered` line (or report.json's `recovery`)."""
  who = f' of host {r.host}' if r.host is not None else ''
  seen = f'detect <= {r.detect_s:.2f} s, ' if r.detect_s is not None else ''
  return (f'trained again {r.total_s:.1f} s after the {r.cause}{who} was seen: {seen}'
          f'stop {r.stop_s:.1f} s, spawn {r.spawn_s:.1f} s, process start '
          f'{r.process_start_s:.1f} s, imports {r.imports_s:.1f} s, jax.distributed '
          f'{r.distributed_s:.1f} s, setup {r.setup_s:.1f} s, restore '
          f'{r.restore_s:.1f} s, programs {r.programs_s:.1f} s{_built(r)}, first step '
          f'{r.first_step_s:.1f} s (report.json: recovery)')


def _built(r: Recovery) -> str:
  """' (3 loaded)', ' (1 compiled, 2 loaded)'; '' where none were counted."""
  built = r.programs_built
  return f" ({', '.join(f'{n} {how}' for how, n in sorted(built.items()))})" if built else ''


class RestartClock:
  """The supervisor's side: the time of each look at the job, the failure the next start
  recovers from (its part of the breakdown) and the restarted job's `recovered` line."""

  def __init__(self, out_dir: Path):
    self.out_dir = Path(out_dir)
    self.look_t = self.last_look_t = time.time()  # this look at the job, and the one before
    self._failure: dict | None = None
    self._follower: Follower | None = None

  def look(self) -> None:
    self.last_look_t, self.look_t = self.look_t, time.time()

  def since_last_look(self) -> float:
    """How late a process's end seen at this look was seen, at most."""
    return round(self.look_t - self.last_look_t, 3)

  def failure(self, cause: str, host: int | None, detect_s: float | None) -> None:
    """A failure seen at this look; the next start recovers from it."""
    self._failure = {'cause': cause, 'host': host, 'detect_s': detect_s,
                     'detected_t': self.look_t, 'stopped_t': self.look_t}

  def stopped(self) -> None:
    """The other processes are stopped."""
    if self._failure:
      self._failure['stopped_t'] = time.time()

  def spawning(self) -> None:
    """A start is spawning: the `recovered` line it writes is looked for from here."""
    self._follower = Follower(self.out_dir) if self._failure else None

  def spawned(self) -> dict:
    """The start line's keys: `recovery`, the supervisor's part, where it restarts."""
    if self._failure is None:
      return {}
    part, self._failure = SupervisorPart(**self._failure, spawned_t=time.time()), None
    return {'recovery': part}

  def recovered(self) -> Recovery | None:
    """The restarted job's `recovered` line's record, once (None until it is written)."""
    lines = self._follower.new() if self._follower else []
    done = next((line.recovered for line in lines if line.kind is Kind.RECOVERED), None)
    if done:
      self._follower = None
    return done
