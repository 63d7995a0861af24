"""A Ray cluster of this machine for mecefo-launch --backend ray (tests/test_ray.py, the restart
benchmark): a 0-CPU head and one 1-CPU node per host, each node with a snapshot directory of its
own (all raylets share this machine's /dev/shm otherwise, and a removed node's part would
survive it), small object stores, and every file of Ray's in a short temporary directory
(Unix socket paths)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from mecefo_jax.ray_host import NODE_SNAPSHOT_DIR_ENV
from mecefo_jax.records.job import process_state

REPO = Path(__file__).resolve().parents[1]
_SMALL = dict(object_store_memory=80 << 20, include_dashboard=False)


@contextlib.contextmanager
def local_cluster(nodes: int, root: Path, env: dict[str, str] | None = None,
                  shm_root: Path | None = None):
  """The cluster (ray.cluster_utils.Cluster) with `dirs` and `tmps` {node id: its snapshot
  directory, its TMPDIR; under `root` (the snapshot directories under `shm_root` where given:
  a tmpfs of the caller's): a node's own, as a machine's} and `temp` (Ray's files; removed
  after, with RAY_TMPDIR restored); `env`: more of the nodes' environment."""
  from ray.cluster_utils import Cluster
  temp = Path(tempfile.mkdtemp(prefix='ray', dir='/tmp'))
  before = os.environ.get('RAY_TMPDIR')
  os.environ['RAY_TMPDIR'] = str(temp)  # the address file and the sessions, ours alone
  (temp / 'ray').mkdir()  # where Ray writes the address file
  cluster = None
  try:
    cluster = Cluster(initialize_head=True,
                      head_node_args=dict(num_cpus=0, temp_dir=str(temp), **_SMALL))
    cluster.temp, cluster.dirs, cluster.tmps = temp, {}, {}
    cluster.root, cluster.env, cluster.added = Path(root), env or {}, 0
    cluster.shm_root = Path(shm_root or root)
    for _ in range(nodes):
      add_node(cluster)
    yield cluster
  finally:
    if cluster is not None:
      cluster.shutdown()
    if before is None:
      os.environ.pop('RAY_TMPDIR', None)
    else:
      os.environ['RAY_TMPDIR'] = before
    shutil.rmtree(temp, ignore_errors=True)


def add_node(cluster) -> str:
  """One more 1-CPU node, with a snapshot directory and a TMPDIR of its own; its id."""
  i = cluster.added
  shm, tmp = cluster.shm_root / f'node{i}-shm', cluster.root / f'node{i}-tmp'
  shm.mkdir(parents=True)
  tmp.mkdir()
  node = cluster.add_node(num_cpus=1, env_vars={
      NODE_SNAPSHOT_DIR_ENV: str(shm), 'TMPDIR': str(tmp), 'PYTHONPATH': str(REPO),
      **cluster.env}, **_SMALL)
  cluster.dirs[node.node_id], cluster.tmps[node.node_id] = shm, tmp
  cluster.added += 1
  return node.node_id


def remove_node(cluster, node_id: str, graceful: bool = True, wait_s: float = 30.0) -> None:
  """Node `node_id` removed (not `graceful`: its processes SIGKILLed, its raylet says no
  goodbye), its snapshot directory (its memory) and its TMPDIR with it, once none of its
  processes is left (a machine's memory goes with its processes: a trainer that outlived its
  raylet by a moment must not write its part back; those left after `wait_s` are SIGKILLed)."""
  [node] = [n for n in cluster.worker_nodes if n.node_id == node_id]
  shm = cluster.dirs[node_id]
  cluster.remove_node(node, allow_graceful=graceful)
  deadline = time.monotonic() + wait_s
  while (left := node_processes(shm)) and time.monotonic() < deadline:
    time.sleep(0.1)
  for pid in left:
    with contextlib.suppress(ProcessLookupError):
      os.kill(pid, signal.SIGKILL)
  while node_processes(shm) and time.monotonic() < deadline + 10:
    time.sleep(0.1)
  for folders in (cluster.dirs, cluster.tmps):
    shutil.rmtree(folders.pop(node_id), ignore_errors=True)


def node_processes(shm: Path) -> list[int]:
  """This machine's live processes of the node whose snapshot directory is `shm` (its raylet,
  its workers and their trainers carry it in their environment); zombies are gone already."""
  mark = f'{NODE_SNAPSHOT_DIR_ENV}={shm}'.encode()
  pids = []
  for proc in Path('/proc').iterdir():
    if not proc.name.isdigit():
      continue
    try:
      environ = (proc / 'environ').read_bytes().split(b'\0')
    except OSError:  # gone, or not ours to read
      continue
    if mark in environ and process_state(int(proc.name)) not in (None, 'Z'):
      pids.append(int(proc.name))
  return pids
