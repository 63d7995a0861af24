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
