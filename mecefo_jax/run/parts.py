"""What one start of a run is built from (run/trainer.py builds them once): handed whole to the
loop's hooks, the report and the start line, never the Trainer itself."""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from mecefo_jax import multihost
from mecefo_jax.config import Config
from mecefo_jax.core.failures import FailureSchedule
from mecefo_jax.data.sources import load_corpus
from mecefo_jax.fault.controller import Controller
from mecefo_jax.model import models, train_state
from mecefo_jax.records.run_state import RunState
from mecefo_jax.run import presence
from mecefo_jax.run.presence import Presence
from mecefo_jax.run.records import RunRecords
from mecefo_jax.run.resume import Start, check_model, initial_state, same_optimizer
from mecefo_jax.run.run_files import RunFiles
from mecefo_jax.run.startup import StartupClock
from mecefo_jax.run.stop import StopRequest
from mecefo_jax.run.storage import OutputGuard
from mecefo_jax.snapshot import recovery
from mecefo_jax.snapshot.manager import state_nbytes
from mecefo_jax.step.program_store import ProgramStore

log = logging.getLogger('mecefo')


@dataclasses.dataclass(frozen=True)
class StartMode:
  """How a start treats the run in its directory, and what train.py hands it.

  `resume`: continue the run from its newest usable snapshot (run/resume.py);
  `explicit_resume` (--resume): finding none is an error instead of a start from step 0;
  `replace` (--fresh): another run there is replaced, one whose run_state.json cannot be read
  too; `replace_finished`: a finished run there is; `host_slot`: this process's slot among a
  multi-process run's hosts (a restart without a dead host); `program_store`: compiled programs
  loaded instead of compiled, and kept for later starts (train.compile_cache:
  step/program_store.py); `stop`: the run's stop request (run/stop.py; train.py installs its
  signal handlers)."""
  resume: bool = False
  explicit_resume: bool = False
  replace: bool = False
  replace_finished: bool = False
  host_slot: int | None = None
  program_store: ProgramStore | None = None
  stop: StopRequest | None = None


@dataclasses.dataclass(frozen=True)
class RunParts:
  """One start's parts, in the order they are built (an earlier one never reads a later)."""
  cfg: Config
  out_dir: Path
  stop: StopRequest  # watching out_dir's stop file
  startup: StartupClock
  files: RunFiles  # the lock, the run's identity, run_state.json
  presence: Presence  # the slices and hosts of this start, its mesh
  outputs: OutputGuard  # the run directory's writes: the first failed one stops the run
  records: RunRecords  # history.jsonl, failures.txt, .reached
  corpus: Any  # data/sources.Corpus
  schedule: FailureSchedule
  snapshots: Any  # the snapshot tiers (snapshot/recovery.open_manager), None when off
  origin: Start  # the state it starts from
  controller: Controller
  previous: RunState | None  # the run recorded in out_dir when this start began


def build(cfg: Config, out_dir: Path, schedule: FailureSchedule | None, mode: StartMode,
          run_files: RunFiles, startup: StartupClock) -> RunParts:
  """All but the lock (`run_files`'), the first programs last; no file of the run is written
  here, and whatever can refuse the run does so before its files are touched."""
  models.spec(cfg.model)  # a model that breaks the contract: refused here
  found = presence.find(cfg, out_dir, mode.resume, mode.host_slot)
  if multihost.is_multiprocess():
    multihost.check_slices_within_processes(found.mesh)
  stop = (mode.stop if mode.stop is not None else StopRequest()).watch(out_dir)
  outputs = OutputGuard(stop.request)  # a failed write (a full disk): stops after the step
  corpus = load_corpus(cfg.train.data, seq_len=cfg.model.seq_len, seed=cfg.train.seed,
                       vocab_size=cfg.model.vocab_size)
  if not corpus.has_eval:
    log.warning('%s holds no eval rows (eval_fraction=0): evals are off, the final one too '
                '(eval_loss null in report.json)', cfg.train.data)
  schedule = schedule or run_files.schedule(found.n_slices, mode.resume)
  previous = run_files.check(resume=mode.resume, replace=mode.replace,
                             replace_finished=mode.replace_finished)
  check_model(cfg, previous, mode.resume)
  snapshots = recovery.open_manager(cfg, *run_files.snapshot_dirs(),
                                    state_nbytes(train_state.abstract_state(cfg)), found.slots)
  try:
    origin, controller = _start_state(cfg, mode, run_files, found, snapshots, schedule, corpus,
                                      previous, startup, out_dir)
  except BaseException:  # re-raised: only the lock and this start's empty folders go
    run_files.close(snapshots, refused=True)
    raise
  return RunParts(cfg, out_dir, stop, startup, run_files, found, outputs,
                  RunRecords(out_dir, run_files.is_chief, outputs), corpus, schedule, snapshots,
                  origin, controller, previous)


def _start_state(cfg: Config, mode: StartMode, run_files: RunFiles, found: Presence, snapshots,
                 schedule, corpus, previous: RunState | None, startup: StartupClock,
                 out_dir: Path) -> tuple[Start, Controller]:
  """(The state this start begins from, its controller with the first programs built)."""
  t0 = time.perf_counter()
  origin = initial_state(cfg, found, snapshots, out_dir, resume=mode.resume,
                         explicit=mode.explicit_resume, times=startup.seconds,
                         program_store=mode.program_store,
                         diverged=previous.diverged if mode.resume and previous else None)
  if origin.rollback:
    same_optimizer(origin.rollback, run_files.changed)
  run_files.carry(found, previous, mode.resume)
  down_at = previous.all_down_at if origin.meta is not None and previous else None
  if down_at is not None:
    run_files.all_down_at(down_at)  # kept while resuming
  controller = Controller.start(
      cfg, found, models.spec(cfg.model).graphdef, corpus, schedule, origin.state,
      meta=origin.meta and origin.meta.controller, step=origin.step, all_down_at=down_at,
      program_store=mode.program_store)
  startup.programs_built(controller.first_programs_s, time.perf_counter() - t0)
  return origin, controller
