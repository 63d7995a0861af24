"""The start-up clock (run/startup.py): the process's age from /proc, the clock's origin, and
the initializer's ahead-of-time phases and program, and every XLA compile booked."""
import dataclasses
import json
import logging
import os
import signal
import sys
import time

import jax
import psutil
import pytest

from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.model import train_state
from mecefo_jax.run import cli, ending, startup
from mecefo_jax.step import initializer, program_store
from procs import TINY

linux = pytest.mark.skipif(not sys.platform.startswith('linux'), reason='/proc is Linux only')


@linux
def test_process_age_agrees_with_psutil_and_runs_with_the_wall_clock():
  age = startup.process_age_s()
  # psutil: the start in whole seconds after boot (btime), so within ~1 s
  assert age == pytest.approx(time.time() - psutil.Process().create_time(), abs=1.5)

  def start_between() -> tuple[float, float]:
    before, age, after = time.time(), startup.process_age_s(), time.time()
    return before - age, after - age
  first = start_between()
  time.sleep(0.3)
  later = start_between()
  # The age runs with the wall clock: both readings put the start at the same time, to /proc's
  # 10 ms ticks (uptime and start), however long the loaded machine made the sleep.
  assert later[0] - 0.021 <= first[1] and first[0] - 0.021 <= later[1], (first, later)


@linux
def test_the_clock_runs_from_the_process_start_only_under_train_py(monkeypatch):
  monkeypatch.setattr(startup, '_entry', None)
  at, kind = startup.origin()
  assert kind == 'trainer' and at == pytest.approx(time.time(), abs=0.1)
  monkeypatch.setattr(startup, '_entry', time.time() - 1.0)
  at, kind = startup.origin()
  assert kind == 'process' and at == pytest.approx(time.time() - startup.process_age_s(), abs=0.05)
  monkeypatch.setattr(startup, 'process_age_s', lambda: None)  # no /proc: train.py's stamp
  assert startup.origin() == (startup._entry, 'train.py')


def test_only_the_first_step_stops_the_clock():
  clock = startup.StartupClock()
  assert clock.describe() == 'start-up not timed'
  time.sleep(0.05)
  clock.step_done()
  first = clock.seconds['first_step_s']
  clock.step_done()
  assert clock.seconds['first_step_s'] == first >= 0.05
  assert clock.report().first_step_from == 'trainer'
  assert set(dataclasses.asdict(clock.report())) == {*startup.KEYS, 'first_step_from'}


def test_the_initializer_is_timed_and_kept_in_the_program_store(devices, tmp_path):
  cfg = load_config(None, [*TINY, 'mesh.slice=2'])
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:2])
  programs = program_store.ProgramStore(tmp_path / 'programs', 1 << 30)
  times = {}
  state = initializer.create(cfg, mesh, programs, times)
  assert set(times) == {'init_lower_s', 'init_compile_s', 'init_run_s', 'init_loaded'}
  assert not times['init_loaded'] and all(times[k] > 0 for k in startup.KEYS[:3])
  assert all(leaf.is_ready() for leaf in jax.tree.leaves(state))
  again = {}
  loaded = initializer.create(cfg, mesh, programs, again)  # a new run: loaded, same state
  assert again['init_loaded'] and again['init_compile_s'] < times['init_compile_s']
  assert again['init_lower_s'] == 0  # found by its recipe: nothing traced
  assert train_state.params_sha256(loaded.params) == train_state.params_sha256(state.params)
  assert train_state.params_sha256(train_state.create_sharded(cfg, mesh).params) == \
      train_state.params_sha256(state.params)


_COMPILE = '/jax/core/compile/backend_compile_duration'


