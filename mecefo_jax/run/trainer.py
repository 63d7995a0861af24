"""The training loop: mesh, sharded state, failure-aware controller, snapshots, evals, outputs."""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from mecefo_jax import multihost
from mecefo_jax.config import Config, ConfigError, to_dict
from mecefo_jax.data.sources import load_corpus
from mecefo_jax.fault.controller import AllSlicesDown, Controller
from mecefo_jax.fault.failures import FailureSchedule, write_trace
from mecefo_jax.model import llama, train_state
from mecefo_jax.run.metrics import MetricsWriter, last_logged_step, to_json
from mecefo_jax.run import evaluation, presence, rundir
from mecefo_jax.run.progress import Progress
from mecefo_jax.run.report_schema import SCHEMA_VERSION
from mecefo_jax.snapshot import image, recovery, store
from mecefo_jax.snapshot.store import state_nbytes
from mecefo_jax.step import train_step
from mecefo_jax.step.store import ProgramStore

log = logging.getLogger('mecefo')


def param_count(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def perplexity(loss: float) -> float:
  return float(np.exp(loss))


class Trainer:
  """Builds everything once (the fault-free step compiled ahead of time), then trains.

  `run()` writes into `out_dir`: metrics.jsonl, tb/ (with tensorboardX), report.json
  (docs/report.md) and training.png (train.plot).

  `progress`: terminal output of the loop: 'auto' (a tqdm bar when stderr is a terminal, else
  plain log lines), 'bar', 'plain' or 'quiet' (see mecefo_jax/progress.py).

  `on_log`: optional callback `on_log(row: dict) -> None`, called in the training thread with
  every metrics row right after it is written to metrics.jsonl (the same dict). Train rows, every
  train.log_every steps and at the last step: {'kind': 'train', 'step', 'loss', 'grad_norm',
  'exact_tokens', 'degraded_tokens', 'wall_s', 'live_slices', 'tokens_per_s'}; eval rows, every
  train.eval_every steps and at the end: {'kind': 'eval', 'step', 'loss', 'perplexity', 'eval_s',
  'wall_s', 'live_slices'} ('step' is the last step trained before the eval). An exception it
  raises stops the run. E.g. a notebook's live loss plot.

  `program_store`: compiled programs loaded instead of compiled, and kept for later starts
  (train.py opens one in train.compile_cache: step/store.py).
  """

  def __init__(self, cfg: Config, out_dir: str | Path, schedule: FailureSchedule | None = None,
               resume: bool = False, *, progress: str = 'auto',
               on_log: Callable[[dict], None] | None = None, replace: bool = False,
               replace_finished: bool = False, host_slot: int | None = None,
               program_store: ProgramStore | None = None):
    if cfg.train.eval_every < 0 or cfg.train.eval_batches < 1:
      raise ConfigError(f'train.eval_every must be >= 0 and train.eval_batches >= 1, got '
                        f'{cfg.train.eval_every}, {cfg.train.eval_batches}')
    self.cfg, self.out_dir = cfg, Path(out_dir)
    self.progress_mode, self.on_log = progress, on_log
    self.presence = presence.find(cfg, self.out_dir, resume, host_slot)
    self.mesh, self.n_slices = self.presence.mesh, self.presence.n_slices
    if multihost.is_multiprocess():
      multihost.check_slices_within_processes(self.mesh)
    self.is_chief = jax.process_index() == 0  # the one process that writes the run's files
    m = cfg.model
    self.corpus = load_corpus(cfg.train.data, seq_len=m.seq_len, seed=cfg.train.seed,
                              vocab_size=m.vocab_size)
    self.graphdef, _, _ = llama.abstract(m)
    f = cfg.faults
    self.schedule = schedule or FailureSchedule.from_spec(
        f.failures, self.n_slices, cfg.train.steps, f.cluster_step_s, cfg.train.seed, f.rate)
    if self.n_slices == 1 and f.failures != 'none':
      log.warning('one slice: a failure leaves no live slice to take over its micro-batch, so '
                  'the run stops at the first failure (use mesh.slice >= 2 to survive failures)')
    self.out_dir.mkdir(parents=True, exist_ok=True)
    self._lock = rundir.lock(self.out_dir) if self.is_chief else None
    self.run_id = self._start_run(resume, replace, replace_finished)
    self.snapshots = recovery.open_manager(cfg, self.out_dir,
                                           state_nbytes(train_state.abstract_state(cfg)),
                                           self.run_id, self.presence.slots)
    t0 = time.perf_counter()
    # A resume restores into abstract targets: the initializer runs only for a new state.
    restored = resume and self.snapshots and recovery.restore(self.snapshots, cfg, self.mesh)
    state = restored[1] if restored else train_state.create_sharded(cfg, self.mesh)
    self.controller = Controller(cfg, self.mesh, self.graphdef, self.corpus, self.schedule, state,
                                 self.n_slices, self.presence.ids, program_store)
    self.start_step, self.losses, self.resumed_from, self.steps_lost = 0, [], None, None
    self.evals: list[dict] = []  # {step, loss, perplexity} of every eval, carried over resumes
    self._eval_s = 0.0
    # run_state.json: the run's identity, and entries kept while resuming (all_down_at)
    self._carried_state = {'run_id': self.run_id, 'config': to_dict(cfg),
                           'n_slices': self.n_slices, 'n_hosts': self.presence.n_hosts}
    self.stopped_by_sigterm, self._finished, self.diverged_at = False, False, None
    self._stop_agreed = False  # multi-process: a stop (SIGTERM) every process agreed on
    if resume:
      self._resume(restored)
      self.controller.apply_presence(self.start_step)
      self._finished = self._resumed_finished()
    # Build the first step's programs now, so that it runs at full speed: the fault-free step,
    # or at a start with slices down (a restart after a death), the takeover's programs.
    fused = self.controller.build_step_programs()
    self.memory = train_step.memory_summary(fused) if fused else {}
    self.compile_s = time.perf_counter() - t0
    if self.controller.wants_precompile():
      self.controller.start_precompile(self.presence.host_slices()
                                       if multihost.is_multiprocess() else None)

  def _start_run(self, resume: bool, replace: bool, replace_finished: bool) -> str:
    """This run's id (rundir.start on process 0, the same on every process)."""
    run_id = rundir.start(self.out_dir, self.cfg, resume=resume, replace=replace,
                          replace_finished=replace_finished) if self.is_chief else None
    if multihost.is_multiprocess():
      run_id = multihost.broadcast_bytes(run_id and run_id.encode(), 0).decode()
    return run_id

  def _resume(self, restored: tuple | None) -> None:
    """Continues from `restored` (step, state, meta), or from step 0 where nothing was."""
    all_down_at = recovery.read_run_state(self.out_dir).get('all_down_at')
    step = 0
    if restored:
      step, state, meta = restored
      self._restored(step, state, meta)
    else:
      log.warning('resume: no intact snapshot or checkpoint of run %s found; starting from '
                  'step 0', self.run_id)
    if all_down_at is not None:
      self._carried_state['all_down_at'] = all_down_at
      if step <= all_down_at:  # every slice was down there; a resume means they are back
        self.controller.devices_back_at = all_down_at

  def _resumed_finished(self) -> bool:
    """Resumed at train.steps of a run that finished (process 0's run_state.json, which a run
    stopped at its last step does not say): nothing is left to do."""
    done = (self.is_chief and self.start_step >= self.cfg.train.steps and
            recovery.read_run_state(self.out_dir).get('status') == 'finished')
    if multihost.is_multiprocess():
      done = multihost.broadcast_bytes(b'1' if done else b'0', 0) == b'1'
    return done

  def _restored(self, step: int, state, meta: dict) -> None:
    reached = last_logged_step(self.out_dir)
    self.steps_lost = max(0, reached + 1 - step) if reached is not None else None
    self.controller.state = state
    self.controller.load_meta(meta['controller'])
    self.start_step, self.losses, self.resumed_from = step, meta['losses'], step
    self.evals = list(meta.get('evals', []))  # snapshots of older versions have none
    log.warning('resumed from the snapshot after step %d; the previous process had logged step '
                '%s, so %s step(s) are trained again', step, reached, self.steps_lost)

  @property
  def state(self):
    return self.controller.state

  @property
  def finished(self) -> bool:
    """Trained to train.steps: by run(), or before it (a finished run resumed)."""
    return self._finished

  def describe(self) -> str:
    n = param_count(self.state.params)
    f = self.cfg.faults
    return (f'model {n / 1e6:.2f}M params | mesh {dict(self.mesh.shape)} on {jax.device_count()} '
            f'{jax.devices()[0].platform} device(s) | global batch {self.n_slices}x'
            f'{self.cfg.train.micro_batch}x{self.cfg.model.seq_len} tokens | failures '
            f'{f.failures}, takeover {f.takeover} | snapshots '
            f'{"on" if self.snapshots else "off"} | compile {self.compile_s:.1f}s')

  def dry_run_info(self) -> dict:
    """What --dry-run prints: sizes, mesh, the compiled fault-free step's memory (per device)."""
    return {'param_count': param_count(self.state.params), 'mesh': dict(self.mesh.shape),
            'devices': f'{jax.device_count()} x {jax.devices()[0].device_kind}',
            'global_batch': [self.n_slices, self.cfg.train.micro_batch, self.cfg.model.seq_len],
            'state_bytes': state_nbytes(self.state), 'compile_s': round(self.compile_s, 2),
            'step_memory_bytes': self.memory, 'data': self.corpus.describe()}

  def evaluate(self, n_batches: int = 4) -> float:
    """Mean token loss on fixed held-out rows, the same whichever slices are live."""
    return evaluation.held_out_loss(self.controller, n_batches)

  def run(self) -> dict:
    """Trains to train.steps (or until every slice is down / SIGTERM); returns the report."""
    cfg = self.cfg
    self._write_run_state('running')
    t_start = time.perf_counter()
    self._tokens_at_start = self._tokens_trained()
    progress = Progress(cfg.train.steps, self.start_step, self.n_slices, cfg.faults.takeover,
                        self.progress_mode)
    writer = MetricsWriter(self.out_dir, fresh=self.start_step == 0, enabled=self.is_chief)
    with writer, progress:
      self._writer, self._progress = writer, progress
      steps_done, stopped = self._loop(t_start)
      if not stopped and not (self.evals and self.evals[-1]['step'] == cfg.train.steps - 1):
        self._emit(self._eval_row(cfg.train.steps - 1, t_start))  # the final eval
    jax.block_until_ready(self.state)
    wall_s = time.perf_counter() - t_start
    if not stopped:  # the final state as a durable checkpoint too: a later --resume extends it
      self._snapshot(cfg.train.steps, durable=True)
    if self.snapshots:
      self.snapshots.wait_until_finished()
    report = self._report(steps_done, wall_s, stopped, tensorboard=writer.tensorboard)
    if self.is_chief:
      (self.out_dir / 'report.json').write_text(to_json(report, indent=2))
    self._write_run_state('stopped' if stopped else 'finished')
    self._finished = not stopped
    if cfg.train.plot and self.is_chief:
      self._plot()
    return report

  def _write_run_state(self, status: str) -> None:
    """run_state.json, and failures.txt: the failures so far as a trace that replays them."""
    if self.is_chief:
      recovery.write_run_state(self.out_dir, status, **self._carried_state)
      write_trace(self.out_dir / 'failures.txt', self.controller.events)

  def _loop(self, t_start) -> tuple[int, str | None]:
    """Trains until the end, all slices down or SIGTERM; returns (steps done, why it stopped)."""
    cfg = self.cfg
    self._window = (t_start, self._tokens_at_start, self._eval_s)  # for windowed tokens/s
    for step in range(self.start_step, cfg.train.steps):
      try:
        metrics = self.controller.step(step, time.perf_counter() - t_start)
      except AllSlicesDown as err:
        message = (f'{err}. When devices return, `python train.py --out {self.out_dir} --resume` '
                   f'continues from the newest snapshot (every slice back at step {step})')
        log.error('%s', message)
        self._carried_state['all_down_at'] = step
        return step, message
      self._progress.step(len(self.controller.live()))
      rows = []
      last = step == cfg.train.steps - 1
      # Checked before every snapshot (which waits for the step anyway off CPU), so that no
      # snapshot ever holds a diverged state, and at every logged step.
      snapshot_due = self.snapshots and (self.snapshots.due(step + 1) or self.preempted)
      # Multi-process: every step, so that the processes agree on when to stop (SIGTERM).
      values = (self._fetch(metrics) if snapshot_due or step % cfg.train.log_every == 0 or last
                or multihost.is_multiprocess() else None)
      if values and not math.isfinite(values['loss']):
        return step, self._diverged(step, values['loss'])
      if step % cfg.train.log_every == 0 or last:
        rows.append(self._train_row(step, values, t_start))
        self.losses.append((step, rows[-1]['loss']))
      preempted = self._stop_agreed if multihost.is_multiprocess() else self.preempted
      every = cfg.train.eval_every
      if not preempted and every and (step + 1) % every == 0:
        rows.append(self._eval_row(step, t_start))  # before the snapshot: its meta holds it
      # With snapshot.every=1 the line of step t is written once snapshot t is complete
      # (maybe_save waited for it) and t+1 started: a crash after it costs at most step t.
      self._snapshot(step + 1, durable=preempted)
      for row in rows:
        self._emit(row)
      if preempted:
        self.stopped_by_sigterm = True
        return step + 1, self._preemption_message(step + 1)
    return cfg.train.steps, None

  def _emit(self, row: dict) -> None:
    """A metrics row to the terminal, metrics.jsonl (+ TensorBoard) and the on_log callback."""
    if row['kind'] == 'train':
      self._progress.train_row(row)
    else:
      self._progress.eval_row(row)
    self._writer.write(row)
    if self.on_log is not None:
      self.on_log(row)

  def _tokens_trained(self) -> int:
    samples = self.controller.samples
    return (samples.get('exact', 0) + samples.get('degraded', 0)) * self.cfg.model.seq_len

  def _fetch(self, metrics) -> dict:
    # Waits for the step. Multi-process: a collective, so every process fetches the same steps.
    stop = self.preempted if multihost.is_multiprocess() else None
    values = multihost.fetch(metrics, self.controller.submesh(self.controller.state_slices),
                             stop=stop)
    self._stop_agreed = bool(values.pop('stop', 0.0))
    if self._stop_agreed and not self.preempted:
      self.snapshots.preempted = 'SIGTERM (to another process of the job)'
    return values

  def _diverged(self, step: int, loss: float) -> str:
    self.diverged_at = step
    message = (f'the training loss is not finite ({loss}) at step {step}: the run stopped '
               f'without saving that step (the snapshots and checkpoints hold earlier steps); '
               f'start anew with a lower optimizer.lr or more optimizer.warmup_steps '
               f'(`python train.py --out {self.out_dir} --fresh ...`)')
    log.error('%s', message)
    return message

  def _train_row(self, step, values, t_start) -> dict:
    now, tokens = time.perf_counter(), self._tokens_trained()
    # tokens/s since the previous train row, eval time left out: dips show failures and rejoins.
    t0, tokens0, eval0 = self._window
    seconds = max(now - t0 - (self._eval_s - eval0), 1e-9)
    self._window = (now, tokens, self._eval_s)
    return {'kind': 'train', 'step': step, **values, 'wall_s': now - t_start,
            'live_slices': len(self.controller.live()), 'tokens_per_s': (tokens - tokens0) / seconds}

  def _eval_row(self, step, t_start) -> dict:
    t0 = time.perf_counter()
    loss = self.evaluate(self.cfg.train.eval_batches)
    spent = time.perf_counter() - t0
    self._eval_s += spent
    # An eval is not step time; its compile, if any, is booked as compile by the program cache.
    self.controller.ledger.exclude(spent)
    self.evals.append({'step': step, 'loss': loss, 'perplexity': perplexity(loss)})
    return {'kind': 'eval', **self.evals[-1], 'eval_s': spent,
            'wall_s': time.perf_counter() - t_start, 'live_slices': len(self.controller.live())}

  @property
  def preempted(self) -> bool:
    return bool(self.snapshots and self.snapshots.preempted)

  def _preemption_message(self, steps_done: int) -> str:
    where = 'a durable checkpoint' if self.cfg.snapshot.durable_every else 'an in-memory snapshot'
    message = (f'stopped by {self.snapshots.preempted} after step {steps_done}, saved as {where}; '
               f'resume with `python train.py --out {self.out_dir} --resume`')
    log.warning('%s', message)
    return message

  def _snapshot(self, steps_done: int, durable: bool = False) -> None:
    """Async snapshot of the state after `steps_done` steps (one replica, copied off donation);
    `durable` also writes a durable checkpoint of it now."""
    sn = self.snapshots
    if not sn:
      return
    c = self.controller
    meta = {'controller': c.dump_meta(), 'losses': self.losses, 'reached': steps_done,
            'evals': self.evals}
    sn.maybe_save(steps_done, c.state, meta, force_durable=durable)

  def _plot(self) -> None:
    try:
      from mecefo_jax.run import plot
      plot.plot_run(self.out_dir)
    except Exception as err:  # noqa: BLE001 -- a missing plot is never worth a failed run
      log.warning('could not write %s: %s: %s', self.out_dir / 'training.png',
                  type(err).__name__, err)

  def close(self) -> None:
    if self.controller.precompiler:
      self.controller.precompiler.stop()
    if self.snapshots:
      self.snapshots.close()
      if self._finished and not self.cfg.snapshot.keep_when_finished:
        # A finished run needs no in-memory snapshots: free the tmpfs (durable ones stay).
        host = self.presence.slots[jax.process_index()] if multihost.is_multiprocess() else None
        recovery.remove_snapshots(self.cfg.snapshot, self.out_dir, self.run_id, durable=False,
                                  host=host)
    if self._lock is not None:
      rundir.unlock(self._lock)  # releases the run directory
      self._lock = None

  def _report(self, steps_done, wall_s, stopped, tensorboard: bool) -> dict:
    """report.json; every key is documented in docs/report.md and checked by report_schema."""
    c, cfg = self.controller, self.cfg
    losses = self.losses
    final_eval = self.evals[-1] if self.evals and not stopped else None
    throughput = self._throughput(steps_done, wall_s)
    return {
        'schema_version': SCHEMA_VERSION,
        'steps': steps_done, 'first_loss': losses[0][1] if losses else None,
        'final_loss': losses[-1][1] if losses else None, 'tokens': self._tokens_trained(),
        'wall_s': wall_s, 'tokens_per_s': throughput['tokens_per_s'], 'compile_s': self.compile_s,
        'throughput': throughput,
        'eval_loss': final_eval and final_eval['loss'],
        'eval_perplexity': final_eval and final_eval['perplexity'], 'evals': self.evals,
        'params_sha256': self._params_sha256(),
        'param_count': param_count(self.state.params), 'entropy_floor': self.corpus.entropy_floor(),
        'losses': losses, 'mesh': dict(self.mesh.shape), 'device': jax.devices()[0].device_kind,
        'step_memory': self.memory, 'takeover': cfg.faults.takeover,
        'failures': cfg.faults.failures, 'failure_events': c.events,
        'scheduled_events': [e.to_dict() for e in self.schedule.all_events()],
        'samples': dict(c.samples), 'goodput': c.goodput, 'stopped': stopped,
        'preempted': self.stopped_by_sigterm, 'diverged_at_step': self.diverged_at,
        'resumed_from_step': self.resumed_from, 'steps_lost': self.steps_lost,
        'live_slices_at_end': list(c.live()), 'snapshots': self._snapshot_report(),
        **c.programs_report(),
        'tensorboard_dir': str(self.out_dir / 'tb') if tensorboard else None,
        'config': to_dict(cfg),
    }

  def _throughput(self, steps_done: int, wall_s: float) -> dict:
    """Rates of this process (a resumed run counts from its resume), eval time left out."""
    train_s = max(wall_s - self._eval_s, 1e-9)
    tokens = self._tokens_trained() - self._tokens_at_start
    return {'tokens_per_s': tokens / train_s,
            'steps_per_s': (steps_done - self.start_step) / train_s,
            'tokens_per_step': self.n_slices * self.cfg.train.micro_batch * self.cfg.model.seq_len,
            'train_s': train_s, 'eval_s': self._eval_s}

  def _params_sha256(self) -> str:
    """Of the live replicas' params (multi-process: hashed where a replica is, sent to all)."""
    if not multihost.is_multiprocess():
      return train_state.params_sha256(self.state.params)
    source = multihost.first_process(self.controller.submesh(self.controller.state_slices))
    digest = None
    if jax.process_index() == source:
      params = self.state.params
      leaves = image.local_replica(params)
      digest = train_state.params_sha256(jax.tree.unflatten(jax.tree.structure(params), leaves))
    return multihost.broadcast_bytes(digest and digest.encode(), source).decode()

  def _snapshot_report(self) -> dict:
    return self.snapshots.report() if self.snapshots else store.OFF
