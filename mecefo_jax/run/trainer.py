"""The Trainer: one start of a run, built once (the first step's programs compiled ahead of time)."""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import jax

from mecefo_jax import multihost
from mecefo_jax.config import Config, trained_to_end
from mecefo_jax.core.failures import FailureSchedule
from mecefo_jax.fault.controller import Controller
from mecefo_jax.model import models
from mecefo_jax.records import history, progress_marks
from mecefo_jax.records.history import Kind
from mecefo_jax.records.job import SIGINT_REASON
from mecefo_jax.records.run_state import RUN_STATE
from mecefo_jax.run import ending, loop_hooks, recovery_time, report, restart
from mecefo_jax.run.hooks import Hook, RunEnd
from mecefo_jax.run.loop import StepLoop
from mecefo_jax.run.parts import RunParts, StartMode, build as build_parts
from mecefo_jax.run.report_schema import Report
from mecefo_jax.run.run_files import RunFiles
from mecefo_jax.run.startup import StartupClock
from mecefo_jax.run.storage import OutputGuard

log = logging.getLogger('mecefo')


class Trainer:
  """Builds everything once, then trains (`run()`), writing into `out_dir` (run/rundir.py lists
  its files: metrics.jsonl, tb/, report.json (docs/report.md), training.png, failures.txt,
  history.jsonl, run_state.json).

  `resume`: continue the run in `out_dir` from its newest usable snapshot (run/resume.py);
  `start`: the other start options (run/parts.StartMode; its `resume` is this one's).
  `progress`: terminal output: 'auto' (a tqdm bar on a terminal, else log lines), 'bar',
  'plain' or 'quiet' (run/progress.py).
  `on_log`: `on_log(row: dict) -> None`, called in the training thread with every metrics row
  right after it is written to metrics.jsonl (docs/report.md lists the keys of train and eval
  rows); an exception it raises stops the run. E.g. a notebook's live loss plot.
  `hooks`: more run/hooks.Hook objects, run after the metrics rows of each step and before the
  stop (e.g. `Every(50, fn)`: `fn(record)` after every 50th step).
  `model`: the model to train, a factory `(ModelConfig, nnx.Rngs) -> module` of the contract
  (model/contract.py) or its `module:factory` name; it sets model.kind (default: cfg's).

  `close()` ends the start (a finished run's in-memory snapshots go, the run is unlocked);
  `with Trainer(...) as trainer:` calls it on the way out.
  """

  def __init__(self, cfg: Config, out_dir: str | Path, schedule: FailureSchedule | None = None,
               resume: bool = False, *, progress: str = 'auto',
               on_log: Callable[[dict], None] | None = None, hooks: Sequence[Hook] = (),
               model: Callable | str | None = None, start: StartMode | None = None):
    startup = StartupClock()  # first: a Trainer built in a notebook is timed from here
    if wrong := [h for h in hooks if not isinstance(h, Hook)]:  # before anything is built
      raise TypeError(f'hooks: {wrong[0]!r} is not a mecefo_jax.run.hooks.Hook; subclass it '
                      f'(every method is optional) or wrap a function as Every(n, fn)')
    if model is not None:
      cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                               kind=models.register(model)))
    mode = start or StartMode()
    mode = dataclasses.replace(mode, resume=mode.resume or resume)
    self.cfg, self.out_dir = cfg, Path(out_dir)
    run_files = RunFiles(cfg, self.out_dir)
    self.report: Report | None = None  # report.json's record, once run() ends
    self.parts: RunParts | None = None
    try:
      self.parts = build_parts(cfg, self.out_dir, schedule, mode, run_files, startup)
      self.hooks, self.saver = loop_hooks.ordered(self.parts, progress, on_log, hooks)
      ending.raise_if_swallowed()  # before the run's own stop request takes SIGTERM over
    except BaseException:  # re-raised: only the lock and this start's empty folders go
      run_files.close(self.parts and self.parts.snapshots, refused=True)
      raise
    previous = self.parts.previous
    self._finished = (mode.resume and previous is not None and previous.status == 'finished'
                      and trained_to_end(cfg, self.parts.origin.step,
                                         self.parts.controller.stream_position()))

  @property
  def controller(self) -> Controller:
    return self.parts.controller

  @property
  def corpus(self):
    return self.parts.corpus

  @property
  def state(self):
    return self.parts.controller.state

  @property
  def finished(self) -> bool:
    """Trained to its end (train.steps or train.samples): by run(), or before it (a finished
    run resumed)."""
    return self._finished

  @property
  def checkpoints_failing(self) -> bool:
    return self.saver.checkpoints_failing

  @property
  def outputs(self) -> OutputGuard:
    return self.parts.outputs

  @property
  def interrupted_unsaved(self) -> bool:
    """A Ctrl-C stopped a run that saves no snapshot: nothing to resume from."""
    return not self.parts.snapshots and self.parts.stop.reason == SIGINT_REASON

  def describe(self) -> str:
    return report.describe(self.parts)

  def evaluate(self, n_batches: int = 4) -> float:
    """Mean token loss on fixed held-out rows, the same whichever slices are live."""
    return self.parts.controller.evaluate(n_batches)

  def run(self) -> dict:
    """Trains to its end (or until every slice is down / a stop); returns the report (the
    dict of report.json; `self.report` holds its record)."""
    p = self.parts
    p.startup.loop_started()
    p.files.start()  # the run's files change from here on only
    restart.book(p.out_dir, p.controller, p.origin.meta)  # before its line
    loop = StepLoop(p, self.hooks, self._restarted_by())
    p.records.start(p.origin, p.controller.events, p.presence.slots, p.controller.live())
    if p.files.changed:  # what this resume changed: keys whose setting allows it
      p.records.history(Kind.CHANGED, step=p.origin.step, settings=p.files.changed)
    if p.origin.rollback:
      p.records.history(Kind.ROLLED_BACK, rolled_back=p.origin.rollback)
    p.outputs.attempt(p.out_dir / RUN_STATE, p.files.write_state, 'running')
    loop_start = time.perf_counter()
    p.records.open_reached()
    try:
      with self.hooks.opened():
        steps_done, stopped = loop.run(loop_start)
        self.hooks.at_end(loop_start, stopped)
    finally:
      p.records.close_reached()
    progress_marks.enter('ending')  # the final save, the report, the plot: no more steps
    jax.block_until_ready(self.state)
    end = RunEnd(steps_done, time.perf_counter() - loop_start, stopped)
    self.saver.finish(steps_done, stopped)
    self.report = report.build(p, self.hooks, loop.recovery, end)
    report.write_ending(p, self.report)
    self._finished = not stopped
    return dataclasses.asdict(self.report)

  def _restarted_by(self) -> dict | None:
    """The supervisor's part of the restart this start is, if one (process 0 reads it)."""
    if not self.parts.files.is_chief:
      return None
    return recovery_time.restarted_by(history.read(self.out_dir, warn=False))

  def __enter__(self) -> Trainer:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def close(self) -> None:
    """Ends the start: background builds stop, the snapshot tiers close, the run is unlocked."""
    p = self.parts
    p.controller.close()
    host = p.presence.slots[jax.process_index()] if multihost.is_multiprocess() else None
    p.files.close(p.snapshots, host, finished=self._finished)
