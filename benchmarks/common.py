"""Shared benchmark harness: config loading, run metadata, interleaved timing, JSON + markdown
table output."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mecefo_jax.config import MODELS
from mecefo_jax.model import contract
from mecefo_jax.step import train_step


def parser(description: str) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=description)
  p.add_argument('--config', default='configs/tiny.yaml', help='YAML config (configs/*.yaml)')
  p.add_argument('--json', default=None, help='write results to this JSON file')
  p.add_argument('overrides', nargs='*', help='dotted overrides, e.g. model.n_layers=4')
  return p


def add_keep_xla_flags(p: argparse.ArgumentParser) -> None:
  """`--keep-xla-flags`: a benchmark's jobs take the caller's XLA_FLAGS (a test suite's, whose
  compiles are faster) instead of XLA's defaults, which are what a user measures."""
  p.add_argument('--keep-xla-flags', action='store_true',
                 help="the jobs take this environment's XLA_FLAGS (a test suite's: faster "
                 "compiles) instead of XLA's defaults")


def add_keep_cache(p: argparse.ArgumentParser) -> None:
  """`--keep-cache`: a benchmark's jobs take the caller's XLA_FLAGS and
  $JAX_COMPILATION_CACHE_DIR (a test suite's: its compiles shared) where cold programs are no
  part of what it measures."""
  p.add_argument('--keep-cache', action='store_true',
                 help="the jobs take this environment's XLA_FLAGS and $JAX_COMPILATION_CACHE_DIR "
                 "(a test suite's: its compiles shared) instead of XLA's defaults and an empty "
                 'cache')


def job_env(keep_xla_flags: bool = False, keep_cache: bool = False, **extra: str) -> dict:
  """This environment for a benchmark's job: without XLA_FLAGS (XLA's defaults) unless
  `keep_xla_flags`, without $JAX_COMPILATION_CACHE_DIR (an empty program store, or the one
  `extra` names) unless `keep_cache`; `extra` added."""
  dropped = (() if keep_xla_flags else ('XLA_FLAGS',)) + (
      () if keep_cache else ('JAX_COMPILATION_CACHE_DIR',))
  return {**{k: v for k, v in os.environ.items() if k not in dropped}, **extra}


