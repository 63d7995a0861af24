"""The training loop: mesh, sharded state, failure-aware controller, snapshots, report.json."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import jax
import numpy as np

from mecefo_jax import model, recovery, sharding, slice_steps, steps, train_state
from mecefo_jax.config import Config, to_dict
from mecefo_jax.controller import AllSlicesDown, Controller
from mecefo_jax.data import global_batch
from mecefo_jax.datasources import load_corpus
from mecefo_jax.failures import FailureSchedule
from mecefo_jax.snapshot import state_nbytes

log = logging.getLogger('mecefo')


def param_count(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


class Trainer:
  """Builds everything once (the fault-free step compiled ahead of time), then trains."""

  def __init__(self, cfg: Config, out_dir: str | Path, schedule: FailureSchedule | None = None,
               resume: bool = False):
    self.cfg, self.out_dir = cfg, Path(out_dir)
    self.mesh = sharding.make_mesh(cfg.mesh)
    self.n_slices = self.mesh.shape['slice']
    m = cfg.model
    self.corpus = load_corpus(cfg.train.data, seq_len=m.seq_len, seed=cfg.train.seed,
                              vocab_size=m.vocab_size)
    self.graphdef, _, _ = model.abstract(m)
    f = cfg.faults
    self.schedule = schedule or FailureSchedule.from_spec(
        f.failures, self.n_slices, cfg.train.steps, f.cluster_step_s, cfg.train.seed)
    self.out_dir.mkdir(parents=True, exist_ok=True)
    self.snapshots = recovery.open_manager(cfg, self.out_dir,
                                           state_nbytes(steps.abstract_state(cfg)))
    t0 = time.perf_counter()
    state = train_state.create_sharded(cfg, self.mesh)
    self.controller = Controller(cfg, self.mesh, self.graphdef, self.corpus, self.schedule, state)
    self.start_step, self.losses, self.resumed_from, self.steps_lost = 0, [], None, None
    self._carried_state = {}  # run_state.json entries kept while resuming (all_down_at)
    self.stopped_by_sigterm = False
    if resume:
      self._resume()
    # Compile the fault-free step now, so that the first step runs at full speed.
    all_slices = tuple(range(self.n_slices))
    self.memory = steps.memory_summary(
        self.controller.fused(all_slices, steps.Role(exact=cfg.train.micro_batch)))
    self.compile_s = time.perf_counter() - t0

  def _resume(self) -> None:
    restored = self.snapshots and recovery.restore(self.snapshots, self.cfg, self.mesh)
    if not restored:
      log.warning('resume: no intact snapshot or checkpoint found; starting from step 0')
      return
    step, state, meta = restored
    reached = recovery.last_logged_step(self.out_dir)
    self.steps_lost = max(0, reached + 1 - step) if reached is not None else None
    self.controller.state = state
    self.controller.load_meta(meta['controller'])
    self.start_step, self.losses, self.resumed_from = step, meta['losses'], step
    all_down_at = recovery.read_run_state(self.out_dir).get('all_down_at')
    if all_down_at is not None:
      self._carried_state['all_down_at'] = all_down_at
      if step <= all_down_at:  # every slice was down there; a resume means they are back
        self.controller.devices_back_at = all_down_at
    log.warning('resumed from the snapshot after step %d; the previous process had logged step '
                '%s, so %s step(s) are trained again', step, reached, self.steps_lost)

  @property
  def state(self):
    return self.controller.state

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
    """Mean loss on held-out samples (ids disjoint from training), on the live slices."""
    live = self.controller.state_slices
    mesh = sharding.submesh(self.mesh, live)
    b = self.cfg.train.micro_batch
    program = self.controller.program(
        ('eval', live), lambda: steps.compile_eval(self.cfg, mesh, b, self.graphdef))
    losses = []
    for i in range(n_batches):
      tokens = global_batch(self.corpus, i, len(live), b, split='eval')
      losses.append(float(program(self.state.params,
                                  jax.device_put(tokens, sharding.batch_sharding(mesh)))))
    return float(np.mean(losses))

  def run(self) -> dict:
    recovery.write_run_state(self.out_dir, 'running', **self._carried_state)
    t_start = time.perf_counter()
    with open(self.out_dir / 'metrics.jsonl', 'a') as metrics_file:
      steps_done, stopped = self._loop(metrics_file, t_start)
    jax.block_until_ready(self.state)
    wall_s = time.perf_counter() - t_start
    if self.snapshots:
      self.snapshots.wait_until_finished()
    report = self._report(steps_done, wall_s, stopped)
    if not stopped:
      report['eval_loss'] = self.evaluate()
      log.info('eval loss %.4f (perplexity %.3f)', report['eval_loss'], np.exp(report['eval_loss']))
    (self.out_dir / 'report.json').write_text(json.dumps(report, indent=2))
    recovery.write_run_state(self.out_dir, 'stopped' if stopped else 'finished',
                             **self._carried_state)
    return report

  def _loop(self, metrics_file, t_start) -> tuple[int, str | None]:
    """Trains until the end, all slices down or SIGTERM; returns (steps done, why it stopped)."""
    cfg = self.cfg
    tokens_per_step = self.n_slices * cfg.train.micro_batch * cfg.model.seq_len
    for step in range(self.start_step, cfg.train.steps):
      try:
        metrics = self.controller.step(step, time.perf_counter() - t_start)
      except AllSlicesDown as err:
        log.error('%s', err)
        self._carried_state['all_down_at'] = step
        return step, str(err)
      row = None
      if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1:
        row = self._log_row(step, metrics, time.perf_counter() - t_start, tokens_per_step)
        self.losses.append((step, row['loss']))
      preempted = self.preempted
      # With snapshot.every=1 the line of step t is written once snapshot t is complete
      # (maybe_save waited for it) and t+1 started: a crash after it costs at most step t.
      self._snapshot(step + 1, durable=preempted)
      if row is not None:
        metrics_file.write(json.dumps(row) + '\n')
        metrics_file.flush()
      if preempted:
        self.stopped_by_sigterm = True
        return step + 1, self._preemption_message(step + 1)
    return cfg.train.steps, None

  @property
  def preempted(self) -> bool:
    return bool(self.snapshots and self.snapshots.preempted)

  def _preemption_message(self, steps_done: int) -> str:
    where = 'a durable checkpoint' if self.cfg.snapshot.durable_every else 'an in-memory snapshot'
    message = (f'preempted (SIGTERM) after step {steps_done}, saved as {where}; resume with '
               '`python train.py --resume`')
    log.warning('%s', message)
    return message

  def _snapshot(self, steps_done: int, durable: bool = False) -> None:
    """Async snapshot of the state after `steps_done` steps (one replica, copied off donation);
    `durable` also writes a durable checkpoint of it now."""
    if not self.snapshots:
      return
    c = self.controller
    meta = {'controller': c.dump_meta(), 'losses': self.losses, 'reached': steps_done}
    # One replica is enough: the slices hold identical copies.
    one_replica = slice_steps.state_view(self.cfg, c.state, self.mesh, c.state_slices[:1])
    self.snapshots.maybe_save(steps_done, one_replica, meta, force_durable=durable)

  def close(self) -> None:
    if self.snapshots:
      self.snapshots.close()

  def _log_row(self, step, metrics, wall_s, tokens_per_step) -> dict:
    row = {'step': step, **{k: float(v) for k, v in metrics.items()}, 'wall_s': wall_s,
           'live_slices': len(self.controller.live())}
    log.info('step %d/%d loss %.4f grad_norm %.3f live %d/%d tok/s %.0f', step, self.cfg.train.steps,
             row['loss'], row['grad_norm'], row['live_slices'], self.n_slices,
             tokens_per_step * (step + 1 - self.start_step) / wall_s)
    return row

  def _report(self, steps_done, wall_s, stopped) -> dict:
    c, cfg = self.controller, self.cfg
    samples = dict(c.samples)
    trained_tokens = (samples.get('exact', 0) + samples.get('degraded', 0)) * cfg.model.seq_len
    losses = self.losses
    return {
        'steps': steps_done, 'first_loss': losses[0][1] if losses else None,
        'final_loss': losses[-1][1] if losses else None, 'tokens': trained_tokens,
        'wall_s': wall_s, 'tokens_per_s': trained_tokens / wall_s, 'compile_s': self.compile_s,
        'params_sha256': train_state.params_sha256(self.state.params),
        'param_count': param_count(self.state.params), 'entropy_floor': self.corpus.entropy_floor(),
        'losses': losses, 'mesh': dict(self.mesh.shape), 'device': jax.devices()[0].device_kind,
        'step_memory': self.memory, 'takeover': cfg.faults.takeover,
        'failures': cfg.faults.failures, 'failure_events': c.events,
        'scheduled_events': [e.to_dict() for e in self.schedule.all_events()],
        'samples': samples, 'goodput': c.goodput, 'stopped': stopped,
        'preempted': self.stopped_by_sigterm,
        'resumed_from_step': self.resumed_from, 'steps_lost': self.steps_lost,
        'live_slices_at_end': list(c.live()),
        'config': to_dict(cfg),
    }
