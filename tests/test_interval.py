"""snapshot.every: auto: the interval rule under injected costs (this CPU is too noisy for 1%)."""

import pytest

from mecefo_jax.snapshot.interval import IntervalTuner, smallest_interval
from mecefo_jax.run.parts import StartMode

@pytest.mark.parametrize('cost, step, budget, cap, expected', [
    (0.05, 1.0, 0.01, 100, 5), (0.3, 1.0, 0.01, 100, 30), (0.3, 0.1, 0.01, 100, 100),
    (0.0, 1.0, 0.01, 100, 1), (0.009, 1.0, 0.01, 100, 1), (0.01, 1.0, 0.01, 100, 1)])
def test_the_smallest_interval_that_meets_the_budget(cost, step, budget, cap, expected):
  k = smallest_interval(cost, step, budget, cap)
  assert k == expected
  assert k == cap or cost / (k * step) <= budget + 1e-12  # meets it ...
  assert k == 1 or cost / ((k - 1) * step) > budget  # ... and one less would not

def simulate(tuner: IntervalTuner, steps: int, idle_s: float, wait_s: float,
             background_s: float, slowdown: float) -> list[int]:
  """A loop whose saves cost `wait_s` in the step and `background_s` of work beside the next
  steps, which run `slowdown` times slower while it lasts; returns the interval proposed at
  each proposal."""
  proposals, left = [], 0.0
  for step in range(1, steps + 1):
    busy = left > 0
    wall = idle_s
    if busy:  # the background work runs beside this step, slowing it
      done = min(left, idle_s * slowdown)
      wall = idle_s + done * (1 - 1 / slowdown)
      left -= done
    saved = step % tuner.every == 0
    if saved:
      wall += wait_s
      left = background_s
    tuner.observe(wall, saved, busy)
    if tuner.due():
      proposals.append(tuner.propose())
  return proposals

@pytest.mark.parametrize('idle, wait, background, slowdown', [
    (1.0, 0.02, 0.3, 1.5), (0.2, 0.01, 0.5, 2.0), (0.05, 0.0, 0.05, 1.2), (2.0, 0.1, 1.0, 3.0)])
def test_the_tuner_finds_an_interval_at_most_twice_the_smallest(idle, wait, background,
                                                                slowdown):
  # The cost a save really adds per period: its wait plus what its background work slows.
  cost = wait + background * (1 - 1 / slowdown)
  best = smallest_interval(cost, idle, 0.01, 200)
  tuner = IntervalTuner(budget=0.01, max_every=200, start=1)
  proposals = simulate(tuner, 20000, idle, wait, background, slowdown)
  assert proposals and best <= proposals[-1] <= 2 * best, (best, proposals[-8:])
  assert tuner.cost_s == pytest.approx(cost, rel=0.05)

def test_an_interval_never_exceeds_max_every_and_starts_probing_when_no_step_is_idle():
  tuner = IntervalTuner(budget=0.01, max_every=16, start=1, periods=2)
  # Every step beside a save (background longer than the interval): no idle step to compare.
  for _ in range(6):
    tuner.observe(1.2, True, True)
  assert tuner.due() and tuner.propose() == 2  # doubles to find idle steps
  proposals = simulate(tuner, 4000, 1.0, 0.5, 5.0, 2.0)  # a costly save: the cap holds
  assert proposals and set(proposals[-3:]) == {16}


def test_a_cost_measured_at_zero_halves_the_interval_instead_of_dropping_it_to_one():
  """A loaded machine's noise can hide a snapshot's cost (the idle steps' median above the
  periods'): seen in a suite run, where auto went 8 -> 1 -> 20. Each re-measure of a zero cost
  halves the interval; a real cost raises it at once."""
  tuner = IntervalTuner(budget=0.01, max_every=100, start=8, periods=1)
  proposals = []
  for _ in range(4):
    for step in range(tuner.every):
      tuner.observe(1.0, step == 0, False)  # no step slower than an idle one: cost 0
    tuner.observe(1.0, True, False)
    proposals.append(tuner.propose())
  assert tuner.cost_s == 0 and proposals == [4, 2, 1, 1]
  assert simulate(tuner, 400, 1.0, 0.3, 0.0, 1.0)[-1] == 30  # 0.3 s a save: up in one move


def test_a_run_with_auto_measures_sets_and_reports_its_interval(tmp_path):
  from mecefo_jax.config import load_config
  from mecefo_jax.run.trainer import Trainer
  from procs import TINY, suite_store
  cfg = load_config(None, [*TINY, 'mesh.slice=2', 'train.steps=60', 'train.eval_every=0',
                           'snapshot.every=auto', 'snapshot.max_every=20',
                           f'snapshot.dir={tmp_path}/shm', 'snapshot.durable_every=0'])
  trainer = Trainer(cfg, tmp_path / 'run', progress='quiet',
                    start=StartMode(program_store=suite_store()))
  try:
    result = trainer.run()
  finally:
    trainer.close()
  interval = result['snapshot_interval']
  assert interval['auto'] and interval['budget'] == 0.01 and interval['max_every'] == 20
  # Saves every 8 steps from the start; after 4 save-to-save periods (step 40) the tuner sets
  # the interval from what it measured, and again after each 4 periods of the interval it set
  # (a cost measured at 0 on a loaded machine sets 1, re-measured 4 steps later; seen here).
  changes, every = interval['changes'], interval['every']
  assert changes and changes[0][0] == 40 and changes[-1][1] == every, changes
  assert all(1 <= e <= 20 for _, e in changes), changes
  assert interval['idle_step_s'] > 0 and interval['cost_s'] is not None
  assert result['snapshots']['every'] == every
  proposed, saves = _replayed(changes, steps=60)
  assert proposed == [step for step, _ in changes]
  assert result['snapshots']['saved'] == saves


def _replayed(changes, steps, periods=4):
  """The steps at which the tuner proposes, and the snapshots saved, for the intervals it set
  (`changes`): a save at each multiple of the interval, the last step's as the final state's."""
  from mecefo_jax.snapshot.interval import START
  every, closed, proposed, saves = START, -1, [], 1  # the first period starts at a save
  intervals_set = (e for _, e in changes)
  for step in range(1, steps + 1):
    if step % every:
      continue
    saves += step < steps
    closed += 1
    if closed == periods:
      proposed.append(step)
      every, closed = next(intervals_set, every), 0
  return proposed, saves
