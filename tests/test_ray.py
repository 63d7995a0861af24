"""The supervisor's Ray transport (mecefo-launch --backend ray) on a real Ray cluster of this
machine (ray.cluster_utils: a 0-CPU head and one 1-CPU node per host, each node with a
snapshot directory of its own): a trainer SIGKILLed, a node removed, a trainer SIGSTOPped; the
run equals the one-process replay of its failures.txt, and nothing is left after it."""
import contextlib
import json
import os
import re
import shlex
import signal
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from benchmarks.ray_cluster import local_cluster, node_processes, remove_node
from deploy import pod_controller as pc
from mecefo_jax import job_rules, launch, ray_driver, ray_host
from mecefo_jax.config import ConfigError
from mecefo_jax.records import history
from mecefo_jax.records.history import Kind
from mecefo_jax.records.job import BAD_INPUT, PEER_LOST, STOPPED, process_state
from mecefo_jax.run import cli
from mecefo_jax.supervisor import free_port
from mecefo_jax.records.run_state import RUN_STATE
from procs import ROOT, TINY, error_lines, report, wait_for

# The SIGSTOP comes a step after the third start (~step 4): the rest trains after the stall.
STEPS = 30
# ordered_reduce: the params bit-identical to the one-process replay (docs/multiprocess.md).
ARGS = ['mesh.slice=3', 'mesh.fsdp=1', 'mesh.ordered_reduce=true', *TINY, f'train.steps={STEPS}',
        'train.log_every=1', 'snapshot.every=1', 'train.eval_every=0']


