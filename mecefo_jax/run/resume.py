"""Where a run starts: a new state, or the newest usable snapshot of the run being resumed.

`initial_state` is the one place that decides it: the newest of every in-memory snapshot (of
any host layout) and durable checkpoint that can be restored, and how many steps the previous
processes had trained beyond it (thrown away, trained again)."""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import jax

from mecefo_jax import multihost
from mecefo_jax.config import Config, ConfigError, to_dict
from mecefo_jax.model import contract, models
from mecefo_jax.records import snapshot_meta
from mecefo_jax.records.history import Rollback
from mecefo_jax.records.run_state import Diverged, ModelId, RunState
from mecefo_jax.records.snapshot_meta import SnapshotMeta
from mecefo_jax.run import hints, rundir
from mecefo_jax.run.metrics import last_logged_step
from mecefo_jax.snapshot import recovery
from mecefo_jax.step import initializer

log = logging.getLogger('mecefo')


@dataclasses.dataclass
class Start:
  step: int  # steps already trained
  state: Any
  meta: SnapshotMeta | None = None  # the restored snapshot's
  where: str | None = None  # the snapshot restored, in words
  reached: int | None = None  # steps the previous processes had trained (>= step)
  rollback: Rollback | None = None  # a diverged run gone back to a snapshot before it

  @property
  def resumed_from(self) -> int | None:
    """The step of the snapshot resumed from; None for a fresh start."""
    return None if self.meta is None else self.step

  @property
  def steps_lost(self) -> int | None:
    """Steps trained before this start and thrown away (trained again)."""
    return None if self.reached is None else max(0, self.reached - self.step)


def initial_state(cfg: Config, presence, snapshots, out_dir: Path, *, resume: bool,
                  explicit: bool = False, n_hosts: int = 1, times: dict | None = None,
                  program_store=None, diverged: Diverged | None = None) -> Start:
  """A new state (step 0), or with `resume` the newest usable snapshot. `explicit` (--resume):
  finding none is an error (ConfigError), else a warning and step 0; a resume never runs the
  initializer (its program: from `program_store` where it is there). `diverged`: the run
  diverged (run_state.json's record, run/hooks.Divergence): the newest snapshot of a step
  <= its last step seen finite, the newer ones taken out of the run; none is an error.
  `times` gets restore_s (with `resume`: the search and the restore) and the initializer's
  (a new state)."""
  times = {} if times is None else times
  if resume:
    t0 = time.perf_counter()
    bound = diverged.last_finite_step if diverged else None
    restored = snapshots and recovery.restore(snapshots, cfg, presence.mesh, at_most=bound)
    if restored:
      jax.block_until_ready(restored[1])
    times['restore_s'] = time.perf_counter() - t0
    if restored:
      return _resumed(restored, out_dir, diverged and _rollback(diverged, restored, snapshots))
    if snapshots and snapshots.per_block:
      raise ConfigError(f'the run in {out_dir} has only snapshots of the per-block parameter '
                        f'layout of mecefo-jax before the scanned model ({snapshots.per_block[0]}, '
                        f'kept) and no durable checkpoint: resume it with that version, or start '
                        f'anew with {hints.fresh(out_dir)}')
    if diverged:
      raise ConfigError(_nothing_before(diverged, out_dir, snapshots))
    found = 'snapshots are off' if not snapshots else _none_intact(snapshots.set_aside)
    if explicit:
      raise ConfigError(f'{hints.flag("--resume")}: no usable snapshot or checkpoint of the run '
                        f'in {out_dir} ({found}); nothing was started. Start it anew with '
                        f'{hints.fresh(out_dir)}')
    log.warning('resume: no snapshot or checkpoint of the run in %s to resume from (%s); '
                'starting from step 0', out_dir, found)
  return Start(0, initializer.create(cfg, presence.mesh, program_store, times))


def _resumed(restored: tuple, out_dir: Path, rollback: Rollback | None) -> Start:
  step, state, meta, where = restored
  reached = multihost.on_chief(lambda: _reached(out_dir))
  start = Start(step, state, snapshot_meta.from_saved(meta), where,
                None if reached is None else max(reached, step), rollback)
  log.warning('resumed from the %s of %d step(s); the previous processes had trained %s '
              'step(s), so %s step(s) are trained again', where, step, start.reached,
              start.steps_lost)
  return start


