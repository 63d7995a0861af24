"""Tests for in-memory snapshots (Orbax + manifests + durable tier) and XOR parity groups."""
import asyncio
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mecefo_jax.model.train_state import TrainState
from mecefo_jax.records.run_dir import MANIFEST_NAME
from mecefo_jax.snapshot import aside, capacity, parity, manager
from mecefo_jax.snapshot.manager import SnapshotError, SnapshotManager
from procs import tree

META = {'data_position': 123, 'config_hash': 'abc123', 'controller': {'failed_slices': [1]}}


@pytest.fixture(scope='module')
def mesh(devices):
  return Mesh(np.array(devices).reshape(4, 2, 1), ('slice', 'fsdp', 'tensor'))


def make_state(mesh, seed=0, width=64):
  """A TrainState-shaped pytree whose buffers the runtime owns (so a train step can donate them)."""
  return _state_builder(mesh, width)(jnp.array(seed, jnp.int32))


@functools.lru_cache
def _state_builder(mesh, width):
  def build(seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    params = {'embed': jax.random.normal(keys[0], (width, 32)),
              'w': jax.random.normal(keys[1], (32, width)).astype(jnp.bfloat16)}
    opt_state = {'count': seed, 'mu': jax.tree.map(lambda p: p.astype(jnp.float32) * 0.5, params)}
    bases = {'blocks': {'gate': jax.random.normal(keys[2], (2, 32, 4))}}
    return TrainState(seed, params, opt_state, bases, jnp.array(-1, jnp.int32),
                      jax.random.key_data(keys[3]))

  rep = NamedSharding(mesh, P())
  param_sh = {'embed': NamedSharding(mesh, P('fsdp', 'tensor')),
              'w': NamedSharding(mesh, P(None, 'fsdp'))}
  shardings = TrainState(rep, param_sh, {'count': rep, 'mu': param_sh},
                         {'blocks': {'gate': NamedSharding(mesh, P(None, 'fsdp'))}}, rep, rep)
  return jax.jit(build, out_shardings=shardings)


def digests(tree):
  return [hashlib.sha256(np.asarray(leaf).tobytes()).hexdigest() for leaf in jax.tree.leaves(tree)]


def abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def files_in(root):
  """procs.tree of `root`, its paths relative to it."""
  return {str(Path(k).relative_to(root)): v for k, v in tree(root).items()}


def step_dirs(directory):
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@pytest.fixture
def slow_orbax_writes(monkeypatch):
  """Holds Orbax's background array writes (pytrees and packed images) for 0.5 s, so a save is
  surely in flight afterwards."""
  from orbax.checkpoint._src.serialization import jax_array_handlers, type_handlers

  def delayed(original):
    async def call(*args, **kwargs):
      await asyncio.sleep(0.5)
      return await original(*args, **kwargs)
    return call

  monkeypatch.setattr(jax_array_handlers, '_async_serialize_replica_slices',
                      delayed(jax_array_handlers._async_serialize_replica_slices))
  monkeypatch.setattr(type_handlers.NumpyHandler, '_open_and_write',
                      delayed(type_handlers.NumpyHandler._open_and_write))


# ---- snapshots ------------------------------------------------------------------------------------

def test_round_trip_is_bit_exact_on_target_shardings(tmp_path, mesh):
  state = make_state(mesh)
  with SnapshotManager(tmp_path / 'mem', every=2) as manager:
    assert not manager.maybe_save(1, state, META)
    assert manager.maybe_save(2, state, META)
  # A fresh manager, as after a crash of the trainer: reads what the old one left.
  with SnapshotManager(tmp_path / 'mem', every=2) as manager:
    step, restored, meta, _ = manager.restore_latest(abstract(state))
  assert (step, meta) == (2, META)
  assert isinstance(restored, TrainState)
  assert digests(restored) == digests(state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert got.sharding == want.sharding and got.dtype == want.dtype


def test_no_tier_signals_through_the_key_value_store_its_peers_share(tmp_path, mesh,
                                                                    monkeypatch):
  # Orbax's async directory creation signals through jax.distributed's key-value store under
  # keys named by a process-wide counter: in a multi-process job two tiers saving from two
  # threads (and each process's local tier, on its peers' keys) waited for signals that were
  # never set or were deleted: every process hung in `saving` (snapshot/tier.py).
  from orbax.checkpoint._src.futures import future
  signalled = []
  monkeypatch.setattr(future.AwaitableSignalsContract, 'add_to_awaitable_signals_contract',
                      classmethod(lambda cls, signals: signalled.append(signals)))
  kwargs = dict(durable_dir=tmp_path / 'durable', durable_every=1)
  with SnapshotManager(tmp_path / 'mem', **kwargs) as manager:
    for step in range(2):
      assert manager.maybe_save(step, make_state(mesh), META) == ('memory', 'durable')
  assert signalled == []
  assert step_dirs(tmp_path / 'mem') == step_dirs(tmp_path / 'durable') == [0, 1]


def test_save_is_a_copy_that_survives_donation(tmp_path, mesh, slow_orbax_writes):
  state = make_state(mesh, width=4096)  # 1.5 MiB of leaves
  # Read from a twin: under jax 0.11 on CPU the host value a read leaves on `state` would keep
  # its buffers from being donated.
  saved_digests = digests(make_state(mesh, width=4096))
  buffers = [{s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards}
             for leaf in jax.tree.leaves(state)]
  train_step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
  with SnapshotManager(tmp_path / 'mem') as manager:
    manager.maybe_save(0, state, META)
    new_state = jax.block_until_ready(train_step(state))
    assert not (tmp_path / 'mem' / '0' / MANIFEST_NAME).exists(), 'save not in flight'
    # Donation really happened: the old arrays are gone and their buffers hold step t+1 (but
    # for bfloat16 ones: jax 0.11 on CPU copies a bfloat16 buffer that a host read touched).
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))
    for leaf, before in zip(jax.tree.leaves(new_state), buffers):
      after = {s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards}
      assert after == before or leaf.dtype == jnp.bfloat16, leaf.dtype
    _, restored, _, _ = manager.restore_latest(abstract(new_state))
  assert digests(restored) == saved_digests != digests(new_state)


