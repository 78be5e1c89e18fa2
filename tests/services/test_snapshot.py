"""Snapshots (jckpt.services.snapshot): host copies in reused slot buffers, entries, content digests."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.errors import InputError
from jckpt.format import payload
from jckpt.format.header import Header
from jckpt.format.layout import lay_out
from jckpt.format.names import GENERATION_KEY, LINEAGE_KEY
from jckpt.format.precs import prec_of
from jckpt.services.snapshot import (
    Slot,
    SnapshotLeaf,
    build_entries,
    content_digest,
    namespace_leaves,
)
from jckpt.storage.reader import CheckpointReader
from jckpt.storage.writer import ArraySource, write_checkpoint

W = (('k', 'w'),)
B = (('k', 'b'),)


def leaf(ns, path, value):
    return (ns, path, value)


# --- namespace_leaves --------------------------------------------------------------------------

def test_namespace_leaves_flattens_each_namespace_in_order():
    x, y, z = np.ones(2), np.zeros(3), np.int32(4)
    leaves = namespace_leaves({'model': {'w': x, 'b': y}, 'opt': [z]})
    assert [(ns, p) for ns, p, _ in leaves] == [('model', B), ('model', W), ('opt', (('i', 0),))]
    assert leaves[0][2] is y and leaves[2][2] is z


@pytest.mark.parametrize('namespace', ['', 'a/b', '0model', 'with space'])
def test_namespace_leaves_refuses_a_bad_namespace(namespace):
    with pytest.raises(InputError, match='invalid namespace'):
        namespace_leaves({namespace: {'w': np.ones(1)}})


# --- Slot.fill ---------------------------------------------------------------------------------

def test_no_cyclic_collection_runs_while_the_loop_waits_for_a_snapshot(monkeypatch):
    """A collection walks every live object of the training program (100+ ms in a big one):
    flattening the tree and taking the snapshot run with the collector paused."""
    import gc

    from jckpt.services import snapshot
    enabled = []
    for module, name in ((snapshot.tree_mod, "flatten"), (snapshot.to_host, "host_leaves")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, **k: (enabled.append(gc.isenabled()),
                                                                       _real(*a, **k))[1])
    leaves = namespace_leaves({"jckpt": {"w": jnp.ones(2), "n": np.ones(3)}})
    Slot(0).take(leaves)
    assert len(enabled) >= 2 and not any(enabled) and gc.isenabled()  # flatten, host_leaves


def test_fill_copies_numpy_leaves_isolated_from_later_mutation():
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    items = Slot(0).fill([leaf('jckpt', W, w)])
    assert len(items) == 1 and isinstance(items[0], SnapshotLeaf)
    item = items[0]
    assert (item.namespace, item.path, item.key_impl) == ('jckpt', W, None)
    assert not np.shares_memory(item.array, w)
    w += 100  # the caller reuses its buffer after the snapshot
    np.testing.assert_array_equal(item.array, np.arange(6, dtype=np.float32).reshape(2, 3))


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize('limit', [None, 0])
def test_cpu_jax_arrays_are_copied_and_outlive_donation_and_deletion(limit):
    x = jnp.arange(1 << 15, dtype=jnp.float32)  # large enough to be imaged
    snapshot = Slot(0, image_limit=limit).take([leaf('jckpt', W, x)])
    assert snapshot.on_device == (limit is None)  # an image on the CPU device, or a host copy
    y = jax.jit(lambda a: a * 2 + 1, donate_argnums=0)(x)  # the next step donates x
    x.delete()
    item = snapshot.drain()[0]
    assert isinstance(item.array, np.ndarray) and item.array.dtype == np.float32
    np.testing.assert_array_equal(item.array, np.arange(1 << 15, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(y), np.arange(1 << 15) * 2 + 1)


def test_fill_reuses_the_slot_buffers_of_the_same_shape_and_dtype():
    slot = Slot(3)
    first = slot.fill([leaf('jckpt', W, np.ones((2, 2), np.float32)),
                       leaf('jckpt', B, np.ones(3, np.int8))])
    second = slot.fill([leaf('jckpt', W, np.full((2, 2), 7, np.float32)),
                        leaf('jckpt', B, np.ones(4, np.int8))])
    assert second[0].array is first[0].array           # same shape and dtype: the same buffer
    np.testing.assert_array_equal(first[0].array, np.full((2, 2), 7, np.float32))
    assert not np.shares_memory(second[1].array, first[1].array)  # another shape: a new one
    third = slot.fill([leaf('jckpt', W, np.ones((2, 2), np.float64))])
    assert not np.shares_memory(third[0].array, second[0].array)  # another dtype: a new one
    assert third[0].array.dtype == np.float64
    other = Slot(4).fill([leaf('jckpt', W, np.ones((2, 2), np.float64))])
    assert not np.shares_memory(other[0].array, third[0].array)  # slots never share buffers


def test_fill_turns_typed_keys_and_scalars_into_host_arrays():
    key = jax.random.key(3)
    items = Slot(0).fill([leaf('jckpt', (('k', 'key'),), key), leaf('jckpt', (('k', 'n'),), 5),
                          leaf('jckpt', (('k', 'h'),), np.float16(1.5))])
    k, n, h = items
    assert k.key_impl is not None and 'threefry' in k.key_impl
    np.testing.assert_array_equal(k.array, np.asarray(jax.random.key_data(key)))
    assert n.array.shape == () and int(n.array) == 5 and n.key_impl is None
    assert h.array.dtype == np.float16 and float(h.array) == 1.5


def test_fill_refuses_a_leaf_that_is_not_an_array_naming_it():
    with pytest.raises(InputError, match='not an array') as info:
        Slot(0).fill([leaf('jckpt', W, np.ones(1)), leaf('opt', (('k', 'name'),), 'adam')])
    assert 'opt/name' in str(info.value)


def test_fill_of_nothing_is_empty():
    assert Slot(0).fill([]) == []


# --- build_entries and ArraySource ------------------------------------------------------------

def host(ns, path, array, key_impl=None):
    return SnapshotLeaf(ns, path, np.asarray(array), key_impl)


def test_entries_count_ids_per_namespace_in_order():
    items = [host('a', W, np.ones(2, np.float32)), host('b', W, np.ones(3, np.int8)),
             host('a', B, np.ones((2, 2), ml_dtypes.bfloat16)), host('b', B, np.float64(1))]
    entries, sources = build_entries(items)
    assert [(e.namespace, e.id) for e in entries] == [('a', 0), ('b', 0), ('a', 1), ('b', 1)]
    assert [e.name for e in entries] == ['a/w', 'b/w', 'a/b', 'b/b']
    assert [e.prec for e in entries] == [prec_of(i.array.dtype) for i in items]
    assert entries[2].prec == 'Bfloat16_prec'
    assert [e.dims for e in entries] == [(2,), (3,), (2, 2), ()]
    assert [e.byte_length for e in entries] == [8, 3, 8, 8]
    assert [e.label for e in entries] == [('w',), ('w',), ('b',), ('b',)]
    assert all(isinstance(s, ArraySource) for s in sources) and len(sources) == 4
    assert sources[0].array is items[0].array


def test_entry_checksums_are_the_payloads():
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([True, False]),
              np.arange(5, dtype=np.int64), np.float32(2.5)]
    entries, sources = build_entries([host('jckpt', (('i', i),), a) for i, a in enumerate(arrays)])
    for e, s, a in zip(entries, sources, arrays):
        assert e.checksum == s.checksum == payload.checksum(payload.encode_payload(np.asarray(a)))


def test_hashed_sources_write_files_that_verify(tmp_path):
    key = jax.random.key(0)
    items = Slot(0).fill([leaf('model', W, np.arange(10.0).reshape(2, 5)),
                          leaf('model', (('k', 'key'),), key),
                          leaf('opt', W, np.arange(3, dtype=np.int16))])
    entries, sources = build_entries(items)
    path = tmp_path / 's.jckpt'
    write_checkpoint(path, lay_out(Header(tensors=entries)), sources, durable=False)
    reader = CheckpointReader(path)
    assert reader.verify() == []
    by_name = {e.name: e for e in reader.header.tensors}
    assert by_name['model/key'].key_impl == entries[1].key_impl
    assert [by_name[e.name].checksum for e in entries] == [e.checksum for e in entries]
    np.testing.assert_array_equal(reader.decode(by_name['model/w']), np.arange(10.0).reshape(2, 5))
    np.testing.assert_array_equal(reader.decode(by_name['opt/w']), np.arange(3, dtype=np.int16))


def test_a_wrong_known_checksum_is_written_as_given(tmp_path):
    """A ArraySource does not hash again: a stale checksum would be caught only by verify."""
    (entry,), (source,) = build_entries([host('jckpt', W, np.ones(4, np.float32))])
    stale = ArraySource(np.zeros(4, np.float32), source.checksum)
    write_checkpoint(tmp_path / 'x.jckpt', lay_out(Header(tensors=(entry,))), [stale], durable=False)
    assert len(CheckpointReader(tmp_path / 'x.jckpt').verify()) == 1


# --- content_digest ----------------------------------------------------------------------------

def entries_of(*arrays, ns='jckpt'):
    return build_entries([host(ns, (('i', i),), a) for i, a in enumerate(arrays)])[0]


def test_digest_ignores_reserved_metadata_and_order():
    e = entries_of(np.ones(3, np.float32))
    a = content_digest(e, {'note': 'x', 'run': 'y', LINEAGE_KEY: 'L1', GENERATION_KEY: '1'})
    b = content_digest(e, {GENERATION_KEY: '2', 'run': 'y', 'note': 'x'})
    assert a == b


def test_digest_sees_user_metadata_and_content():
    e = entries_of(np.ones(3, np.float32))
    base = content_digest(e, {'note': 'a'})
    assert content_digest(e, {'note': 'b'}) != base
    assert content_digest(e, {}) != base
    assert content_digest(entries_of(np.ones(3, np.float32)), {'note': 'a'}) == base
    assert content_digest(entries_of(np.zeros(3, np.float32)), {'note': 'a'}) != base  # checksum
    assert content_digest(entries_of(np.ones(3, np.int32)), {'note': 'a'}) != base      # prec
    assert content_digest(entries_of(np.ones((3, 1), np.float32)), {'note': 'a'}) != base  # dims
    assert content_digest(entries_of(np.ones(3, np.float32), ns='other'), {'note': 'a'}) != base


def test_digest_sees_the_key_implementation():
    data = np.zeros(2, np.uint32)
    plain = build_entries([host('jckpt', W, data)])[0]
    keyed = build_entries([host('jckpt', W, data, key_impl='threefry2x32')])[0]
    assert content_digest(plain, {}) != content_digest(keyed, {})


def test_mirror_and_manager_record_empty_nodes_for_exports(tmp_path):
    """A snapshot records the tree's nodes without leaves, as `save` does (for orbax exports)."""
    import optax
    state = optax.adamw(1e-3).init({"w": jnp.ones(3)})
    with jckpt.Mirror(tmp_path / "m.jckpt") as m:
        m.submit(state)
    with jckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, items={"opt": state})
    jckpt.save(jckpt.Context(namespace="opt"), state, tmp_path / "s.jckpt")
    want = jckpt.describe(tmp_path / "s.jckpt").metadata_dict()["jckpt.empty_nodes"]
    assert jckpt.describe(tmp_path / "m.jckpt").metadata_dict()["jckpt.empty_nodes"] == \
        want.replace('"opt"', '"jckpt"')
    step = next(p for p in (tmp_path / "run").iterdir() if p.name.startswith("step"))
    assert jckpt.describe(step).metadata_dict()["jckpt.empty_nodes"] == want


