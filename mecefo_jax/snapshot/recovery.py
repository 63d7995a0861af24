"""Snapshots in a run: open the tiers, save each step off the critical path, resume bit-exactly."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import signal
from pathlib import Path

import jax

from mecefo_jax import multihost
from mecefo_jax.config import Config, ConfigError, SnapshotConfig
from mecefo_jax.model.train_state import abstract_state, state_shardings
from mecefo_jax.snapshot.host import HostSnapshots
from mecefo_jax.snapshot.capacity import SnapshotError, check_writable
from mecefo_jax.snapshot.store import SnapshotManager, default_snapshot_dir

log = logging.getLogger('mecefo')
RUN_STATE = 'run_state.json'


def run_name(out_dir: Path) -> str:
  """Stable per run directory, so a resumed trainer finds its tmpfs snapshots."""
  resolved = str(Path(out_dir).resolve())
  return f'{Path(resolved).name}-{hashlib.sha1(resolved.encode()).hexdigest()[:8]}'


def snapshot_dirs(sn: SnapshotConfig, out_dir: Path, run_id: str) -> tuple[Path, str]:
  """(in-memory tier, durable tier) directories of run `run_id`: one run's snapshots never
  share a directory with another's, whatever --out they were written for."""
  memory = (Path(sn.dir) if sn.dir else default_snapshot_dir(run_name(out_dir))) / run_id
  durable = sn.durable_dir or str(Path(out_dir).resolve() / 'checkpoints')
  return memory, f'{durable.rstrip("/")}/{run_id}'


def remove_snapshots(sn: SnapshotConfig, out_dir: Path, run_id: str, *, durable: bool,
                     host: int | None = None) -> None:
  """Deletes run `run_id`'s in-memory snapshots (the tmpfs folder of `out_dir` too, once no
  run is left in it) and, with `durable`, its durable checkpoints. `host`: a process of a
  multi-process run deletes only its own part (the others may still read theirs)."""
  memory, durable_dir = snapshot_dirs(sn, out_dir, run_id)
  shutil.rmtree(memory if host is None else memory / f'host{host}', ignore_errors=True)
  for empty in (memory, memory.parent):  # the last process out removes them
    with contextlib.suppress(OSError):
      empty.rmdir()
  if durable and '://' not in durable_dir:
    shutil.rmtree(durable_dir, ignore_errors=True)


def _make_parent(tier_dir: Path, *, given: bool) -> None:
  """Creates the directory that holds a tier's run-id directory. Defaults are made with their
  parents; a directory the user gave must have an existing, writable parent (one-line error)."""
  if not given:
    tier_dir.parent.mkdir(parents=True, exist_ok=True)
  elif not tier_dir.parent.exists():
    check_writable(tier_dir.parent)
    tier_dir.parent.mkdir(exist_ok=True)  # another process of the job may make it first


def open_manager(cfg: Config, out_dir: Path, state_bytes: int, run_id: str,
                 slots=None) -> SnapshotManager | HostSnapshots | None:
  """The snapshot tiers of run `run_id` (capacity checked now), or None with --no-snapshots.
  `slots`: multi-process, the logical host of each process (HostSnapshots)."""
  sn = cfg.snapshot
  if not sn.enabled:
    return None
  directory, durable = snapshot_dirs(sn, out_dir, run_id)
  try:
    _make_parent(directory, given=bool(sn.dir))
    if sn.durable_every and '://' not in durable:  # buckets: Orbax creates what it needs
      _make_parent(Path(durable), given=bool(sn.durable_dir))
    if multihost.is_multiprocess():
      if sn.durable_every:
        log.warning('multi-process run: durable checkpoints are off (per-host in-memory '
                    'snapshots with parity only; see docs/tpu.md)')
      return HostSnapshots(directory, cfg, slots=slots, every=sn.every, keep=sn.keep)
    return SnapshotManager(directory, every=sn.every, keep=sn.keep, durable_dir=durable,
                           durable_every=sn.durable_every, durable_keep=sn.durable_keep,
                           state_bytes=state_bytes)
  except SnapshotError as err:
    raise ConfigError(f'{err} (set snapshot.dir=..., or --no-snapshots)') from None


def restore(manager: SnapshotManager | HostSnapshots, cfg: Config, mesh):
  """(step, state on the full mesh, meta) from the newest intact snapshot, else None."""
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_state(cfg), state_shardings(cfg, mesh))
  return manager.restore_latest(target)


def write_run_state(out_dir: Path, status: str, **extra) -> None:
  """`running` until the run ends; a `running` or `stopped` run is resumed automatically."""
  tmp = Path(out_dir) / (RUN_STATE + '.tmp')
  tmp.write_text(json.dumps({'status': status, **extra}))
  tmp.replace(Path(out_dir) / RUN_STATE)


def read_run_state(out_dir: Path) -> dict:
  """The run_state.json of `out_dir`, {} if there is none."""
  path = Path(out_dir) / RUN_STATE
  return json.loads(path.read_text()) if path.is_file() else {}


def unfinished(out_dir: Path) -> bool:
  return read_run_state(out_dir).get('status') in ('running', 'stopped')


def install_sigterm_handler(manager: SnapshotManager | HostSnapshots, *,
                            exit_code: int = 128 + signal.SIGTERM,
                            defer: bool = False, signum: int = signal.SIGTERM):
  """On SIGTERM (preemption), or `signum` (SIGINT: Ctrl-C): wait for in-flight snapshots, then
  exit. Main thread only.

  Sets manager.preempted, finishes the writes, calls any previous Python handler, then raises
  SystemExit(exit_code) so that `finally` blocks run. With `defer` it only sets
  manager.preempted: the training loop checkpoints and stops at the end of its step (the
  handler then never waits inside code that it interrupted); a second SIGINT then raises
  KeyboardInterrupt, for a user who will not wait for the step. Returns the previous handler.
  """
  previous = signal.getsignal(signum)
  name = 'SIGINT (Ctrl-C)' if signum == signal.SIGINT else signal.Signals(signum).name

  def on_signal(signum, frame):
    if defer and signum == signal.SIGINT and manager.preempted:
      raise KeyboardInterrupt
    manager.preempted = name  # truthy: which signal stopped the run
    if defer:
      log.warning('%s: stopping after this step, with a final checkpoint', name)
      return
    log.warning('%s: waiting for in-flight snapshots before exiting', name)
    manager.wait_until_finished()
    # Python's own SIGINT handler would only raise KeyboardInterrupt instead of our exit.
    if callable(previous) and previous is not signal.default_int_handler:
      previous(signum, frame)
    raise SystemExit(exit_code)

  signal.signal(signum, on_signal)
  return previous
