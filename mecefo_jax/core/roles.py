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
