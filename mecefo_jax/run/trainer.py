"""The training loop: mesh, sharded state, failure-aware controller, snapshots, evals, outputs."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from mecefo_jax import files, multihost
from mecefo_jax.config import Config
from mecefo_jax.data.sources import load_corpus
from mecefo_jax.fault.controller import AllSlicesDown, Controller
from mecefo_jax.core.failures import FailureSchedule
from mecefo_jax.model import llama, train_state
from mecefo_jax.run import evaluation, hints, presence, report, restart, rundir
from mecefo_jax.run.after_step import AFTER_STEP, AfterStep
from mecefo_jax.run.metrics import MetricsWriter, to_json
from mecefo_jax.run.progress import Progress
from mecefo_jax.run.records import RunRecords
from mecefo_jax.run.resume import Start, carried_state, initial_state
from mecefo_jax.run.startup import StartupClock
from mecefo_jax.run.stop import STOP_FILE, StopRequest, test_death
from mecefo_jax.snapshot import recovery
from mecefo_jax.snapshot.interval import IntervalTuner
from mecefo_jax.snapshot.store import state_nbytes
from mecefo_jax.step import train_step
from mecefo_jax.step.store import ProgramStore, compile_counts

log = logging.getLogger('mecefo')


def perplexity(loss: float) -> float:
  return float(np.exp(loss))


class Trainer(AfterStep):
  """Builds everything once (the first step's programs compiled ahead of time), then trains.

  `run()` writes into `out_dir` (run/rundir.py lists its files): metrics.jsonl, tb/ (with
  tensorboardX), report.json (docs/report.md), training.png (train.plot), failures.txt,
  history.jsonl and run_state.json.

  `resume`: continue the run in `out_dir` from its newest usable snapshot (run/resume.py);
  `explicit_resume` (--resume): finding none is an error instead of a start from step 0.

  `progress`: terminal output of the loop: 'auto' (a tqdm bar when stderr is a terminal, else
  plain log lines), 'bar', 'plain' or 'quiet' (see mecefo_jax/progress.py).

  `on_log`: optional callback `on_log(row: dict) -> None`, called in the training thread with
  every metrics row right after it is written to metrics.jsonl (the same dict; docs/report.md
  lists the keys of train and eval rows). An exception it raises stops the run. E.g. a
  notebook's live loss plot.

  `stop`: the run's stop request (run/stop.py; train.py installs its signal handlers).
  `program_store`: compiled programs loaded instead of compiled, and kept for later starts
  (train.py opens one in train.compile_cache: step/store.py).
  """

  def __init__(self, cfg: Config, out_dir: str | Path, schedule: FailureSchedule | None = None,
               resume: bool = False, *, explicit_resume: bool = False, progress: str = 'auto',
               on_log: Callable[[dict], None] | None = None, replace: bool = False,
               replace_finished: bool = False, host_slot: int | None = None,
               program_store: ProgramStore | None = None, stop: StopRequest | None = None):
    self.startup = StartupClock()  # first: a Trainer built in a notebook is timed from here
    self.compiles_at_start = compile_counts()  # report: programs.other_compiles
    self.cfg, self.out_dir = cfg, Path(out_dir)
    self.progress_mode, self.on_log = progress, on_log
    self.stop = stop if stop is not None else StopRequest()
    if jax.process_index() == 0 and self.stop.file is None:
      self.stop.file = self.out_dir / STOP_FILE
    self.is_chief = jax.process_index() == 0  # the one process that writes the run's files
    # The run's lock before anything: no process of this start opens, creates, cleans or
    # deletes a file under out_dir or the snapshot places until process 0 holds it.
    self._lock, self.snapshots = rundir.lock_job(self.out_dir), None
    try:
      self._build(schedule, resume, explicit_resume, replace, replace_finished, host_slot,
                  program_store)
    except BaseException:  # re-raised: only the lock and this start's empty folders go
      self._release(remove_empty=True)
      raise

  def _build(self, schedule, resume, explicit_resume, replace, replace_finished, host_slot,
             program_store) -> None:
    """All but the lock, the first programs built last; no file of the run is written here."""
    cfg = self.cfg
    # Everything that can refuse the run is checked before any of its files is touched.
    self.presence = presence.find(cfg, self.out_dir, resume, host_slot)
    self.mesh, self.n_slices = self.presence.mesh, self.presence.n_slices
    if multihost.is_multiprocess():
      multihost.check_slices_within_processes(self.mesh)
    self.records = RunRecords(self.out_dir, self.is_chief)
    self.host = self.presence.slots[jax.process_index()]
    m = cfg.model
    self.corpus = load_corpus(cfg.train.data, seq_len=m.seq_len, seed=cfg.train.seed,
                              vocab_size=m.vocab_size)
    if not self.corpus.has_eval:
      log.warning('%s holds no eval rows (eval_fraction=0): evals are off, the final one too '
                  '(eval_loss null in report.json)', cfg.train.data)
    self.graphdef, _, _ = llama.abstract(m)
    f = cfg.faults
    # A trace is read from the run's own copy at a resume, and copied at the start (rundir.py).
    self.trace = None if schedule else rundir.read_trace(self.out_dir, f.failures, resume)
    if schedule is None and self.trace:
      schedule = FailureSchedule.from_trace(self.trace.path, self.n_slices, self.trace.text,
                                            self.trace.source)
    self.schedule = schedule or FailureSchedule.from_spec(
        f.failures, self.n_slices, cfg.train.steps, f.cluster_step_s, cfg.train.seed, f.rate)
    if self.n_slices == 1 and f.failures != 'none':
      log.warning('one slice: a failure leaves no live slice to take over its micro-batch, so '
                  'the run stops at the first failure (use mesh.slice >= 2 to survive failures)')
    self._checked = multihost.on_chief(lambda: rundir.check_start(
        self.out_dir, cfg, resume=resume, replace=replace, replace_finished=replace_finished))
    self.run_id, previous = self._checked['run_id'], self._checked['previous']
    self.snapshots = recovery.open_manager(
        cfg, *rundir.snapshot_dirs(cfg.snapshot, self.out_dir, self.run_id),
        state_nbytes(train_state.abstract_state(cfg)), self.presence.slots)
    t0 = time.perf_counter()
    start = initial_state(cfg, self.presence, self.snapshots, self.out_dir, resume=resume,
                          explicit=explicit_resume, times=self.startup.seconds,
                          program_store=program_store)
    sn = cfg.snapshot
    self.tuner = (IntervalTuner(sn.overhead_budget, sn.max_every)
                  if self.snapshots and sn.every == 'auto' else None)
    if self.tuner:
      self.snapshots.every = self.tuner.every
    self.controller = Controller(cfg, self.mesh, self.graphdef, self.corpus, self.schedule,
                                 start.state, self.n_slices, self.presence.ids, program_store)
    # run_state.json: the run's identity, and entries kept while resuming (all_down_at)
    self._carried_state = carried_state(cfg, self.run_id, self.presence, previous, resume)
    self.compute_dtype = self._carried_state['compute_dtype']  # model.compute_dtype resolved
    self._continue(start, previous)
    self._finished = (resume and self.start_step >= cfg.train.steps and
                      previous.get('status') == 'finished')
    # Build the first step's programs now, so that it runs at full speed: the fault-free step,
    # or at a start with slices down (a restart after a death), the takeover's programs.
    t_programs = time.perf_counter()
    fused = self.controller.build_step_programs()
    self.startup.seconds['first_programs_s'] = time.perf_counter() - t_programs
    self.memory = train_step.memory_summary(fused) if fused else {}
    self.compile_s = time.perf_counter() - t0
    if self.controller.wants_precompile():
      self.controller.start_precompile(self.presence.host_slices()
                                       if multihost.is_multiprocess() else None)

  def _continue(self, start: Start, previous: dict) -> None:
    """Takes over where `start` left the run: controller, losses, evals, present slices."""
    self.start_step, self.resumed_from, self.steps_lost = start.step, None, None
    self.losses, self.evals = [], []  # evals: {step, loss, perplexity}, carried over resumes
    self.eval_s, self.diverged_at, self.stop_reason = 0.0, None, None
    self._stop_agreed, self._saved = False, (None, [])  # _saved: (step, where) of the last save
    self.checkpoints_failing = False  # stopped by durable saves that kept failing
    c = self.controller
    if start.meta is not None:
      c.load_meta(start.meta['controller'])
      self.resumed_from, self.steps_lost = start.step, start.steps_lost
      self.losses, self.evals = start.meta['losses'], list(start.meta.get('evals', []))
      c.apply_presence(start.step)
      all_down_at = previous.get('all_down_at')
      if all_down_at is not None:
        self._carried_state['all_down_at'] = all_down_at
        if start.step <= all_down_at:  # every slice was down there; a resume means they are back
          c.devices_back_at = all_down_at
    self._initial = start

  @property
  def state(self):
    return self.controller.state

  @property
  def finished(self) -> bool:
    """Trained to train.steps: by run(), or before it (a finished run resumed)."""
    return self._finished

  def describe(self) -> str:
    n = report.param_count(self.state.params)
    f = self.cfg.faults
    return (f'model {n / 1e6:.2f}M params | mesh {dict(self.mesh.shape)} on {jax.device_count()} '
            f'{jax.devices()[0].platform} device(s), compute {self.compute_dtype} | global batch '
            f'{self.n_slices}x{self.cfg.train.micro_batch}x{self.cfg.model.seq_len} tokens | failures '
            f'{f.failures}, takeover {f.takeover} | snapshots '
            f'{"on" if self.snapshots else "off"} | compile {self.compile_s:.1f}s | '
            f'{self.startup.describe()}')

  def evaluate(self, n_batches: int = 4) -> float:
    """Mean token loss on fixed held-out rows, the same whichever slices are live."""
    return evaluation.held_out_loss(self.controller, n_batches)

  def run(self) -> dict:
    """Trains to train.steps (or until every slice is down / a stop); returns the report."""
    cfg = self.cfg
    self.startup.loop_started()
    # The run's files change from here on only: a start that failed before left them as they were.
    if self.is_chief:
      rundir.start(self.out_dir, self._checked)  # a new run: its predecessor's files go
      if self.trace:
        rundir.keep_trace(self.out_dir, self.trace)
    restart.book(self.out_dir, self.controller.ledger, self._initial.meta)  # before its line
    self.records.start(self._initial, self.controller.events, self.presence.slots,
                       self.controller.live())
    self._write_run_state('running')
    t_start, self.tokens_at_start = time.perf_counter(), self.tokens_trained()
    progress = Progress(cfg.train.steps, self.start_step, self.n_slices, cfg.faults.takeover,
                        self.progress_mode)
    writer = MetricsWriter(self.out_dir, fresh=self.start_step == 0, enabled=self.is_chief)
    self.records.open_reached()
    try:
      with writer, progress:
        self._writer, self._progress = writer, progress
        steps_done, stopped = self._loop(t_start)
        if (self.corpus.has_eval and not stopped
            and not (self.evals and self.evals[-1]['step'] == cfg.train.steps - 1)):
          self._emit(self._eval_row(cfg.train.steps - 1, t_start))  # the final eval
    finally:
      self.records.close_reached()
    jax.block_until_ready(self.state)
    wall_s = time.perf_counter() - t_start
    if not stopped:  # the final state as a durable checkpoint too: a later --resume extends it
      self._snapshot(cfg.train.steps, stop=True)
    if self.snapshots:
      self.snapshots.wait_until_finished(agree=True)
    result = report.build(self, steps_done, wall_s, stopped, tensorboard=writer.tensorboard)
    status = 'stopped' if stopped else 'finished'
    if self.is_chief:
      files.replace_text(self.out_dir / rundir.REPORT, to_json(result, indent=2))
    self.records.history('end', status=status, step=steps_done,
                         why=stopped or 'trained train.steps')
    self._write_run_state(status)
    self._finished = not stopped
    if cfg.train.plot and self.is_chief:
      self._plot()
    return result

  def _write_run_state(self, status: str) -> None:
    if self.is_chief:
      rundir.write_run_state(self.out_dir, status, **self._carried_state)

  def _loop(self, t_start) -> tuple[int, str | None]:
    """Trains until the end, all slices down or a stop; returns (steps done, why it stopped)."""
    cfg = self.cfg
    self._window = (t_start, self.tokens_at_start, self.eval_s)  # for windowed tokens/s
    for step in range(self.start_step, cfg.train.steps):
      t_step, busy = time.perf_counter(), bool(self.snapshots) and self.snapshots.busy()
      try:
        metrics = self.controller.step(step, time.perf_counter() - t_start)
      except AllSlicesDown as err:
        message = (f'{err}. When devices return, {hints.resume(self.out_dir)} continues from '
                   f'the newest snapshot (every slice back at step {step})')
        log.error('%s', message)
        self._carried_state['all_down_at'] = step
        return step, message
      self.records.events(self.controller.events)
      self._progress.step(len(self.controller.live()))
      rows, last = [], step == cfg.train.steps - 1
      # Multi-process: fetched every step, as the fetch is also the job's stop vote; with
      # snapshot.every=auto too, so that each step's wall is its own (not a later one's wait).
      fetch = (step % cfg.train.log_every == 0 or last or multihost.is_multiprocess()
               or self.tuner or (self.snapshots and self.snapshots.due(step + 1))
               or step == self.start_step)  # the start-up clock's end: the first step trained
      values = self._fetch(metrics, step + 1) if fetch else None
      if values:  # the fetch waited for the step: it is trained
        self.records.reached(step + 1)
        self.startup.step_done()
      for name in AFTER_STEP:
        stopped = getattr(self, f'_after_{name}')(step, values, rows, t_start)
        if stopped:
          return step + (name != 'divergence'), stopped
      if self.tuner:
        self.tuner.after_step(self.snapshots, step + 1, time.perf_counter() - t_step, busy)
      test_death(self.host, step + 1, *self._settled())
    return cfg.train.steps, None

  def _settled(self) -> list:
    """What a test's death waits for, so that where it lands is the same in every run."""
    waits = [self.snapshots.wait_until_finished] if self.snapshots else []
    return waits + ([self.controller.precompiler.wait] if self.controller.precompiler else [])

  def _emit(self, row: dict) -> None:
    """A metrics row to the terminal, metrics.jsonl (+ TensorBoard) and the on_log callback."""
    if row['kind'] == 'train':
      self._progress.train_row(row)
    else:
      self._progress.eval_row(row)
    self._writer.write(row)
    if self.on_log is not None:
      self.on_log(row)

  def tokens_trained(self) -> int:
    samples = self.controller.samples
    return (samples.get('exact', 0) + samples.get('degraded', 0)) * self.cfg.model.seq_len

  def _fetch(self, metrics, steps_done: int) -> dict:
    # Waits for the step. Multi-process: a collective, so every process fetches the same steps.
    vote = self.stop.due(steps_done) if multihost.is_multiprocess() else None
    values = multihost.fetch(metrics, self.controller.submesh(self.controller.state_slices),
                             stop=vote)
    self._stop_agreed = bool(values.pop('stop', 0.0))
    return values

  def _train_row(self, step, values, t_start) -> dict:
    now, tokens = time.perf_counter(), self.tokens_trained()
    # tokens/s since the previous train row, eval time left out: dips show failures and rejoins.
    t0, tokens0, eval0 = self._window
    seconds = max(now - t0 - (self.eval_s - eval0), 1e-9)
    self._window = (now, tokens, self.eval_s)
    return {'kind': 'train', 'step': step, **values, 'wall_s': now - t_start,
            'live_slices': len(self.controller.live()), 'tokens_per_s': (tokens - tokens0) / seconds}

  def _eval_row(self, step, t_start) -> dict:
    t0 = time.perf_counter()
    loss = self.evaluate(self.cfg.train.eval_batches)
    spent = time.perf_counter() - t0
    self.eval_s += spent
    # An eval is not step time; its compile, if any, is booked as compile by the program cache.
    self.controller.ledger.exclude(spent)
    self.evals.append({'step': step, 'loss': loss, 'perplexity': perplexity(loss)})
    return {'kind': 'eval', **self.evals[-1], 'eval_s': spent,
            'wall_s': time.perf_counter() - t_start, 'live_slices': len(self.controller.live())}

  def _plot(self) -> None:
    try:
      from mecefo_jax.run import plot
      plot.plot_run(self.out_dir)
    except Exception as err:  # noqa: BLE001 -- a missing plot is never worth a failed run
      log.warning('could not write %s: %s: %s', self.out_dir / rundir.PLOT,
                  type(err).__name__, err)

  def close(self) -> None:
    if self.controller.precompiler:
      self.controller.precompiler.stop()
    # A finished run needs no in-memory snapshots: free the tmpfs (durable ones stay), unless
    # its final durable save failed (the in-memory tier then holds the only copy).
    guard = self.snapshots and self.snapshots.durable
    kept = self.cfg.snapshot.keep_when_finished or bool(guard and not guard.last_ok)
    self._release(remove_memory=self._finished and not kept)

  def _release(self, remove_memory: bool = False, remove_empty: bool = False) -> None:
    """Closes the snapshot tiers (`remove_memory`: and deletes this host's in-memory ones;
    `remove_empty`: and the tiers' directories if nothing is in them), unlocks the run."""
    try:
      if self.snapshots:
        self.snapshots.close()
        if remove_memory:
          host = self.host if multihost.is_multiprocess() else None
          rundir.remove_snapshots(self.cfg.snapshot, self.out_dir, self.run_id, durable=False,
                                  host=host)
        if remove_empty:
          rundir.remove_empty_dirs(self.cfg.snapshot, self.out_dir, self.run_id)
    finally:
      if self._lock is not None:  # releases the run directory (a refused start's empty one goes)
        rundir.unlock(self._lock, self.out_dir if remove_empty else None)
        self._lock = None