@pytest.mark.parametrize("accelerated", [True, False])
def test_copy_all_copies_every_pair_whatever_its_layout(monkeypatch, accelerated):
    from jckpt.services import snapshot

    left = []
    if not accelerated:
        monkeypatch.setattr(snapshot, "accelerator", None)
    elif snapshot.accelerator is not None:
        real = snapshot.accelerator
        monkeypatch.setattr(snapshot, "accelerator", type("Spy", (), {"copy_arrays": staticmethod(
            lambda d, s: left.extend(real.copy_arrays(d, s)) or list(left))}))
    rng = np.random.default_rng(0)
    sources = [rng.random((3, 4), np.float32),                      # plain: copied in C
               rng.random(1 << 15),                                 # 256 KiB: C, without the GIL
               np.asarray(jnp.arange(5)),                           # a CPU jax array's host view
               rng.random((4, 6))[:, ::2],                          # strided: numpy copies it
               np.ones((2, 2), ml_dtypes.bfloat16),                 # no buffer export: numpy
               np.arange(6, dtype=">i4"),                           # big-endian, into native
               np.float64(2.5).reshape(()),                         # 0-d
               jnp.arange(7, dtype=jnp.float32),                    # a CPU jax array: its buffer
               jnp.ones(3, jnp.bfloat16)]                           # no buffer export: numpy
    targets = [np.empty(s.shape, s.dtype) for s in sources[:5]] + [
        np.empty(6, np.int32), np.empty((), np.float64), np.empty(7, np.float32),
        np.empty(3, ml_dtypes.bfloat16)]
    snapshot.copy_all(list(zip(targets, sources)))
    for t, s in zip(targets, sources):
        assert np.array_equal(t, s)
    if accelerated and snapshot.accelerator is not None:
        assert left == [3, 4, 5, 8]  # what C leaves to numpy: strided, bfloat16, big-endian