def _rollback(diverged: Diverged, restored: tuple, snapshots) -> Rollback:
  """The rollback a resume of a diverged run made, said in one line."""
  back = Rollback(diverged.diverged_at_step, diverged.last_finite_step, to_step=restored[0],
                  discarded=list(snapshots.discarded))
  log.warning('the run diverged at step %d: went back to the %s, the newest snapshot of a step '
              '<= %d (the last step seen with a finite loss and gradient norm)%s',
              back.diverged_at_step, restored[3], back.last_finite_step,
              f'; taken out of the run, newer: {", ".join(back.discarded)}' if back.discarded
              else '')
  return back


def same_optimizer(rollback: Rollback, changed: dict) -> None:
  """A warning where a diverged run goes back with its optimizer settings unchanged: the same
  steps diverge the same way again."""
  if not any(key.startswith('optimizer.') for key in changed):
    log.warning('the run goes back to step %d with the optimizer settings it diverged with at '
                'step %d: it will likely diverge again; give a lower optimizer.lr or more '
                'optimizer.warmup_steps to --resume', rollback.to_step, rollback.diverged_at_step)


def _nothing_before(diverged: Diverged, out_dir: Path, snapshots) -> str:
  """The refusal of a resume of a run that diverged before any snapshot it can go back to."""
  last = diverged.last_finite_step
  seen = (f' before any snapshot of a step <= {last} (the last step seen with a finite loss '
          f'and gradient norm) was kept' if last >= 0 else ', its first step')
  off = ' (snapshots are off)' if not snapshots else ''
  return (f'{hints.flag("--resume")}: the run in {out_dir} diverged at step '
          f'{diverged.diverged_at_step}{seen}{off}, so there is no snapshot to go back to; '
          f'nothing was started. Start it anew with a lower optimizer.lr or more '
          f'optimizer.warmup_steps: {hints.fresh(out_dir)}')


def _none_intact(set_aside: list[str]) -> str:
  """What a resume that found nothing usable found, in words."""
  if not set_aside:
    return 'none was saved'
  return (f'none intact; set aside, not deleted, as it failed its checks: {", ".join(set_aside)}'
          f' (docs/snapshots.md: how to restore one by hand)')


def _reached(out_dir: Path) -> int | None:
  """Steps the previous processes of this run had trained (process 0's files)."""
  logged = last_logged_step(out_dir)
  known = [n for n in (rundir.read_reached(out_dir), logged + 1 if logged is not None else None)
           if n is not None]
  return max(known, default=None)


def carried_state(cfg: Config, run_id: str, presence, previous: RunState | None,
                  resume: bool) -> RunState:
  """run_state.json's entries of this start: the run's identity, its model's (model.kind and
  its parameter tree's digest), its config as given (`auto`
  stays auto, so that a resume on another backend resolves it there), its layout, and the
  platform and compute dtype it trains in. A resume in another compute dtype than the run's
  says so in one warning line."""
  platform = jax.devices()[0].platform
  model = models.spec(cfg.model)
  state = RunState('running', run_id, to_dict(cfg), presence.n_slices,
                   ModelId(model.kind, model.tree_digest), presence.n_hosts, platform,
                   contract.compute_dtype(cfg.model).name,
                   # simulated devices: a resume simulates as many
                   jax.local_device_count() if platform == 'cpu' else None)
  before = previous.compute_dtype if resume and previous else None
  if before and before != state.compute_dtype:
    # The snapshots hold the params and optimizer state in model.param_dtype whatever the
    # compute dtype, so the run goes on; only the rounding of activations and matmuls changes.
    log.warning('resumed on %s computing in %s (model.compute_dtype=%s), where the run computed '
                'in %s on %s: the state carries over unchanged (params in %s), the rounding '
                'of activations and matmuls changes from here', platform,
                state.compute_dtype, cfg.model.compute_dtype, before,
                previous.platform or 'another backend', cfg.model.param_dtype)
  return state


def check_model(cfg: Config, previous: RunState | None, resume: bool) -> None:
  """A resume trains the run's model: one whose parameter tree differs (its code changed under
  the same model.kind) is refused in one line (ConfigError)."""
  recorded = previous.model if resume and previous else None
  model = models.spec(cfg.model)
  if recorded and recorded.tree != model.tree_digest:
    raise ConfigError(f'resume with another model: model.kind={model.kind!r} now has parameter '
                      f'tree {model.tree_digest}, the run trained tree {recorded.tree} '
                      '(its code changed?); resume with the run\'s model, or start anew with '
                      '--fresh (or another --out)')
