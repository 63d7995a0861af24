"""The runs quality.py and quality_trace.py share: one training run evaluated on the fixed
held-out set, the increase over the fault-free run, a schedule's statistics."""
from __future__ import annotations

import tempfile
from pathlib import Path


def _cfg(args, policy: str, extra: tuple[str, ...] = ()):
  from mecefo_jax.config import load_config
  from mecefo_jax.plan.runs import policy_spec
  data = [f'train.data={args.data}'] if args.data else []
  takeover, budget = policy_spec('neighbor' if policy == 'fault-free' else policy)
  budget = [] if budget is None else [f'faults.time_budget={budget}']
  return load_config(args.config, [f'mesh.slice={args.slices}', 'mesh.fsdp=1', 'mesh.tensor=1',
                                   'snapshot.enabled=false', f'faults.takeover={takeover}',
                                   *data, *args.overrides, *budget, *extra])


def train(args, policy: str, schedule, extra: tuple[str, ...] = ()) -> dict:
  """One run (`extra`: overrides after the policy's); its final params evaluated on the fixed
  held-out set."""
  import jax

  from mecefo_jax.run.parts import StartMode
  from mecefo_jax.run.trainer import Trainer
  from mecefo_jax.step.program_store import open_store
  cfg = _cfg(args, policy, extra)
  # The program store train.py opens: the runs of one invocation (policies, seeds) and of the
  # next load the programs they share instead of compiling them again. And, as train.py leaves
  # it, JAX's own persistent cache off: a program that cache gave is neither stored nor aliased
  # (step/cache.py compile_lowered), so every run of this process lowered it again (the suite's
  # trace-mode test: each of its 2 seeds x 3 runs lowered the same 4-slice program).
  jax.config.update('jax_enable_compilation_cache', False)
  start = StartMode(program_store=open_store(cfg.train.compile_cache, cfg.train.program_store_mb))
  with tempfile.TemporaryDirectory() as out:
    trainer = Trainer(cfg, Path(out), schedule, start=start)
    report = trainer.run()
    if report.get('stopped'):  # its final loss would not be comparable with the others'
      raise RuntimeError(f'{policy} run stopped early: {report["stopped"]}')
    run = {k: report.get(k) for k in ('steps', 'final_loss', 'wall_s', 'samples', 'goodput',
                                      'params_sha256', 'losses', 'evals', 'compile_s')}
    # Fixed held-out rows of all n slices, whichever are live at the end: comparable runs.
    run['eval_loss'] = trainer.evaluate(args.eval_batches)
  return run


def mean_std_sem(xs) -> dict:
  """Mean, sample std and standard error over seeds (std and sem 0 for one seed), and the 95%
  interval of the mean (`t_interval`)."""
  import numpy as np
  x = np.asarray(xs, dtype=float)
  std = float(x.std(ddof=1)) if len(x) > 1 else 0.0
  return {'mean': float(x.mean()), 'std': std, 'sem': std / float(np.sqrt(len(x))),
          'ci95': t_interval(x)}


def t_interval(xs) -> list[float] | None:
  """The 95% interval of the mean of paired per-seed differences: mean +- t(0.975, n-1) * sem
  (Student's t: a handful of seeds, each difference a seed's run against its own fault-free
  run); None for one seed."""
  import numpy as np
  from scipy import stats
  x = np.asarray(xs, dtype=float)
  if len(x) < 2:
    return None
  half = float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x)))
  return [float(x.mean()) - half, float(x.mean()) + half]


def _relative(runs: dict, base: dict) -> None:
  import numpy as np
  for r in runs.values():
    r['perplexity'] = float(np.exp(r['eval_loss']))
    r['eval_increase_pct'] = 100.0 * (r['eval_loss'] / base['eval_loss'] - 1.0)
    r['ppl_increase_pct'] = 100.0 * (np.exp(r['eval_loss'] - base['eval_loss']) - 1.0)
  base.setdefault('perplexity', float(np.exp(base['eval_loss'])))


def live_counts(schedule, n: int, steps: int) -> list[int]:
  """Live slices at each step, as the controller sees them (a step's events apply first)."""
  return [n - len(failed) for failed in schedule.failed_sets(steps)]


def schedule_stats(schedule, n: int, steps: int) -> dict:
  live = live_counts(schedule, n, steps)
  return {'failures': sum(e.kind == 'fail' for e in schedule.all_events()),
          'steps_with_failure_frac': sum(x < n for x in live) / steps,
          'mean_down_slices': n - sum(live) / steps, 'min_live': min(live),
          'live_per_step': live, 'events': [e.to_dict() for e in schedule.all_events()]}