@pytest.mark.parametrize('size', [8, 1 << 16])  # copied to host, or imaged on the device
def test_a_donated_or_traced_leaf_is_named_by_submit_and_save(tmp_path, size):
    """Donation before the snapshot (not after: that is safe) and a save inside jax.jit are
    user mistakes: an InputError naming the leaf, nothing queued, the writer still usable."""
    x = jnp.arange(float(size))
    jax.jit(lambda a: a + 1, donate_argnums=0)(x)
    with jckpt.Mirror(tmp_path / 'm.jckpt') as mirror, \
            jckpt.CheckpointManager(tmp_path / 'run') as mgr:
        for call in (lambda: mirror.submit({'ok': np.ones(2), 'w': x}),
                     lambda: mgr.save(1, {'w': x})):
            with pytest.raises(InputError, match="has been deleted") as e:
                call()
            assert e.value.entry == 'jckpt/w'
        seen = []

        def step(a):
            with pytest.raises(InputError, match="is a tracer") as e:
                mirror.submit({'w': a})
            seen.append(e.value.entry)
            return a

        jax.jit(step)(jnp.ones(size))
        assert seen == ['jckpt/w'] and mirror.counters.committed == 0
        mirror.submit({'w': jnp.ones(size)})
        mgr.save(1, {'w': jnp.ones(size)})
    assert mirror.counters.durable == 1 and mgr.all_steps() == [1]