def test_every_xla_compile_of_a_failure_run_is_in_its_report(tmp_path, cold_programs, caplog):
  """A tiny 2-slice run with a failure, compiling every program (no store): XLA's compiles
  (jax.monitoring, counted here) are the programs report.json books, the initializer and its
  other_compiles, none twice. Its log's start-up and compile times are report.json's, each
  line naming what it counts (docs/outputs.md: The terminal)."""
  compiles = []
  listener = lambda event, duration, **_: event == _COMPILE and compiles.append(duration)
  (tmp_path / 'T').write_text('3 1 fail\n')
  caplog.set_level(logging.INFO, 'mecefo')
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    code = cli.main(['--out', str(tmp_path / 'D'), *TINY, 'mesh.slice=2', '--failures',
                     f'trace:{tmp_path / "T"}', '--takeover', 'spread', 'train.steps=6',
                     'train.eval_every=0',
                     'train.compile_cache='])
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  report = json.loads((tmp_path / 'D' / 'report.json').read_text())
  programs, start = report['programs'], report['startup']
  s = report['compile_s']  # the state and the first programs: the start line's, the last line's
  assert s >= start['init_lower_s'] + start['init_compile_s'] + start['init_run_s'] + \
      start['first_programs_s'] and start['first_step_s'] > s + start['first_step_run_s']
  [opening] = [m for m in caplog.messages if m.startswith('model ')]
  assert opening.endswith(
      f"| state + first programs {s:.1f}s: init {start['init_lower_s']:.1f}+"
      f"{start['init_compile_s']:.1f}+{start['init_run_s']:.1f}s (lower+compile+run), first "
      f"programs {start['first_programs_s']:.1f}s") and ' compile ' not in opening, opening
  from benchmarks.gpu_check import START_LINE  # what the GPU check reads of a killed run
  assert START_LINE.search(opening).group(5) == f"{start['first_programs_s']:.1f}"
  [last] = [m for m in caplog.messages if m.startswith('start-up: first step done')]
  assert (f"first step done {start['first_step_s']:.1f}s after the {start['first_step_from']} "
          f"start: the state + first programs {s:.1f}s, the step itself "
          f"{start['first_step_run_s']:.1f}s") in last, last
  # The goodput's compile (the builds steps waited for, the initializer's not) says so.
  [goodput] = [m for m in caplog.messages if m.startswith('goodput (s; compile: the program '
                                                          'builds steps and evals waited for)')]
  assert f"'compile': {round(report['goodput']['compile'], 2)}" in goodput, goodput
  assert code == 0 and report['samples']['degraded'] > 0 and programs['loaded'] == 0
  init = int(not start['init_loaded'])
  assert programs['compiled'] >= 3 and init == 1
  assert len(compiles) == programs['compiled'] + init + programs['other_compiles'], \
      (len(compiles), programs, start)
  assert programs['scan_unroll'] == 1


def test_a_sigterm_swallowed_on_its_way_stops_the_start_up_at_its_next_line(monkeypatch):
  """The start-up's SIGTERM lands in a __del__ (as in jax's garbage-collection callback):
  Python swallows its StartupStopped and the start-up goes on (a SIGTERM test at load 20 trained
  its run to the end so); raise_if_swallowed raises it again at a line of the start-up's own.
  Python's "Exception ignored" report of it stays off stderr (the one line is the start-up's
  own; seen in CI); any other unraisable error is reported as before."""
  reported = []
  monkeypatch.setattr(sys, 'unraisablehook', lambda u: reported.append(u.exc_type))

  class Collected:
    def __init__(self, error=None):
      self.error = error

    def __del__(self):
      if self.error:
        raise self.error
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(0.05)  # the handler runs here, inside __del__

  previous = ending.stop_startup_on_sigterm()
  try:
    Collected()
    Collected(ValueError('not ours'))
    assert reported == [ValueError]
    with pytest.raises(ending.StartupStopped, match='SIGTERM'):
      ending.raise_if_swallowed()
    ending.raise_if_swallowed()  # once
  finally:
    ending.restore_sigterm(previous)
  Collected(ValueError('after'))
  assert reported == [ValueError, ValueError]
