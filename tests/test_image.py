"""Tests for the byte image of a pytree (the in-memory snapshot format)."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mecefo_jax.config import load_config
from mecefo_jax.model import train_state
from mecefo_jax.snapshot import image
from mecefo_jax.snapshot.manager import SnapshotError, SnapshotManager


@pytest.fixture(scope='module')
def mesh(devices):
  return Mesh(np.array(devices[:4]).reshape(2, 2), ('fsdp', 'tensor'))


def make_tree(mesh, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  on = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  return {'w': on(jax.random.normal(keys[0], (8, 6)), 'fsdp', 'tensor'),
          'half': on(jax.random.normal(keys[1], (4, 10)).astype(jnp.bfloat16), None, 'tensor'),
          'replicated': on(jax.random.bits(keys[2], (3,), jnp.uint32)),
          'step': on(jnp.array(seed, jnp.int32)),
          'host': np.arange(5, dtype=np.int16)}


def target_of(tree, mesh):
  sharding = lambda x: x.sharding if isinstance(x, jax.Array) else NamedSharding(mesh, P())
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x)), tree)


def test_round_trip_is_bit_exact_and_reuses_the_buffer(mesh):
  tree = make_tree(mesh)
  packed, layout = image.pack(tree)
  assert packed.nbytes == image.nbytes(layout) == 8 * 6 * 4 + 4 * 10 * 2 + 3 * 4 + 4 + 5 * 2
  assert layout[0] == ["['half']", [4, 10], 'bfloat16']
  again, _ = image.pack(make_tree(mesh, seed=1), packed)
  assert again is packed  # the same host buffer, refilled
  restored = image.unpack(packed, target_of(tree, mesh))
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(make_tree(mesh, seed=1))):
    assert got.dtype == want.dtype and np.array_equal(np.asarray(got), np.asarray(want))
  assert restored['w'].sharding == tree['w'].sharding


def test_pack_takes_only_the_given_devices_shards(mesh):
  x = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, P('fsdp')))
  first_rows = {d for d in mesh.devices[0]}  # the devices holding rows 0..1
  packed, _ = image.pack({'x': x}, devices=first_rows)
  got = packed.view(np.float32).reshape(4, 2)
  assert np.array_equal(got[:2], np.arange(4.0).reshape(2, 2))


def test_restore_into_another_layout_is_a_clear_error(tmp_path, mesh):
  tree = make_tree(mesh)
  with SnapshotManager(tmp_path / 'mem') as manager:
    manager.maybe_save(3, tree, {})
  other = dict(tree, w=jax.device_put(jnp.zeros((8, 4)), tree['w'].sharding))
  with SnapshotManager(tmp_path / 'mem') as manager:
    with pytest.raises(SnapshotError, match=r"another state.*saved \["):
      manager.restore_latest(target_of(other, mesh))
    assert manager.restore_latest(target_of(tree, mesh))[0] == 3  # nothing was deleted


def _owners(sources, lay, slice_of) -> np.ndarray:
  """The slice that supplies each float32 element of the image, by split_sources."""
  out = []
  for source, (_, shape, _) in zip(sources, lay):
    rows, per_row = shape[0], int(np.prod(shape[1:]))
    if isinstance(source, list):
      out += [np.full((b - a) * per_row, slice_of(devices)) for a, b, devices in source]
    else:
      out.append(np.full(rows * per_row, slice_of(source)))
  return np.concatenate(out)


def test_each_slice_copies_its_share_of_the_image_bit_identically(devices):
  """4 slices of 2 devices: the split copy reads each byte from one slice's devices, leaves cut
  along their (unsharded) leading axis where shares meet; each slice copies its 1/4 of the image
  up to one row; the image is the replica-0 image."""
  mesh = Mesh(np.array(devices[:8]).reshape(4, 2, 1), ('slice', 'fsdp', 'tensor'))
  keys = jax.random.split(jax.random.PRNGKey(0), 12)
  tree = {f'w{i}': jax.device_put(jax.random.normal(k, (16, 24 + 8 * i)),
                                  NamedSharding(mesh, P(None, 'fsdp')))
          for i, k in enumerate(keys)}
  sources = image.split_sources(tree)
  slice_of = lambda s: next(k for k in range(4) if s == frozenset(mesh.devices[k].flat))
  lay = image.layout(tree)
  owners = _owners(sources, lay, slice_of)
  assert list(owners) == sorted(owners) and set(owners) == {0, 1, 2, 3}  # contiguous shares
  assert any(isinstance(s, list) for s in sources)  # some leaf is cut between two slices
  row = max(x.nbytes // x.shape[0] for x in jax.tree.leaves(tree))
  shares = np.bincount(owners) * 4
  assert shares.max() <= image.nbytes(lay) / 4 + row, shares
  split, _ = image.pack(tree, devices=sources)
  whole, _ = image.pack(tree)  # every leaf's replica 0 (slice 0's devices)
  assert np.array_equal(split, whole)
  # Replicas made to differ (slice k holds k everywhere): each byte really came from its slice.
  marked = {name: jax.make_array_from_single_device_arrays(
      x.shape, x.sharding, [jax.device_put(np.full(s.data.shape, k, np.float32), s.device)
                            for s in x.addressable_shards
                            for k in [next(k for k in range(4) if s.device in mesh.devices[k])]])
            for name, x in tree.items()}
  packed, _ = image.pack(marked, devices=image.split_sources(marked))
  np.testing.assert_array_equal(packed.view(np.float32), owners)


def test_no_slice_of_32_copies_more_than_its_share_plus_one_layer():
  """llama_60m's state layout (stacked blocks) over 32 one-device slices, without devices: each
  slice's bytes are at most 1/32 of the image plus one layer's row of the largest leaf."""
  cfg = load_config('configs/llama_60m.yaml', [])
  state = train_state.abstract_state(cfg)
  mesh = types.SimpleNamespace(shape={'slice': 32, 'fsdp': 1, 'tensor': 1},
                               devices=np.arange(32).reshape(32, 1, 1))
  sharding = types.SimpleNamespace(mesh=mesh, spec=P())
  tree = jax.tree.map(lambda a: types.SimpleNamespace(shape=a.shape, dtype=a.dtype,
                                                      sharding=sharding), state)
  lay = image.layout(state)
  sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for _, shape, dtype in lay]
  copied = np.zeros(32)
  for source, (_, shape, _), size in zip(image.split_sources(tree), lay, sizes):
    pieces = source if isinstance(source, list) else [(0, shape[0] if shape else 1, source)]
    for a, b, devices in pieces:
      copied[next(iter(devices))] += size * (b - a) / (shape[0] if shape else 1)
  layer = max(size // shape[0] for (path, shape, _), size in zip(lay, sizes)
              if "['blocks']" in path)
  assert copied.sum() == image.nbytes(lay)
  assert copied.max() <= image.nbytes(lay) / 32 + layer, (copied.max(), image.nbytes(lay) / 32)
