"""report.json's schema (its keys here, its sections from their owners), checked: docs/report.md."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Literal

from mecefo_jax import sections
from mecefo_jax.config import COMPUTE_DTYPES
from mecefo_jax.core.decider import Plans
from mecefo_jax.core.failures import AppliedEvent, FailureEvent
from mecefo_jax.core.goodput import Seconds
from mecefo_jax.records.history import Recovery, Rollback
from mecefo_jax.records.job import BAD_INPUT, command
from mecefo_jax.records.metrics import Eval, EvalRow, TrainRow
from mecefo_jax.run.startup import Startup
from mecefo_jax.sections import entry
from mecefo_jax.snapshot.interval import SnapshotInterval
from mecefo_jax.snapshot.manager import Snapshots
from mecefo_jax.step.cache import Programs
from mecefo_jax.step.precompile import Precompile

SCHEMA_VERSION = 12  # 2: precompile section; 3: programs section; 4: programs.store, loaded;
# 5: steps_lost_total, preempted includes --stop-after and the supervisor's stop request;
# 6: snapshot_interval, compute_dtype (model.compute_dtype resolved on the run's backend);
# 7: startup section (the start-up clock), startup.init_loaded, programs.scan_unroll,
# programs.other_compiles and other_compile_s, snapshots.durable_failed; 8: goodput.restart;
# 9: programs.moved_ahead and moved_ahead_s, plans. The keys are those of version 9 since: the
# sections became dataclasses (sections.py), only the order of keys inside a few sections moved.
# 10: rollback, changed_on_resume, failures_note. 11: trace_nodes_by_slice.
# 12: recovery.programs_built.


class ReportError(ValueError):
  """A report that does not match the schema; the message lists every mismatch."""


# ---- the report: its own keys, and its sections from their owners ------------------------------

LOSS = 'nats/token'


@dataclasses.dataclass
class Throughput:
  """Rates of this process, eval time left out."""
  tokens_per_s: float = entry('tokens/s', 'tokens trained in this process / train_s')
  steps_per_s: float = entry('steps/s', 'steps trained in this process / train_s')
  tokens_per_step: int = entry('tokens', 'global batch: slices x micro_batch x seq_len')
  train_s: float = entry('s', 'wall_s minus eval_s (snapshots and rejoins included)')
  eval_s: float = entry('s', 'time spent in evals (compiles included)')


@dataclasses.dataclass
class Report:
  """report.json (docs/report.md): every key's type is its annotation, with its unit and doc."""
  schema_version: int = entry('', f'version of this schema ({SCHEMA_VERSION})')
  steps: int = entry('steps', 'steps done (train.steps unless the run stopped early)')
  first_loss: float | None = entry(LOSS, 'training loss of the first logged step')
  final_loss: float | None = entry(LOSS, 'training loss of the last step trained (always logged)')
  tokens: int = entry('tokens', 'tokens trained (exact + degraded samples x seq_len), all '
                      'processes of a resumed run')
  wall_s: float = entry('s', 'wall time of the training loop in this process: steps, snapshots, '
                        'evals (start-up compile excluded)')
  tokens_per_s: float = entry('tokens/s', 'same as throughput.tokens_per_s')
  compile_s: float = entry('s', "start-up: the state built (initialized: init_*, or restored: "
                          "restore_s) and the first step's programs built (first_programs_s); "
                          "the start line's `state + first programs`")
  throughput: Throughput = entry('', 'rates of this process, eval time left out')
  eval_loss: float | None = entry(LOSS, 'held-out loss after the last step; null if the run '
                                  'stopped early or its data has no eval rows '
                                  '(eval_fraction=0: evals off)')
  eval_perplexity: float | None = entry('', 'exp(eval_loss)')
  evals: list[Eval] = entry('', 'every eval (train.eval_every and the end), oldest first')
  params_sha256: str | None = entry('', 'sha256 of every parameter (path, dtype, shape, bytes): '
                                    'equal iff bit-identical; null only in a multi-process run '
                                    'where the writing process holds no live slice')
  param_count: int = entry('parameters', 'number of model parameters')
  entropy_floor: float | None = entry(LOSS, 'lowest reachable loss of the built-in corpus; null '
                                      'for other data')
  # A loss of a diverged run may be NaN or inf: written as null (metrics.to_json), never bare NaN.
  losses: list[tuple[int, float | None]] = entry(LOSS, '[step, training loss] of every logged '
                                                 'step; the loss is null if not finite '
                                                 '(diverged)')
  mesh: dict[str, int] = entry('devices', "mesh axis sizes: {'slice', 'fsdp', 'tensor'}")
  device: str = entry('', 'device kind, e.g. cpu, NVIDIA H100 80GB HBM3, TPU v5 lite')
  compute_dtype: Literal[COMPUTE_DTYPES] = entry('', 'dtype of activations and matmuls: '
                                                 "model.compute_dtype, 'auto' resolved on this "
                                                 'backend (bfloat16 on TPU/GPU, float32 on CPU); '
                                                 'params stay model.param_dtype')
  step_memory: dict[str, int] = entry('bytes', 'compiled fault-free step per device (argument, '
                                      'output, temp, alias, generated code); {} where the backend '
                                      'has none or the run (re)started with slices down (it builds '
                                      "the takeover's programs instead)")
  takeover: str = entry('', 'faults.takeover policy')
  failures: str = entry('', 'faults.failures source')
  failure_events: list[AppliedEvent] = entry('', 'fail/repair events as applied, in order')
  scheduled_events: list[FailureEvent] = entry('', 'the failure schedule (applied or not), sorted')
  failures_note: str | None = entry('', 'a failure preset that applied no failure in the run: '
                                    "its steps' simulated hours against the preset's rate, the "
                                    'line the run ends with too; null otherwise')
  trace_nodes_by_slice: list[str | None] | None = entry(
      '', "a JSON node fault log's failures (--failures trace:LOG): the log's node each slice "
      'replays, by slice index (drawn with train.seed; null for a node that never fails in the '
      'log); null for other failures')
  samples: dict[str, int] = entry('samples', "{'exact', 'degraded', 'dropped'}: how the "
                                  'micro-batch rows were processed')
  goodput: Seconds = entry('s', 'where the time went')
  stopped: str | None = entry('', 'why the run stopped early (all slices down, a stop request, a '
                              'non-finite loss) and what it saved where; null if it finished')
  preempted: bool = entry('', 'stopped by a stop request: SIGTERM, Ctrl-C, --stop-after or the '
                          "supervisor's (exit code 143), resumable")
  diverged_at_step: int | None = entry('step', 'step whose training loss or gradient norm was '
                                       'not finite (the run stopped there, exit code 4; a '
                                       '--resume goes back to a snapshot before it); null '
                                       'otherwise')
  startup: Startup = entry('', "this process's wait for its first step: compile_s holds init_*, "
                           'restore_s and first_programs_s; first_step_s also the imports, data '
                           'and snapshot tiers before them and first_step_run_s after')
  recovery: Recovery | None = entry('', 'a restart by the supervisor after a death or a stall: '
                                    'where the time from the failure seen to the first step '
                                    'trained again went (process 0); null for any other start')
  resumed_from_step: int | None = entry('step', 'step of the snapshot resumed from; null for a '
                                        'fresh run')
  steps_lost: int | None = entry('steps', 'steps trained again after this resume; null if not '
                                 'resumed or unknown')
  rollback: Rollback | None = entry('', 'a resume of a diverged run: the snapshot before the '
                                    'divergence it went back to; null for any other start')
  changed_on_resume: dict[str, Any] = entry('', "config keys this resume changed, {key: [the "
                                            "run's value, this start's]} (keys whose setting "
                                            'allows it: docs/config.md); {} otherwise')
  steps_lost_total: int = entry('steps', 'steps trained again over the whole run, every restart '
                                "and resume counted (history.jsonl's thrown_away lines)")
  live_slices_at_end: list[int] = entry('', 'slices live after the last step')
  snapshots: Snapshots = entry('', 'snapshot tiers of this run')
  snapshot_interval: SnapshotInterval = entry('', 'how the in-memory snapshot interval was chosen')
  precompile: Precompile = entry('', 'programs of live sets one failure or repair away, compiled '
                                 'ahead in a background thread')
  programs: Programs = entry('', 'the step, eval and refresh programs this process built')
  plans: Plans = entry('', "the decider's step plans (core/decider.py)")
  tensorboard_dir: str | None = entry('', 'TensorBoard event files; null without tensorboardX')
  config: dict[str, Any] = entry('', 'the resolved config (sections and keys of config.py)')


