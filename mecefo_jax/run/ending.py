"""How a training process ends: its last line and exit code; outside its loop, one line (a lost
peer, a signal in start-up)."""
from __future__ import annotations

import re
import signal
import sys
import threading
import time

from pathlib import Path
from typing import TYPE_CHECKING

from mecefo_jax.config import PRESETS, Config
from mecefo_jax.core.failures import rate_scale
from mecefo_jax.records.job import (ALL_DOWN, CHECKPOINTS_FAILING, DIVERGED, INTERRUPTED,
                                    OUTPUTS_FAILING, PEER_LOST, STOPPED)

if TYPE_CHECKING:  # (no jax here: train.py imports this module before jax)
  from mecefo_jax.run.report_schema import Report
  from mecefo_jax.run.startup import Startup

# What a collective's failure says when a peer process of the job is gone (gloo on CPU, NCCL
# on GPU, the coordination service anywhere); jax raises it as a JaxRuntimeError, or, from
# multihost_utils.process_allgather (the metrics' fetch), as a ValueError that holds the
# runtime's status ('UNKNOWN: Gloo AllGather failed: ... Connection closed by peer', jax 0.10.2).
_PEER_LOSS = ('Gloo', 'NCCL', 'Connection reset by peer', 'Connection closed by peer',
              'coordination service', 'heartbeat')
_RUNTIME_STATUS = re.compile(r'(UNKNOWN|INTERNAL|UNAVAILABLE|ABORTED|CANCELLED|'
                             r'DEADLINE_EXCEEDED|FAILED_PRECONDITION): ')
# Where a start-up was: the first of these that the innermost frame of the package it was
# running starts with (`module:function`).
_PHASES = (('mecefo_jax.run.cli:_no_jax_cache', 'importing jax'),
           ('mecefo_jax.multihost:initialize', 'jax.distributed.initialize (waiting for every '
                                               'process)'),
           ('mecefo_jax.data', 'loading the data'),
           ('mecefo_jax.step', 'compiling or loading the first programs'),
           ('mecefo_jax.fault', 'compiling or loading the first programs'),
           ('mecefo_jax.run.resume', 'restoring the state'),
           ('mecefo_jax.snapshot', 'opening the snapshot tiers or restoring from them'),
           ('mecefo_jax.model', 'building the model'),
           ('mecefo_jax.run', 'setting up the run'),
           ('jax._src.compiler', 'compiling a program'),
           ('jax._src.distributed', 'jax.distributed.initialize (waiting for every process)'))


def peer_lost(err: BaseException) -> bool:
  """Whether `err` is a collective's failure because a peer process of the job is gone."""
  runtime = (type(err).__name__ in ('JaxRuntimeError', 'XlaRuntimeError') or
             type(err) is ValueError and _RUNTIME_STATUS.match(str(err)))
  return bool(runtime) and any(mark in str(err) for mark in _PEER_LOSS)


def lost_peer(host: int, err: BaseException) -> int:
  """One line for a survivor of a peer's death (not the runtime's traceback); PEER_LOST."""
  what = re.sub(r'\[[^\]]*\.(cc|h):\d+\] ', '', str(err).strip().splitlines()[0])
  print(f'error: host {host}: a collective failed, a peer process of the job is gone ({what}); '
        f'exit {PEER_LOST}: the job restarts without the dead process, from its last snapshot '
        '(the supervisor does it)', file=sys.stderr, flush=True)
  _linger_if_service_host()
  return PEER_LOST


# The job's coordination service lives in process 0. Once process 0 exits, jax aborts every
# process still connected to it (SIGABRT, "Terminating process because the JAX distributed
# service detected fatal errors", a C++ trace): on a loaded machine that came before a slower
# survivor's own collective failed and it said so (exit -6 in a 3-process test, run here).
# Process 0 stays this long after its line; a supervisor kills it at once (kill_all).
SERVICE_LINGER_S = 10.0


def hosts_service() -> bool:
  """Whether this process holds its job's coordination service (process 0 of a job started by
  jax.distributed.initialize). Any thread, at any time: it never starts a backend."""
  distributed = sys.modules.get('jax._src.distributed')
  return getattr(getattr(distributed, 'global_state', None), 'service', None) is not None


def _linger_if_service_host() -> None:
  """Process 0 of a job of 3 or more waits SERVICE_LINGER_S (SIGTERM ends it) before exiting,
  so that every other survivor reports its own lost peer first."""
  import jax  # here: this module is imported before train.py sets up jax's flags
  if jax.process_index() != 0 or jax.process_count() < 3:
    return
  signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a stop ends the wait, not a handler
  time.sleep(SERVICE_LINGER_S)


