"""How long a process may go without a new progress mark: the stall watch's deadlines
(mecefo_jax/watch.py reads a job's marks against them; a process whose supervisor is gone reads
its own, run/supervised.py).

  training    STEP_FACTOR x the longest recent step (dispatch to dispatch), at least STEP_FLOOR_S;
              the start-up allowance until STEPS_TIMED steps are timed
  compiling, evaluating, saving (each kind of save apart)
              PHASE_FACTOR x the longest spent in it, at least PHASE_FLOOR_S;
              PHASE_FIRST_S until one has ended
  start-up    (starting, compiling before the first step) START_FACTOR x the longest start-up
              of an earlier start of the job, at least START_FLOOR_S; START_FIRST_S at the first
  a wait for the saves or builds in flight, the run's end (NOT_MEASURED): PHASE_FIRST_S

docs/tpu.md says why these numbers.
"""
from __future__ import annotations

from mecefo_jax.records.progress_marks import ProgressMark

STEP_FACTOR, STEP_FLOOR_S, STEPS_TIMED = 10.0, 10.0, 3
PHASE_FACTOR, PHASE_FLOOR_S, PHASE_FIRST_S = 5.0, 10.0, 300.0
START_FACTOR, START_FLOOR_S, START_FIRST_S = 3.0, 60.0, 900.0
# Phases whose length no earlier one bounds: a wait for the saves or builds in flight (`*/wait`:
# an async durable write of any size, background compiles), the run's end (the final save, the
# report, the plot).
NOT_MEASURED = ('ending',)


def allowance(key: str, measured: dict[str, float], step_s: float | None,
              stall_s: float | None) -> tuple[float, str]:
  """(The seconds a process may stay in phase `key` without a new mark, what set them):
  `measured`: the job's longest time in each phase key; `step_s`: its longest recent step,
  None until timed; `stall_s`: --stall-s, which makes every deadline its own."""
  if stall_s:
    return stall_s, '--stall-s'
  if key == 'training':
    if step_s is not None:
      return max(STEP_FLOOR_S, STEP_FACTOR * step_s), 'measured'
    key = 'start-up'  # the first steps: their programs may still be loading
  if key in ('starting', 'compiling/start-up', 'start-up'):
    seen = measured.get('start-up')
    return ((max(START_FLOOR_S, START_FACTOR * seen), 'measured') if seen else
            (START_FIRST_S, 'first'))
  seen = None if key in NOT_MEASURED or key.endswith('/wait') else measured.get(key)
  return ((max(PHASE_FLOOR_S, PHASE_FACTOR * seen), 'measured') if seen else
          (PHASE_FIRST_S, 'first'))


def phase_key(mark: ProgressMark | None) -> str:
  """The phase key `mark` is timed as ('starting' where there is none yet)."""
  if mark is None:
    return 'starting'
  if mark.step < 0 and mark.phase == 'compiling':
    return 'compiling/start-up'
  return mark.key


def step_s(mark: ProgressMark) -> float | None:
  """Its longest recent step, once STEPS_TIMED are timed; else None."""
  return mark.step_s if mark.steps_timed >= STEPS_TIMED else None


def own_deadline(mark: ProgressMark | None) -> float:
  """The seconds one process may go without a new mark by its own measures (its mark's longest
  phases and steps): what a process whose supervisor is gone allows itself."""
  if mark is None:
    return START_FIRST_S
  return allowance(phase_key(mark), mark.longest, step_s(mark), None)[0]
