"""The executor: carries out the decider's step plans on devices (state, batches, programs)."""
from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np

from mecefo_jax import multihost, sharding
from mecefo_jax.config import Config
from mecefo_jax.core.decider import StepPlan
from mecefo_jax.core.programs import REJOIN, ProgramKey
from mecefo_jax.core.roles import Role, slice_list
from mecefo_jax.core.takeover import SliceWork
from mecefo_jax.data import order
from mecefo_jax.model.train_state import (at_schedule_count, params_sha256, schedule_count,
                                          schedule_on, state_shardings)
from mecefo_jax.step import slice_steps, train_step
from mecefo_jax.step.cache import ProgramCache


class AllSlicesDown(RuntimeError):
  pass


class Executor:
  """Holds the train state on the slices that hold it and runs each plan's programs there."""

  def __init__(self, cfg: Config, slices: sharding.PresentSlices, programs: ProgramCache,
               corpus, n_slices: int, state, book: Callable[[str, float], None]):
    """`slices`: the run's present slices (logical id -> devices); `book(bucket, seconds)`:
    the goodput ledger's, for the rejoin copies."""
    self.cfg, self.programs, self.corpus, self.n_slices = cfg, programs, corpus, n_slices
    self.submesh = slices.sub  # logical slice ids -> the mesh of their devices
    self.state, self.state_slices = state, slices.ids
    self._book = book
    self._schedule_at: int | None = None  # the schedule's count now, where this process knows it
    self._schedule: tuple = (None, None)  # (live set, the numbers on its devices)

  def place(self, live: tuple[int, ...]) -> None:
    """Moves the state onto exactly the live slices: a view when shrinking, a copy on rejoin."""
    if live == self.state_slices:
      return
    keep = tuple(s for s in self.state_slices if s in live)
    if not keep:
      raise AllSlicesDown(
          f'no live slice holds the training state: slices {slice_list(self.state_slices)} held it '
          f'and are all down')
    if keep != self.state_slices:
      self.state = slice_steps.state_view(self.cfg, self.state, self.submesh(keep))
    if keep != live:
      # Rejoin: the repaired slices receive the current state from live peers.
      t0 = time.perf_counter()
      target = state_shardings(self.cfg, self.submesh(live))
      if multihost.is_multiprocess():
        # A program like the step's: the index of the slice the copies come from is its shape.
        copy = self.programs.program(ProgramKey(REJOIN, live, live.index(keep[0])))
        self.state = copy(multihost.stack_for_rejoin(self.state, target))
      else:
        self.state = jax.device_put(self.state, target)
      self.state = jax.block_until_ready(self.state)
      self._book('rejoin', time.perf_counter() - t0)
    self.state_slices = live

  def run(self, plan: StepPlan) -> dict | None:
    """Runs `plan`: the state placed on its live slices, the basis refresh, the step. Returns
    the metrics (device scalars), None where this process holds no live slice."""
    live = plan.live
    self.place(live)
    local = multihost.is_local(self.submesh(live))
    if plan.refresh is not None:
      refresh = self.programs.program(plan.refresh)
      if local:
        self.state = refresh(self.state)
    if plan.first_id is not None:
      self._schedule_by_samples(plan.first_id, local)
    programs = self.programs.step_programs(plan.programs)
    b = self.cfg.train.micro_batch
    ids_SxB = (order.sample_ids(plan.step, self.n_slices, b) if plan.first_id is None
               else order.stream_ids(plan.first_id, live, self.n_slices, b))
    work = plan.assignment.work
    if programs.fused is None:
      return self._run_groups(live, programs, work, ids_SxB)
    if not local:
      return None  # multi-process: the processes holding the live slices run it
    role = plan.roles[live[0]]
    self.state, metrics = programs.fused(self.state, self._batch(ids_SxB, work, live, role),
                                         self._schedule_on(live))
    return metrics

  def _schedule_on(self, live: tuple[int, ...]):
    """The learning rate's numbers, an argument of the programs that apply the optimizer, on
    the devices of `live` (placed again when the live set changes)."""
    if self._schedule[0] != live:
      self._schedule = (live, schedule_on(self.cfg, self.submesh(live)))
    return self._schedule[1]

  def _schedule_by_samples(self, first_id: int, local: bool) -> None:
    """`requeue`: the learning-rate schedule at the samples trained, in global batches of every
    slice (the optimizer counts steps, and a step on fewer slices trains fewer samples). Without
    failures the two agree and nothing is set."""
    if not local:  # this process does not step now; a rejoin copies the count from a peer
      self._schedule_at = None
      return
    at = first_id // (self.n_slices * self.cfg.train.micro_batch)
    if self._schedule_at is None:  # once per start or rejoin: the count of a resumed state
      self._schedule_at = int(np.asarray(schedule_count(self.state.opt_state).addressable_data(0)))
    if at != self._schedule_at:
      put = lambda c: jax.make_array_from_callback((), c.sharding,
                                                   lambda _: np.asarray(at, c.dtype))
      self.state = self.state._replace(opt_state=at_schedule_count(self.state.opt_state, put))
    self._schedule_at = at + 1  # the step moves it by one

  def _run_groups(self, live, programs, work, ids_SxB) -> dict | None:
    outputs = []
    for role, slices, program in programs.groups:
      if not multihost.is_local(self.submesh(slices)):
        continue  # multi-process: another process runs this group
      state_view = slice_steps.state_view(self.cfg, self.state, self.submesh(slices))
      outputs.append(program(state_view, self._batch(ids_SxB, work, slices, role)))
    if not outputs:
      return None
    # Each slice's sums stay on its devices; the stack over the live mesh places them by device.
    sums = slice_steps.stack_groups(outputs, self.cfg, self.submesh(live))
    self.state, metrics = programs.update(self.state, sums, self._schedule_on(live))
    return metrics

  def _batch(self, ids_SxB, work, slices, role: Role) -> jax.Array:
    """Tokens of `slices` on their devices; each process makes only the rows it holds."""
    mesh = self.submesh(slices)
    return multihost.put_batch(lambda ss: self._tokens(ids_SxB, [work[slices[i]] for i in ss]),
                               train_step.batch_shape(self.cfg, len(slices), role),
                               sharding.batch_sharding(mesh))

  def _tokens(self, ids_SxB, works: list[SliceWork]) -> np.ndarray:
    """[len(works), rows, L + 1]: every slice's rows made in one call (each row is a function of
    its id alone, so the tokens are those of one call a slice)."""
    ids = [ids_SxB[r.owner, r.start:r.stop] for w in works for r in (*w.exact, *w.degraded)]
    rows = self.corpus.sequences(np.concatenate(ids))
    return rows.reshape(len(works), -1, rows.shape[-1])

  def replica_hashes(self) -> dict[int, str]:
    """params_sha256 of the params held by each live slice (bit-identical replicas hash equal)."""
    view = lambda s: slice_steps.state_view(self.cfg, self.state, self.submesh((s,)))
    return {s: params_sha256(view(s).params) for s in self.state_slices}
