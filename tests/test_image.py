"""Tests for the byte image of a pytree (the in-memory snapshot format)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mecefo_jax.snapshot import image
from mecefo_jax.snapshot.store import SnapshotError, SnapshotManager


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


def test_each_slice_copies_its_share_of_the_image_bit_identically(devices):
  """4 slices of 2 devices: the split copy reads each leaf from one slice's devices, the slices'
  shares add up to the image in about equal parts, and the image is the replica-0 image."""
  mesh = Mesh(np.array(devices[:8]).reshape(4, 2, 1), ('slice', 'fsdp', 'tensor'))
  keys = jax.random.split(jax.random.PRNGKey(0), 12)
  tree = {f'w{i}': jax.device_put(jax.random.normal(k, (16, 24 + 8 * i)),
                                  NamedSharding(mesh, P(None, 'fsdp')))
          for i, k in enumerate(keys)}
  sources = image.split_sources(tree)
  slices = [next(k for k in range(4) if s == frozenset(mesh.devices[k].flat)) for s in sources]
  assert slices == sorted(slices) and set(slices) == {0, 1, 2, 3}  # contiguous shares, all slices
  sizes = [x.nbytes for x in jax.tree.leaves(tree)]
  shares = [sum(b for b, k in zip(sizes, slices) if k == s) for s in range(4)]
  assert max(shares) - min(shares) <= 2 * max(sizes), shares  # ~1/4 each, up to a leaf
  split, _ = image.pack(tree, devices=sources)
  whole, _ = image.pack(tree)  # every leaf's replica 0 (slice 0's devices)
  assert np.array_equal(split, whole)
  # Replicas made to differ (slice k holds k everywhere): each leaf really came from its slice.
  marked = {name: jax.make_array_from_single_device_arrays(
      x.shape, x.sharding, [jax.device_put(np.full(s.data.shape, k, np.float32), s.device)
                            for s in x.addressable_shards
                            for k in [next(k for k in range(4) if s.device in mesh.devices[k])]])
            for name, x in tree.items()}
  packed, lay = image.pack(marked, devices=image.split_sources(marked))
  assert [int(v.ravel()[0]) for v in image.views(packed, lay)] == slices
