"""The supervisor's Ray transport (`mecefo-launch --backend ray`): the job's hosts on the nodes of
a running Ray cluster, the supervisor's rules unchanged (supervisor.py).

Each job (each start and restart) gets one fresh actor per host (ray_host.py; max_restarts=0:
a trainer whose jax backend is up cannot join another jax.distributed job), pinned to its host's
node (NodeAffinitySchedulingStrategy, hard), which runs the trainer as its child. The
coordinator is worker 0's node and a port free there. Every look asks each actor for its
trainer's exit code, progress mark and process state (the stall watch reads these, not files);
an actor that Ray declares dead (its node removed or lost) is the death of its host. After a
death or a stall the job restarts without that host, as the local supervisor's does; the host
rejoins (after --rejoin-after) once its node is alive, or a spare node Ray provides (one with
the resources and no host of the job) takes its place. A driver killed or stopped: the actors
are detached and hold a lease that every look renews; past --stopped-s the job stops at an
agreed step (snapshotted) and the actors leave (ray_host.py); a driver that runs again finds
them gone after that stop, which is no death: it takes the job back from the stopped step, as
the local supervisor does. With --slice-hosts K (TPU VMs),
hosts K*u .. K*u+K-1 run on the K nodes of one TPU slice (Ray's slice-name label), in its
worker order: a death of one of them takes its whole slice out of the job, which rejoins once
that slice (or a spare one) is whole and alive; --megascale numbers the job's slices for
multislice (docs/tpu.md).

Why raw actors, not Ray Train's JaxTrainer: its worker group restarts whole and waits for the
missing node; MeCeFO goes on at once with the survivors, each keeping its logical host and its
snapshot part on its node. Every node runs this package (installed, or on its PYTHONPATH), and
--out (the run directory) is a directory that every node and the driver reach (as it is on
one machine); docs/multiprocess.md.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import time

import ray
from ray.exceptions import ActorUnavailableError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from mecefo_jax.config import ConfigError
from mecefo_jax.job_rules import megascale_env, tpu_slice
from mecefo_jax.ray_host import NODE_SNAPSHOT_DIR_ENV, Host
from mecefo_jax.records import history
from mecefo_jax.records.history import Kind
from mecefo_jax.records.job import STOPPED, HostLook
from mecefo_jax.records.progress_marks import ProgressMark
from mecefo_jax.supervisor import Supervisor

NAMESPACE = 'mecefo'  # detached actors live in a named namespace
# The driver's environment that every trainer gets, wherever it runs (its node's own for the
# rest: its Python, paths, the GPUs Ray gave its actor).
FORWARDED = ('JAX_', 'XLA_', 'MECEFO_', 'TPU_', 'MEGASCALE_', 'NCCL_', 'PYTHONUNBUFFERED')
_NOT_FORWARDED = (NODE_SNAPSHOT_DIR_ENV, 'CUDA_VISIBLE_DEVICES')
_CALL_S = 60.0  # an actor's start, kill or wait (its node's worker start-up included)
_LOOK_S = 2.0  # a look waits this long for the actors' answers; the others answer next time
_NODES_S = 1.0  # ray.nodes() asked at most this often
_CONNECT_S = 10.0  # the cluster's address takes a connection within this
# Ray's labels of a TPU VM's node: its slice's name, its index in the slice (--slice-hosts).
SLICE_LABEL, WORKER_LABEL = 'ray.io/tpu-slice-name', 'ray.io/tpu-worker-id'


def connect(address: str | None) -> None:
  """Connects to the running cluster at `address` (else $RAY_ADDRESS, else the local one);
  ConfigError (one line) where none runs."""
  address = address or os.environ.get('RAY_ADDRESS') or 'auto'
  try:
    _reachable(address)
    ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
  except (OSError, RuntimeError, ValueError) as err:  # ConnectionError is an OSError
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    raise ConfigError(f'--backend ray: no Ray cluster at {address!r} ({reason}); start one '
                      '(`ray start --head`, KubeRay) or pass --address') from None


def _reachable(address: str) -> None:
  """An OSError where HOST:PORT takes no connection (ray.init would retry it for minutes)."""
  host, sep, port = address.rpartition(':')
  if sep and port.isdigit() and '://' not in address:
    socket.create_connection((host, int(port)), timeout=_CONNECT_S).close()


def host_resources(args) -> dict[str, float]:
  """What one host's actor holds on its node: --ray-resources, and K GPUs with --gpus."""
  need = dict(args.ray_resources)
  if args.gpus:
    need['GPU'] = float(args.devices_per_process)
  return need