def test_keeps_only_the_last_k(tmp_path, mesh):
  state = make_state(mesh)
  with SnapshotManager(tmp_path / 'mem', every=2, keep=2) as manager:
    for step in range(7):
      manager.maybe_save(step, state, {'step': step})
    manager.wait_until_finished()
    assert step_dirs(tmp_path / 'mem') == [4, 6]
    step, _, meta, _ = manager.restore_latest(abstract(state))
  assert step == 6 and meta == {'step': 6}


def test_snapshot_without_manifest_is_ignored(tmp_path, mesh, caplog):
  old, new = make_state(mesh, seed=1), make_state(mesh, seed=2)
  with SnapshotManager(tmp_path / 'mem') as manager:
    manager.maybe_save(1, old, META)
    manager.maybe_save(2, new, META)
  (tmp_path / 'mem' / '2' / MANIFEST_NAME).unlink()  # as if killed before finishing
  with SnapshotManager(tmp_path / 'mem') as manager, caplog.at_level(logging.WARNING):
    step, restored, *_ = manager.restore_latest(abstract(old))
  assert step == 1 and digests(restored) == digests(old)
  assert 'no manifest' in caplog.text and step_dirs(tmp_path / 'mem') == [1]


def test_truncated_file_fails_checksum_is_set_aside_and_previous_snapshot_is_used(
    tmp_path, mesh, caplog):
  """A damaged snapshot is moved aside as it was (not deleted), reported, and the line's
  command puts it back."""
  old, new = make_state(mesh, seed=1), make_state(mesh, seed=2)
  with SnapshotManager(tmp_path / 'mem') as manager:
    manager.maybe_save(1, old, META)
    manager.maybe_save(2, new, META)
  files = [p for p in (tmp_path / 'mem' / '2').rglob('*') if p.is_file()]
  largest = max(files, key=lambda p: p.stat().st_size)
  os.truncate(largest, largest.stat().st_size // 2)
  damaged = files_in(tmp_path / 'mem' / '2')
  with SnapshotManager(tmp_path / 'mem') as manager, caplog.at_level(logging.WARNING), \
       warnings.catch_warnings():
    warnings.simplefilter('error')  # one log line, no Python warning with its source line
    step, restored, *_ = manager.restore_latest(abstract(old))
    reported = manager.report().set_aside
  assert step == 1 and digests(restored) == digests(old)
  [line] = [m for m in caplog.messages if 'set aside' in m]
  assert re.match(r'skipping memory snapshot .*/mem/2: .* fails its checksum; set aside as '
                  r'.*/set_aside/mem/2-\d{8}T\d{6}Z/2 \(not deleted; to restore it by hand: mkdir -p ',
                  line), line
  [where] = reported
  assert where.startswith(str(tmp_path / 'set_aside' / 'mem')) and files_in(where) == damaged
  why = json.loads((Path(where).parent / aside.WHY).read_text())
  assert (why['step'], why['problem']) == (2, f'{largest.relative_to(tmp_path / "mem" / "2")} '
                                              'fails its checksum')
  assert step_dirs(tmp_path / 'mem') == [1]
  subprocess.run(line.split('restore it by hand: ')[1].rstrip(')'), shell=True, check=True)
  assert files_in(tmp_path / 'mem' / '2') == damaged  # back as it was: checked (and set aside) again


def test_falls_back_to_durable_when_memory_is_empty(tmp_path, mesh):
  states = [make_state(mesh, seed=s) for s in range(6)]
  kwargs = dict(keep=2, durable_dir=tmp_path / 'durable', durable_every=2, durable_keep=2)
  with SnapshotManager(tmp_path / 'mem', **kwargs) as manager:
    for step, state in enumerate(states):
      manager.maybe_save(step, state, {'step': step})
  assert step_dirs(tmp_path / 'mem') == [4, 5] and step_dirs(tmp_path / 'durable') == [2, 4]
  shutil.rmtree(tmp_path / 'mem')  # host memory lost (e.g. the machine rebooted)
  (tmp_path / 'mem').mkdir()
  with SnapshotManager(tmp_path / 'mem', **kwargs) as manager:
    step, restored, meta, _ = manager.restore_latest(abstract(states[0]))
  assert (step, meta) == (4, {'step': 4}) and digests(restored) == digests(states[4])
  with SnapshotManager(tmp_path / 'empty') as manager:
    assert manager.restore_latest(abstract(states[0])) is None


def test_what_a_tier_holds_is_counted_while_another_process_removes_its_tmp_folders(
    tmp_path, monkeypatch):
  """A restarted process counts the bytes its tmpfs tier holds while another process's Orbax
  removes a save's *.orbax-checkpoint-tmp folder (a loaded suite run: FileNotFoundError in
  the start-up); a folder or file gone meanwhile is left out, the rest counted."""
  kept, tmp = tmp_path / 'host0' / '3', tmp_path / 'host2' / '4.orbax-checkpoint-tmp'
  for folder in (kept, tmp / 'meta.orbax-checkpoint-tmp'):
    folder.mkdir(parents=True)
  (kept / 'image').write_bytes(b'x' * 100)
  (tmp / 'meta.orbax-checkpoint-tmp' / 'meta').write_bytes(b'y' * 7)
  (tmp / 'part').write_bytes(b'z' * 5)
  walk = os.walk

  def racing(top):  # the other process removes the tmp folder once the walk has listed it
    for entry in walk(top):
      yield entry
      if entry[0] == str(tmp):
        shutil.rmtree(tmp)
  monkeypatch.setattr(capacity.os, 'walk', racing)
  assert capacity.held_bytes(tmp_path) == 105  # its part, counted before it went; not its meta
  monkeypatch.undo()
  assert capacity.held_bytes(tmp_path) == 100 and capacity.held_bytes(tmp_path / 'no') == 0


def test_bad_directories_are_rejected_before_training(tmp_path):
  with pytest.raises(SnapshotError, match=r'missing/snap: parent .*missing does not exist'):
    SnapshotManager(tmp_path / 'missing' / 'snap')
  if os.path.isdir('/proc'):  # Linux: not writable even for root, unlike a chmod-ed dir
    with pytest.raises(SnapshotError, match=r'/proc/mecefo: /proc is not writable'):
      capacity.check_capacity('/proc/mecefo', 1, keep=2)
  with pytest.raises(SnapshotError, match=r'MiB free < .* MiB needed \(2\+1 snapshots of'):
    SnapshotManager(tmp_path / 'snap', keep=2, state_bytes=2**60)
  capacity.check_capacity(tmp_path / 'snap', 2**20, keep=2)


def test_state_nbytes_counts_concrete_and_abstract_leaves(mesh):
  state = make_state(mesh)
  expected = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(state))
  assert manager.state_nbytes(state) == manager.state_nbytes(abstract(state)) == expected