class StartupStopped(BaseException):
  """SIGTERM before the training loop could honour it: the start-up unwinds (what it made goes:
  the Trainer's lock and empty folders, train.py's new directories), then one line. A
  BaseException: no `except Exception` on the way takes it for an error."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.job = False  # a process of a multi-process job (train.py sets it)


# The SIGTERM the start-up's handler raised on. Its StartupStopped can land in a garbage-collection
# callback (jax's), which swallows it and the start-up goes on (seen at load 20 on 2 cores):
# raise_if_swallowed() raises it again at a line of the start-up's own, and the start-up's
# unraisable hook keeps Python's "Exception ignored in" traceback off stderr (one line, not two).
_raised: list[int] = []


def stop_startup_on_sigterm():
  """Until the run's own stop request takes over (run/stop.py), SIGTERM stops the start-up at
  the next Python line (a compile or a wait inside the runtime finishes first); once. Returns
  what it replaced (restore_sigterm); main thread only, else nothing is changed."""
  def on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one would cut the clean-up
    _raised.append(signum)
    raise StartupStopped(signum)
  if threading.current_thread() is not threading.main_thread():
    return None
  previous_hook = sys.unraisablehook
  def quiet_if_stopped(unraisable):
    if not isinstance(unraisable.exc_value, StartupStopped):  # that one is raised again later
      previous_hook(unraisable)
  sys.unraisablehook = quiet_if_stopped
  return signal.signal(signal.SIGTERM, on_sigterm), previous_hook


def raise_if_swallowed() -> None:
  """StartupStopped again where the start-up's SIGTERM was swallowed on its way (a start-up that
  one unwinds never gets here)."""
  if _raised:
    raise StartupStopped(_raised.pop())


def restore_sigterm(previous) -> None:
  if previous is not None:
    handler, sys.unraisablehook = previous
    signal.signal(signal.SIGTERM, handler)


def phase(stop: BaseException) -> str:
  """Where the start-up was when `stop` was raised, in words."""
  tb, frames = stop.__traceback__, []
  while tb is not None:
    frames.append(f"{tb.tb_frame.f_globals.get('__name__', '')}:{tb.tb_frame.f_code.co_name}")
    tb = tb.tb_next
  for frame in reversed(frames):  # the innermost first
    words = next((w for prefix, w in _PHASES if frame.startswith(prefix)), None)
    if words:
      return words
  return 'starting'


def startup_stopped(stop: StartupStopped) -> int:
  """The start-up's one line; STOPPED (the run directory is as it was before this start)."""
  print(f'error: stopped by {stop} during start-up ({phase(stop)}), before any step: nothing '
        f'of this start is kept; run the same command to start again', file=sys.stderr,
        flush=True)
  return STOPPED


def exit_code(report: Report, checkpoints_failing: bool, outputs_failed: bool,
              interrupted_unsaved: bool) -> int:
  """The documented exit code of a run that ended its loop (records/job.py): `report`'s, where
  durable checkpoints kept failing, a write of the run directory failed, or a Ctrl-C stopped
  a run without snapshots."""
  if checkpoints_failing:  # its stop line ended the loop; a failed write after it too
    return CHECKPOINTS_FAILING
  if outputs_failed:  # a full disk: stopped after the step, resumable
    return OUTPUTS_FAILING
  if report.preempted and interrupted_unsaved:
    return INTERRUPTED  # nothing saved: not a resumable stop
  if report.preempted:  # SIGTERM, Ctrl-C or --stop-after: snapshotted, resumable
    return STOPPED
  if report.diverged_at_step is not None:
    return DIVERGED
  return ALL_DOWN if report.stopped else 0


def first_step(startup: Startup, compile_s: float) -> str:
  """The start-up clock's end (report.json `startup`), in one line: what it holds besides the
  state and first programs of the start line (`compile_s`)."""
  if startup.first_step_s is None:
    return 'start-up: no step trained in this process'
  return (f"start-up: first step done {startup.first_step_s:.1f}s after the "
          f"{startup.first_step_from} start: the state + first programs {compile_s:.1f}s, "
          f"the step itself {startup.first_step_run_s:.1f}s, the rest imports, data and "
          'snapshot tiers (report.json: startup)')


def _num(x) -> str:
  return 'n/a' if x is None else f'{x:.4f}'


def no_failure_note(cfg: Config, n_slices: int, steps_done: int, applied: list) -> str | None:
  """The line a run of a failure preset that applied no failure ends with (and report.json's
  failures_note): what its steps covered against the preset's rate; None otherwise."""
  f = cfg.faults
  if f.failures not in PRESETS or applied:
    return None
  mean_h = PRESETS[f.failures][0] * rate_scale(f.rate, n_slices)
  hours = steps_done * f.cluster_step_s / 3600
  return (f'--failures {f.failures} produced no failure in this run: its {steps_done} steps at '
          f'faults.cluster_step_s={f.cluster_step_s:g} cover {hours:.3g} simulated hours, and '
          f'the preset fails one of its {n_slices} slice(s) every {mean_h:.3g} hours on average '
          f'(faults.rate={f.rate}): {hours / mean_h:.2f} failures expected; train more steps or '
          f'raise faults.cluster_step_s to see failures')


def summary(report: Report, out_dir: Path) -> str:
  """The one line a run ends with (also under --quiet)."""
  r, ppl, diverged = report, report.eval_perplexity, report.diverged_at_step
  head = (f"done: {r.steps} steps" if r.stopped is None else  # trained them all
          f"stopped: {r.steps} of {r.config['train']['steps']} steps")
  final = _num(r.final_loss) if diverged is None else f'not finite at step {diverged}'
  return (f"{head}, loss {_num(r.first_loss)} -> {final}, eval {_num(r.eval_loss)} "
          f"(perplexity {'n/a' if ppl is None else f'{ppl:.3f}'}; entropy floor "
          f"{_num(r.entropy_floor)}) in {r.wall_s:.1f}s, {r.tokens_per_s:.0f} tok/s; outputs in "
          f"{out_dir}")
