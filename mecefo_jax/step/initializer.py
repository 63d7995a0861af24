"""The initial train state: its program loaded from the program store or compiled, then run."""
from __future__ import annotations

import logging
import time
from typing import Sequence

import jax
from jax.sharding import Mesh

from mecefo_jax.config import Config
from mecefo_jax.model import train_state
from mecefo_jax.step import retarget
from mecefo_jax.step.program_store import booking, cache_hits, compiler_options, fingerprint, ProgramStore

log = logging.getLogger('mecefo')


def compile_or_load(lowered: jax.stages.Lowered, devices: Sequence,
                    program_store: ProgramStore | None,
                    model: str = '') -> tuple[jax.stages.Compiled, bool]:
  """(`lowered` as a program for `devices`, whether it came from the store): loaded from the
  store (keyed with the devices' ids and the `model`), else compiled and kept there."""
  key = program_store and fingerprint(lowered, devices, model)
  entry = program_store.read(key) if key else None
  if entry is not None:
    try:
      return entry.load_onto(devices), True
    except Exception as err:  # noqa: BLE001 -- private APIs: compile instead
      log.warning('loading the initializer from the store failed (%s: %s); compiling it',
                  type(err).__name__, err)
  hits = cache_hits()
  with booking():
    compiled = lowered.compile(compiler_options(program_store, devices) or None)
  # Not a program JAX's persistent cache gave back: on CPU its copy would lack its functions
  # (step/cache.py ProgramCache._compiled).
  if program_store is not None and cache_hits() == hits:
    program_store.write(key, retarget.Serialized.of(compiled, devices))
  return compiled, False


def create(cfg: Config, mesh: Mesh, program_store: ProgramStore | None = None,
           times: dict | None = None) -> train_state.TrainState:
  """A fresh state created directly in its shardings on `mesh`, returned once it exists.
  `times` gets init_lower_s, init_compile_s (compiled, or loaded from the store: init_loaded)
  and init_run_s (run until the state is there)."""
  t0 = time.perf_counter()
  lowered = train_state.lower_init(cfg, mesh)
  t1 = time.perf_counter()
  compiled, loaded = compile_or_load(lowered, list(mesh.devices.flat), program_store,
                                     cfg.model.kind)
  t2 = time.perf_counter()
  state = jax.block_until_ready(compiled(train_state.init_seed(cfg, mesh)))
  if times is not None:
    times.update(init_lower_s=t1 - t0, init_compile_s=t2 - t1,
                 init_run_s=time.perf_counter() - t2, init_loaded=loaded)
  return state
