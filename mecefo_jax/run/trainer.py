"""The training loop: each step planned, executed, recorded, then handed to the hooks in order."""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import jax

from mecefo_jax import files, multihost
from mecefo_jax.config import Config
from mecefo_jax.core.failures import FailureSchedule
from mecefo_jax.data.sources import load_corpus
from mecefo_jax.fault.controller import AllSlicesDown, Controller
from mecefo_jax.model import models, train_state
from mecefo_jax.records import history, progress_marks
from mecefo_jax.records.history import Kind, Recovery
from mecefo_jax.run import (ending, hints, loop_hooks, plot, presence, recovery_time, report,
                            restart, rundir)
from mecefo_jax.run.hooks import Hook, RunEnd, StepRecord
from mecefo_jax.run.metrics import to_json
from mecefo_jax.run.records import RunRecords
from mecefo_jax.run.resume import check_model, initial_state, same_optimizer
from mecefo_jax.run.run_files import RunFiles
from mecefo_jax.run.startup import StartupClock, marks as startup_marks
from mecefo_jax.run.storage import OutputGuard
from mecefo_jax.run.stop import StopRequest, test_block, test_death
from mecefo_jax.snapshot import recovery
from mecefo_jax.snapshot.manager import state_nbytes
from mecefo_jax.step.program_store import ProgramStore

log = logging.getLogger('mecefo')