def usable_groups(need: dict[str, float], slice_hosts: int = 1) -> list[tuple[str, ...]]:
  """The alive nodes with `need` among their resources, in a stable order: one node a group
  with `slice_hosts` 1; else the TPU slices (Ray's ray.io/tpu-slice-name label) whose
  `slice_hosts` nodes are all alive and usable, each in its TPU worker order."""
  nodes = sorted((n for n in ray.nodes() if n['Alive'] and
                  all(n['Resources'].get(k, 0) >= v for k, v in need.items())),
                 key=lambda n: n['NodeID'])
  if slice_hosts == 1:
    return [(n['NodeID'],) for n in nodes]
  slices: dict[str, list[dict]] = {}
  for n in nodes:
    name = n.get('Labels', {}).get(SLICE_LABEL)
    if name:
      slices.setdefault(name, []).append(n)
  return [tuple(n['NodeID'] for n in sorted(members, key=_worker_id))
          for _, members in sorted(slices.items()) if len(members) == slice_hosts]


def _worker_id(node: dict) -> int:
  return int(node.get('Labels', {}).get(WORKER_LABEL, 0))


def check_cluster(n: int, need: dict[str, float], slice_hosts: int = 1) -> list[tuple[str, ...]]:
  """The groups (usable_groups) for a job of n hosts; ConfigError (one line) where the cluster
  has fewer."""
  groups, units = usable_groups(need, slice_hosts), n // slice_hosts
  if len(groups) < units:
    alive = [x for x in ray.nodes() if x['Alive']]
    what = ('node(s)' if slice_hosts == 1 else f'whole TPU slice(s) of {slice_hosts} nodes '
            f'(label {SLICE_LABEL})')
    raise ConfigError(f'--backend ray: the cluster has {len(groups)} {what} with the resources '
                      f'of a host ({need}) among {len(alive)} alive; -n {n} needs {units} (one '
                      'host per node)')
  return groups[:units]


class RayProcess:
  """A host's trainer as the supervisor sees a process: its actor answers for it, through the
  driver's looks (`seen`: the last answer)."""

  def __init__(self, actor, started):
    self.actor, self._started, self._pid = actor, started, None
    self.returncode: int | None = None
    self.seen = HostLook()
    self.lost: str | None = None  # why the actor is gone (Ray's words), once it is

  @property
  def pid(self) -> int:
    """The trainer's pid on its node (-1: its actor never started it)."""
    if self._pid is None:
      self._pid = self._call(self._started, -1)
    return self._pid

  def _gone(self, err: BaseException) -> None:
    """The actor is gone (its node, or it was killed): the trainer died with it."""
    self.lost = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    self.returncode = -signal.SIGKILL if self.returncode is None else self.returncode

  def _call(self, ref, otherwise):
    try:
      return ray.get(ref, timeout=_CALL_S)
    except RayError as err:  # the actor gone, not answering, or its call failed
      self._gone(err)
      return otherwise

  def answer(self, ref) -> None:
    """Takes the actor's answer to a look."""
    try:
      self.seen = ray.get(ref)
    except ActorUnavailableError:
      return  # unreachable for now: Ray says whether it is dead
    except RayError as err:
      self._gone(err)
      return
    if self.seen.code is not None:
      self.returncode = self.seen.code

  def poll(self) -> int | None:
    return self.returncode

  def wait(self) -> int:
    if self.returncode is None:
      self.returncode = self._call(self.actor.wait.remote(), -signal.SIGKILL)
    return self.returncode

  def kill(self) -> None:
    if self.returncode is None and self.pid > 0:
      self.returncode = self._call(self.actor.kill.remote(), -signal.SIGKILL)

  def send_signal(self, signum: int) -> None:
    if self.returncode is None and self.pid > 0:
      self.actor.signal.remote(signum)  # a look sees what follows


