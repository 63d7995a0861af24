"""The learning-rate schedule (warmup, cosine decay) whose numbers are a program argument."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

f32 = np.float32


class Schedule(NamedTuple):
  """A schedule's numbers, an argument of the programs that apply the optimizer, so that runs
  of other lengths or learning rates share those programs (docs/programs.md). Each is folded
  on the host as XLA folds the constants of optax's `warmup_cosine_decay_schedule`, so the
  rates are optax's to the bit (tests/test_schedule.py)."""
  warmup: np.ndarray  # int32: warmup steps
  warmup_inv: np.ndarray  # 1 / warmup (0 without warmup)
  rise: np.ndarray  # the warmup's start minus the peak
  peak: np.ndarray  # the peak learning rate
  decay_len: np.ndarray  # steps of the cosine decay
  turn: np.ndarray  # pi / decay_len: the cosine's argument per step
  floor: np.ndarray  # the decay's end as a share of the peak (alpha)
  half_keep: np.ndarray  # (1 - floor) / 2


def schedule_of(lr: float, warmup_steps: int, steps: int, min_lr_ratio: float) -> Schedule:
  """The numbers of a warmup of min(warmup_steps, steps) steps from lr / (warmup + 1) to `lr`,
  then a cosine decay to lr · min_lr_ratio at `steps` (at least one step of it)."""
  warmup = min(warmup_steps, steps)
  decay_len = f32(max(steps, warmup + 1) - warmup)
  floor = 0.0 if lr == 0.0 else lr * min_lr_ratio / lr  # in doubles, as optax's alpha
  return Schedule(
      warmup=np.int32(warmup), warmup_inv=f32(1) / f32(warmup) if warmup else f32(0),
      rise=f32(lr / (warmup + 1) - lr), peak=f32(lr), decay_len=decay_len,
      turn=f32(np.pi) * (f32(1) / decay_len), floor=f32(floor), half_keep=f32(0.5) * f32(1 - floor))


def abstract_schedule() -> Schedule:
  """The argument's shapes and dtypes: scalars, the same for every schedule."""
  return Schedule(*(jax.ShapeDtypeStruct((), np.asarray(v).dtype)
                    for v in schedule_of(1.0, 1, 2, 0.0)))


def learning_rate(count: jax.Array, s: Schedule) -> jax.Array:
  """The rate at optimizer step `count` (int32). The operations are those XLA leaves of optax's
  schedule once it has folded the constants (divisions become products by reciprocals, the
  cosine's pi / length and the decay's 0.5 · (1 - alpha) one factor each)."""
  warm_at = jnp.clip(count, 0, s.warmup).astype(jnp.float32)
  warm = s.rise * (1 - warm_at * s.warmup_inv) + s.peak
  decay_at = jnp.minimum((count - s.warmup).astype(jnp.float32), s.decay_len)
  decayed = (jnp.cos(decay_at * s.turn) + 1) * s.half_keep + s.floor
  return jnp.where(count < s.warmup, warm, decayed * s.peak)
