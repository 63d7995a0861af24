"""Compiled programs moved onto other devices of the same mesh shape, without an XLA compile.

A program's HLO depends on the shape of its mesh, not on which devices make it up; only the
executable's device assignment and the shardings' device ids do. A move serializes the
executable and loads it back with a device assignment of the new devices, every recorded
device id mapped old -> new (in mesh order). This uses private and experimental JAX APIs
(jax._src.compiler, the unpickler of jax.experimental.serialize_executable): it is tested with
jax 0.10 to 0.11 (requirements.txt), checked by `probe()` on a tiny program (output compared
with a direct compile) once per process, or once per runtime where a program store keeps its
pass (kept_verdict), and never used where the probe fails or on TPU
(jax issue #38004: a cached program loaded on a device subset without device 0 can halt the
runtime, and a probe on one subset does not vouch for another).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.extend
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.experimental import serialize_executable
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mecefo_jax import multihost
from mecefo_jax.config import AUTO_MODES  # train.move_programs

log = logging.getLogger('mecefo')


class _Remapped(serialize_executable._JaxPjrtUnpickler):  # noqa: SLF001 -- see module docstring
  """Unpickles a serialized program with device ids mapped old -> new and the executable loaded
  under a device assignment of the new devices (else it keeps the old assignment)."""

  def __init__(self, payload: bytes, old_ids: Sequence[int], new: Sequence):
    super().__init__(io.BytesIO(payload), new[0].client, list(new))
    self.new_id = {o: n.id for o, n in zip(old_ids, new)}
    self.new_ids = [d.id for d in new]

  def persistent_load(self, pid):
    if pid[0] == 'device':
      return self.devices_by_id[self.new_id[pid[1]]]
    if pid[0] == 'exec':
      from jax._src import compiler
      options = compiler.get_compile_options(
          num_replicas=1, num_partitions=len(self.new_ids),
          device_assignment=np.asarray([self.new_ids]), backend=self.backend)
      return self.backend.deserialize_executable(pid[1], executable_devices=self.execution_devices,
                                                 compile_options=options)
    return super().persistent_load(pid)


@dataclasses.dataclass
class Serialized:
  """A compiled program as bytes, with the ids of the devices it was compiled for (in mesh
  order; they need not exist in the process that loads it)."""
  payload: bytes
  in_tree: Any  # jax.tree_util.PyTreeDef of the arguments
  out_tree: Any
  device_ids: list[int]

  @classmethod
  def of(cls, compiled: jax.stages.Compiled, devices: Sequence) -> 'Serialized':
    return cls(*serialize_executable.serialize(compiled), [d.id for d in devices])

  def load_onto(self, devices: Sequence) -> jax.stages.Compiled:
    if len(devices) != len(self.device_ids):
      raise ValueError(f'a program of {len(self.device_ids)} devices cannot run on {len(devices)}')
    if devices[0].platform == 'cpu':
      _init_lapack()
    unloaded, args_flat, no_kwargs = _Remapped(self.payload, self.device_ids, devices).load()
    return jax.stages.Compiled(unloaded.load(), [], self.in_tree.unflatten(args_flat),
                               self.out_tree, no_kwargs=no_kwargs)


@functools.cache
def _init_lapack() -> None:
  """Readies the CPU's LAPACK kernels for a program this process never lowered. jax fills their
  function table when it lowers a linalg op (QR, SVD: the low-rank bases, ops/basis.py), so a
  program found in the store by its recipe alone would call an empty table: a SIGSEGV at its
  first run. jax's own loader of exported programs does the same (jax._src.export). For every
  program, not only those whose bytes name a LAPACK kernel: a guess at jax's kernel names that
  would fail as a crash, for the ~0.1 s of importing scipy.linalg once per process."""
  from jax._src.lax import linalg
  linalg.initialize_lapack()


def _tiny_program(mesh: Mesh):
  """A sum over the mesh's devices (a collective on two): wrong device ids, a wrong answer."""
  sh = NamedSharding(mesh, P('d'))
  x = jax.ShapeDtypeStruct((len(mesh.devices), 4), jnp.float32, sharding=sh)
  return jax.jit(lambda x: (x * jnp.arange(1.0, 5.0)).sum(0), in_shardings=sh,
                 out_shardings=NamedSharding(mesh, P())).lower(x).compile()


