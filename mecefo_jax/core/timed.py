"""A failure or repair at a time in seconds: what Poisson presets and node fault logs produce."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TimedEvent:
  """A failure or repair at a time in seconds (the simulator's continuous clock)."""
  time_s: float
  slice: int
  kind: str  # 'fail' | 'repair'