# ---- checking and docs -------------------------------------------------------------------------

def errors(report: Any) -> list[str]:
  """Every mismatch between `report` (parsed report.json) and Report; [] if it matches."""
  return sections.errors(Report, report)


def validate(report: Any) -> None:
  """Raises ReportError listing every mismatch."""
  found = errors(report)
  if found:
    raise ReportError(f'report does not match the schema ({len(found)}): ' + '; '.join(found))


def rows(section: type = Report):
  """(dotted key, type, unit, meaning) of every key, nested sections flattened."""
  return sections.rows(section)


def markdown(section: type = Report) -> str:
  lines = ['| key | type | unit | meaning |', '|---|---|---|---|']
  return '\n'.join(lines + [f'| `{k}` | {t} | {u} | {d} |' for k, t, u, d in rows(section)])


def rows_markdown() -> str:
  """docs/report.md's tables of metrics.jsonl's rows: a train row's keys, then an eval row's."""
  return '\n\n'.join(f'{title} rows (`kind: "{title.lower()}"`):\n\n{markdown(row)}'
                     for title, row in (('Train', TrainRow), ('Eval', EvalRow)))


def _bare_constant(name: str):
  raise ValueError(f'bare {name} is not JSON (a non-finite number is written as null)')


def load(path: Path) -> Any:
  """The parsed report at `path`; OSError / ValueError with a one-line message otherwise."""
  if not path.is_file():
    raise OSError(f'{path}: not found (give a report.json or a run directory holding one)')
  try:
    return json.loads(path.read_bytes(), parse_constant=_bare_constant)
  except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, bare NaN
    raise ValueError(f'{path}: not valid JSON: {err}') from None


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog=command('mecefo_jax.run.report_schema'),
                              description='Check a report.json against the schema.')
  p.add_argument('report', nargs='?', help='report.json or a run directory')
  p.add_argument('--markdown', action='store_true', help='print the key table of docs/report.md')
  p.add_argument('--rows', action='store_true',
                 help="print docs/report.md's tables of metrics.jsonl's rows")
  args = p.parse_args(argv)
  if args.rows:
    print(rows_markdown())
    return 0
  if args.markdown or not args.report:
    print(markdown())
    return 0
  path = Path(args.report)
  path = path / 'report.json' if path.is_dir() else path
  try:
    report = load(path)
  except (OSError, ValueError) as err:
    print(f'error: {err}', file=sys.stderr)
    return BAD_INPUT
  found = errors(report)
  for line in found:
    print(f'{path}: {line}', file=sys.stderr)
  print(f'{path}: {"OK" if not found else f"{len(found)} mismatch(es)"}')
  return 1 if found else 0


if __name__ == '__main__':
  sys.exit(main())
