"""report.json schema (type, unit, meaning of every key) and a small checker: docs/report.md."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mecefo_jax.config import COMPUTE_DTYPES
from mecefo_jax.core.goodput import Bucket
from mecefo_jax.run.exits import BAD_INPUT
from mecefo_jax.run.report_spec import (Choice, Field, ListOf, MapOf, Nullable, Pair, Record,
                                         Scalar)
from mecefo_jax.run.startup import ORIGINS

SCHEMA_VERSION = 9  # 2: precompile section; 3: programs section; 4: programs.store, loaded;
# 5: steps_lost_total, preempted includes --stop-after and the supervisor's stop request;
# 6: snapshot_interval, compute_dtype (model.compute_dtype resolved on the run's backend);
# 7: startup section (the start-up clock), startup.init_loaded, programs.scan_unroll,
# programs.other_compiles and other_compile_s, snapshots.durable_failed; 8: goodput.restart;
# 9: programs.moved_ahead and moved_ahead_s, plans


class ReportError(ValueError):
  """A report that does not match the schema; the message lists every mismatch."""


# ---- the schema --------------------------------------------------------------------------------

INT, FLOAT, STR, BOOL = Scalar(int), Scalar(float), Scalar(str), Scalar(bool)
# A loss of a diverged run may be NaN or inf: written as null (metrics.to_json), never bare NaN.
LOSS_VALUE = Nullable(FLOAT)
LOSS = 'nats/token'
GOODPUT_DOC = {
    Bucket.NORMAL: 'steps with every slice live',
    Bucket.DEGRADED: 'share of steps under failure spent on the samples processed',
    Bucket.COMPILE: 'building programs (compile, load, move) while the step waited: the fault-free '
                    'step at start-up, new live sets, evals',
    Bucket.REJOIN: 'copying the state to repaired slices',
    Bucket.LOST: 'share of steps under failure standing for samples dropped (`drop` policy)',
    Bucket.RESTART: "after a death (the supervisor's): from it to the restarted loop, less its "
                    'compiles',
}

EVAL = Record({
    'step': Field(INT, 'step', 'last training step before the eval (the eval sees the params after it)'),
    'loss': Field(LOSS_VALUE, LOSS, 'mean held-out loss over train.eval_batches batches; '
                  'null if not finite (diverged)'),
    'perplexity': Field(LOSS_VALUE, '', 'exp(loss); null if not finite'),
})
EVENT_FIELDS = {
    'step': Field(INT, 'step', 'step at whose start the event applies'),
    'slice': Field(INT, '', 'data-parallel slice index'),
    'kind': Field(Choice(('fail', 'repair')), '', 'the slice fails, or is repaired and rejoins'),
    'source': Field(STR, '', "where it came from: 'api', 'preset:high', 'trace:FILE', "
                    "'error: ...' (a real error while dispatching), 'resume', 'absent' / "
                    "'present' (a start without / again with the slice's devices or host)"),
}
FAILURE_EVENT = Record({
    **EVENT_FIELDS,
    'wall_s': Field(FLOAT, 's', 'run wall time when the controller applied it'),
    'live': Field(INT, 'slices', 'live slices after it'),
})
THROUGHPUT = Record({
    'tokens_per_s': Field(FLOAT, 'tokens/s', 'tokens trained in this process / train_s'),
    'steps_per_s': Field(FLOAT, 'steps/s', 'steps trained in this process / train_s'),
    'tokens_per_step': Field(INT, 'tokens', 'global batch: slices x micro_batch x seq_len'),
    'train_s': Field(FLOAT, 's', 'wall_s minus eval_s (snapshots and rejoins included)'),
    'eval_s': Field(FLOAT, 's', 'time spent in evals (compiles included)'),
})
SNAPSHOTS = Record({
    'enabled': Field(BOOL, '', 'snapshot.enabled (false with --no-snapshots)'),
    'dir': Field(Nullable(STR), '', 'in-memory tier directory (tmpfs); null when disabled'),
    'every': Field(INT, 'steps', 'snapshot.every; 0 when disabled'),
    'saved': Field(INT, '', 'in-memory snapshots written by this process'),
    'skipped': Field(INT, '', 'in-memory snapshots skipped on a write error (e.g. tmpfs full), '
                     'with a warning each; training went on'),
    'retained_steps': Field(ListOf(INT), 'steps', 'in-memory snapshots on disk at the end'),
    'durable_dir': Field(Nullable(STR), '', 'durable checkpoint directory; null if none'),
    'durable_every': Field(INT, 'steps', 'snapshot.durable_every; 0 if no durable tier'),
    'durable_saved': Field(INT, '', 'durable checkpoints written by this process'),
    'durable_failed': Field(INT, '', 'durable checkpoints that failed to save, with a line each; '
                            'training went on (3 in a row stop the run, exit 5)'),
    'durable_retained_steps': Field(ListOf(INT), 'steps', 'durable checkpoints on disk at the end'),
})
SNAPSHOT_INTERVAL = Record({
    'auto': Field(BOOL, '', "snapshot.every=auto: the interval was chosen from measured costs "
                  '(snapshot/interval.py)'),
    'every': Field(INT, 'steps', 'the in-memory snapshot interval at the end; 0 when disabled'),
    'budget': Field(Nullable(FLOAT), '', 'snapshot.overhead_budget (auto); null otherwise'),
    'max_every': Field(Nullable(INT), 'steps', 'snapshot.max_every (auto); null otherwise'),
    'cost_s': Field(Nullable(FLOAT), 's', 'measured cost of one snapshot to the loop: its wait '
                    'plus its background work\'s slowdown of the steps beside it (auto)'),
    'idle_step_s': Field(Nullable(FLOAT), 's', 'median wall of a step with no snapshot work '
                         '(auto)'),
    'changes': Field(ListOf(ListOf(INT)), '', '[step, every] at each re-measure of auto (every '
                     '4 save-to-save periods), the interval set from that step on'),
})
PRECOMPILE = Record({
    'enabled': Field(BOOL, '', 'faults.precompile resolved (auto: on for GPU/TPU single-process)'),
    'live_sets': Field(INT, '', 'live sets whose programs were compiled in the background'),
    'seconds': Field(FLOAT, 's', 'background compile time, off the critical path'),
})

PROGRAMS = Record({
    'move': Field(BOOL, '', 'train.move_programs resolved: programs moved between sets of slices '
                  'of one shape (step/retarget.py)'),
    'store': Field(Nullable(STR), '', 'the program store directory (step/store.py), null if none'),
    'compiled': Field(INT, '', 'programs compiled by this process (background compiles included)'),
    'compiled_s': Field(FLOAT, 's', 'their lowering and compile time'),
    'loaded': Field(INT, '', "programs loaded instead of compiled: from the program store, or hits "
                    "of JAX's persistent compilation cache"),
    'loaded_s': Field(FLOAT, 's', 'their lowering and load time'),
    'moved': Field(INT, '', 'programs moved onto another set of slices instead of compiled'),
    'moved_s': Field(FLOAT, 's', 'time spent moving them'),
    'moved_ahead': Field(INT, '', 'of the moves, those made in the background before their set '
                         'of slices was live (faults.precompile)'),
    'moved_ahead_s': Field(FLOAT, 's', 'their time, off the critical path'),
    'scan_unroll': Field(INT, '', "lax.scan's unroll over the stacked blocks in every program "
                         '(the same at every depth)'),
    'other_compiles': Field(INT, '', 'XLA compiles of this process besides the programs above '
                            'and the initializer (eager ops, layout conversions; jax.monitoring)'),
    'other_compile_s': Field(FLOAT, 's', 'their XLA compile time'),
})

PLANS = Record({
    'steps': Field(INT, 'steps', 'steps planned by this process (a step retried after a slice '
                   'error counts again)'),
    'digest': Field(STR, '', 'a running hash of every plan: equal on every process of a job'),
})

SECONDS = Nullable(FLOAT)
STARTUP = Record({
    'init_lower_s': Field(SECONDS, 's', 'the initializer (params, AdamW state) traced and lowered; '
                          'null when the state was restored'),
    'init_compile_s': Field(SECONDS, 's', 'the initializer compiled ahead of time; null when '
                            'restored'),
    'init_run_s': Field(SECONDS, 's', 'the initializer run until the state exists (blocked); '
                        'null when restored'),
    'init_loaded': Field(Nullable(BOOL), '', 'the initializer loaded from the program store '
                         '(init_compile_s is then its load); null when restored'),
    'restore_s': Field(SECONDS, 's', 'a resume: finding and restoring the newest usable snapshot '
                       '(until the state exists; also when none was usable); null without resume'),
    'first_programs_s': Field(SECONDS, 's', "the first step's programs compiled or loaded from "
                              "the program store (the takeover's at a start with slices down)"),
    'first_step_run_s': Field(SECONDS, 's', 'the first step itself: from the training loop\'s '
                              'start to its end, blocked on its metrics (data, dispatch, run)'),
    'first_step_s': Field(SECONDS, 's', "wall time from first_step_from to the end of this "
                          "process's first step, blocked on its metrics; null if it trained none"),
    'first_step_from': Field(Choice(ORIGINS), '', "'process': the process start (train.py on "
                             "Linux: /proc/self/stat), 'train.py': train.py's first statement "
                             "(no /proc), 'trainer': Trainer() (a notebook or a script)"),
})

SCHEMA = Record({
    'schema_version': Field(INT, '', f'version of this schema ({SCHEMA_VERSION})'),
    'steps': Field(INT, 'steps', 'steps done (train.steps unless the run stopped early)'),
    'first_loss': Field(Nullable(FLOAT), LOSS, 'training loss of the first logged step'),
    'final_loss': Field(Nullable(FLOAT), LOSS, 'training loss of the last logged step'),
    'tokens': Field(INT, 'tokens', 'tokens trained (exact + degraded samples x seq_len), all '
                    'processes of a resumed run'),
    'wall_s': Field(FLOAT, 's', 'wall time of the training loop in this process: steps, '
                    'snapshots, evals (start-up compile excluded)'),
    'tokens_per_s': Field(FLOAT, 'tokens/s', 'same as throughput.tokens_per_s'),
    'compile_s': Field(FLOAT, 's', 'start-up: build the state and compile the fault-free step'),
    'throughput': Field(THROUGHPUT, '', 'rates of this process, eval time left out'),
    'eval_loss': Field(Nullable(FLOAT), LOSS, 'held-out loss after the last step; null if the '
                       'run stopped early or its data has no eval rows (eval_fraction=0: '
                       'evals off)'),
    'eval_perplexity': Field(Nullable(FLOAT), '', 'exp(eval_loss)'),
    'evals': Field(ListOf(EVAL), '', 'every eval (train.eval_every and the end), oldest first'),
    'params_sha256': Field(Nullable(STR), '', 'sha256 of every parameter (path, dtype, shape, '
                           'bytes): equal iff bit-identical; null only in a multi-process run '
                           'where the writing process holds no live slice'),
    'param_count': Field(INT, 'parameters', 'number of model parameters'),
    'entropy_floor': Field(Nullable(FLOAT), LOSS, 'lowest reachable loss of the built-in '
                           'corpus; null for other data'),
    'losses': Field(ListOf(Pair(INT, LOSS_VALUE)), LOSS, '[step, training loss] of every logged '
                    'step; the loss is null if not finite (diverged)'),
    'mesh': Field(MapOf(INT), 'devices', "mesh axis sizes: {'slice', 'fsdp', 'tensor'}"),
    'device': Field(STR, '', 'device kind, e.g. cpu, NVIDIA H100 80GB HBM3, TPU v5 lite'),
    'compute_dtype': Field(Choice(COMPUTE_DTYPES), '', 'dtype of activations and matmuls: '
                           "model.compute_dtype, 'auto' resolved on this backend (bfloat16 on "
                           'TPU/GPU, float32 on CPU); params stay model.param_dtype'),
    'step_memory': Field(MapOf(INT), 'bytes', 'compiled fault-free step per device (argument, '
                         'output, temp, alias, generated code); {} where the backend has none '
                         'or the run (re)started with slices down (it builds the takeover\'s '
                         'programs instead)'),
    'takeover': Field(STR, '', 'faults.takeover policy'),
    'failures': Field(STR, '', 'faults.failures source'),
    'failure_events': Field(ListOf(FAILURE_EVENT), '', 'fail/repair events as applied, in order'),
    'scheduled_events': Field(ListOf(Record(EVENT_FIELDS)), '', 'the failure schedule '
                              '(applied or not), sorted'),
    'samples': Field(MapOf(INT), 'samples', "{'exact', 'degraded', 'dropped'}: how the "
                     'micro-batch rows were processed'),
    'goodput': Field(Record({k.value: Field(FLOAT, 's', v) for k, v in GOODPUT_DOC.items()}), 's',
                     'where the time went'),
    'stopped': Field(Nullable(STR), '', 'why the run stopped early (all slices down, a stop '
                     'request, a non-finite loss) and what it saved where; null if it finished'),
    'preempted': Field(BOOL, '', 'stopped by a stop request: SIGTERM, Ctrl-C, --stop-after or '
                       "the supervisor's (exit code 143), resumable"),
    'diverged_at_step': Field(Nullable(INT), 'step', 'step whose training loss was not finite '
                              '(the run stopped there, exit code 4); null otherwise'),
    'startup': Field(STARTUP, '', "this process's wait for its first step: compile_s holds "
                     'init_*, restore_s and first_programs_s; first_step_s also the imports, '
                     'data and snapshot tiers before them and first_step_run_s after'),
    'resumed_from_step': Field(Nullable(INT), 'step', 'step of the snapshot resumed from; null '
                               'for a fresh run'),
    'steps_lost': Field(Nullable(INT), 'steps', 'steps trained again after this resume; null '
                        'if not resumed or unknown'),
    'steps_lost_total': Field(INT, 'steps', 'steps trained again over the whole run, every '
                              'restart and resume counted (history.jsonl\'s thrown_away lines)'),
    'live_slices_at_end': Field(ListOf(INT), '', 'slices live after the last step'),
    'snapshots': Field(SNAPSHOTS, '', 'snapshot tiers of this run'),
    'snapshot_interval': Field(SNAPSHOT_INTERVAL, '', 'how the in-memory snapshot interval was '
                               'chosen'),
    'precompile': Field(PRECOMPILE, '', 'programs of live sets one failure or repair away, '
                        'compiled ahead in a background thread'),
    'programs': Field(PROGRAMS, '', 'the step, eval and refresh programs this process built'),
    'plans': Field(PLANS, '', "the decider's step plans (core/decider.py)"),
    'tensorboard_dir': Field(Nullable(STR), '', 'TensorBoard event files; null without '
                             'tensorboardX'),
    'config': Field(MapOf(None), '', 'the resolved config (sections and keys of config.py)'),
})


# ---- checking and docs -------------------------------------------------------------------------

def errors(report: Any) -> list[str]:
  """Every mismatch between `report` (parsed report.json) and SCHEMA; [] if it matches."""
  found: list[str] = []
  SCHEMA.check(report, '', found)
  return found


def validate(report: Any) -> None:
  """Raises ReportError listing every mismatch."""
  found = errors(report)
  if found:
    raise ReportError(f'report does not match the schema ({len(found)}): ' + '; '.join(found))


def rows(record: Record = SCHEMA, prefix: str = ''):
  """(dotted key, type, unit, meaning) of every key, nested records flattened."""
  for key, field in record.fields.items():
    spec = field.spec
    yield prefix + key, spec.name, field.unit, field.doc
    if isinstance(spec, ListOf) and isinstance(spec.item, Record):
      yield from rows(spec.item, f'{prefix}{key}[].')
    elif isinstance(spec, Record):
      yield from rows(spec, f'{prefix}{key}.')


def markdown() -> str:
  lines = ['| key | type | unit | meaning |', '|---|---|---|---|']
  return '\n'.join(lines + [f'| `{k}` | {t} | {u} | {d} |' for k, t, u, d in rows()])


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
  p = argparse.ArgumentParser(prog='python -m mecefo_jax.run.report_schema',
                              description='Check a report.json against the schema.')
  p.add_argument('report', nargs='?', help='report.json or a run directory')
  p.add_argument('--markdown', action='store_true', help='print the key table of docs/report.md')
  args = p.parse_args(argv)
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
