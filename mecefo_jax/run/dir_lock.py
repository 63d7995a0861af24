"""The run directory's lock: one training process (or job) per `--out`; a dead one's taken over
(its holder, as a supervisor looks at it: records/run_dir.py)."""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

from mecefo_jax.config import ConfigError
from mecefo_jax.records.run_dir import LOCK, in_use_message

log = logging.getLogger('mecefo')


def lock(out_dir: Path):
  """An exclusive lock on `out_dir` held until the returned file is closed; the kernel drops it
  when its process dies (SIGKILL included), so a stale lock is simply taken over.

  What it guarantees (Linux): two starts on one machine never both hold it. On an NFS `--out`
  (docs/tpu.md) the kernel turns flock() into an NFS byte-range lock held by the server, so
  starts on different machines exclude each other too, with NFS's caveats: a mount with
  `local_lock=flock` (or `nolock`) locks on each machine alone; a machine that dies or loses
  the server keeps the lock until the server's lease runs out (NFSv4: 90 s by default), and one
  cut off longer than that loses it without being told while its process may still write;
  and, a POSIX lock there, closing any other descriptor of .lock in the process would drop it
  (nothing else opens that file). Windows and macOS are out of scope."""
  fd = os.open(Path(out_dir) / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
  holder = os.read(fd, 32).decode(errors='replace').strip()
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    raise ConfigError(in_use_message(out_dir, holder)) from None
  if holder and holder != str(os.getpid()):
    log.info('run directory lock of pid %s (no longer running) taken over', holder)
  os.ftruncate(fd, 0)
  with contextlib.suppress(OSError):  # a full disk: held all the same, its holder unnamed
    os.pwrite(fd, str(os.getpid()).encode(), 0)
  return os.fdopen(fd, 'r+')


def lock_job(out_dir: Path):
  """lock(), taken by process 0 of a job, whose outcome every process learns (one broadcast)
  before any of them touches a file: a refusal is raised on all. The lock on process 0, None on
  the others."""
  from mecefo_jax import multihost  # (jax: not for light readers)
  held = []

  def take() -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    held.append(lock(out_dir))
  multihost.on_chief(take)
  return held[0] if held else None


def unlock(held, refused: Path | None = None) -> None:
  """Releases a lock() at a clean exit, its pid erased first: the next start then finds no
  holder to report (a killed process leaves its pid, and the next start takes it over).
  `refused`: the run directory of a refused start, removed (still held: no other start uses
  it) if it holds nothing but the lock file."""
  if refused is not None:
    with contextlib.suppress(OSError):
      if [p.name for p in Path(refused).iterdir()] == [LOCK]:
        (Path(refused) / LOCK).unlink()
        Path(refused).rmdir()
  held.truncate(0)
  held.close()
