"""The initial train state: its program loaded from the program store or compiled, then run."""
from __future__ import annotations

import functools
import logging
import time
from typing import Callable, Sequence

import jax
from jax.sharding import Mesh

from mecefo_jax.config import Config
from mecefo_jax.model import train_state
from mecefo_jax.step import retarget
from mecefo_jax.step.cache import compile_lowered
from mecefo_jax.step.program_store import covers_code, fingerprint, ProgramStore, recipe

log = logging.getLogger('mecefo')


def compile_or_load(lower: Callable[[], jax.stages.Lowered], devices: Sequence,
                    program_store: ProgramStore | None, model: str = '',
                    recipe: str | None = None) -> tuple[jax.stages.Compiled, bool]:
  """(the program `lower()` lowers, for `devices`; whether it came from the store): loaded from
  the store (by `recipe`'s alias without lowering where given, else by its fingerprint with the
  devices' ids and the `model`), else compiled and kept there."""
  lowered = functools.cache(lower)
  key = functools.cache(lambda: fingerprint(lowered(), devices, model))
  entry = program_store.lookup(recipe, key) if program_store else None
  program = _load(entry, devices) if entry is not None else None
  loaded = program is not None
  if not loaded:  # kept in the store unless JAX's persistent cache gave it (compile_lowered)
    program, serialized, _ = compile_lowered(lowered(), devices, program_store,
                                             serialize=program_store is not None)
    if serialized is not None:
      program_store.write(key(), serialized)
  if recipe and key.cache_info().currsize:  # lowered: the recipe's alias is known
    program_store.set_alias(recipe, key())
  return program, loaded


def _load(entry: retarget.Serialized, devices: Sequence) -> jax.stages.Compiled | None:
  try:
    return entry.load_onto(devices)
  except Exception as err:  # noqa: BLE001 -- private APIs: compile instead
    log.warning('loading the initializer from the store failed (%s: %s); compiling it',
                type(err).__name__, err)
    return None


def create(cfg: Config, mesh: Mesh, program_store: ProgramStore | None = None,
           times: dict | None = None) -> train_state.TrainState:
  """A fresh state created directly in its shardings on `mesh`, returned once it exists.
  `times` gets init_lower_s (0 where the store had it by its recipe), init_compile_s (compiled,
  or loaded from the store: init_loaded) and init_run_s (run until the state is there)."""
  devices, lower_s = list(mesh.devices.flat), []

  def lower() -> jax.stages.Lowered:
    t = time.perf_counter()
    lowered = train_state.lower_init(cfg, mesh)
    lower_s.append(time.perf_counter() - t)
    return lowered
  by_recipe = program_store and covers_code(cfg.model.kind)
  t0 = time.perf_counter()
  compiled, loaded = compile_or_load(
      lower, devices, program_store, cfg.model.kind,
      recipe(cfg, ('init', [d.id for d in devices]), dict(mesh.shape), optimizer=False)
      if by_recipe else None)
  t1 = time.perf_counter()
  state = jax.block_until_ready(compiled(train_state.init_seed(cfg, mesh)))
  if times is not None:
    times.update(init_lower_s=sum(lower_s, 0.0), init_compile_s=t1 - t0 - sum(lower_s, 0.0),
                 init_run_s=time.perf_counter() - t1, init_loaded=loaded)
  return state