@functools.lru_cache(maxsize=None)
def probe(platform: str) -> str | None:
  """None if moving works on this backend here (a tiny program with a collective, moved onto
  other devices, gives a direct compile's output bit for bit), else why not. With several
  processes every process runs it (the devices are the job's) and all must pass."""
  devices = jax.devices(backend=platform)
  old = devices[:2]
  new = [devices[0], devices[2]] if len(devices) > 2 else old[::-1]
  try:
    moved = Serialized.of(_tiny_program(Mesh(np.asarray(old), ('d',))), old).load_onto(new)
    why = _compare(moved, _tiny_program(Mesh(np.asarray(new), ('d',))), new)
  except Exception as err:  # noqa: BLE001 -- private APIs: any failure means "compile instead"
    why = f'{type(err).__name__}: {err}'
  if jax.process_count() > 1:
    votes = multihost.allgather_json(why)
    why = next((w for w in votes if w is not None), None)
  return why


def _compare(moved, direct, devices) -> str | None:
  """Runs both where this process holds one of `devices`; why their outputs differ, if they do."""
  if not any(d.process_index == jax.process_index() for d in devices):
    return None  # another process runs them
  mesh = Mesh(np.asarray(devices), ('d',))
  x_Dx4 = np.arange(4.0 * len(devices), dtype=np.float32).reshape(len(devices), 4)
  x = jax.make_array_from_callback(x_Dx4.shape, NamedSharding(mesh, P('d')), lambda i: x_Dx4[i])
  got, want = (np.asarray(f(x).addressable_data(0)) for f in (moved, direct))
  same = np.array_equal(got, want)
  return None if same else 'a moved program gave another output than a direct compile'


def enabled(mode: str, platform: str | None = None, verdicts: Path | None = None) -> bool:
  """Whether programs are moved between device sets: `mode` always/never, or auto (every backend
  but TPU, where it is not measured yet), and only where the probe passes (logged if not).
  `verdicts`: a directory (the program store's) where the probe's pass is kept for this
  runtime (kept_verdict). With several processes, every process must call it (the probe runs
  on the job's devices)."""
  if mode not in AUTO_MODES:
    raise ValueError(f'move_programs must be one of {AUTO_MODES}, got {mode!r}')
  platform = platform or jax.default_backend()
  if mode == 'never' or (mode == 'auto' and platform == 'tpu'):
    return False
  if len(jax.devices(backend=platform)) < 2:
    return False  # one device: nothing to move between
  why_not = kept_verdict(platform, verdicts)
  if why_not is not None:
    log.warning('programs are compiled for each set of devices (moving them between sets '
                'failed its probe on %s: %s)', platform, why_not)
    return False
  return True


def kept_verdict(platform: str, directory: Path | None) -> str | None:
  """probe(platform), unless an earlier process's probe of this runtime passed and said so in
  `directory` (a later start of a job, a replay: ~0.3 CPU s less a process on CPU). Its file
  is named after what the probe's outcome depends on (verdict_key). A failure is not kept: it
  may have been its moment's (and costs compiles, never results). With several processes all
  probe unless each of them has the pass kept."""
  path = directory / f'move-probe-{verdict_key(platform)}.passed' if directory else None
  passed = path is not None and path.is_file()
  if jax.process_count() > 1:
    passed = all(multihost.allgather_json(passed))
  if passed:
    return None
  why_not = probe(platform)
  if why_not is None and path is not None:
    _touch(path)
  return why_not


def verdict_key(platform: str) -> str:
  """A digest of what a probe's outcome depends on: this module's code (the loader it tests),
  jax's and jaxlib's versions, the backend, its version and flags (compile_environment), the
  devices' kind and number, the process count."""
  devices = jax.devices(backend=platform)
  parts = (_own_source(), jax.__version__, jaxlib.__version__, *compile_environment(),
           platform, devices[0].device_kind, str(len(devices)), str(jax.process_count()))
  return hashlib.sha256('\0'.join(parts).encode()).hexdigest()[:32]


@functools.cache
def _own_source() -> str:
  """This module's code, read once a process (each Controller asks for the key)."""
  return Path(__file__).read_text()


def compile_environment() -> tuple[str, ...]:
  """What shapes a compile besides its program: the backend and its version, the XLA and
  libtpu flags."""
  backend = jax.extend.backend.get_backend()
  return (backend.platform, backend.platform_version,
          os.environ.get('XLA_FLAGS', ''), os.environ.get('LIBTPU_INIT_ARGS', ''))


def _touch(path: Path) -> None:
  with contextlib.suppress(OSError):  # a full or read-only store: the next process probes again
    path.touch()
