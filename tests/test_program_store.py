"""The program store: programs loaded by later processes onto any slices, bad entries refused."""
import functools
import logging
import os
import re
import shutil
import threading

import jax
import jaxlib
import numpy as np
import pytest

from mecefo_jax import sharding
from mecefo_jax.config import load_config
from mecefo_jax.model import contract, llama, train_state
from mecefo_jax.step import program_store, retarget
from mecefo_jax.core.programs import (EVAL, FUSED, GROUP, REFRESH_COLD, REFRESH_WARM, REJOIN,
                                      UPDATE, ProgramKey)
from mecefo_jax.core.roles import Role
from mecefo_jax.step.cache import ProgramCache
from mecefo_jax.step.lowering import LOWER
import procs

pytestmark = pytest.mark.usefixtures('devices')
TINY = ['model.d_model=32', 'model.n_heads=2', 'model.ffn_dim=48', 'model.seq_len=16',
        'model.n_layers=1', 'model.vocab_size=64', 'train.micro_batch=4', 'mesh.slice=4',
        'mesh.fsdp=2']
CFG = load_config(None, TINY)
# The built-in llama named as a user's model: a recipe does not cover a user's helper modules.
USER_CFG = load_config(None, [*TINY, 'model.kind=mecefo_jax.model.llama:LLaMA'])
SLICES = sharding.PresentSlices(sharding.make_mesh(CFG.mesh), (0, 1, 2, 3))
GRAPHDEF = llama.abstract(CFG.model)[0]


def _cache(program_store, move=True, cfg=CFG) -> ProgramCache:
  """A fresh cache (as in a new process) over the store."""
  return ProgramCache(cfg, SLICES, GRAPHDEF, lambda s: None, move=move,
                      program_store=program_store)


@functools.lru_cache(maxsize=None)
def _inputs(slices):
  """Fixed params and tokens on `slices`, made once per slices (a new jit of the initializer
  each call was a compile each call; the eval program donates neither)."""
  mesh = SLICES.sub(slices)
  params = jax.jit(lambda: train_state.init_state(CFG).params,
                   out_shardings=train_state.state_shardings(CFG, mesh).params)()
  tokens = np.random.default_rng(0).integers(0, 64, (len(slices), 4, 17)).astype(np.int32)
  return params, jax.device_put(tokens, sharding.batch_sharding(mesh))


def _loss(program, slices):
  """The eval program's output on `slices` for fixed params and tokens."""
  out = program(*_inputs(slices))
  return {k: np.asarray(v) for k, v in out.items()}


@functools.lru_cache(maxsize=None)
def _direct(slices):
  """The eval program compiled for `slices` (no store, no move)."""
  return LOWER['eval'](CFG, SLICES.sub(slices), GRAPHDEF, None).compile()


def _counts(cache):
  return {k: getattr(cache.stats, k) for k in ('compiled', 'loaded', 'moved')}


def test_a_later_process_loads_a_stored_program_onto_any_slices_of_its_shape(tmp_path):
  programs = program_store.ProgramStore(tmp_path, 1 << 30)
  _cache(programs).program(ProgramKey(EVAL, (0, 1)))
  later = _cache(programs)
  loaded = later.program(ProgramKey(EVAL, (2, 3)))
  assert _counts(later) == {'compiled': 0, 'loaded': 1, 'moved': 0}
  got, want = _loss(loaded, (2, 3)), _loss(_direct((2, 3)), (2, 3))
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k])
  # Where programs are not moved, an entry serves its own devices only (the key holds them).
  fixed = _cache(programs, move=False)
  fixed.program(ProgramKey(EVAL, (2, 3)))
  assert _counts(fixed) == {'compiled': 1, 'loaded': 0, 'moved': 0}
  again = _cache(programs, move=False)
  again.program(ProgramKey(EVAL, (2, 3)))
  assert _counts(again) == {'compiled': 0, 'loaded': 1, 'moved': 0}


def _truncate(path):
  path.write_bytes(path.read_bytes()[:1000])


