"""Named restart costs: seconds from a node's fault to the first step trained again, by phase."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This product's restart phases: a SIGKILL once the background builds are done (the case of a
# restart at scale), measured at a clean commit on a quiet machine.
MEASURED = 'docs/results/restart_time_3proc_kill_at_40.json'
RAY_NODE = 'docs/results/restart_time_ray_node_killed_tiny.json'  # a node lost on Ray: its detection


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
  basis: tuple = ()  # (phase, 'measured' | 'assumed' | 'scaled' | 'published'), one per phase

  @property
  def total_s(self) -> float:
    if self.total_given_s is not None:
      return self.total_given_s
    return (self.detect_s + self.schedule_s + self.process_start_s + self.distributed_s
            + self.restore_gb / self.restore_gbps + self.programs_s + self.first_step_s)

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self), 'basis': dict(self.basis), 'total_s': self.total_s}


def fast(step_s: float) -> Restart:
  """This product's restart after a process death, phase by phase (MEASURED), scaled where one
  CPU host of a tiny model cannot stand for a 400-node job of a 7B model (marked `scaled`)."""
  phases = json.loads((ROOT / MEASURED).read_text())['median']
  ray = json.loads((ROOT / RAY_NODE).read_text())['median']
  return Restart(
      detect_s=phases['detect_s'], schedule_s=0.0, process_start_s=phases['imports_s'],
      distributed_s=10.0, restore_gb=112.0, restore_gbps=50.0, programs_s=10.0,
      first_step_s=step_s,
      basis=(('detect_s', 'measured'), ('schedule_s', 'assumed'),
             ('process_start_s', 'measured'), ('distributed_s', 'scaled'),
             ('restore_s', 'scaled'), ('programs_s', 'scaled'), ('first_step_s', 'assumed')),
      source=(f'measured ({MEASURED}, a SIGKILL of one of 3 processes): detection of the death '
              f'{phases["detect_s"]:.1f} s by the local supervisor (a node lost on Ray is seen in '
              f'{ray["seen_s"]:.1f} s, {RAY_NODE}; a hung host only at the stall deadline), '
              f'imports {phases["imports_s"]:.1f} s. Assumed: survivors restart in place (no '
              'scheduling); the first step one step time. Scaled: jax.distributed of 400 '
              f'processes 10 s (measured {phases["distributed_s"]:.2f} s for 3); restore of a 7B '
              "model's fp32 state with AdamW (16 B/param, 112 GB per node) from the in-memory "
              'tier at 50 GB/s; programs loaded from the program store 10 s (measured '
              f'{phases["programs_s"]:.1f} s for tiny)'))


def profiles(step_s: float) -> dict[str, Restart]:
  published = (('total_s', 'published'),)
  return {
      'fast': fast(step_s),
      'FlashRecovery': Restart(total_given_s=150.0, basis=published, source=(
          'FlashRecovery (arXiv 2509.03047): about 150 s to recover a job of 4,800 devices; '
          'published as a total')),
      'slow': Restart(total_given_s=660.0, basis=published, source=(
          'arXiv 2605.09370: a median retry of 11 minutes on 504 B200s; published as a total')),
  }
