"""Compiled programs kept on disk across processes, keyed by what their compile depends on."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import logging
import os
import pickle
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import jaxlib
from jax._src import config as jax_config  # trace_context: what jax's jit cache keys on

from mecefo_jax.model import contract
from mecefo_jax.step import retarget

log = logging.getLogger('mecefo')
FORMAT = 3  # bump when an entry's layout changes: older entries are then misses
SUFFIX = '.jaxprog'
ALIAS = '.alias'  # a recipe's file: the fingerprint its program had when last lowered
CLAIM_S = 600.0  # a claim to compile an entry older than this is stale (its holder is stuck)
PEER_POLL_S = 0.2  # how often a process looks for an entry that another process compiles


_hits = threading.local()  # this thread's hits of JAX's persistent compilation cache


def _count_hit(event: str, **_) -> None:
  if event == '/jax/compilation_cache/cache_hits':
    _hits.n = cache_hits() + 1


jax.monitoring.register_event_listener(_count_hit)


def cache_hits() -> int:
  """Programs this thread loaded from JAX's persistent compilation cache so far."""
  return getattr(_hits, 'n', 0)


# Every XLA compile of this process (jax.monitoring), split by whether it was a booked program
# (the step, eval, refresh and update programs, the initializer: compiled inside `booking()`)
# or anything else (eager ops, conversions): report.json's programs.other_compiles.
_COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'
_compiles = {'booked': 0, 'booked_s': 0.0, 'other': 0, 'other_s': 0.0}
_compiles_lock = threading.Lock()


def _count_compile(event: str, duration: float, **_) -> None:
  if event == _COMPILE_EVENT:
    with _compiles_lock:
      if getattr(_hits, 'booking', False):
        _compiles['booked'] += 1
        _compiles['booked_s'] += duration
      else:
        _compiles['other'] += 1
        _compiles['other_s'] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile)


@contextlib.contextmanager
def booking():
  """Compiles in this thread inside it are a booked program's."""
  _hits.booking = True
  try:
    yield
  finally:
    _hits.booking = False


def compile_counts() -> dict:
  """{'booked', 'booked_s', 'other', 'other_s'}: XLA compiles of this process so far (count,
  seconds)."""
  with _compiles_lock:
    return dict(_compiles)


def fingerprint(lowered: jax.stages.Lowered, devices: Sequence | None, model: str = '') -> str:
  """The key of a compiled program: the identity of its model (model.kind), its lowered module
  (the model, config, shapes, dtypes, shardings and jax config that shape it), its argument and
  result trees (empty containers leave no trace in the module, yet a call checks them), the
  jax/jaxlib versions, the backend and the XLA flags; `devices` (their ids) where the program
  cannot be moved between device sets."""
  h = hashlib.sha256()
  for part in (model, lowered.as_text(), str(lowered.in_tree), str(lowered.out_tree), str(FORMAT),
               jax.__version__, jaxlib.__version__, *retarget.compile_environment(),
               'any' if devices is None else ','.join(str(d.id) for d in devices)):
    h.update(part.encode())
    h.update(b'\0')
  return h.hexdigest()


# Settings that shape no program: where and how often the host writes, logs and saves, the seed
# and the learning rate's schedule (arguments: ops/schedule.py), where the run ends, the
# host-side failure policy (a program's kind and variant: its ProgramKey).
_HOST_ONLY = {'train': ('out_dir', 'log_every', 'eval_every', 'plot', 'compile_cache',
                        'program_store_mb', 'move_programs', 'seed', 'steps', 'samples', 'tokens'),
              'optimizer': ('lr', 'warmup_steps', 'min_lr_ratio'),
              'faults': None, 'snapshot': None}


# AdamW's numbers: compiled into a program that applies the optimizer; any other takes the
# optimizer's state, whose tree they leave as it is (optimizer.grad_clip does not: it adds a
# transform and its state), so its recipe leaves them out.
_OPTIMIZER_VALUES = {'optimizer': ('b1', 'b2', 'eps', 'weight_decay')}