class Trainer:
  """Builds everything once (the first step's programs compiled ahead of time), then trains.

  `run()` writes into `out_dir` (run/rundir.py lists its files): metrics.jsonl, tb/ (with
  tensorboardX), report.json (docs/report.md), training.png (train.plot), failures.txt,
  history.jsonl and run_state.json.

  `resume`: continue the run in `out_dir` from its newest usable snapshot (run/resume.py);
  `explicit_resume` (--resume): finding none is an error instead of a start from step 0.
  `progress`: terminal output: 'auto' (a tqdm bar on a terminal, else log lines), 'bar',
  'plain' or 'quiet' (run/progress.py).
  `on_log`: `on_log(row: dict) -> None`, called in the training thread with every metrics row
  right after it is written to metrics.jsonl (docs/report.md lists the keys of train and eval
  rows); an exception it raises stops the run. E.g. a notebook's live loss plot.
  `hooks`: more run/hooks.Hook objects, run after the metrics rows of each step and before the
  stop (e.g. `Every(50, fn)`: `fn(record)` after every 50th step).
  `stop`: the run's stop request (run/stop.py; train.py installs its signal handlers).
  `program_store`: compiled programs loaded instead of compiled, and kept for later starts
  (train.py opens one in train.compile_cache: step/program_store.py).
  `model`: the model to train, a factory `(ModelConfig, nnx.Rngs) -> module` of the contract
  (model/contract.py) or its `module:factory` name; it sets model.kind (default: cfg's).

  `close()` ends the start (a finished run's in-memory snapshots go, the run is unlocked);
  `with Trainer(...) as trainer:` calls it on the way out.
  """

  def __init__(self, cfg: Config, out_dir: str | Path, schedule: FailureSchedule | None = None,
               resume: bool = False, *, explicit_resume: bool = False, progress: str = 'auto',
               on_log: Callable[[dict], None] | None = None, replace: bool = False,
               replace_finished: bool = False, host_slot: int | None = None,
               program_store: ProgramStore | None = None, stop: StopRequest | None = None,
               hooks: Sequence[Hook] = (), model: Callable | str | None = None):
    self.startup = StartupClock()  # first: a Trainer built in a notebook is timed from here
    if wrong := [h for h in hooks if not isinstance(h, Hook)]:  # before anything is built
      raise TypeError(f'hooks: {wrong[0]!r} is not a mecefo_jax.run.hooks.Hook; subclass it '
                      f'(every method is optional) or wrap a function as Every(n, fn)')
    if model is not None:
      cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                               kind=models.register(model)))
    self.cfg, self.out_dir = cfg, Path(out_dir)
    self.stop = (stop if stop is not None else StopRequest()).watch(self.out_dir)
    self.files, self.snapshots = RunFiles(cfg, self.out_dir), None
    self.recovery: Recovery | None = None  # a restart's breakdown (process 0)
    self._restarted_by: dict | None = None
    try:
      self._build(schedule, resume, explicit_resume, dict(replace=replace,
                  replace_finished=replace_finished), host_slot, program_store)
      self.hooks, self.saver = loop_hooks.ordered(self, progress, on_log, hooks)
      ending.raise_if_swallowed()  # before the run's own stop request takes SIGTERM over
    except BaseException:  # re-raised: only the lock and this start's empty folders go
      self.files.close(self.snapshots, refused=True)
      raise

  def _build(self, schedule, resume, explicit_resume, replacing, host_slot, store) -> None:
    """All but the lock, the first programs built last; no file of the run is written here.
    Everything that can refuse the run is checked before any of its files is touched."""
    cfg = self.cfg
    self.model = models.spec(cfg.model)  # a model that breaks the contract: refused here
    self.presence = presence.find(cfg, self.out_dir, resume, host_slot)
    if multihost.is_multiprocess():
      multihost.check_slices_within_processes(self.presence.mesh)
    # A failed write of the run directory (a full disk) stops the run after its step (exit 6).
    self.outputs = OutputGuard(self.stop.request)
    self.records = RunRecords(self.out_dir, self.files.is_chief, self.outputs)
    self.corpus = load_corpus(cfg.train.data, seq_len=cfg.model.seq_len, seed=cfg.train.seed,
                              vocab_size=cfg.model.vocab_size)
    if not self.corpus.has_eval:
      log.warning('%s holds no eval rows (eval_fraction=0): evals are off, the final one too '
                  '(eval_loss null in report.json)', cfg.train.data)
    self.schedule = schedule or self.files.schedule(self.presence.n_slices, resume)
    previous = self.files.check(resume=resume, **replacing)
    check_model(cfg, previous, resume)
    self.snapshots = recovery.open_manager(cfg, *self.files.snapshot_dirs(),
                                           state_nbytes(train_state.abstract_state(cfg)),
                                           self.presence.slots)
    t0 = time.perf_counter()
    self.origin = initial_state(cfg, self.presence, self.snapshots, self.out_dir, resume=resume,
                                explicit=explicit_resume, times=self.startup.seconds,
                                program_store=store,
                                diverged=previous.diverged if resume and previous else None)
    if self.origin.rollback:
      same_optimizer(self.origin.rollback, self.files.changed)
    self.files.carry(self.presence, previous, resume)
    down_at = previous.all_down_at if self.origin.meta is not None and previous else None
    if down_at is not None:
      self.files.all_down_at(down_at)  # kept while resuming
    meta = self.origin.meta
    self.controller = Controller.start(
        cfg, self.presence, self.model.graphdef, self.corpus, self.schedule,
        self.origin.state, meta=meta and meta['controller'], step=self.origin.step,
        all_down_at=down_at, program_store=store)
    self.startup.programs_built(self.controller.first_programs_s, time.perf_counter() - t0)
    self._finished = (resume and self.origin.step >= cfg.train.steps and
                      previous.status == 'finished')

  @property
  def state(self):
    return self.controller.state

  @property
  def finished(self) -> bool:
    """Trained to train.steps: by run(), or before it (a finished run resumed)."""
    return self._finished

  @property
  def checkpoints_failing(self) -> bool:
    return self.saver.checkpoints_failing

  def describe(self) -> str:
    return report.describe(self)

  def evaluate(self, n_batches: int = 4) -> float:
    """Mean token loss on fixed held-out rows, the same whichever slices are live."""
    return self.controller.evaluate(n_batches)

  def run(self) -> dict:
    """Trains to train.steps (or until every slice is down / a stop); returns the report."""
    cfg = self.cfg
    self.startup.loop_started()
    self.files.start()  # the run's files change from here on only
    restart.book(self.out_dir, self.controller, self.origin.meta)  # before its line
    if self.files.is_chief:  # the supervisor's part of the restart this start is, if one
      self._restarted_by = recovery_time.restarted_by(history.read(self.out_dir, warn=False))
    self.records.start(self.origin, self.controller.events, self.presence.slots,
                       self.controller.live())
    if self.files.changed:  # what this resume changed: keys whose setting allows it
      self.records.history(Kind.CHANGED, step=self.origin.step, settings=self.files.changed)
    if self.origin.rollback:
      self.records.history(Kind.ROLLED_BACK, rolled_back=self.origin.rollback)
    self.outputs.attempt(self.out_dir / rundir.RUN_STATE, self.files.write_state, 'running')
    loop_start = time.perf_counter()
    self.records.open_reached()
    try:
      with self.hooks.opened():
        steps_done, stopped = self._loop(loop_start)
        self.hooks.at_end(loop_start, stopped)
    finally:
      self.records.close_reached()
    progress_marks.enter('ending')  # the final save, the report, the plot: no more steps
    jax.block_until_ready(self.state)
    end = RunEnd(steps_done, time.perf_counter() - loop_start, stopped)
    self.saver.finish(cfg.train.steps, stopped)
    result = report.build(self, end)
    status = 'stopped' if stopped else 'finished'
    if self.files.is_chief:
      self.outputs.attempt(self.out_dir / rundir.REPORT, files.replace_text,
                           self.out_dir / rundir.REPORT, to_json(result, indent=2))
    self.records.history(Kind.END, status=status, step=steps_done,
                         why=stopped or 'trained train.steps')
    # run_state.json tells the truth on a full disk too: written in place if need be.
    self.outputs.attempt(self.out_dir / rundir.RUN_STATE, self.files.write_state, status)
    self._finished = not stopped
    if cfg.train.plot and self.files.is_chief and self.outputs.error is None:
      plot.plot_or_warn(self.out_dir)
    return result

  def _loop(self, loop_start: float) -> tuple[int, str | None]:
    """Trains until the end, all slices down or a stop; returns (steps done, why it stopped)."""
    c, host = self.controller, self.presence.slots[jax.process_index()]
    # What a test's death waits for, so that where it lands is the same in every run.
    settled = ([self.snapshots.wait_until_finished] if self.snapshots else []) + [c.settle]
    for step in range(self.origin.step, self.cfg.train.steps):
      self.hooks.before_step(step)
      t_step = time.perf_counter()
      try:
        metrics = c.step(step, t_step - loop_start)  # planned and executed
      except AllSlicesDown as err:
        message = (f'{err}. When devices return, {hints.resume(self.out_dir)} continues from '
                   f'the newest snapshot (every slice back at step {step})')
        log.error('%s', message)
        self.files.all_down_at(step)
        return step, message
      test_block(host, step)
      self.hooks.dispatched(step)
      record = self._record(step, metrics, loop_start, t_step)
      stop = self.hooks.after_step(record)
      if stop is not None:
        return stop.steps_done, stop.message
      test_death(host, step + 1, *settled)
    return self.cfg.train.steps, None

  def _record(self, step: int, metrics, loop_start: float, t_step: float) -> StepRecord:
    """The step's record, its metrics fetched where a hook wants them and for the first step
    (the start-up clock's end): the fetch waits for the step."""
    c = self.controller
    self.records.events(c.events)
    record = StepRecord(step, c.last_plan, None, loop_start, built=c.last_built, metrics=metrics)
    due = self.stop.due(step + 1)  # a stop after this step: its loss is the run's last one
    if self.hooks.wants_values(step) or step == self.origin.step or due:
      # Several processes: a collective every step, carrying this process's stop vote.
      vote = due if multihost.is_multiprocess() else None
      record.values, voted = c.fetch(metrics, vote)
      record.stop_voted = voted if multihost.is_multiprocess() else due
      self.records.reached(step + 1)  # the fetch waited for the step: it is trained
      self.startup.step_done()
      if step == self.origin.step and self._restarted_by is not None:
        self._recovered()
    record.step_s = time.perf_counter() - t_step
    return record

  def _recovered(self) -> None:
    """A restart's first step is trained (process 0): where its time went, in history.jsonl
    (the supervisor prints it) and in report.json."""
    s = self.startup
    self.recovery = recovery_time.measure(self._restarted_by, s.origin, startup_marks(),
                                          s.seconds, s.first_step_end,
                                          self.controller.first_programs)
    self.records.history(Kind.RECOVERED, recovered=self.recovery)

  def __enter__(self) -> Trainer:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def close(self) -> None:
    """Ends the start: background builds stop, the snapshot tiers close, the run is unlocked."""
    self.controller.close()
    host = self.presence.slots[jax.process_index()] if multihost.is_multiprocess() else None
    self.files.close(self.snapshots, host, finished=self._finished)