def _events(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _rows(run: Path) -> int:
  path = run / 'metrics.jsonl'
  return path.read_text().count('"step"') if path.exists() else 0


def _last(events: Path, kind: str) -> dict | None:
  return next((e for e in reversed(_events(events)) if e['kind'] == kind), None)


def _gone(pid: int) -> bool:
  return process_state(pid) in (None, 'Z')


def test_a_lost_actor_is_a_death_and_a_survivors_exit_is_not():
  # An actor Ray declares dead reads as its trainer killed (ray_driver.RayProcess).
  assert job_rules.dead({0: -signal.SIGKILL, 1: PEER_LOST, 2: STOPPED, 3: 0, 4: 1}) == [0, 4]
  assert job_rules.exit_text(-signal.SIGKILL) == 'killed by SIGKILL'


def test_a_host_needs_a_node_with_its_resources_and_gpus_add_their_own():
  args = launch.parse_args(['-n', '2', '--backend', 'ray', '--gpus', '--devices-per-process', '4',
                            '--ray-resources', 'CPU=8,TPU=0', '--', '--out', 'r'])
  assert ray_driver.host_resources(args) == {'CPU': 8.0, 'TPU': 0.0, 'GPU': 4.0}
  assert launch.parse_args(['-n', '2']).ray_resources == {'CPU': 1.0}


def _node(i: int, tpu_slice: str | None = None, worker: int = 0, alive: bool = True) -> dict:
  """A node as ray.nodes() describes it; a TPU VM's with the labels Ray gives it."""
  labels = {} if tpu_slice is None else {ray_driver.SLICE_LABEL: tpu_slice,
                                         ray_driver.WORKER_LABEL: str(worker)}
  return {'NodeID': f'n{i}', 'Alive': alive, 'Resources': {'CPU': 1.0}, 'Labels': labels}


def test_a_tpu_slice_is_placed_in_its_worker_order_and_leaves_and_rejoins_whole(
    monkeypatch, tmp_path):
  import ray
  nodes = [_node(0, 'b', 1), _node(1, 'a', 1), _node(2, 'a', 0), _node(3, 'b', 0), _node(4),
           _node(5, 'c', 0), _node(6, 'c', 1, alive=False)]
  monkeypatch.setattr(ray, 'nodes', lambda: nodes)
  monkeypatch.setattr(ray_driver, '_NODES_S', 0.0)  # every look asks Ray
  need = {'CPU': 1.0}
  assert ray_driver.usable_groups(need) == [(f'n{i}',) for i in range(6)]
  assert ray_driver.usable_groups(need, 2) == [('n2', 'n1'), ('n3', 'n0')]  # c: one node down
  with pytest.raises(ConfigError, match=r'^--backend ray: the cluster has 2 whole TPU slice\(s\) '
                                        r'of 2 nodes .* -n 6 needs 3 '):
    ray_driver.check_cluster(6, need, 2)
  run = tmp_path / 'run'
  args = launch.parse_args(['-n', '4', '--backend', 'ray', '--slice-hosts', '2',
                            '--rejoin-after', '0', '--', '--out', str(run)])
  driver = ray_driver.RayDriver(args)
  assert [driver.node_of(h) for h in range(4)] == ['n2', 'n1', 'n3', 'n0']
  restarts = []
  monkeypatch.setattr(driver, 'kill_all', lambda: None)
  monkeypatch.setattr(driver, '_restart', lambda: restarts.append(list(driver.hosts)))
  run.mkdir()
  (run / RUN_STATE).write_text('{}')  # the run exists: a restart of the survivors
  driver._without(3)  # host 3 died: its slice's host 2 leaves with it
  assert restarts == [[0, 1]] and sorted(driver.ready_at) == [2, 3]
  nodes[0]['Alive'] = False  # slice b is no longer whole, and no spare slice is
  assert driver._coming() == {}
  nodes[0]['Alive'] = True  # slice b whole again: its own hosts come back on it, both
  assert sorted(driver._coming()) == [2, 3] and driver.group_of[1] == ('n3', 'n0')
  nodes[0]['Alive'], nodes[6]['Alive'] = False, True  # b lost, c whole: c is theirs now
  assert sorted(driver._coming()) == [2, 3] and driver.group_of[1] == ('n5', 'n6')


def test_a_job_of_one_tpu_slice_waits_for_it_whole(monkeypatch, tmp_path):
  import ray
  nodes = [_node(0, 'a', 0), _node(1, 'a', 1)]
  monkeypatch.setattr(ray, 'nodes', lambda: nodes)
  monkeypatch.setattr(ray_driver, '_NODES_S', 0.0)
  run = tmp_path / 'run'
  driver = ray_driver.RayDriver(launch.parse_args(
      ['-n', '2', '--backend', 'ray', '--slice-hosts', '2', '--rejoin-after', '0', '--',
       '--out', str(run)]))
  restarts = []
  monkeypatch.setattr(driver, 'kill_all', lambda: None)
  monkeypatch.setattr(driver, '_restart', lambda: restarts.append(list(driver.hosts)))
  run.mkdir()
  (run / RUN_STATE).write_text('{}')
  driver._without(0)
  assert restarts == [[0, 1]] and driver.rejoins == 2 and driver.ready_at == {}


class _LeftActor:
  """An actor that is gone: every look at it raises Ray's error (fake_ray's ray.get)."""
  class look:
    @staticmethod
    def remote():
      return 'a look'


def _left(monkeypatch, tmp_path, away: bool, stopped_since_start: bool):
  """A 2-host driver whose actors are both gone at its next look; (driver, restarts)."""
  import ray
  from ray.exceptions import RayError
  monkeypatch.setattr(ray, 'nodes', lambda: [_node(0), _node(1)])
  monkeypatch.setattr(ray, 'wait', lambda refs, **_: (refs, []))
  monkeypatch.setattr(ray, 'get', lambda ref, **_: (_ for _ in ()).throw(
      RayError('The actor died unexpectedly before finishing this task.')))
  run = tmp_path / 'run'
  driver = ray_driver.RayDriver(launch.parse_args(
      ['-n', '2', '--backend', 'ray', '--stopped-s', '5', '--', '--out', str(run)]))
  run.mkdir()
  (run / RUN_STATE).write_text('{}')
  history.append(run, Kind.STOP, step=7, why='a stop agreed by the job')
  # This job started before that stop, or after it (the stop: an earlier job's); history's
  # clock is rounded to ms.
  driver.job_started_t = time.time() + (-1 if stopped_since_start else 1)
  driver.procs = {h: ray_driver.RayProcess(_LeftActor, None) for h in (0, 1)}
  for proc in driver.procs.values():
    proc._pid = 1234
  driver.looked_at = time.monotonic() - (60 if away else 0)  # a gap in its looks: stopped
  restarts = []
  monkeypatch.setattr(driver, '_restart', lambda: restarts.append(list(driver.hosts)))
  return driver, restarts


def test_actors_gone_at_their_lease_are_the_jobs_stop_taken_back_not_deaths(monkeypatch,
                                                                            tmp_path):
  """A driver stopped past --stopped-s: the job stops itself at an agreed step and each actor
  leaves once its lease ran out (ray_host.py). Running again, the driver finds them gone: a stop
  that it takes back from that step, as the local supervisor does, not a death of each host
  (seen in the Ray soak: a death, a restart without the host, then its grow-back)."""
  driver, restarts = _left(monkeypatch, tmp_path, away=True, stopped_since_start=True)
  driver._watch()
  assert [p.returncode for p in driver.procs.values()] == [STOPPED, STOPPED]
  kinds = [line.kind for line in history.read(driver.args.out)]
  assert Kind.LAUNCH_TAKE_BACK in kinds and Kind.LAUNCH_ACTOR_LOST not in kinds, kinds
  assert restarts == [[0, 1]] and driver.deaths == 0


@pytest.mark.parametrize('away, stopped_since_start', [(False, True), (True, False)])
def test_actors_gone_otherwise_are_deaths(monkeypatch, tmp_path, away, stopped_since_start):
  """Not stopped (no gap in the driver's looks), or no stop of this job on record: an actor
  gone is its host's death."""
  driver, restarts = _left(monkeypatch, tmp_path, away, stopped_since_start)
  driver._look()
  assert [p.returncode for p in driver.procs.values()] == [-signal.SIGKILL] * 2
  kinds = [line.kind for line in history.read(driver.args.out)]
  assert kinds.count(Kind.LAUNCH_ACTOR_LOST) == 2, kinds


def test_the_kuberay_recipe_runs_the_driver_with_flags_it_accepts():
  """deploy/kuberay-tpu.yaml (not run on a pod): its entrypoint passes mecefo-launch's parser
  and train.py's config; one job host per worker pod, whose chips hold one MeCeFO slice."""
  manifest = yaml.safe_load((ROOT / 'deploy' / 'kuberay-tpu.yaml').read_text())
  assert manifest['kind'] == 'RayJob' and manifest['apiVersion'].startswith('ray.io/')
  command = shlex.split(manifest['spec']['entrypoint'])
  assert command[0] == 'mecefo-launch', command  # the package's console script
  args = launch.parse_args(command[1:])
  [group] = manifest['spec']['rayClusterSpec']['workerGroupSpecs']
  assert args.backend == 'ray' and group['numOfHosts'] == 1
  assert group['replicas'] == group['minReplicas'] == args.num_processes
  [container] = group['template']['spec']['containers']
  chips = int(container['resources']['limits']['google.com/tpu'])
  cfg = cli.new_config(pc.check_train_args(args.train_args))  # exits if refused
  assert cfg.mesh.fsdp * cfg.mesh.tensor == chips == args.devices_per_process
  assert args.ray_resources == {'TPU': float(chips)}
  assert cfg.snapshot.durable_dir.startswith('gs://') and cfg.snapshot.durable_every > 0


def test_no_ray_cluster_is_one_line(tmp_path, capsys, monkeypatch):
  monkeypatch.delenv('RAY_ADDRESS', raising=False)
  address = f'127.0.0.1:{free_port()}'  # nothing listens there
  code = launch.main(['--backend', 'ray', '--address', address, '-n', '2', '--', '--out',
                      str(tmp_path / 'run')])
  [line] = error_lines(capsys.readouterr().err)
  assert code == BAD_INPUT and line.startswith(f"error: --backend ray: no Ray cluster at "
                                               f"'{address}' ("), line
  assert not (tmp_path / 'run').exists()


@pytest.fixture
def cluster(tmp_path):
  default = set(Path('/tmp/ray').glob('session_*'))  # Ray's own place: nothing of ours there
  with local_cluster(3, tmp_path) as c:
    yield c
  # A trainer its Host actor left behind (one that waits in a collective when its test failed
  # mid-job) outlives the cluster: killed here, and an error where its test passed.
  left = [pid for shm in c.dirs.values() for pid in node_processes(shm)]
  for pid in left:
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, signal.SIGKILL)
  assert not left, f"processes of the cluster's nodes left after its shutdown: {left}"
  assert not c.temp.exists() and set(Path('/tmp/ray').glob('session_*')) == default