class _Seen:
  """The stall watch's reader of a Ray job: what the actors' last answers say."""

  def __init__(self, driver: RayDriver):
    self.driver = driver

  def _seen(self, host: int) -> HostLook:
    proc = self.driver.procs.get(host)
    return proc.seen if proc is not None else HostLook()

  def mark(self, host: int, pid: int) -> ProgressMark | None:
    return self._seen(host).mark

  def state(self, host: int, pid: int) -> str | None:
    return self._seen(host).state

  def cpu_seconds(self, host: int, pid: int) -> float | None:
    return self._seen(host).cpu


class RayDriver(Supervisor):
  """The supervisor with its hosts' processes on Ray nodes (see the module's docstring)."""

  def __init__(self, args):
    super().__init__(args)
    self.need, self.k = host_resources(args), args.slice_hosts
    # TPU slice u (hosts K*u .. K*u+K-1) -> its nodes, host K*u+w on the w-th.
    self.group_of = dict(enumerate(check_cluster(len(self.hosts), self.need, self.k)))
    self.actors: dict[int, object] = {}
    self.coordinator: str | None = None
    self._nodes, self._nodes_at = [], -_NODES_S
    self.job_started_t = time.time()  # the job started last (history.jsonl's clock)
    if self.watch:
      self.watch.reader = _Seen(self)

  def _alive(self) -> list[tuple[str, ...]]:
    """The usable groups of nodes now (asked of Ray at most every _NODES_S)."""
    if time.monotonic() - self._nodes_at >= _NODES_S:
      self._nodes, self._nodes_at = usable_groups(self.need, self.k), time.monotonic()
    return self._nodes

  def node_of(self, host: int) -> str:
    return self.group_of[host // self.k][host % self.k]

  def _port(self) -> int:
    """The job's actors, one per host on its node; the coordinator on worker 0's node."""
    self._release()
    self.job_started_t = time.time()
    options = dict(max_restarts=0, lifetime='detached', num_cpus=self.need.get('CPU', 0),
                   num_gpus=self.need.get('GPU', 0),
                   resources={k: v for k, v in self.need.items() if k not in ('CPU', 'GPU')})
    actor = ray.remote(Host)
    for h in self.hosts:
      self.actors[h] = actor.options(
          name=f'{self.args.out.name}-host{h}-{os.getpid()}-{self.restarts}', **options,
          scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_of(h), soft=False),
      ).remote(h, self.args.stopped_s)
    self.say(Kind.LAUNCH_PLACE,
             f'hosts {self.hosts} on Ray nodes {[self.node_of(h)[:8] for h in self.hosts]}',
             nodes={h: self.node_of(h) for h in self.hosts})
    try:
      self.coordinator, port = None, 0
      ip, port = ray.get(self.actors[self.hosts[0]].where.remote(), timeout=_CALL_S)
      self.coordinator = f'{ip}:{port}'
    except RayError:
      pass  # worker 0's actor never came: its death, seen at the first look
    return port

  def spawn(self, pid: int, host: int, n: int, port: int) -> RayProcess:
    cmd, env = self.command(pid, host, n, port)
    args = [f'--coordinator={self.coordinator}' if a.startswith('--coordinator=') else a
            for a in cmd[3:]]  # after `python -m mecefo_jax`: the node's Python runs it
    env = {k: v for k, v in env.items() if k.startswith(FORWARDED) and k not in _NOT_FORWARDED}
    if 'TPU' in self.need:  # the node's TPU chips, not CPU devices (the local default)
      args = [a for a in args if not a.startswith('--host-devices=')]
      env['JAX_PLATFORMS'] = os.environ.get('JAX_PLATFORMS', 'tpu')
    if self.args.megascale and self.coordinator is not None:
      env.update(megascale_env(self.hosts, host, self.k, self.coordinator.rpartition(':')[0]))
    log = str(self._log(host))  # on the node; process 0's stderr also shown here by Ray
    actor = self.actors[host]
    if self.coordinator is None:
      proc = RayProcess(actor, None)
      proc._gone(RuntimeError(f'the actor of host {self.hosts[0]} (process 0) did not start'))
      proc._pid = -1
      return proc
    return RayProcess(actor, actor.start.remote(args, env, log, self.args.stopped_s, pid == 0))

  def _watch(self) -> int | None:
    self._look()
    return super()._watch()

  def _look(self) -> None:
    """Asks every running host's actor for its trainer's state (renewing their leases)."""
    live = {h: p for h, p in self.procs.items() if p.returncode is None}
    refs = {h: p.actor.look.remote() for h, p in live.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=_LOOK_S)
    stopped_itself = None  # whether the job stopped itself while this driver was stopped
    for h, ref in refs.items():
      if ref in ready:
        live[h].answer(ref)
        if live[h].lost and stopped_itself is None:
          stopped_itself = self._stopped_at_lease()
        if live[h].lost and stopped_itself:
          # Its lease ran out: its trainer stopped at the job's agreed step, then it left.
          live[h].returncode, live[h].lost = STOPPED, None
        elif live[h].lost:
          self.say(Kind.LAUNCH_ACTOR_LOST,
                   f'host {h}\'s actor is gone ({live[h].lost}): its trainer died with it',
                   host=h, why=live[h].lost)

  def _stopped_at_lease(self) -> bool:
    """This driver was stopped past --stopped-s (a gap in its looks) and the job it started
    last has stopped itself since (history.jsonl's stop, written once every process agreed on
    the step): its actors left when their leases ran out (ray_host.py), no host died."""
    if not (self.away or time.monotonic() - self.looked_at > self.args.stopped_s):
      return False
    stops = [line for line in history.read(self.args.out, warn=False) if line.kind is Kind.STOP]
    return bool(stops) and stops[-1].t >= self.job_started_t

  def words(self, host: int) -> str:
    return self.procs[host].seen.words or ''  # its actor's, with the exit code

  def kill_first(self, host: int) -> None:
    self.procs[host].kill()

  def kill_all(self) -> None:
    super().kill_all()
    self._release()

  def _release(self) -> None:
    """The actors of the job that ended leave (their node's resources freed for the next)."""
    closing = [a.close.remote() for a in self.actors.values()]
    ray.wait(closing, num_returns=len(closing), timeout=_LOOK_S * 5)  # a lost node's: never
    for actor in self.actors.values():
      ray.kill(actor)
    self.actors = {}

  def _coming(self) -> dict[int, float]:
    """The absent hosts with nodes for them now, a TPU slice's all at once: their own nodes,
    alive, else a spare group (alive, with the resources, no host on it), which becomes theirs."""
    alive, taken = self._alive(), {self.group_of[h // self.k] for h in self.hosts}
    absent = sorted({h // self.k for h in self.ready_at},
                    key=lambda u: self.ready_at[u * self.k])
    own = {u for u in absent if self.group_of[u] in alive and self.group_of[u] not in taken}
    taken |= {self.group_of[u] for u in own}
    spare, coming = [g for g in alive if g not in taken], {}
    for u in absent:
      if u not in own and spare:
        self.group_of[u] = spare.pop(0)
      if u in own or self.group_of[u] not in taken and self.group_of[u] in alive:
        coming.update({h: self.ready_at[h] for h in tpu_slice(u * self.k, self.k)})
        taken.add(self.group_of[u])
    return coming