def with_model(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """`--model KIND|MODULE:FACTORY` on `p` (= model.kind; model_overrides adds it)."""
  p.add_argument('--model', default=None,
                 help=f"{' | '.join(MODELS)} | MODULE:FACTORY (= model.kind)")
  return p


def model_overrides(args) -> list[str]:
  """args.overrides, with model.kind=args.model where --model is given."""
  return [*args.overrides, *([f'model.kind={args.model}'] if args.model else [])]


REPO = Path(__file__).resolve().parents[1]
RUN_KEYS = ('commit', 'command', 'device', 'date')  # what run_info records, emit insists on


def device_info() -> dict:
  """Platform, device kind and count, and the host's CPUs (all, and those this process may use)."""
  d = jax.devices()[0]
  available = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  return {'platform': jax.default_backend(), 'device_kind': d.device_kind,
          'device_count': jax.device_count(), 'host_cpu_count': os.cpu_count(),
          'host_cpus_available': available, 'jax': jax.__version__, 'python': platform.python_version(),
          'host': platform.node()}


def git_commit() -> str | None:
  """HEAD of the repository, '-dirty' appended if the work tree has changes; None without git.
  Read-only: --no-optional-locks keeps `git status` from refreshing the index."""
  def git(*args):
    return subprocess.run(['git', '--no-optional-locks', *args], cwd=REPO, capture_output=True,
                          text=True, check=True, timeout=30).stdout.strip()
  try:
    head = git('rev-parse', 'HEAD')
    # A result written by an earlier benchmark of the same session changes no code.
    return head + ('-dirty' if git('status', '--porcelain', '--', '.', ':!docs/results') else '')
  except (OSError, subprocess.SubprocessError):
    return None


def run_info(module: str, argv: Sequence[str] | None) -> dict:
  """commit, command, device and UTC date of a benchmark run: every result JSON starts with them.
  `module` is the benchmark's module (its __spec__.name), `argv` its arguments (main's argv, or
  the command line's when None), so the command reruns it from the repository root."""
  args = list(sys.argv[1:] if argv is None else argv)
  return {'commit': git_commit(), 'command': shlex.join(['python', '-m', module, *args]),
          'device': device_info(),
          'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict:
  """Median seconds per call of each fn, calls interleaved round-robin so machine noise is shared."""
  for _ in range(warmup):
    for fn in fns.values():
      jax.block_until_ready(fn())
  samples = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      samples[name].append(time.perf_counter() - t0)
  return {name: {'median_s': statistics.median(v), 'min_s': min(v), 'n': len(v)}
          for name, v in samples.items()}


def markdown_table(rows: list[dict], columns: list[str]) -> str:
  fmt = lambda v: f'{v:.4g}' if isinstance(v, float) else str(v)
  lines = ['| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
  lines += ['| ' + ' | '.join(fmt(r.get(c, '')) for c in columns) + ' |' for r in rows]
  return '\n'.join(lines)


def emit(result: dict, table: str, json_path: str | None) -> None:
  """Prints the table and writes `result` (which must carry run_info's keys) as JSON."""
  missing = [k for k in RUN_KEYS if k not in result]
  if missing:
    raise ValueError(f'result lacks {missing}: start it with common.run_info(...)')
  print(table)
  if json_path:
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(result, indent=2))
    print(f'wrote {json_path}')


def unrolled_flops(lower: Callable[[], 'jax.stages.Lowered']) -> float:
  """XLA's FLOP count of the program `lower()` lowers, traced with the blocks unrolled
  (contract.unrolled) and not compiled: a compiled program's count holds the body of the scan
  over the blocks once, whatever n_layers."""
  with contract.unrolled():
    return float(cost_analysis(lower()).get('flops', 0.0))


def cost_analysis(compiled) -> dict:
  """XLA's cost analysis of a compiled program as one dict ({} where the backend has none)."""
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}


def random_tokens(cfg, roles: dict) -> dict:
  """Seeded random int32 tokens in each role's one-slice batch shape, keyed like `roles`."""
  rng = np.random.default_rng(0)
  return {k: jnp.asarray(rng.integers(0, cfg.model.vocab_size, train_step.batch_shape(cfg, 1, r)),
                         jnp.int32) for k, r in roles.items()}


def donating_runners(programs: dict, states: dict, tokens: dict, schedule,
                     state_of: Callable[[object], object] = lambda name: name) -> dict:
  """name -> one call of the step programs[name] on states[state_of(name)], tokens[name] and
  `schedule` (train_state.schedule_on); the programs donate their state, so each call stores
  the new one in its place."""
  def runner(name):
    def run():
      key = state_of(name)
      states[key], metrics = programs[name](states[key], tokens[name], schedule)
      return metrics
    return run
  return {name: runner(name) for name in programs}


STEP_LINE = re.compile(r'\bstep (\d+)/\d+ loss')  # a step's log line of train.py


# Process 0's line once the programs of the jobs that restart after a death are in the program
# store (step/precompile.py): a fault after it should find them there.
BUILT = 'background builds done'


class JobOutput:
  """A supervised job started in a session of its own; every line of its output kept with its
  arrival time (the recovery benchmarks time the lines), its `--events` file in `events_path`."""
  events_path: Path

  def start(self, cmd: list[str], env: dict) -> None:
    self.lines: list[tuple[float, str]] = []
    self.t0 = time.time()
    self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      self.lines.append((time.time(), line.rstrip()))

  def last_step(self) -> int:
    steps = [int(m.group(1)) for _, line in list(self.lines)[-50:]
             if (m := STEP_LINE.search(line))]
    return max(steps, default=-1)

  def said(self, text: str) -> bool:
    """Whether a line of the job's terminal output holds `text`."""
    return any(text in line for _, line in list(self.lines))

  def tail(self, n: int = 40) -> str:
    return '\n'.join(line for _, line in self.lines[-n:])

  def first_after(self, t: float, pattern: re.Pattern = STEP_LINE) -> tuple[float, re.Match] | None:
    """The arrival time and match of the first line after `t` that `pattern` finds."""
    return next(((when, m) for when, line in list(self.lines)
                 if when > t and (m := pattern.search(line))), None)

  def events(self) -> list[dict]:
    """The supervisor's events so far (start, death, stall, rejoin-ready, ...)."""
    if not self.events_path.exists():
      return []
    return [json.loads(x) for x in self.events_path.read_text().splitlines()]

  def host_pid(self, host: int) -> int:
    """The pid of `host`'s process in the job started last."""
    return [e for e in self.events() if e['kind'] == 'start'][-1]['pids'][str(host)]

  def left(self) -> list[int]:
    """The pids of the processes the job started (its start events') still running."""
    pids = [p for e in self.events() if e['kind'] == 'start' for p in e['pids'].values()]
    return [p for p in pids if p > 0 and Path(f'/proc/{p}').exists()]

  def wait_for(self, condition, timeout: float, what: str):
    """Polls `condition` until it returns a true value, which it returns; raises with the
    output's tail where the job ends or `timeout` seconds pass first."""
    deadline = time.time() + timeout
    while not (value := condition()):
      if self.proc.poll() is not None or time.time() > deadline:
        raise RuntimeError(f'no {what} (exit {self.proc.poll()}):\n{self.tail(30)}')
      time.sleep(0.02)
    return value

  def wait(self, timeout: float) -> int:
    """The job's exit code, once the reader thread has taken its last lines."""
    code = self.proc.wait(timeout=timeout)
    time.sleep(0.5)
    return code

  def kill(self) -> None:
    """SIGKILL to the job's session: the supervisor and every process it started."""
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
    self.proc.wait()
