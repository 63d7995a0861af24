"""The planner's output per slice: the rows it runs exactly and degraded, in how many passes."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, order=True)
class Role:
  """One slice's work in a step: sequences run with the exact step, then with the degraded step.

  `passes` > 1 runs the degraded rows in that many sequential chunks (lax.scan), so that a
  slice carrying many orphaned micro-batches keeps the memory of one chunk.
  """
  exact: int = 0
  degraded: int = 0
  passes: int = 1

  def __post_init__(self):
    # Hashed once: a plan at scale looks up hundreds of roles.
    object.__setattr__(self, '_hash', hash((self.exact, self.degraded, self.passes)))

  def __hash__(self) -> int:
    return self._hash

  @property
  def rows(self) -> int:
    return self.exact + self.degraded


def split_passes(degraded_rows: int, max_rows: int) -> int:
  """Fewest passes of at most max_rows rows each (0 = no limit)."""
  if max_rows <= 0 or degraded_rows <= max_rows:
    return 1
  return -(-degraded_rows // max_rows)


def slice_list(slices) -> str:
  """`slices` for a log line: '[0, 1, 4, 5]', runs of 3 or more as ranges ('[0-2, 4-31]'), so
  that a line about one slice of 256 stays one line."""
  runs: list[list[int]] = []
  for s in sorted(slices):
    if runs and s == runs[-1][-1] + 1:
      runs[-1].append(s)
    else:
      runs.append([s])
  parts = [f'{r[0]}-{r[-1]}' if len(r) >= 3 else ', '.join(map(str, r)) for r in runs]
  return f"[{', '.join(parts)}]"
