"""Where a restart's time went: process 0's side, measured once its first step is trained again
(records/recovery.py: the supervisor's side, which starts the breakdown and prints the whole)."""
from __future__ import annotations

import dataclasses

from mecefo_jax.records.history import HistoryLine, Kind, Recovery, SupervisorPart


def restarted_by(history: list[HistoryLine]) -> SupervisorPart | None:
  """The supervisor's part of the restart that this start is, if it is one: the `recovery` of
  the last launch-start line since the run's last start line."""
  starts = [i for i, line in enumerate(history) if line.kind is Kind.START]
  since = history[starts[-1] + 1:] if starts else history
  launched = [line for line in since if line.kind is Kind.LAUNCH_START]
  return launched[-1].recovery if launched else None


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