def _flip_payload(path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF  # inside the executable's bytes: the checksum catches it
  path.write_bytes(bytes(data))


def _another_programs_entry(path):
  other = next(p for p in path.parent.glob(f'*{program_store.SUFFIX}') if p != path)
  path.write_bytes(other.read_bytes())


@pytest.fixture(scope='module')
def two_entries(tmp_path_factory):
  """A store as a first process leaves it: the eval programs of (0, 1) and (0,), compiled once
  for the module (each damage case used to compile both again)."""
  path = tmp_path_factory.mktemp('two_entries')
  first = _cache(program_store.ProgramStore(path, 1 << 30))
  first.program(ProgramKey(EVAL, (0, 1)))
  first.program(ProgramKey(EVAL, (0,)))  # a second entry
  assert _counts(first) == {'compiled': 2, 'loaded': 0, 'moved': 0}
  return path


@pytest.mark.parametrize('damage', [_truncate, _flip_payload, _another_programs_entry,
                                    lambda p: p.write_bytes(b'not a program')])
def test_a_bad_entry_is_a_warning_and_a_compile_then_is_replaced(two_entries, tmp_path, damage,
                                                                caplog):
  shutil.copytree(two_entries, tmp_path / 'store')  # each test damages a copy of its own
  programs = program_store.ProgramStore(tmp_path / 'store', 1 << 30)
  assert len(list(programs.dir.glob(f'*{program_store.SUFFIX}'))) == 2
  damage(programs.path(_key((0, 1))))
  later = _cache(programs)
  with caplog.at_level(logging.WARNING, 'mecefo'):
    program = later.program(ProgramKey(EVAL, (2, 3)))
  assert _counts(later) == {'compiled': 1, 'loaded': 0, 'moved': 0}
  assert 'program store: entry' in caplog.text and 'compiling instead' in caplog.text
  np.testing.assert_array_equal(_loss(program, (2, 3))['loss_sum'],
                                _loss(_direct((2, 3)), (2, 3))['loss_sum'])
  healed = _cache(programs)
  healed.program(ProgramKey(EVAL, (1, 2)))
  assert _counts(healed) == {'compiled': 0, 'loaded': 1, 'moved': 0}


def _key(slices):
  return program_store.fingerprint(LOWER['eval'](CFG, SLICES.sub(slices), GRAPHDEF, None), None,
                                   CFG.model.kind)


def test_the_key_covers_the_model_xla_flags_and_where_programs_do_not_move_their_devices(monkeypatch):
  a, b = SLICES.sub((0, 1)), SLICES.sub((2, 3))
  low_a, low_b = (LOWER['eval'](CFG, m, GRAPHDEF, None) for m in (a, b))
  assert program_store.fingerprint(low_a, None) == program_store.fingerprint(low_b, None)
  assert program_store.fingerprint(low_a, list(a.devices.flat)) != program_store.fingerprint(low_b, list(b.devices.flat))
  before = program_store.fingerprint(low_a, None)
  assert program_store.fingerprint(low_a, None, 'own_model:Model') != before  # the model's name
  monkeypatch.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', '') + ' --xla_cpu_enable_fast_math=true')
  assert program_store.fingerprint(low_a, None) != before


def test_the_key_covers_the_argument_trees_that_leave_no_trace_in_the_module():
  """An empty container is no argument of the module, yet a call checks the tree (a state with
  `bases: {}`, gaussian bases, is not a state with svd bases' empty entry)."""
  double = jax.jit(lambda state: state['x'] * 2)
  x = np.ones(4, np.float32)
  plain, with_empty = double.lower({'x': x}), double.lower({'x': x, 'bases': {}})
  assert plain.as_text() == with_empty.as_text()
  assert program_store.fingerprint(plain, None) != program_store.fingerprint(with_empty, None)


def _entry(n_bytes: int) -> retarget.Serialized:
  return retarget.Serialized(bytes(n_bytes), jax.tree.structure(0), jax.tree.structure(0), [0])


def test_the_least_recently_used_entries_are_evicted_above_the_size_limit(tmp_path):
  programs = program_store.ProgramStore(tmp_path, 25_000)
  programs.write('a', _entry(10_000))
  programs.write('b', _entry(10_000))
  for age, key in ((300, 'a'), (200, 'b')):
    t = programs.path(key).stat().st_mtime - age
    os.utime(programs.path(key), (t, t))
  assert programs.read('a') is not None  # used: now the newest
  programs.write('c', _entry(10_000))
  assert {p.stem for p in tmp_path.glob(f'*{program_store.SUFFIX}')} == {'a', 'c'}
  programs.set_alias('recipe-of-c', 'c')
  assert programs.alias_of('recipe-of-c') == 'c'
  programs.write('huge', _entry(40_000))  # larger than the limit: kept alone
  assert {p.stem for p in tmp_path.glob(f'*{program_store.SUFFIX}')} == {'huge'}
  assert programs.alias_of('recipe-of-c') is None  # its entry evicted: the alias goes too
  assert not list(tmp_path.glob(f'*{program_store.ALIAS}'))


def _recipe(cfg, program=('eval', 2, None), optimizer=True):
  return program_store.recipe(cfg, program, {'slice': 2, 'fsdp': 2, 'tensor': 1}, optimizer)


HOST_ONLY = ['train.out_dir=elsewhere', 'train.log_every=1', 'train.eval_every=3',
             'train.seed=5', 'snapshot.every=1', 'snapshot.durable_every=3',
             'faults.precompile=never', 'faults.takeover=spread',
             # the schedule (an argument of the programs that apply the optimizer) and the end
             'train.steps=7', 'train.samples=99', 'optimizer.lr=0.5', 'optimizer.warmup_steps=3',
             'optimizer.min_lr_ratio=0.5']


def test_a_recipe_follows_what_shapes_a_program_not_where_the_run_writes(monkeypatch):
  base = _recipe(CFG)
  assert _recipe(load_config(None, [*TINY, *HOST_ONLY])) == base
  assert _recipe(load_config(None, [*TINY, 'optimizer.b1=0.8'])) != base
  assert _recipe(CFG, ('eval', 4, None)) != base
  with jax.default_matmul_precision('float32'):  # a jax setting a trace reads
    assert _recipe(CFG) != base
  with contract.unrolled():
    assert _recipe(CFG) != base
  flags = os.environ.get('XLA_FLAGS', '') + ' --xla_cpu_enable_fast_math=true'
  monkeypatch.setenv('XLA_FLAGS', flags)
  assert _recipe(CFG) != base


# AdamW's numbers: a recipe leaves them out of the programs that do not apply the optimizer.
OPTIMIZER_VALUES = ['optimizer.b1=0.8', 'optimizer.b2=0.9', 'optimizer.eps=1e-6',
                    'optimizer.weight_decay=0.3']


def test_the_settings_a_recipe_leaves_out_leave_the_lowered_program_as_it_is():
  """What lets a recipe find a program that runs: the settings it leaves out shape none; the
  AdamW's numbers shape only the programs that apply it (a recipe's `optimizer`); the
  schedule's, none (an argument)."""
  key = lambda cfg, kind=EVAL, variant=None: _cache(None, cfg=cfg)._request(
      ProgramKey(kind, (0, 1), variant), False).store_key
  host_only = load_config(None, [*TINY, *HOST_ONLY])
  every_kind = ((GROUP, Role(exact=4, degraded=4)), (REFRESH_COLD, None), (REFRESH_WARM, None),
                (EVAL, None), (REJOIN, 0), (UPDATE, None))
  for kind, variant in (*every_kind, (FUSED, Role(exact=4))):
    assert key(host_only, kind, variant) == key(CFG, kind, variant), kind
  other = load_config(None, [*TINY, *OPTIMIZER_VALUES])
  for kind, variant in every_kind[:-1]:
    assert not kind.optimizer and key(other, kind, variant) == key(CFG, kind, variant), kind
  assert UPDATE.optimizer and key(other, UPDATE) != key(CFG, UPDATE)
  init = lambda cfg: program_store.fingerprint(train_state.lower_init(cfg, SLICES.sub((0, 1))),
                                               None, cfg.model.kind)
  assert init(other) == init(CFG) == init(host_only)  # the initializer's recipe leaves them out
  assert _recipe(other, optimizer=False) == _recipe(CFG, optimizer=False) != _recipe(CFG)
  clipped = load_config(None, [*TINY, 'optimizer.grad_clip=0'])  # a transform less: kept
  assert _recipe(clipped, optimizer=False) != _recipe(CFG, optimizer=False)


def test_a_program_built_ahead_is_found_by_its_recipe_without_lowering(tmp_path, monkeypatch):
  """A restart's programs, built ahead into the store, are known there by their recipe's
  alias: a later process (or another live set of the shape) lowers nothing to see them, nor
  to load the program a step runs. A user's model (module:factory) may trace through modules
  the recipe does not read: its programs are found by their lowered fingerprint."""
  programs = program_store.ProgramStore(tmp_path, 1 << 30)
  assert _cache(programs).prepare(ProgramKey(EVAL, (0, 1)))  # compiled into the store
  lowered = []
  lower_eval = LOWER['eval']
  monkeypatch.setitem(LOWER, 'eval', lambda *a: lowered.append(a[1]) or lower_eval(*a))
  assert _cache(programs).prepare(ProgramKey(EVAL, (2, 3)))  # a later process, its shape
  assert lowered == []
  for entry in tmp_path.glob(f'*{program_store.SUFFIX}'):
    entry.unlink()  # the alias names an entry no longer there: lowered, compiled again
  assert _cache(programs).prepare(ProgramKey(EVAL, (0, 1)))
  assert len(lowered) == 1 and list(tmp_path.glob(f'*{program_store.SUFFIX}'))
  later = _cache(programs)
  later.program(ProgramKey(EVAL, (0, 1)))
  assert len(lowered) == 1 and _counts(later)['loaded'] == 1
  for n, how in ((2, 'compiled'), (3, 'loaded')):  # a user's model: its own entry, each lowered
    user = _cache(programs, cfg=USER_CFG)
    user.program(ProgramKey(EVAL, (0, 1)))
    assert len(lowered) == n and _counts(user)[how] == 1


def test_train_py_fills_its_store_then_a_fresh_process_loads_every_program_by_recipe(launcher,
                                                                                     tmp_path):
  """train.compile_cache: the first run compiles every program into DIR/programs, the second
  loads them all and ends bit-exact (JAX's own cache is off: an executable it loaded could not
  be stored, its copy would fail to run). The programs of a MeCeFO policy: the degraded row's
  basis refresh calls LAPACK (QR, ops/basis.py), whose kernels jax readies only when it lowers a
  linalg op, so a process that found the refresh by its recipe alone (no lowering) ran it into a
  SIGSEGV (retarget._init_lapack)."""
  trace, cache = tmp_path / 'trace.txt', tmp_path / 'xla'
  trace.write_text('1 1 fail\n')
  env = {k: v for k, v in launcher.env().items() if k != 'JAX_COMPILATION_CACHE_DIR'}
  args = ['--host-devices', '2', f'--failures=trace:{trace}', *procs.TINY, 'mesh.slice=2',
          'train.steps=3', 'train.eval_every=0', 'snapshot.enabled=false',
          'faults.takeover=spread', f'train.compile_cache={cache}']
  runs = [launcher.train('--out', tmp_path / name, *args, env=env) for name in ('cold', 'warm')]
  for run in runs:
    assert run.returncode == 0, run.stderr[-3000:]
  # Both slices' step, the failed slice's refresh and step, the eval: compiled, then loaded.
  built = [re.findall(rf'{how} the (\w+) program onto slices (\[[\d, ]+\])', run.stderr)
           for how, run in zip(('compiling', 'loaded from the store'), runs)]
  assert built[0] == built[1] == [('fused', '[0, 1]'), ('refresh_cold', '[0]'), ('fused', '[0]'),
                                  ('eval', '[0]')], (built, runs[0].stderr[-3000:])
  cold, warm = (procs.report(tmp_path / name) for name in ('cold', 'warm'))
  counts = [(r['programs']['compiled'], r['programs']['loaded']) for r in (cold, warm)]
  assert counts == [(4, 0), (0, 4)], counts
  assert warm['programs']['store'] == str(cache / 'programs')
  assert [p.name for p in cache.iterdir()] == ['programs']
  assert cold['samples']['degraded'] > 0 and warm['params_sha256'] == cold['params_sha256']


def test_concurrent_writers_never_show_a_reader_a_partial_entry(tmp_path, caplog):
  programs = program_store.ProgramStore(tmp_path, 1 << 30)
  seen, stop = [], threading.Event()

  def write(n):
    for i in range(20):
      programs.write('k', _entry(1000 * (n + 1) + i))

  def read():
    while not stop.is_set():
      entry = programs.read('k')
      if entry is not None:
        seen.append(len(entry.payload))

  writers = [threading.Thread(target=write, args=(n,)) for n in range(4)]
  reader = threading.Thread(target=read)
  with caplog.at_level(logging.WARNING, 'mecefo'):
    reader.start()
    for t in writers:
      t.start()
    for t in writers:
      t.join()
    stop.set()
    reader.join()
  assert seen and 'program store' not in caplog.text
  assert [p.name for p in tmp_path.iterdir()] == [f'k{program_store.SUFFIX}']  # no temporary left


def test_a_hit_of_jaxs_persistent_cache_is_counted_as_a_load(tmp_path):
  from jax._src import compilation_cache
  on = {'jax_compilation_cache_dir': str(tmp_path), 'jax_enable_compilation_cache': True,
        'jax_persistent_cache_min_compile_time_secs': 0}  # (train.py turns the cache off)
  saved = {k: jax.config.values[k] for k in on}
  try:
    compilation_cache.reset_cache()
    for k, v in on.items():
      jax.config.update(k, v)
    first, second = _cache(None, move=False), _cache(None, move=False)
    first.program(ProgramKey(EVAL, (0,)))
    second.program(ProgramKey(EVAL, (0,)))
  finally:
    for k, v in saved.items():
      jax.config.update(k, v)
    compilation_cache.reset_cache()
  assert _counts(first) == {'compiled': 1, 'loaded': 0, 'moved': 0}
  assert _counts(second) == {'compiled': 0, 'loaded': 1, 'moved': 0}


@pytest.mark.parametrize('platform', ['gpu', 'cpu'])
def test_autotune_cache_option_reaches_the_compile_on_gpu_only(tmp_path, monkeypatch, platform):
  """On GPU every compile gets XLA's per-fusion autotune cache under the store (by jaxlib
  version and device kind), a compiler option, so the store's keys stay the same."""
  monkeypatch.setattr(program_store, '_platform', lambda devices: platform)
  seen, compile_ = [], jax.stages.Lowered.compile

  def spy(self, compiler_options=None):
    seen.append(compiler_options)
    return compile_(self, compiler_options)  # XLA CPU takes the option and ignores it

  monkeypatch.setattr(jax.stages.Lowered, 'compile', spy)
  kept = program_store.ProgramStore(tmp_path / 'programs', 1 << 30)
  _cache(kept).program(ProgramKey(EVAL, (0, 1)))
  (key,) = [p.name for p in kept.dir.glob(f'*{program_store.SUFFIX}')]
  if platform == 'cpu':
    assert seen == [None] and not (kept.dir / 'autotune').exists()
    return
  (options,) = seen
  directory = kept.dir / 'autotune' / f'{jaxlib.__version__}-cpu'
  assert options == {program_store.AUTOTUNE_OPTION: str(directory)} and directory.is_dir()
  # The same program's key without the option: identical (the option is not part of it).
  monkeypatch.setattr(program_store, '_platform', lambda devices: 'cpu')
  lowered = LOWER['eval'](CFG, SLICES.sub((0, 1)), GRAPHDEF, None)
  assert f'{program_store.fingerprint(lowered, None, CFG.model.kind)}{program_store.SUFFIX}' == key