def test_ray_runs_the_job_through_a_kill_a_lost_node_and_a_stall(launcher, tmp_path, cluster):
  # A cluster that cannot run the job: one line.
  refused = launcher.run([sys.executable, '-m', 'mecefo_jax.launch', '--backend', 'ray',
                          '--address', cluster.address, '-n', '4', '--', '--out', tmp_path / 'x',
                          *ARGS], timeout=120)
  [line] = error_lines(refused.stderr)
  assert refused.returncode == BAD_INPUT and line.startswith(
      "error: --backend ray: the cluster has 3 node(s) with the resources of a host "
      "({'CPU': 1.0}) among 4 alive; -n 4 needs 4"), refused.stderr[-3000:]

  run, events = tmp_path / 'run', tmp_path / 'events.jsonl'
  out = open(tmp_path / 'driver.log', 'wb')
  driver = launcher.start([sys.executable, '-m', 'mecefo_jax.launch', '--backend', 'ray',
                           '--address', cluster.address, '-n', '3', '--rejoin-after', '0',
                           '--stall-s', '10', '--events', events, '--', '--out', run, *ARGS],
                          stdout=out, stderr=subprocess.STDOUT)
  out.close()

  def trained_again(after: int) -> None:
    """Waits for a job started after event `after` to train a step."""
    def done():
      started = [e for e in _events(events)[after:] if e['kind'] == 'start']
      return started and _rows(run) > rows_at[0]
    rows_at = [_rows(run)]
    wait_for(done, 180, 'the job to train again', driver)

  wait_for(lambda: _rows(run) >= 3, 240, 'three trained steps', driver)
  # 1. A trainer SIGKILLed: the survivors go on; its host (its node alive) rejoins at once.
  os.kill(_last(events, 'start')['pids']['1'], signal.SIGKILL)
  wait_for(lambda: _last(events, 'rejoin'), 180, 'host 1 to rejoin', driver)
  trained_again(len(_events(events)) - 1)
  # 2. Host 2's node removed (its snapshot memory with it): the job goes on without it.
  seen = len(_events(events))
  node_id = _last(events, 'place')['nodes']['2']
  removed = cluster.dirs[node_id]
  remove_node(cluster, node_id)
  trained_again(seen)
  # 3. A trainer SIGSTOPped: named, killed, and the job restarts without that process.
  seen = len(_events(events))
  stopped = _last(events, 'start')['pids']['1']
  os.kill(stopped, signal.SIGSTOP)
  try:
    wait_for(lambda: driver.poll() is not None, 240, 'the run to end')
  finally:
    if not _gone(stopped):
      os.kill(stopped, signal.SIGKILL)
  log = (tmp_path / 'driver.log').read_text(errors='replace')
  assert driver.returncode == 0, log[-5000:]
  kinds = [e['kind'] for e in _events(events) if e['kind'] not in ('place', 'actor-lost')]
  assert kinds == ['start', 'death', 'start', 'rejoin-ready', 'rejoin', 'start', 'death',
                   'start', 'stall', 'wait', 'start', 'end'], kinds
  lost = [e for e in _events(events) if e['kind'] == 'actor-lost']
  assert [e['host'] for e in lost] == [2], lost
  deaths = [e for e in _events(events) if e['kind'] == 'death']
  assert [d['host'] for d in deaths] == [1, 2] and deaths[0]['code'] == -signal.SIGKILL
  [stall] = [e for e in _events(events)[seen:] if e['kind'] == 'stall']
  assert stall['host'] == 1 and stall['stopped'] == [1], stall
  assert _gone(stopped)
  assert 'host 1 stopped first' in log and 'its process is stopped (SIGSTOP)' in log

  result = report(run)
  assert result['steps'] == STEPS and result['samples']['dropped'] == 0, result['samples']
  assert result['recovery']['cause'] == 'stall' and result['recovery']['host'] == 1
  _replay_matches(launcher, run, tmp_path)

  # Nothing left: no trainer, no actor's mark, no snapshot part on a node, no raylet.
  pids = [p for e in _events(events) if e['kind'] == 'start' for p in e['pids'].values()]
  assert all(_gone(p) for p in pids if p > 0)
  assert not [p for d in cluster.dirs.values() for p in d.rglob('*') if p.is_file()]
  assert not removed.exists()  # nothing of the removed node's trainer wrote after it went
  assert not [p for d in cluster.tmps.values() for p in d.iterdir()]  # the actors' marks
  raylets = [n.all_processes for n in cluster.worker_nodes]
  cluster.shutdown()
  assert all(p.process.poll() is not None for n in raylets for ps in n.values() for p in ps)
  assert (cluster.temp / 'session_latest').exists()  # Ray's files went where it was told


