"""Command line of train.py: config + dotted overrides, one clear line on bad input."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

# No jax import here: XLA_FLAGS are still settable, and config errors come at once.
from mecefo_jax.config import (CONFIGS, DEFAULT_OUT, MODELS, POLICIES, Config, ConfigError, FaultConfig,
                               builtin_configs, config_file, end_setting, load_config, rule_of,
                               to_dict)
from mecefo_jax.records import run_state
from mecefo_jax.records.job import BAD_INPUT, INTERRUPTED
from mecefo_jax.run import ending, hints, startup, storage, supervised


DEFAULT_CONFIG = CONFIGS / 'tiny.yaml'  # in the package: the default does not depend on the cwd
# A test hook: `HOST` makes the process of logical host HOST fail in its start-up with an
# `error:` line (tests/test_launch.py: the supervisor ends the job and shows that line).
TEST_START_ERROR_ENV = 'MECEFO_TEST_START_ERROR'
# Simulated CPU devices (--host-devices) XLA's CPU client runs a train step on, measured on a
# 2-core host: 256 trained 2 tiny steps (37 s); 512 and 1000 waited in the all-reduce
# rendezvous, then aborted (exit 134 after 142 s / 103 s, megabytes of rendezvous dumps, the
# run left `running`): refused before any work instead.
MAX_HOST_DEVICES = 256
HIGH_WHY = {MAX_HOST_DEVICES: ' (simulated CPU devices; more wedge XLA\'s CPU collectives)'}


class OneLineParser(argparse.ArgumentParser):
  """argparse whose usage errors are one `error: ...` line (exit BAD_INPUT), like every other
  error (train.py's and the supervisor's)."""

  def error(self, message):
    print(f'error: {message} (see {self.prog} --help)', file=sys.stderr)
    sys.exit(BAD_INPUT)


def at_least(low: int, kind: type = int, high: int | None = None):
  """An argparse type: a finite `kind` (int or float) >= `low` (and <= `high`)."""
  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f'expected {"an integer" if kind is int else "a number"}, got {text!r}') from None
    if not (math.isfinite(value) and value >= low):  # NaN fails both
      raise argparse.ArgumentTypeError(f'must be >= {low}, got {text}')
    if high is not None and value > high:
      raise argparse.ArgumentTypeError(f'must be <= {high}, got {text}{HIGH_WHY.get(high, "")}')
    return value
  return parse


def parse_args(argv=None) -> argparse.Namespace:
  command = hints.train_command()  # as typed: `python train.py`, `mecefo-train`, ...
  p = OneLineParser(
      prog=command, description='MeCeFO fault-tolerant LLM training (JAX/Flax).',
      epilog=f'example: {command} --config tiny train.steps=50 model.n_layers=4')
  p.add_argument('--config', default=None, metavar='NAME|FILE',
                 help=f'a built-in config by name ({", ".join(builtin_configs())}; shipped in '
                      'the package) or a YAML file, overriding the defaults (default: tiny)')
  p.add_argument('--out', default=None, help='run directory (default: train.out_dir)')
  p.add_argument('--print-config', action='store_true', help='print the resolved config and exit')
  p.add_argument('--data', default=None,
                 help='synthetic (built in) | tokens:DIR (a corpus tokenized once by `python -m '
                      'mecefo_jax.data.prepare SOURCE --out DIR`: any size, read by memory map) | '
                      'text:PATH (a file, or a folder of .txt/.md) | pydoc (Python\'s help() '
                      'texts, no download) | tokens:FILE (.npy, or raw ids with dtype=) | hf:NAME '
                      '(text:, pydoc and hf: are tokenized in every process at every start: '
                      'a large corpus is refused with the prepare command); options after ?, joined by &: tokenizer=FILE|DIR (tokenizer.json for '
                      'text, pydoc, hf; default: bytes), dtype=uint8|uint16|uint32 (a raw tokens '
                      'file: required), column=, split=, config= (hf), eval_fraction=F; e.g. '
                      'pydoc?tokenizer=tok/ (= train.data)')
  p.add_argument('--dry-run', action='store_true',
                 help='build, compile the step, print parameters, mesh and memory; no training '
                      'and no files left behind')
  p.add_argument('--model', default=None, metavar='KIND|MODULE:FACTORY',
                 help=f"the model: {' | '.join(MODELS)} (built in) or a model of the contract "
                      'by its factory, imported from the current directory too (= model.kind; '
                      'docs/own_model.md)')
  p.add_argument('--failures', default=None,
                 help=f"{rule_of('faults.failures').allowed()} (presets: docs/algorithm.md §5; "
                      '= faults.failures)')
  p.add_argument('--takeover', default=None, choices=POLICIES,
                 help='who processes a failed slice\'s micro-batch (= faults.takeover, default '
                      f'{FaultConfig.takeover}; README: "Which takeover policy?")')
  start = p.add_mutually_exclusive_group()
  start.add_argument('--resume', action='store_true',
                     help='continue from the newest intact snapshot / checkpoint of --out')
  start.add_argument('--fresh', action='store_true',
                     help='start from step 0 even if --out holds an unfinished run')
  p.add_argument('--stop-after', type=at_least(1), default=None, metavar='STEPS',
                 help='stop once this many steps are trained, as SIGTERM would: snapshotted, '
                      'resumable with --resume (train.steps keeps the schedule)')
  p.add_argument('--no-snapshots', action='store_true', help='no in-memory snapshots (= snapshot.enabled=false)')
  p.add_argument('--quiet', '-q', action='store_true',
                 help='only warnings, errors (failures, repairs) and the final summary line')
  p.add_argument('--host-devices', type=at_least(1, high=MAX_HOST_DEVICES), default=None,
                 help='CPU only: simulate this many devices (XLA host platform), e.g. 8 slices')
  p.add_argument('--coordinator', default=None,
                 help='multi-process run: HOST:PORT of process 0 (automatic on TPU pods)')
  p.add_argument('--num-processes', type=int, default=None, help='multi-process run: how many')
  p.add_argument('--process-id', type=int, default=None, help='multi-process run: this one (0..n-1)')
  p.add_argument('--host-slot', type=at_least(0), default=None,
                 help='multi-process run restarted with fewer processes: the logical host this '
                      'process is (default: its process id); see docs/tpu.md')
  p.add_argument('--heartbeat-s', type=at_least(1), default=100,
                 help='multi-process run: seconds of silence after which a process counts as dead '
                      'and the others abort (then restart them with --resume)')
  p.add_argument('overrides', nargs='*', help='dotted overrides: section.key=value')
  return p.parse_intermixed_args(argv)


def _setup_process(args) -> None:
  """Environment (before jax is imported anywhere) and logging."""
  # jaxlib's QR/SVD (the svd-basis refresh) use OpenBLAS, whose threads fight XLA's own on
  # CPU hosts: measured 5.2 s vs 1.15 s per llama_60m refresh on 2 cores.
  os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')
  if args.host_devices is not None:
    _setup_devices(args.host_devices)
  logging.basicConfig(level=logging.WARNING, format='%(asctime)s %(message)s', datefmt='%H:%M:%S')
  logging.getLogger('mecefo').setLevel(logging.WARNING if args.quiet else logging.INFO)
  # Orbax logs a failed background save with its whole traceback; the snapshot code reports
  # it in one line (a skipped in-memory snapshot, or a durable-tier error), so keep it quiet.
  logging.getLogger('absl').setLevel(logging.CRITICAL)
  storage.quiet_failed_saves()
  supervised.leave_ctrl_c_to_the_supervisor()


def _setup_devices(count: int) -> None:
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count={count}')


def _overrides(args) -> list[str]:
  flags = {'model.kind': args.model, 'train.data': args.data, 'faults.failures': args.failures,
           'faults.takeover': args.takeover}
  overrides = list(args.overrides)
  # Quoted: a flag's value is the string as written, never YAML ('text:' reads as a mapping).
  overrides += [f'{key}={json.dumps(value, ensure_ascii=False)}'
                for key, value in flags.items() if value]
  # A dry run writes no snapshots (nothing left in /dev/shm) and trains in a scratch dir.
  overrides += ['snapshot.enabled=false'] if args.no_snapshots or args.dry_run else []
  return overrides


def _config_path(args) -> Path:
  return config_file(args.config) if args.config is not None else DEFAULT_CONFIG


def new_config(args) -> Config:
  """The config of a new run started with `args` (train.py's parse): --config, then the
  dotted overrides and the flags that stand for them (ConfigError when invalid)."""
  return load_config(_config_path(args), _overrides(args))


def _config(args) -> tuple[Config, Path]:
  """The run's config and directory. A resume (--resume, or an unfinished run in --out) starts
  from the config recorded in run_state.json, so that only what is given changes (and only keys
  a resume may change: their settings' `on_resume`, config.py); a failure trace read from a
  run directory replays that run's config (rundir.replay_base)."""
  from mecefo_jax.run import rundir
  if args.out and not args.fresh and not args.dry_run:
    recorded = run_state.read_run_state(Path(args.out))
    if recorded and recorded.config and (args.resume or run_state.unfinished(Path(args.out))):
      given = args.config and config_file(args.config)
      cfg = load_config(given, _overrides(args), base=recorded.config)
      if args.host_devices is None and recorded.host_devices:
        _setup_devices(recorded.host_devices)  # jax is not imported yet
      return cfg, Path(args.out)
  replay = rundir.replay_base(args.failures) if args.failures else None
  if replay is None:
    cfg = new_config(args)
  else:
    cfg = load_config(args.config and config_file(args.config), _overrides(args), base=replay[0])
    if args.host_devices is None:  # jax is not imported yet: the run's device count holds
      _setup_devices(replay[1])
  return cfg, Path(args.out or cfg.train.out_dir)


def _check_out_dir(out_dir: Path) -> None:
  """Creates the run directory; one that cannot be used fails in one line before any work."""
  if out_dir.exists() and not out_dir.is_dir():
    raise ConfigError(f'run directory {str(out_dir)!r} (--out) exists and is not a directory')
  try:
    out_dir.mkdir(parents=True, exist_ok=True)
  except OSError as err:
    raise ConfigError(f'cannot create run directory {str(out_dir)!r} (--out): '
                      f'{err.strerror or err}') from None
  if not os.access(out_dir, os.W_OK | os.X_OK):
    raise ConfigError(f'run directory {str(out_dir)!r} (--out) is not writable')


def _new_dirs(out_dir: Path) -> list[Path]:
  """The directories that creating `out_dir` would make, deepest first."""
  path = out_dir.absolute()
  return [d for d in (path, *path.parents) if not d.exists()]


def _remove_dirs(made: list[Path]) -> None:
  """Removes the directories `made` (deepest first) while they are empty."""
  for directory in made:
    try:
      directory.rmdir()
    except FileNotFoundError:
      continue  # removed already (the trainer's run directory)
    except OSError:
      break  # not ours any more (something wrote into it), or never made


def _probe_out_dir(out_dir: Path) -> None:
  """A dry run's check of the run directory: created as a real run would, then removed."""
  made = _new_dirs(out_dir)
  try:
    _check_out_dir(out_dir)
  finally:
    _remove_dirs(made)


def main(argv=None) -> int:
  args = parse_args(argv)
  _setup_process(args)
  scratch = Path(tempfile.mkdtemp(prefix='mecefo-dry-run-')) if args.dry_run else None
  previous = ending.stop_startup_on_sigterm()
  try:
    with hints.command_line():  # refusals name train.py's flags
      return _main(args, scratch)
  except KeyboardInterrupt:  # before the handlers are in place, or twice
    return _interrupted()
  except ending.StartupStopped as stopped:  # before --out was made (else _main says it)
    return ending.startup_stopped(stopped)
  finally:
    ending.restore_sigterm(previous)
    if scratch is not None:
      shutil.rmtree(scratch, ignore_errors=True)


def _interrupted() -> int:
  print('error: interrupted (Ctrl-C) without a final snapshot; --resume continues from the '
        'last snapshot, if any', file=sys.stderr)
  return INTERRUPTED


def _error(err: Exception) -> int:
  print(f'error: {err}', file=sys.stderr)
  return BAD_INPUT


def _main(args, scratch: Path | None) -> int:
  try:  # config and --out first: their errors need no jax import (seconds)
    cfg, out_dir = _config(args)
    made = _new_dirs(out_dir)
    if not args.print_config:
      (_check_out_dir if scratch is None else _probe_out_dir)(out_dir)
  except ConfigError as e:
    return _error(e)
  if args.print_config:
    import yaml
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return 0
  try:
    code = _start(args, cfg, out_dir, scratch)
  except ending.StartupStopped as stop:  # the Trainer's lock and folders are gone already
    _remove_dirs(made)
    return _leave(stop.job, ending.startup_stopped(stop))
  if code == BAD_INPUT:  # a refused start leaves no directory it made (the trainer's are gone)
    _remove_dirs(made)
  return code


def _start(args, cfg, out_dir: Path, scratch: Path | None) -> int:
  """Builds the trainer (in `scratch` for a dry run), then trains."""
  from mecefo_jax.core.decider import StreamMismatch
  from mecefo_jax.data.sources import DataError
  from mecefo_jax.snapshot.capacity import SnapshotError
  from mecefo_jax.run import stop
  job = False  # a process of a multi-process job
  stop_request = stop.StopRequest(args.stop_after)
  supervised.watch_supervisor(stop_request)
  try:
    _no_jax_cache()
    startup.mark('jax_imported')
    from mecefo_jax import multihost
    from mecefo_jax.records import progress_marks
    progress_marks.open_marks(_host(args))  # where a supervisor asks for them: it watches
    progress_marks.enter('starting', 'jax.distributed.initialize')
    job = multihost.initialize(args.coordinator, args.num_processes, args.process_id,
                               args.heartbeat_s)
    startup.mark('distributed')
    progress_marks.enter('starting', 'the run: data, snapshots, state')
    _test_start_error(args)
    from mecefo_jax.run import parts, trainer
    from mecefo_jax.step import program_store
    startup.mark('imported')
    resume = scratch is None and (args.resume or (not args.fresh and
                                                   run_state.unfinished(out_dir)))
    mode = parts.StartMode(
        resume=resume, explicit_resume=args.resume, replace=args.fresh,
        # runs/latest, not chosen by the user: a new run replaces a finished one
        replace_finished=args.out is None and cfg.train.out_dir == DEFAULT_OUT,
        host_slot=args.host_slot, stop=stop_request,
        program_store=program_store.open_store(cfg.train.compile_cache,
                                               cfg.train.program_store_mb))
    run = trainer.Trainer(cfg, scratch or out_dir, progress='quiet' if args.quiet else 'auto',
                          start=mode)
  except (ConfigError, DataError, SnapshotError, StreamMismatch) as e:
    return _leave(job, _error(e))
  except ending.StartupStopped as stopped:
    stopped.job = job  # (jax.distributed's shutdown at exit would wait for the others)
    raise
  except Exception as err:
    if not job:
      raise
    if ending.peer_lost(err):
      return _leave(job, ending.lost_peer(_host(args), err))
    traceback.print_exc()  # what Python prints for it, then the exit below (exit 1)
    return _leave(job, 1)
  # Installed with or without snapshots: a KeyboardInterrupt raised by Python's own handler can
  # land in a garbage-collection callback (jax's), which swallows it and training goes on.
  stop_request.install()
  try:
    return _train(args, run, out_dir)
  except Exception as err:
    if not (job and ending.peer_lost(err)):
      raise
    return _leave(job, ending.lost_peer(_host(args), err))
  finally:
    stop_request.uninstall()


def _leave(job: bool, code: int) -> int:
  """`code`; a process of a multi-process job that failed in start-up exits with it at once:
  jax.distributed's shutdown at exit would wait for the other processes, which wait for this
  one in their next collective (the supervisor, seeing the exit, stops them)."""
  if job:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  return code


def _host(args) -> int:
  """This process's logical host."""
  return args.host_slot if args.host_slot is not None else args.process_id or 0


def _test_start_error(args) -> None:
  """The start-up failure TEST_START_ERROR_ENV asks for, if it is this host's (a test hook)."""
  spec, host = os.environ.get(TEST_START_ERROR_ENV), _host(args)
  if spec is not None and spec == str(host):
    raise ConfigError(f'{TEST_START_ERROR_ENV}={spec}: host {host} fails in start-up (a test '
                      f'hook)')


def _no_jax_cache() -> None:
  """train.py keeps its compiled programs in the program store (step/program_store.py); JAX's own
  persistent cache is off, even where $JAX_COMPILATION_CACHE_DIR names one: on CPU an
  executable it loaded is serialized again without its functions (jax 0.10.2), so it could
  be neither stored nor moved; and with several processes a process that loads from it reaches
  the next collective long before one that compiles (gloo gives up after 30 s), where the
  store's loads are agreed by all processes."""
  import jax
  jax.config.update('jax_enable_compilation_cache', False)


def _train(args, run, out_dir: Path) -> int:
  log = logging.getLogger('mecefo')
  log.info('%s', run.describe())
  log.info('data: %s', run.corpus.describe())
  if args.dry_run:
    from mecefo_jax.run import report
    print(json.dumps(report.dry_run_info(run.parts), indent=2))
    run.close()
    return 0
  if run.finished:  # a finished run resumed: its report stands
    run.close()
    key, n, unit = end_setting(run.cfg)
    print(f'nothing to do: the run in {out_dir} has trained its {key}={n} {unit}; pass a larger '
          f'{key} to train on', file=sys.stderr)
    return 0
  try:
    run.run()
  finally:
    run.close()
  report = run.report
  summary = ending.summary(report, out_dir)
  if args.quiet:
    print(summary, file=sys.stderr)
  else:
    log.info('%s', summary)
    # Its compile is every program build a step or an eval waited for (the first programs
    # among them), not the initializer's: not the start line's state + first programs.
    log.info('goodput (s; compile: the program builds steps and evals waited for): %s; samples %s',
             {k: round(v, 2) for k, v in dataclasses.asdict(report.goodput).items()},
             report.samples)
    log.info('plans: %d steps, digest %s', report.plans.steps, report.plans.digest)
    log.info('%s', ending.first_step(report.startup, report.compile_s))
  if report.failures_note:
    log.warning('%s', report.failures_note)  # the last line, under --quiet too
  code = ending.exit_code(report, run.checkpoints_failing, run.outputs.error is not None,
                          run.interrupted_unsaved)
  return _interrupted() if code == INTERRUPTED else code
