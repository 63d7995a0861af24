"""The programs a replayed step requests from the controller's program cache, and what building
them costs: a compile for each new shape, a move for each new set of slices of a compiled one."""
from __future__ import annotations

import dataclasses
from typing import Callable

from mecefo_jax.model import bases
from mecefo_jax.step import cache


@dataclasses.dataclass(frozen=True)
class RunPrograms:
  """What besides the roles decides the programs a run's steps request: its config."""
  ordered_reduce: bool = False  # mesh.ordered_reduce: never the fused step under failure
  refresh: str | None = None  # svd bases: mecefo.refresh ('warm' | 'full'); None: no refresh
  evals: bool = False  # train.eval_every > 0

  @classmethod
  def of(cls, cfg) -> 'RunPrograms':
    svd = bases.kind(cfg).refresh is not None
    return cls(cfg.mesh.ordered_reduce, cfg.mecefo.refresh if svd else None,
               cfg.train.eval_every > 0)


def program_requests(live: tuple[int, ...], roles: dict, run: RunPrograms,
                     refreshed: bool) -> list[tuple]:
  """The programs (kind, slices, *args) that steps on `live` request from the controller's
  program cache, given the planner's `roles`: the step's own (cache.step_keys); where a slice
  degrades, the svd refresh, from scratch the first time (`refreshed` False) and warm after
  (unless mecefo.refresh=full); the eval. The controller refreshes every tau steps and evals
  every train.eval_every steps on whatever set is live then: these are the requests of a
  live set that lasts that long (the first degraded one: its first refresh and the warm one
  tau steps later)."""
  keys = cache.step_keys(live, roles, run.ordered_reduce)
  if run.refresh and any(r.degraded for r in roles.values()):
    warm = run.refresh == 'warm'
    if not (warm and refreshed):
      keys.append(('refresh', live, False))
    if warm:
      keys.append(('refresh', live, True))
  if run.evals:
    keys.append(('eval', live))
  return keys


class ProgramLedger:
  """What building the requested programs costs, as step/cache.py's ProgramCache builds them:
  with moving on, a compile for each new shape (cache.shape_of) and a move for each new
  request of a shape compiled before; with moving off, a compile for each new request."""

  def __init__(self, compile_s: Callable[[tuple], float], move_s: float, move: bool, built=()):
    """`compile_s(key)`: compile seconds of a request; `built`: requests built before the
    window (the fault-free run's), not charged."""
    self.compile_s, self.move_s, self.move = compile_s, move_s, move
    self.stats = {'compiled': 0, 'compiled_s': 0.0, 'moved': 0, 'moved_s': 0.0}
    self.forget()
    self._built.update(built)
    self._shapes.update(map(cache.shape_of, self._built))

  def forget(self) -> None:
    """A fresh process: nothing is built, the bases were never refreshed."""
    self._built, self._shapes, self.refreshed = set(), set(), False

  def charge(self, keys) -> float:
    """Seconds to build the programs of `keys` that are not built yet (booked in stats)."""
    spent = 0.0
    for key in keys:
      if key in self._built:
        continue
      self._built.add(key)
      self.refreshed |= key[0] == 'refresh'
      shape = cache.shape_of(key)
      if self.move and shape in self._shapes:
        spent += self._book('moved', self.move_s)
      else:
        self._shapes.add(shape)
        spent += self._book('compiled', self.compile_s(key))
    return spent

  def _book(self, what: str, seconds: float) -> float:
    self.stats[what] += 1
    self.stats[f'{what}_s'] += seconds
    return seconds
