"""The replay's cost model: seconds of each program, measured or predicted per role."""
from __future__ import annotations

import dataclasses
import re
import statistics

import numpy as np

from mecefo_jax.config import ConfigError
from mecefo_jax.core import programs
from mecefo_jax.core.programs import ProgramKey
from mecefo_jax.core.roles import Role

ROLE_NAME = r'e(\d+)_d(\d+)_p(\d+)'  # a role's name in a measurement: role_name


def role_name(r: Role) -> str:
  return f'e{r.exact}_d{r.degraded}_p{r.passes}'


def features(role: Role) -> list[float]:
  """Linear model: program overhead + exact rows + degraded passes + degraded rows."""
  degraded = role.degraded > 0
  return [1.0, role.exact, role.passes if degraded else 0.0, role.degraded]


def fit(costs: dict[Role, float]) -> np.ndarray:
  """Least-squares coefficients of `features` from measured role costs."""
  roles = sorted(costs)
  a = np.asarray([features(r) for r in roles])
  return np.linalg.lstsq(a, np.asarray([costs[r] for r in roles]), rcond=None)[0]


def predict(coef: np.ndarray, role: Role) -> float:
  return float(np.dot(coef, features(role)))


@dataclasses.dataclass
class ClusterCosts:
  """Seconds, measured on one slice. Group programs run per slice, then one update program."""
  normal_s: float  # fused normal step: fault-free, and any step where all live slices are normal
  update_s: float  # cross-slice update program (the §3 combine + optimizer) after the groups
  group_s: dict[Role, float]  # per-slice contribution program of each role
  group_compile_s: dict[Role, float]
  fused_compile_s: float  # also charged for the fused step of any other role
  # Compile seconds of every other kind of program, by kind name (core/programs.py KINDS).
  compile_s_by_kind: dict[str, float] = dataclasses.field(default_factory=dict)
  refresh_s: float = 0.0  # svd bases refresh, run before the steps where the decider plans one
  move_s: float = 0.0  # a compiled program moved onto other slices (step/retarget.py)
  rejoin_s: float = 0.0  # state copy onto a repaired slice
  restore_s: float = 0.0  # checkpoint-restart: restore of a durable checkpoint on restart
  modelled: set = dataclasses.field(default_factory=set)  # roles whose cost is predicted

  def complete(self, roles: set[Role]) -> 'ClusterCosts':
    """Fills roles not measured from the linear fit (and mean compile time); marks them modelled."""
    missing = set(roles) - set(self.group_s)
    if not missing:
      return self
    if not hasattr(self, '_fit'):  # of the measured roles only, once
      measured = {r: s for r, s in self.group_s.items() if r not in self.modelled}
      self._fit = (fit(measured), float(np.mean([self.group_compile_s[r] for r in measured])))
    coef, compile_mean = self._fit
    for r in missing:
      self.group_s[r] = predict(coef, r)
      self.group_compile_s[r] = compile_mean
    self.modelled |= missing
    return self

  def group(self, role: Role) -> float:
    """Seconds of `role`'s group program: measured, else predicted (and then kept)."""
    found = self.group_s.get(role)
    return self.complete({role}).group_s[role] if found is None else found

  def group_compile(self, role: Role) -> float:
    return self.complete({role}).group_compile_s[role]

  def compile_of(self, key: ProgramKey) -> float:
    """Compile seconds of the program `key`: a group program by its role, a fused step as the
    fused normal one, any other kind by its name."""
    if key.kind is programs.GROUP:
      return self.group_compile(key.variant)
    if key.kind is programs.FUSED:
      return self.fused_compile_s
    return self.compile_s_by_kind[key.kind.name]

  def to_json(self) -> dict:
    roles = [{'exact': r.exact, 'degraded': r.degraded, 'passes': r.passes,
              'step_s': self.group_s[r], 'compile_s': self.group_compile_s[r],
              'modelled': r in self.modelled}
             for r in sorted(self.group_s)]
    scalars = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ('group_s', 'group_compile_s', 'modelled')}
    return {**scalars, 'roles': roles}


def costs_from(measurement: dict, stat: str) -> ClusterCosts:
  """Cluster costs from the timed programs: `stat` ('median' or 'min') of the repeats, or
  'flops': a compute-bound device, each program's XLA FLOP count x the measured median seconds
  per FLOP of the fused normal step (rejoin, restore and compiles stay measured). XLA counts a
  loop body once, so multi-pass roles are left to the cost model there."""
  t = {k: v['min_s' if stat == 'min' else 'median_s'] for k, v in measurement['times'].items()}
  if stat == 'flops':
    if 'flops' not in measurement:
      raise ConfigError('step costs by FLOPs (--stat flops) need a measurement with FLOP counts '
                        '(failure_throughput of this version)')
    flops = measurement['flops']
    per_flop = t['fused_normal'] / flops['fused_normal']
    t |= {name: f * per_flop for name, f in flops.items()}
  compile_s = measurement['compile_s']
  roles = {Role(*map(int, re.fullmatch(ROLE_NAME, name).groups())): name
           for name in measurement['roles']}
  if stat == 'flops':
    roles = {r: name for r, name in roles.items() if r.passes == 1}
  return ClusterCosts(
      normal_s=t['fused_normal'], update_s=t['update'],
      group_s={r: t[name] for r, name in roles.items()},
      group_compile_s={r: compile_s[name] for r, name in roles.items()},
      fused_compile_s=compile_s['fused_normal'],
      # 'refresh' is the refresh a run repeats (warm unless mecefo.refresh=full), 'refresh_full'
      # the first one from scratch where they differ.
      compile_s_by_kind={
          'update': compile_s['update'], 'refresh_warm': compile_s.get('refresh', 0.0),
          'refresh_cold': compile_s.get('refresh_full', compile_s.get('refresh', 0.0)),
          'eval': compile_s['eval']},
      refresh_s=t.get('refresh', 0.0), move_s=statistics.mean(measurement['move_s'].values()),
      rejoin_s=t['rejoin'],
      # Older measurements have no durable restore: the rejoin copy, a lower bound, stands in.
      restore_s=measurement.get('restore_s', t['rejoin']))