def _replay_matches(launcher, run: Path, cwd: Path) -> dict:
  """The run's report, once the one-process replay of its failures.txt (as printed there) gave
  the same params and samples."""
  line = (run / 'failures.txt').read_text().splitlines()[0]
  replay_cmd = re.fullmatch(r'# replay: `(python -m mecefo_jax [^`]*)`', line).group(1)
  replay = launcher.run([sys.executable, *shlex.split(replay_cmd)[1:]], timeout=600,
                        cwd=cwd, env={**launcher.env(), 'PYTHONPATH': str(ROOT)})
  assert replay.returncode == 0, replay.stderr[-3000:]
  result = report(run)
  assert result['params_sha256'] == report(run / 'replay')['params_sha256']
  assert result['samples'] == report(run / 'replay')['samples']
  return result


def test_a_host_runs_the_trainer_as_its_child_and_answers_for_it(tmp_path):
  """ray_host.Host without Ray (the actor's body): it starts `python -m mecefo_jax ARGS` as its
  child, a look says the child's exit code, and close() removes the marks it kept."""
  host = ray_host.Host(0, lease_s=3600.0)  # no lease runs out here (it would end this process)
  log = tmp_path / 'host0.log'
  host.start(['--help'], {}, str(log), stopped_s=60.0)
  assert host.wait() == 0
  seen = host.look()
  assert seen.code == 0 and seen.mark is None
  assert 'usage:' in log.read_text()
  host.close()
  assert not host.marks.exists()


def test_a_lease_that_runs_out_ends_the_pipe_then_the_actor(monkeypatch):
  """A driver killed or stopped (no look for lease_s): the actor closes the write end of the
  pipe its trainer watches (the trainer then stops the job after its next step, snapshotted:
  run/supervised.py, as under a local supervisor that is gone), removes its marks and leaves;
  each look renews the lease."""
  left = threading.Event()
  monkeypatch.setattr(ray_host.Host, '_leave', lambda self: left.set())
  host = ray_host.Host(0, lease_s=1.0)
  deadline = time.monotonic() + 2.5
  while time.monotonic() < deadline:  # looks keep it: 2.5 s, past its 1 s lease
    host.renewed = time.monotonic()  # what look() does, without a child to look at
    time.sleep(0.1)
  assert not left.is_set() and select.select([host.read_fd], [], [], 0)[0] == []
  assert left.wait(10), 'the lease did not run out'
  assert os.read(host.read_fd, 1) == b''  # the trainer's watch sees the end of the pipe
  assert not host.marks.exists()
