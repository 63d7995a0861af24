"""Where a restart's time went, from the failure seen to the first step trained again.

The supervisor (supervisor.py) records its part in the `launch-start` line of history.jsonl that
starts the restarted job (`recovery`: the cause, the detection, the survivors' stop, the
spawn); process 0 of that job adds its own start-up (imports, jax.distributed, restore,
programs, the first step), writes the whole as a `recovered` line once its first step is
trained, and keeps it for report.json (`recovery`). The supervisor prints that line. Standard
library only: the supervisor imports it.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from mecefo_jax.sections import entry

RECOVERED = 'recovered'  # history.jsonl's kind of the line process 0 writes


@dataclasses.dataclass
class Recovery:
  """report.json's `recovery`: this start's restart after a failure, process 0's view."""
  cause: str = entry('', "what the restart followed: 'death' (a process ended), 'stall' or "
                     "'peer-lost' (a process lost a peer and none was seen to die)")
  host: int | None = entry('', 'the logical host that died or stalled; null when none was '
                           'singled out')
  detect_s: float | None = entry('s', "how late the failure was seen, at most: a death, the "
                                 "supervisor's interval between its look that saw the process "
                                 'alive and the one that saw it ended; null where unknown')
  stop_s: float = entry('s', 'the other processes stopped (killed and reaped), from the detection')
  spawn_s: float = entry('s', "the restarted job's processes spawned, after the stop")
  process_start_s: float = entry('s', "from the spawn to the process's start (its exec)")
  imports_s: float = entry('s', 'Python imports: jax, then the training modules')
  distributed_s: float = entry('s', 'jax.distributed.initialize: every process connected')
  setup_s: float = entry('s', 'the rest of the start-up: devices, data, run directory, snapshot '
                         'tiers, the loop\'s start')
  restore_s: float = entry('s', 'the newest usable snapshot found and restored')
  programs_s: float = entry('s', "the first step's programs compiled or loaded from the program "
                            'store')
  programs_built: dict[str, int] = entry('programs', "those programs by how each was built: "
                                         "'compiled', 'loaded' (the program store), 'moved'")
  first_step_s: float = entry('s', 'the first step trained again, blocked on its metrics')
  total_s: float = entry('s', 'from the detection to the end of the first step trained again')


@dataclasses.dataclass
class SupervisorPart:
  """The supervisor's part of a restart, kept in its `launch-start` line (`recovery`); times
  from time.time()."""
  cause: str
  host: int | None
  detect_s: float | None
  detected_t: float  # the supervisor's look that saw the failure
  stopped_t: float  # the other processes stopped
  spawned_t: float  # the restarted job's processes spawned

  @classmethod
  def read(cls, fields) -> SupervisorPart | None:
    """From a `launch-start` line's `recovery`; None where there is none or it is not one."""
    try:
      return cls(**fields)
    except TypeError:
      return None


def restarted_by(history: list[dict]) -> SupervisorPart | None:
  """The supervisor's part of the restart that this start is, if it is one: the `recovery` of
  the last launch-start line since the run's last start line."""
  starts = [i for i, e in enumerate(history) if e['kind'] == 'start']
  since = history[starts[-1] + 1:] if starts else history
  launched = [e for e in since if e['kind'] == 'launch-start']
  fields = launched[-1].get('recovery') if launched else None
  return SupervisorPart.read(fields) if isinstance(fields, dict) else None