# ---- parity -------------------------------------------------------------------------------------

@pytest.mark.parametrize('n', [2, 3, 4, 5])
def test_parity_rebuilds_any_one_lost_part_and_block(n):
  # The layout of HostSnapshots: n parts of one length (a multiple of n-1), one block per host.
  rng = np.random.default_rng(n)
  parts = [rng.integers(0, 256, 6 * (n - 1), dtype=np.uint8) for _ in range(n)]
  blocks = [parity.parity_block(parts, holder) for holder in range(n)]
  assert all(len(b) == 6 for b in blocks)
  for lost in range(n):  # a dead host loses its part and the block it kept
    rebuilt = parity.rebuild_part([None if i == lost else p for i, p in enumerate(parts)],
                                  [None if i == lost else b for i, b in enumerate(blocks)], lost)
    np.testing.assert_array_equal(rebuilt, parts[lost])
  with pytest.raises(parity.ParityError):
    parity.parity_block([parts[0], parts[1][:-1]] + parts[2:], 0)


def test_newest_usable_snapshot_follows_each_snapshots_own_hosts():
  from mecefo_jax.snapshot.host import newest_usable
  full, survivors = (0, 1, 2, 3), (0, 2, 3)
  # Host 1 died after step 8 (its part of 8 is gone too); hosts 0, 2, 3 restarted from 8 and
  # saved 9 and 10 coded over themselves. Process p below is logical host slots[p].
  held = [{8: full, 9: survivors, 10: survivors}, {8: full, 9: survivors},
          {8: full, 9: survivors, 10: survivors}]
  assert newest_usable(held, (0, 2, 3)) == (10, survivors)  # 10 lacks one part: rebuilt
  # Then host 3 dies too: 10 has 1 of its 3 parts left, 9 has 2 (host 3's is rebuilt).
  assert newest_usable(held[:2], (0, 2)) == (9, survivors)
  # Two parts missing is one too many: the older full-layout step with 3 of 4 parts is taken.
  assert newest_usable([{8: full, 9: survivors}, {8: full}, {8: full}], (0, 1, 3)) == (8, full)
  # A replacement's stale part of an old layout never outvotes a newer complete layout.
  assert newest_usable([{10: survivors}, {12: full}, {10: survivors}, {10: survivors}],
                       (0, 1, 2, 3)) == (10, survivors)
  assert newest_usable([{8: full}, {}], (0, 1)) is None