def recipe(cfg, program: tuple, mesh_shape: dict, optimizer: bool = True) -> str:
  """What a program is made from, known without tracing it: the config's program settings
  (without AdamW's numbers where the program does not apply the optimizer:
  `optimizer=False`), `program` (its ProgramKey's shape, or its slices and devices where
  programs do not move), the mesh's axes, the code that builds it (code_identity), jax's trace
  settings, and the versions, backend and flags of its fingerprint: the key of its alias
  (ProgramStore.alias_of). Where it covers all the code that traces the program (covers_code),
  ProgramStore.lookup finds the program by it without lowering; else only by its lowered
  fingerprint."""
  settings = dataclasses.asdict(cfg)
  left_out = dict(_HOST_ONLY)
  for section, fields in ({} if optimizer else _OPTIMIZER_VALUES).items():
    left_out[section] = left_out.get(section, ()) + fields
  for section, fields in left_out.items():
    if fields is None:
      settings.pop(section)
    else:
      settings[section] = {k: v for k, v in settings[section].items() if k not in fields}
  parts = (str(FORMAT), repr(settings), repr(program), repr(sorted(mesh_shape.items())),
           code_identity(cfg.model.kind), *_trace_settings(), *retarget.compile_environment())
  return hashlib.sha256('\0'.join(parts).encode()).hexdigest()


@functools.cache
def code_identity(model_kind: str) -> str:
  """A digest of the source that traces a program: this package's files, the module of a model
  named `module:factory`, and the versions of jax, jaxlib, flax and optax. (A model's helper
  modules are not in it: an edit there leaves an alias stale, which costs a compile, see
  ProgramStore.alias_of.)"""
  package = Path(__file__).resolve().parents[1]
  files = sorted(package.rglob('*.py'))
  module = model_kind.partition(':')[0] if ':' in model_kind else ''
  origin = getattr(sys.modules.get(module), '__file__', None)  # imported: the model was built
  h = hashlib.sha256()
  for path in [*files, *([Path(origin)] if origin else [])]:
    h.update(str(path.relative_to(package) if path.is_relative_to(package) else path).encode())
    h.update(_sha(path.read_bytes()).encode())
  for name in ('jax', 'jaxlib', 'flax', 'optax'):
    h.update(f'{name} {getattr(importlib.import_module(name), "__version__", "")}'.encode())
  return h.hexdigest()


def covers_code(model_kind: str) -> bool:
  """Whether a recipe covers all the code that traces a program of `model_kind`: a built-in
  model's (all in this package). A user's model (`module:factory`) may trace through helper
  modules that code_identity does not read: its programs are looked up by fingerprint."""
  return ':' not in model_kind


def _trace_settings() -> tuple[str, ...]:
  """jax's settings that shape a trace (x64, matmul precision, PRNG, promotion rules, ...): the
  list its own jit cache keys on (a private API), else every setting of jax.config (a change of
  any then costs a lowering). Not the axis environment: programs are lowered outside any trace."""
  try:
    names, values = jax_config.trace_context_names(), jax_config.trace_context()
  except (AttributeError, NotImplementedError):
    names, values = zip(*sorted(jax.config.values.items()))
  return tuple(f'{n}={v!r}' for n, v in zip(names, values) if n != 'axis_env_state') + (
      f'scan_unroll={contract.scan_unroll()!r}',)


# XLA's per-fusion autotune results (GPU GEMM and fusion configs) kept across compiles; jax
# would set it with its persistent cache, which train.py turns off. A compiler option per
# compile, not an XLA flag: the program store's keys do not depend on where the store is.
AUTOTUNE_OPTION = 'xla_gpu_per_fusion_autotune_cache_dir'


def compiler_options(program_store: 'ProgramStore | None', devices: Sequence) -> dict:
  """Options for compiling a program for `devices`: on GPU, with a store, XLA's autotune cache
  in `autotune/<jaxlib version>-<device kind>` under the store; else none."""
  if program_store is None or not devices or _platform(devices) != 'gpu':
    return {}
  kind = ''.join(c if c.isalnum() or c in '.-' else '_' for c in devices[0].device_kind)
  directory = program_store.dir / 'autotune' / f'{jaxlib.__version__}-{kind}'
  directory.mkdir(parents=True, exist_ok=True)
  return {AUTOTUNE_OPTION: str(directory)}


