"""One start's hold on its run directory: the lock, the run's identity, run_state.json, the trace."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax

from mecefo_jax import multihost, sections
from mecefo_jax.config import Config
from mecefo_jax.core.failures import FailureSchedule
from mecefo_jax.core.fault_log import LogMapping
from mecefo_jax.records.run_dir import snapshot_dirs
from mecefo_jax.records.run_state import Diverged, RunState, write_run_state
from mecefo_jax.run import dir_lock, rundir
from mecefo_jax.run.resume import carried_state
from mecefo_jax.snapshot.manager import memory_kept_when_finished

log = logging.getLogger('mecefo')


class RunFiles:
  """The run directory as one start holds it. Nothing under it is written until `start()`
  (only process 0 writes): a start refused before leaves the run as it was."""

  def __init__(self, cfg: Config, out_dir: Path):
    # The lock before anything: no process of this start opens, creates, cleans or deletes a
    # file under out_dir or the snapshot places until process 0 holds it.
    self.cfg, self.out_dir, self.is_chief = cfg, out_dir, jax.process_index() == 0
    self._lock = dir_lock.lock_job(out_dir)
    self.trace: rundir.Trace | None = None
    self._checked: rundir.Checked | None = None
    self.state: RunState | None = None  # run_state.json of this start (resume.carried_state)

  def schedule(self, n_slices: int, resume: bool) -> FailureSchedule:
    """faults.failures as a schedule; a trace is read from the run's own copy at a resume."""
    cfg, f = self.cfg, self.cfg.faults
    if n_slices == 1 and f.failures != 'none':
      log.warning('one slice: a failure leaves no live slice to take over its micro-batch, so '
                  'the run stops at the first failure (use mesh.slice >= 2 to survive failures)')
    self.trace = rundir.read_trace(self.out_dir, f.failures, resume)
    if self.trace:
      return FailureSchedule.from_trace(self.trace.path, n_slices, self.trace.text,
                                        self.trace.source, LogMapping.of(cfg), f.cluster_step_s)
    return FailureSchedule.from_spec(f.failures, n_slices, cfg.train.steps, f.cluster_step_s,
                                     cfg.train.seed, f.rate, LogMapping.of(cfg))

  def check(self, *, resume: bool, replace: bool,
            replace_finished: bool) -> RunState | None:
    """What start() will do, checked on process 0 without touching a file; the recorded
    run_state.json of the run there (None: none)."""
    checked = multihost.on_chief(lambda: sections.to_json(rundir.check_start(
        self.out_dir, self.cfg, resume=resume, replace=replace, replace_finished=replace_finished)))
    self._checked = sections.from_json(rundir.Checked, checked)
    return self._checked.previous

  @property
  def changed(self) -> dict[str, list]:
    """{key: [the run's value, this start's]} of the config keys this resume changes."""
    return self._checked.changed

  @property
  def run_id(self) -> str:
    return self._checked.run_id

  def carry(self, presence, previous: RunState | None, resume: bool) -> None:
    self.state = carried_state(self.cfg, self.run_id, presence, previous, resume)

  @property
  def compute_dtype(self) -> str:
    return self.state.compute_dtype  # model.compute_dtype resolved

  def all_down_at(self, step: int) -> None:
    """Every slice went down at `step`: a resume brings them back there (run_state.json)."""
    self.state = dataclasses.replace(self.state, all_down_at=step)

  def diverged(self, diverged: Diverged) -> None:
    """The run diverged (run/hooks.Divergence): a resume goes back to a snapshot of a step <=
    its last_finite_step (run_state.json; the resume's own start drops it)."""
    self.state = dataclasses.replace(self.state, diverged=diverged)

  def start(self) -> None:
    """The run's files change from here on: a new run's predecessor's files go."""
    if self.is_chief:
      rundir.start(self.out_dir, self._checked)
      if self.trace:
        rundir.keep_trace(self.out_dir, self.trace)

  def write_state(self, status: str) -> None:
    if self.is_chief:
      write_run_state(self.out_dir, dataclasses.replace(self.state, status=status))

  def snapshot_dirs(self) -> tuple[Path, str]:
    return snapshot_dirs(self.cfg.snapshot, self.out_dir, self.run_id)

  def close(self, snapshots, host: int | None = None, *, finished: bool = False,
            refused: bool = False) -> None:
    """Closes the snapshot tiers and unlocks the run. A finished run needs no in-memory
    snapshots: this host's go (`host`: its part of a multi-process run's; durable ones stay),
    unless its final durable save failed (the in-memory tier then holds the only copy).
    `refused`: a start that failed: the tiers' empty directories go, and the run directory if
    it holds nothing else."""
    kept = snapshots and memory_kept_when_finished(snapshots, self.cfg.snapshot.keep_when_finished)
    if snapshots:
      snapshots.close()
    # A dead host's part (a job restarted without it) goes with the run's own.
    hosts = (host, *getattr(snapshots, 'stale', ())) if host is not None else (None,)
    self.release(hosts, remove_memory=bool(snapshots) and finished and not kept,
                 remove_dirs=bool(snapshots) and refused, refused=refused)

  def release(self, hosts: tuple = (None,), *, remove_memory: bool = False,
              remove_dirs: bool = False, refused: bool = False) -> None:
    """`remove_memory`: deletes the in-memory snapshots (`hosts`: these hosts' parts only;
    (None,): all);
    `remove_dirs`: the tiers' directories where nothing is in them. Then unlocks the run
    (`refused`: a refused start's run directory goes if it holds nothing else)."""
    sn = self.cfg.snapshot
    try:
      for host in hosts if remove_memory else ():
        rundir.remove_snapshots(sn, self.out_dir, self.run_id, durable=False, host=host)
      if remove_dirs:
        rundir.remove_empty_dirs(sn, self.out_dir, self.run_id)
    finally:
      if self._lock is not None:
        dir_lock.unlock(self._lock, self.out_dir if refused else None)
        self._lock = None