def test_manifest_checksums_detect_corruption_and_other_formats_are_unreadable(tmp_path):
  from mecefo_jax.snapshot.manifest import verify_manifest, write_manifest
  (tmp_path / 'd').mkdir()
  (tmp_path / 'd' / 'a').write_bytes(bytes(range(256)) * 1000)
  (tmp_path / 'empty').write_bytes(b'')  # mmap refuses empty files: the streamed path
  write_manifest(tmp_path)
  written = json.loads((tmp_path / MANIFEST_NAME).read_text())
  assert written['format'] == 3 and set(written['files']['empty']) == {'bytes', 'xxh3'}
  assert verify_manifest(tmp_path) is None
  data = (tmp_path / 'd' / 'a').read_bytes()
  (tmp_path / 'd' / 'a').write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, 1 bit off
  assert verify_manifest(tmp_path) == 'd/a fails its checksum'
  (tmp_path / 'd' / 'a').write_bytes(data[:100])
  assert verify_manifest(tmp_path) == 'd/a fails its checksum'
  (tmp_path / 'd' / 'a').write_bytes(data)
  assert verify_manifest(tmp_path) is None
  older = {'format': 2, 'files': {name: {'bytes': e['bytes'], 'crc32': '0'}
                                  for name, e in written['files'].items()}}
  (tmp_path / MANIFEST_NAME).write_text(json.dumps(older))
  assert verify_manifest(tmp_path).startswith('unreadable manifest (format 2')


def test_remove_tree_deletes_a_durable_tier_and_shrugs_at_a_missing_one(tmp_path, caplog):
  from mecefo_jax.snapshot import recovery
  tier = tmp_path / 'checkpoints' / 'run1'
  (tier / '5').mkdir(parents=True)
  (tier / '5' / 'x').write_text('data')
  recovery.remove_tree(str(tier))
  recovery.remove_tree(str(tier))  # already gone: nothing to do, no error
  assert not tier.exists() and (tmp_path / 'checkpoints').is_dir()


def test_a_step_removed_while_a_tier_lists_its_steps_is_left_out(tmp_path, mesh, monkeypatch):
  """Orbax lists the step folders, then reads each one's commit time: one removed in between
  (the tier's finisher keeping `keep`, seen in CI) made the listing fail; it is listed again
  without it."""
  from orbax.checkpoint._src.path import step as orbax_step
  state, removed = make_state(mesh), []
  with SnapshotManager(tmp_path / 'mem', every=1, keep=3) as manager:
    for step in range(3):
      manager.maybe_save(step, state, {'step': step})
    manager.wait_until_finished()
    read = orbax_step.Metadata.commit_timestamp_nsecs.fget

    def removed_before_it_is_read(metadata):
      if not removed and metadata.step == 1:
        removed.append(metadata.path)
        shutil.rmtree(metadata.path)
      return read(metadata)

    monkeypatch.setattr(orbax_step.Metadata, 'commit_timestamp_nsecs',
                        property(removed_before_it_is_read))
    [tier] = manager.tiers
    assert tier.steps() == [2, 0] and removed
