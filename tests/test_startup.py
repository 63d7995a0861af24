"""The start-up clock (run/startup.py): the process's age from /proc, the clock's origin, and
train_state.create_sharded's ahead-of-time phases."""
import sys
import time

import jax
import psutil
import pytest

from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.model import train_state
from mecefo_jax.run import startup
from procs import TINY

linux = pytest.mark.skipif(not sys.platform.startswith('linux'), reason='/proc is Linux only')


@linux
def test_process_age_agrees_with_psutil_and_runs_with_the_wall_clock():
  age = startup.process_age_s()
  # psutil: the start in whole seconds after boot (btime), so within ~1 s
  assert age == pytest.approx(time.time() - psutil.Process().create_time(), abs=1.5)
  time.sleep(0.3)
  assert startup.process_age_s() - age == pytest.approx(0.3, abs=0.05)


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
  assert clock.report()['first_step_from'] == 'trainer'
  assert set(clock.report()) == {*startup.KEYS, 'first_step_from'}


def test_create_sharded_times_lower_compile_and_run_and_returns_a_ready_state(devices):
  cfg = load_config(None, [*TINY, 'mesh.slice=2'])
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:2])
  times = {}
  state = train_state.create_sharded(cfg, mesh, times)
  assert set(times) == {'init_lower_s', 'init_compile_s', 'init_run_s'}
  assert all(v > 0 for v in times.values()) and times['init_compile_s'] > times['init_run_s']
  assert all(leaf.is_ready() for leaf in jax.tree.leaves(state))
  again = train_state.create_sharded(cfg, mesh)  # no times: the same state
  assert train_state.params_sha256(again.params) == train_state.params_sha256(state.params)
