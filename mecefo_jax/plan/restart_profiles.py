"""Named restart costs: seconds from a node's fault to the first step trained again, by phase."""
from __future__ import annotations

import dataclasses

from mecefo_jax.config import ConfigError
from mecefo_jax.plan import measured

# This product's restart phases (package data restart_phases): a SIGKILL once the background
# builds are done (the case of a restart at scale), measured at a clean commit on a quiet
# machine; ray_node_lost: a node lost on Ray, its detection.


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
  """This product's restart after a process death, phase by phase (package data
  restart_phases), scaled where one CPU host of a tiny model cannot stand for a 400-node job of
  a 7B model (marked `scaled`)."""
  phases = measured.fields('restart_phases')['median']
  ray = measured.fields('ray_node_lost')['median']
  kill, ray_node = measured.source('restart_phases'), measured.source('ray_node_lost')
  return Restart(
      detect_s=phases['detect_s'], schedule_s=0.0, process_start_s=phases['imports_s'],
      distributed_s=10.0, restore_gb=112.0, restore_gbps=50.0, programs_s=10.0,
      first_step_s=step_s,
      basis=(('detect_s', 'measured'), ('schedule_s', 'assumed'),
             ('process_start_s', 'measured'), ('distributed_s', 'scaled'),
             ('restore_s', 'scaled'), ('programs_s', 'scaled'), ('first_step_s', 'assumed')),
      source=(f'measured ({kill}, a SIGKILL of one of 3 processes): detection of the death '
              f'{phases["detect_s"]:.1f} s by the local supervisor (a node lost on Ray is seen in '
              f'{ray["seen_s"]:.1f} s, {ray_node}; a hung host only at the stall deadline), '
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


PHASES = ('detect_s', 'schedule_s', 'process_start_s', 'distributed_s', 'restore_gb',
          'restore_gbps', 'programs_s', 'first_step_s')


def _phases(text: str) -> dict[str, float]:
  """'detect_s=2,programs_s=30' -> {name: value}: names of PHASES, values >= 0."""
  values = {}
  for term in filter(None, (t.strip() for t in text.split(','))):
    name, _, value = (x.strip() for x in term.partition('='))
    try:
      values[name] = float(value)
    except ValueError:
      values[name] = -1.0
    if name not in PHASES or not values[name] >= 0:
      raise ConfigError(f'restart phase {term!r}: expected NAME=SECONDS >= 0 (restore_gb: GB, '
                        f"restore_gbps: GB/s), NAME one of {', '.join(PHASES)}")
  return values


def given(step_s: float, total_s: float | None = None, phases: str = '') -> Restart:
  """A restart the user states: `total_s` seconds in all, or `phases` ('detect_s=2,
  programs_s=30', the others as in `fast`)."""
  if total_s is not None:
    if not total_s >= 0:
      raise ConfigError(f'the restart cost must be >= 0 seconds, got {total_s:g}')
    return Restart(total_given_s=total_s, basis=(('total_s', 'given'),),
                   source=f'given: {total_s:g} s from a fault to the first step trained again')
  values, base = _phases(phases), fast(step_s)
  named = set(values) | ({'restore_s'} if {'restore_gb', 'restore_gbps'} & set(values) else set())
  basis = tuple((k, 'given' if k in named else b) for k, b in base.basis)
  return dataclasses.replace(base, **values, basis=basis, source=(
      'given: ' + ', '.join(f'{k} {v:g}' for k, v in values.items()) + '; the rest as in fast: '
      + base.source))