def _platform(devices: Sequence) -> str:
  return devices[0].platform


def open_store(compile_cache: str, max_mb: int) -> 'ProgramStore | None':
  """train.py's program store: `programs/` in the compilation cache directory,
  $JAX_COMPILATION_CACHE_DIR where set, else train.compile_cache ('' = none)."""
  directory = os.environ.get('JAX_COMPILATION_CACHE_DIR') or compile_cache
  return ProgramStore(Path(directory) / 'programs', max_mb << 20) if directory else None


class ProgramStore:
  """One directory of programs `<fingerprint>.jaxprog`, shared by any number of processes and
  runs: written by atomic rename, checked before use (a bad entry is a warning and a miss,
  and is removed), the least recently used evicted above `max_bytes`."""

  def __init__(self, directory: str | Path, max_bytes: int):
    self.dir, self.max_bytes = Path(directory).expanduser(), max_bytes
    self.dir.mkdir(parents=True, exist_ok=True)

  def path(self, key: str) -> Path:
    return self.dir / f'{key}{SUFFIX}'

  @contextlib.contextmanager
  def claim(self, key: str):
    """Yields whether this process should compile `key` for the store: False where another
    live process of this machine holds its claim (processes sharing a store, as a local job's
    do, fill each entry once); a claim of a dead process, or older than CLAIM_S, is taken over."""
    path = self.dir / f'{key}.claim'
    held = _take_claim(path) or (_stale_claim(path) and _take_claim(path))
    try:
      yield held
    finally:
      if held:
        path.unlink(missing_ok=True)

  def fill(self, key: str, compile_into: Callable[[], None],
           give_up: Callable[[], bool] | None = None,
           present: Callable[[], bool] | None = None) -> bool:
    """Sees that entry `key` gets into the store (`present()`, default: its file exists):
    `compile_into()` here, unless a live process of this machine holds `key`'s claim; then
    (`give_up` given) waits until it is present, or the claim is released or goes stale (this
    process then takes it over), or `give_up()`. Whether it is present, or compiled here, when
    it returns: a job's processes split a restart's programs among themselves by claims, and a
    process that dies holding one must not leave the others to report their builds done
    without it. A recipe's claim (ProgramCache) is taken before lowering; `present` reads
    its alias."""
    present = present or (lambda: self.path(key).exists())
    while not present():
      with self.claim(key) as mine:
        if mine:
          compile_into()
          return True
      if give_up is None or give_up():
        return False
      time.sleep(PEER_POLL_S)
    return True

  def alias_of(self, recipe: str) -> str | None:
    """The fingerprint last lowered from `recipe` (ProgramStore.set_alias), where its entry is
    in the store; else None. For the builds of programs ahead of need, which only see that an
    entry is there: a stale alias (code the recipe does not cover, edited) leaves the true
    entry unbuilt, and the process that needs it finds it by its fingerprint or compiles it."""
    try:
      key = (self.dir / f'{recipe}{ALIAS}').read_text()
    except OSError:
      return None
    return key if key and self.path(key).exists() else None

  def set_alias(self, recipe: str, key: str) -> None:
    """Records that `recipe` lowered to fingerprint `key` (atomically; a failed write is a
    later lowering, not an error)."""
    path = self.dir / f'{recipe}{ALIAS}'
    tmp = path.with_name(f'.{path.name}.{os.getpid()}.{threading.get_ident()}.tmp')
    try:
      tmp.write_text(key)
      os.replace(tmp, path)
    except OSError:
      tmp.unlink(missing_ok=True)

  def lookup(self, recipe: str | None,
             key: Callable[[], str] | None) -> retarget.Serialized | None:
    """A program's entry: by `recipe`'s alias where given (nothing lowered; the caller passes
    a recipe only where it covers the program's code, covers_code), else, or where the alias
    names no usable entry, by `key()`, its lowered fingerprint (None: by the alias only)."""
    alias = self.alias_of(recipe) if recipe else None
    entry = self.read(alias) if alias else None
    return entry if entry is not None or key is None else self.read(key())

  def read(self, key: str) -> retarget.Serialized | None:
    """The entry under `key`, checked; None if there is none or it is unusable (warned)."""
    path = self.path(key)
    try:
      blob = path.read_bytes()
    except FileNotFoundError:
      return None
    try:
      entry = pickle.loads(blob)
      why = _mismatch(entry, key)
    except Exception as err:  # noqa: BLE001 -- truncated or corrupt: any error is a miss
      why = f'unreadable ({type(err).__name__}: {err})'
    if why:
      log.warning('program store: entry %s is %s; compiling instead', path.name, why)
      path.unlink(missing_ok=True)
      return None
    os.utime(path)  # recently used: evicted last
    return retarget.Serialized(entry['payload'], entry['in_tree'], entry['out_tree'],
                               entry['device_ids'])

  def write(self, key: str, program: retarget.Serialized) -> None:
    """Stores `program` under `key` (atomically: readers see the whole entry or none)."""
    entry = {'format': FORMAT, 'fingerprint': key, 'device_ids': program.device_ids,
             'payload': program.payload, 'payload_sha256': _sha(program.payload),
             'in_tree': program.in_tree, 'out_tree': program.out_tree}
    path = self.path(key)
    tmp = path.with_name(f'.{path.name}.{os.getpid()}.{threading.get_ident()}.tmp')
    try:
      tmp.write_bytes(pickle.dumps(entry))
      os.replace(tmp, path)
    except OSError as err:  # a full or read-only disk costs later compiles, not the run
      tmp.unlink(missing_ok=True)
      log.warning('program store: could not write %s (%s)', path.name, err)
      return
    self.evict(keep=path)

  def evict(self, keep: Path | None = None) -> None:
    """Removes the least recently used entries until the store fits in max_bytes."""
    entries = []
    for p in self.dir.glob(f'*{SUFFIX}'):
      try:
        st = p.stat()
      except FileNotFoundError:  # another process evicted it
        continue
      entries.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in entries)
    for _, size, p in sorted(entries, key=lambda e: e[0]):
      if total <= self.max_bytes:
        break
      if p != keep:
        p.unlink(missing_ok=True)
        total -= size
    if total < sum(size for _, size, _ in entries):
      self._drop_dangling_aliases()

  def _drop_dangling_aliases(self) -> None:
    """Removes the aliases whose entry was evicted."""
    for alias in self.dir.glob(f'*{ALIAS}'):
      with contextlib.suppress(OSError):
        if not self.path(alias.read_text()).exists():
          alias.unlink()


