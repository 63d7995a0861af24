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
from mecefo_jax.run import hints, rundir
from mecefo_jax.run.metrics import last_logged_step
from mecefo_jax.snapshot import recovery
from mecefo_jax.step import initializer

log = logging.getLogger('mecefo')


@dataclasses.dataclass
class Start:
  step: int  # steps already trained
  state: Any
  meta: dict | None = None  # the restored snapshot's meta (controller, losses, evals)
  where: str | None = None  # the snapshot restored, in words
  reached: int | None = None  # steps the previous processes had trained (>= step)

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
                  program_store=None) -> Start:
  """A new state (step 0), or with `resume` the newest usable snapshot. `explicit` (--resume):
  finding none is an error (ConfigError), else a warning and step 0; a resume never runs the
  initializer (its program: from `program_store` where it is there). `times` gets restore_s
  (with `resume`: the search and the restore) and the initializer's (a new state)."""
  times = {} if times is None else times
  if resume:
    t0 = time.perf_counter()
    restored = snapshots and recovery.restore(snapshots, cfg, presence.mesh)
    if restored:
      jax.block_until_ready(restored[1])
    times['restore_s'] = time.perf_counter() - t0
    if restored:
      step, state, meta, where = restored
      reached = multihost.on_chief(lambda: _reached(out_dir))
      start = Start(step, state, meta, where, None if reached is None else max(reached, step))
      log.warning('resumed from the %s of %d step(s); the previous processes had trained %s '
                  'step(s), so %s step(s) are trained again', where, step, start.reached,
                  start.steps_lost)
      return start
    if snapshots and snapshots.per_block:
      raise ConfigError(f'the run in {out_dir} has only snapshots of the per-block parameter '
                        f'layout of mecefo-jax before the scanned model ({snapshots.per_block[0]}, '
                        f'kept) and no durable checkpoint: resume it with that version, or start '
                        f'anew with {hints.fresh(out_dir)}')
    found = 'snapshots are off' if not snapshots else _none_intact(snapshots.set_aside)
    if explicit:
      raise ConfigError(f'{hints.flag("--resume")}: no usable snapshot or checkpoint of the run '
                        f'in {out_dir} ({found}); nothing was started. Start it anew with '
                        f'{hints.fresh(out_dir)}')
    log.warning('resume: no intact snapshot or checkpoint of the run in %s found (%s); starting '
                'from step 0', out_dir, found)
  return Start(0, initializer.create(cfg, presence.mesh, program_store, times))


def _none_intact(set_aside: list[str]) -> str:
  """What a resume that found nothing usable found, in words."""
  if not set_aside:
    return 'none intact'
  return (f'none intact; set aside, not deleted, as it failed its checks: {", ".join(set_aside)}'
          f' (docs/snapshots.md: how to restore one by hand)')


def _reached(out_dir: Path) -> int | None:
  """Steps the previous processes of this run had trained (process 0's files)."""
  logged = last_logged_step(out_dir)
  known = [n for n in (rundir.read_reached(out_dir), logged + 1 if logged is not None else None)
           if n is not None]
  return max(known, default=None)


def carried_state(cfg: Config, run_id: str, presence, previous: dict, resume: bool) -> dict:
  """run_state.json's entries of this start: the run's identity, its model's (model.kind and
  its parameter tree's digest), its config as given (`auto`
  stays auto, so that a resume on another backend resolves it there), its layout, and the
  platform and compute dtype it trains in. A resume in another compute dtype than the run's
  says so in one warning line."""
  platform = jax.devices()[0].platform
  model = models.spec(cfg.model)
  state = {'run_id': run_id, 'config': to_dict(cfg), 'n_slices': presence.n_slices,
           'model': {'kind': model.kind, 'tree': model.tree_digest},
           'n_hosts': presence.n_hosts, 'platform': platform,
           'compute_dtype': contract.compute_dtype(cfg.model).name}
  if platform == 'cpu':  # simulated devices: a resume simulates as many
    state['host_devices'] = jax.local_device_count()
  before = previous.get('compute_dtype') if resume else None
  if before and before != state['compute_dtype']:
    # The snapshots hold the params and optimizer state in model.param_dtype whatever the
    # compute dtype, so the run goes on; only the rounding of activations and matmuls changes.
    log.warning('resumed on %s computing in %s (model.compute_dtype=%s), where the run computed '
                'in %s on %s: the state carries over unchanged (params in %s), the rounding '
                'of activations and matmuls changes from here', platform,
                state['compute_dtype'], cfg.model.compute_dtype, before,
                previous.get('platform', 'another backend'), cfg.model.param_dtype)
  return state


def check_model(cfg: Config, previous: dict, resume: bool) -> None:
  """A resume trains the run's model: one whose parameter tree differs (its code changed under
  the same model.kind) is refused in one line (ConfigError)."""
  recorded = previous.get('model') if resume else None
  model = models.spec(cfg.model)
  if recorded and recorded.get('tree') != model.tree_digest:
    raise ConfigError(f'resume with another model: model.kind={model.kind!r} now has parameter '
                      f'tree {model.tree_digest}, the run trained tree {recorded.get("tree")} '
                      '(its code changed?); resume with the run\'s model, or start anew with '
                      '--fresh (or another --out)')
