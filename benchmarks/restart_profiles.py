"""Named restart costs: seconds from a node's fault to the first step trained again, by phase."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This product's restart phases: a SIGKILL once the background builds are done (the case of a
# restart at scale), measured at a clean commit on a quiet machine.
MEASURED = 'docs/results/restart_time_3proc_kill_at_40.json'
STALL = 'docs/results/stall_recovery_sigstop_default_idle.json'  # a hung host's detection


@dataclasses.dataclass(frozen=True)
class Restart:
  """A restart's phases (seconds; the restore as bytes over bandwidth) and where they come from."""
  detect_s: float = 0.0
  schedule_s: float = 0.0  # finding and booting a node (0: the survivors restart in place)
  process_start_s: float = 0.0  # process start and imports
  distributed_s: float = 0.0  # jax.distributed and mesh set-up
  restore_gb: float = 0.0  # state read per node
  restore_gbps: float = 1.0
  programs_s: float = 0.0  # compile, or load from the program store
  first_step_s: float = 0.0
  total_given_s: float | None = None  # a published total with no phases
  source: str = ''

  @property
  def total_s(self) -> float:
    if self.total_given_s is not None:
      return self.total_given_s
    return (self.detect_s + self.schedule_s + self.process_start_s + self.distributed_s
            + self.restore_gb / self.restore_gbps + self.programs_s + self.first_step_s)

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self), 'total_s': self.total_s}


def fast(step_s: float) -> Restart:
  """This product's restart, phase by phase (MEASURED, STALL), scaled where one CPU host of a
  tiny model cannot stand for a 400-node job of a 7B model (each scaled phase says so)."""
  phases = json.loads((ROOT / MEASURED).read_text())['median']
  detect = json.loads((ROOT / STALL).read_text())['detect_s']
  return Restart(
      detect_s=detect, schedule_s=0.0, process_start_s=phases['imports_s'],
      distributed_s=10.0, restore_gb=112.0, restore_gbps=50.0, programs_s=10.0,
      first_step_s=step_s,
      source=(f'measured: detection = a hung host seen at the stall deadline ({STALL}: '
              f'{detect:.1f} s; a process death is seen in 0.1 s), imports '
              f'{phases["imports_s"]:.1f} s ({MEASURED}); survivors restart in place (no '
              'scheduling). Scaled (assumed): jax.distributed of 400 processes 10 s (measured '
              f'{phases["distributed_s"]:.2f} s for 3); restore of a 7B model\'s fp32 state with '
              'AdamW (16 B/param, 112 GB per node) from the in-memory tier at 50 GB/s; programs '
              f'loaded from the program store 10 s (measured {phases["programs_s"]:.1f} s for '
              'tiny); the first step one step time'))


def profiles(step_s: float) -> dict[str, Restart]:
  return {
      'fast': fast(step_s),
      'FlashRecovery': Restart(total_given_s=150.0, source=(
          'FlashRecovery (arXiv 2509.03047): about 150 s to recover a job of 4,800 devices; '
          'published as a total')),
      'slow': Restart(total_given_s=660.0, source=(
          'arXiv 2605.09370: a median retry of 11 minutes on 504 B200s; published as a total')),
  }
