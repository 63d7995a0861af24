"""The learning-rate schedule as a program argument gives optax's rates to the bit."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mecefo_jax.ops.schedule import learning_rate, schedule_of


def _optax_rates(lr, warmup_steps, steps, min_lr_ratio, counts):
  """What make_optimizer compiled before the schedule became an argument: optax's schedule,
  its numbers constants of the program (XLA folds them), negated as optax.adamw applies it."""
  warmup = min(warmup_steps, steps)
  schedule = optax.warmup_cosine_decay_schedule(lr / (warmup + 1), lr, warmup,
                                                max(steps, warmup + 1), end_value=lr * min_lr_ratio)
  return np.asarray(jax.jit(lambda c: -1 * schedule(c))(counts))


_as_argument = jax.jit(lambda c, s: -1 * learning_rate(c, s))  # one program for every schedule


def test_the_schedule_as_an_argument_gives_optaxs_rates_to_the_bit():
  """Every count of short schedules and both ends of long ones, for warmups longer and
  shorter than the run, none, and decays to 0, to the peak and between."""
  for lr, warmup, steps, ratio in itertools.product([3e-3, 0.5], [20, 0, 7], [200, 1, 33, 1000],
                                                    [0.1, 0.0, 1.0]):
    counts = jnp.asarray([*range(min(steps, 300) + 3), *range(max(steps - 40, 300), steps + 3)],
                         jnp.int32)
    want = _optax_rates(lr, warmup, steps, ratio, counts)
    got = np.asarray(_as_argument(counts, schedule_of(lr, warmup, steps, ratio)))
    assert np.array_equal(got.view(np.int32), want.view(np.int32)), (lr, warmup, steps, ratio)


def test_a_learning_rate_of_zero_trains_nothing():
  rates = _as_argument(jnp.arange(30, dtype=jnp.int32), schedule_of(0.0, 5, 20, 0.1))
  assert not np.asarray(rates).any()