def measure(part: SupervisorPart, origin: float, marks: dict[str, float], seconds: dict,
            first_step_end: float, programs_built: dict[str, int]) -> Recovery:
  """The whole restart: the supervisor's `part`, this process's start (`origin`: its start,
  `marks`: startup.marks(), `seconds`: the start-up clock's), `first_step_end`: its first
  step's end (all time.time()), `programs_built`: how its first step's programs were built."""
  jax_at = marks.get('jax_imported', origin)
  up_at = marks.get('distributed', jax_at)
  imported_at = marks.get('imported', up_at)
  stop_s, spawn_s = part.stopped_t - part.detected_t, part.spawned_t - part.stopped_t
  process_start_s = max(0.0, origin - part.spawned_t)
  imports_s, distributed_s = (jax_at - origin) + (imported_at - up_at), up_at - jax_at
  restore_s = seconds.get('restore_s') or 0.0
  programs_s = seconds.get('first_programs_s') or 0.0
  first_step_s = seconds.get('first_step_run_s') or 0.0
  total_s = first_step_end - part.detected_t
  setup_s = max(0.0, total_s - (stop_s + spawn_s + process_start_s + imports_s + distributed_s +
                                restore_s + programs_s + first_step_s))
  r = Recovery(cause=part.cause, host=part.host, detect_s=part.detect_s, stop_s=stop_s,
               spawn_s=spawn_s, process_start_s=process_start_s, imports_s=imports_s,
               distributed_s=distributed_s, setup_s=setup_s, restore_s=restore_s,
               programs_s=programs_s, programs_built=dict(programs_built),
               first_step_s=first_step_s, total_s=total_s)
  return dataclasses.replace(r, **{f.name: round(v, 3) for f, v in
                                   zip(dataclasses.fields(r), dataclasses.astuple(r))
                                   if isinstance(v, float)})


def describe(r: dict) -> str:
  """The supervisor's line of a `recovered` record (or report.json's `recovery`)."""
  who = f' of host {r["host"]}' if r.get('host') is not None else ''
  seen = f'detect <= {r["detect_s"]:.2f} s, ' if r.get('detect_s') is not None else ''
  return (f'trained again {r["total_s"]:.1f} s after the {r["cause"]}{who} was seen: {seen}'
          f'stop {r["stop_s"]:.1f} s, spawn {r["spawn_s"]:.1f} s, process start '
          f'{r["process_start_s"]:.1f} s, imports {r["imports_s"]:.1f} s, jax.distributed '
          f'{r["distributed_s"]:.1f} s, setup {r["setup_s"]:.1f} s, restore '
          f'{r["restore_s"]:.1f} s, programs {r["programs_s"]:.1f} s{_built(r)}, first step '
          f'{r["first_step_s"]:.1f} s (report.json: recovery)')


def _built(r: dict) -> str:
  """' (3 loaded)', ' (1 compiled, 2 loaded)'; '' for a record without the counts."""
  built = r.get('programs_built') or {}
  return f" ({', '.join(f'{n} {how}' for how, n in sorted(built.items()))})" if built else ''


class Follower:
  """The supervisor's reader of history.jsonl's new lines, for the `recovered` one."""

  def __init__(self, path: Path):
    self.path = Path(path)
    self.offset = self.path.stat().st_size if self.path.exists() else 0

  def recovered(self) -> dict | None:
    """The first `recovered` record written since, if any (complete lines only)."""
    try:
      with open(self.path, 'rb') as f:
        f.seek(self.offset)
        data = f.read()
    except OSError:
      return None
    data = data[:data.rfind(b'\n') + 1]
    self.offset += len(data)
    for line in data.decode('utf-8', 'replace').splitlines():
      try:
        row = json.loads(line)
      except ValueError:
        continue
      if isinstance(row, dict) and row.get('kind') == RECOVERED:
        return row
    return None


class RestartClock:
  """The supervisor's side: the time of each look at the job, the failure the next start
  recovers from (its part of the breakdown) and the restarted job's `recovered` line."""

  def __init__(self, history: Path):
    self.history = Path(history)
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
    self._follower = Follower(self.history) if self._failure else None

  def spawned(self) -> dict:
    """The start line's fields: `recovery`, the supervisor's part, where it restarts."""
    if self._failure is None:
      return {}
    part, self._failure = SupervisorPart(**self._failure, spawned_t=time.time()), None
    return {'recovery': dataclasses.asdict(part)}

  def recovered(self) -> dict | None:
    """The restarted job's `recovered` record, once (None until it is written)."""
    done = self._follower and self._follower.recovered()
    if done:
      self._follower = None
    return done or None