def _mismatch(entry, key: str) -> str | None:
  """Why `entry` cannot be used as the program `key`, or None."""
  if not isinstance(entry, dict) or entry.get('format') != FORMAT:
    return 'of another format'
  if entry['fingerprint'] != key:
    return 'of another program (fingerprint mismatch)'
  if _sha(entry['payload']) != entry['payload_sha256']:
    return 'corrupt (payload checksum mismatch)'
  return None


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _take_claim(path: Path) -> bool:
  """Creates the claim file `path` (this machine and pid in it); False if it exists. A store
  that cannot be written claims nothing and compiles (its write then fails quietly)."""
  try:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    return False
  except OSError:
    return True
  with os.fdopen(fd, 'w') as f:
    f.write(f'{socket.gethostname()} {os.getpid()}')
  return True


def _stale_claim(path: Path) -> bool:
  """The claim's holder is gone (a process of this machine no longer running) or it is older
  than CLAIM_S; then it is removed."""
  try:
    host, pid = path.read_text().split()
    age = time.time() - path.stat().st_mtime
  except (OSError, ValueError):
    return False  # being written, or just released: the other process's
  gone = host == socket.gethostname() and not Path(f'/proc/{pid}').exists()
  if gone or age > CLAIM_S:
    path.unlink(missing_ok=True)
    return True
  return False
