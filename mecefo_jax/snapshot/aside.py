"""Snapshots that fail their checks: moved aside with why they were, never deleted.

A tier in D (a durable `<root>/<run id>`, an in-memory `<tmpfs>/<run id>` or its `host<N>`) sets
snapshot S aside as `<D's parent>/set_aside/<D's name>/<S>-<UTC time>/<S>`, with `why.json`
beside it: the snapshot's files as they were, restorable by hand by moving that `<S>` back into D
(the next resume checks it again). docs/snapshots.md says what is kept how long.
"""
from __future__ import annotations

import contextlib
import json
import os
import time

from etils import epath

SET_ASIDE = 'set_aside'
WHY = 'why.json'
# A test's slow move (tests/test_multiprocess.py): each one waits this many seconds first, as a
# bucket's copy-and-delete does, so that other processes reading the tier meanwhile see it.
TEST_DELAY_ENV = 'MECEFO_TEST_ASIDE_DELAY_S'


def place(tier_dir: epath.Path) -> epath.Path:
  """The directory that holds what the tier in `tier_dir` set aside."""
  tier_dir = epath.Path(tier_dir)
  return tier_dir.parent / SET_ASIDE / tier_dir.name


def set_aside(tier_dir: epath.Path, step: int, problem: str) -> epath.Path:
  """Moves snapshot `step` of the tier in `tier_dir` aside (a rename: no byte is copied on a
  local disk or tmpfs), `problem` written beside it; returns where it now is. Raises OSError
  where it cannot be moved (it is then left where it was)."""
  source = epath.Path(tier_dir) / str(step)
  time.sleep(float(os.environ.get(TEST_DELAY_ENV, 0)))
  stamp = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
  entry = place(tier_dir) / f'{step}-{stamp}'
  n = 1
  while entry.exists():  # set aside twice within a second (the step trained again)
    entry, n = place(tier_dir) / f'{step}-{stamp}-{n}', n + 1
  entry.mkdir(parents=True)
  target = entry / str(step)
  try:
    if '://' in os.fspath(source):
      source.rename(target)  # a bucket: the filesystem library moves it
    else:
      os.rename(os.fspath(source), os.fspath(target))
  except Exception as err:  # noqa: BLE001 -- any filesystem's failure: the snapshot stays put
    entry.rmdir()
    raise OSError(f'cannot move {source} to {target}: {err}') from err
  with contextlib.suppress(OSError):  # a full disk: the name still says step and time
    (entry / WHY).write_text(json.dumps({'step': step, 'from': os.fspath(source),
                                         'problem': problem, 'time': stamp}))
  return target


def restore_hint(where: epath.Path, tier_dir: epath.Path, step: int) -> str:
  """How to put snapshot `step`, set aside as `where`, back by hand (a refused start removes
  the tier's directory once empty)."""
  return f'mkdir -p {tier_dir} && mv {where} {epath.Path(tier_dir) / str(step)}'
