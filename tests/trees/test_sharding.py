"""Sharded arrays on 8 virtual CPU devices: save from any mesh, restore onto any other."""

import os

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jckpt
from jckpt.api.multiprocess import save_directory
from jckpt.errors import FormatError, MismatchError
from jckpt.storage.reader import CheckpointReader
from jckpt.trees import facts, to_host, transfers
from jckpt.trees import sharding as sh
from tests.helpers import cpu_devices


def mesh(shape, names, devices=None):
    devices = cpu_devices() if devices is None else devices
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), names)


def put(x, m, spec):
    return jax.device_put(x, NamedSharding(m, spec))


def data(shape, dtype=np.float32, offset=0):
    return (np.arange(int(np.prod(shape))) + offset).reshape(shape).astype(dtype)


@pytest.fixture(scope="module")
def m42():
    return mesh((4, 2), ("data", "model"))


@pytest.fixture(scope="module")
def m24():
    return mesh((2, 4), ("b", "a"))


def sample_tree(m42):
    return {
        "w": put(data((16, 24)), m42, P("data", "model")),
        "replicated": put(data((8, 4), offset=5), m42, P()),
        "partial": put(data((16, 6), offset=7), m42, P("data")),
        "bf16": put(data((8, 16), ml_dtypes.bfloat16), m42, P("model", "data")),
        "scalar": put(np.float32(3.5), m42, P()),
        "odd": put(data((7, 8), np.int32), m42, P(None, "data")),
        "step": np.int32(12),
        "host": data((3,), np.int16),
    }


def test_mesh_to_mesh_one_device_and_numpy(tmp_path, m42, m24):
    tree = sample_tree(m42)
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(), tree, path)
    # onto a (2, 4) mesh with another spec
    target = {
        "w": jax.ShapeDtypeStruct((16, 24), np.float32, sharding=NamedSharding(m24, P(None, "a"))),
        "bf16": jax.ShapeDtypeStruct((8, 16), ml_dtypes.bfloat16,
                                     sharding=NamedSharding(m24, P("a", "b"))),
        "odd": jax.ShapeDtypeStruct((7, 8), np.int32, sharding=NamedSharding(m24, P(None, "a"))),
        "scalar": jax.ShapeDtypeStruct((), np.float32, sharding=NamedSharding(m24, P())),
        "replicated": put(np.zeros((8, 4), np.float32), m24, P("b")),  # a jax.Array target
    }
    back = jckpt.restore(jckpt.Context(), target, path)
    for k, v in back.items():
        assert v.sharding == target[k].sharding, k
        np.testing.assert_array_equal(np.asarray(v), np.asarray(tree[k]))
    # onto one device, and as numpy
    one = cpu_devices()[3]
    back = jckpt.restore(jckpt.Context(device=one), {"w": jax.ShapeDtypeStruct((16, 24), np.float32)},
                         path)
    assert back["w"].devices() == {one}
    host = jckpt.restore(jckpt.Context(), {"step": 0, "w": np.zeros((16, 24), np.float32),
                                           "partial": np.zeros((16, 6), np.float32)}, path)
    assert host["step"] == 12
    assert isinstance(host["w"], np.ndarray) and isinstance(host["partial"], np.ndarray)
    np.testing.assert_array_equal(host["w"], data((16, 24)))
    np.testing.assert_array_equal(host["partial"], data((16, 6), offset=7))
    # load rebuilds every leaf
    _, loaded = jckpt.load(jckpt.Context(), path)
    for k, v in tree.items():
        np.testing.assert_array_equal(np.asarray(loaded["jckpt"][k]), np.asarray(v))


def test_each_device_reads_only_its_shard(tmp_path, m42, m24):
    path = tmp_path / "s.jckpt"
    x = data((64, 48))
    jckpt.save(jckpt.Context(), {"w": put(x, m42, P("data", "model"))}, path)
    for m, spec in [(m24, P(None, "a")), (m24, P("a", "b")), (m42, P("model")),
                    (mesh((8,), ("x",)), P(None, "x"))]:
        s = NamedSharding(m, spec)
        with sh.record_reads() as log:
            back = jckpt.restore(jckpt.Context(), {"w": jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                             sharding=s)}, path)
        shard_bytes = int(np.prod(s.shard_shape(x.shape))) * 4
        # each distinct slice read once, though replicas of it (P("model") on data x model,
        # P(None, "a") on b x a) sit on several devices
        assert len(log) == len({b for b, _ in log}) == len(set(map(str, s.devices_indices_map(
            x.shape).values())))
        assert all(n == shard_bytes for _, n in log), (spec, log)
        assert shard_bytes < x.nbytes
        np.testing.assert_array_equal(np.asarray(back["w"]), x)


def test_a_cast_restore_still_reads_only_each_shard(tmp_path, m42, m24):
    path = tmp_path / "s.jckpt"
    x = data((64, 48))
    jckpt.save(jckpt.Context(), {"w": put(x, m42, P("data", "model"))}, path)
    s = NamedSharding(m24, P("a", "b"))
    with sh.record_reads() as log:
        back = jckpt.restore(jckpt.Context(), {"w": jax.ShapeDtypeStruct(x.shape, ml_dtypes.bfloat16,
                                                                         sharding=s)}, path, cast=True)
    assert len(log) == 8 and all(n == x.nbytes // 8 for _, n in log)
    assert back["w"].dtype == ml_dtypes.bfloat16


def test_replicas_are_read_once_and_no_gather(tmp_path, m42, monkeypatch):
    tree = {"full": put(data((8, 8)), m42, P()), "rows": put(data((8, 8)), m42, P("data")),
            "both": put(data((8, 8)), m42, P("data", "model"))}
    real = transfers.await_host

    def no_gather(data):
        assert not facts.is_sharded(data), f"{data.shape} was gathered to host whole"
        return real(data)

    monkeypatch.setattr(transfers, "await_host", no_gather)
    leaves = to_host.host_leaves([(str(p), leaf) for p, leaf in jckpt.trees.pytree.flatten(tree)],
                                   pieces=True)
    assert [len(h.shards) for h in leaves] == [8, 1, 4]  # both, full, rows
    assert all(h.array is None for h in leaves)
    jckpt.save(jckpt.Context(), tree, tmp_path / "r.jckpt")
    assert CheckpointReader(tmp_path / "r.jckpt").verify() == []
    _, back = jckpt.load(jckpt.Context(), tmp_path / "r.jckpt")
    for k, v in tree.items():
        np.testing.assert_array_equal(np.asarray(back["jckpt"][k]), np.asarray(v))


def test_indivisible_target_is_a_clear_error(tmp_path, m42):
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(), {"w": data((10, 6))}, path)
    target = {"w": jax.ShapeDtypeStruct((10, 6), np.float32,
                                        sharding=NamedSharding(m42, P("data", "model")))}
    with pytest.raises(MismatchError, match="not divisible") as info:
        jckpt.restore(jckpt.Context(), target, path)
    assert info.value.entry == "jckpt/w" and "PartitionSpec" in info.value.fix
    ctx = jckpt.Context(device=NamedSharding(m42, P("data")))
    with pytest.raises(MismatchError, match="not divisible"):
        jckpt.restore(ctx, {"w": jax.ShapeDtypeStruct((10, 6), np.float32)}, path)


def test_a_context_device_sharding_an_array_cannot_take_is_an_input_error_naming_it(tmp_path,
                                                                                    m42):
    """`load` with `Context(device=<sharding>)` raised JAX's own IndivisibleError (an array of 3
    rows under P('data') of 4) or an IndexError (a scalar or a single typed key under it),
    naming neither the file nor the entry."""
    path = tmp_path / "s.jckpt"
    jckpt.save(jckpt.Context(), {"w": data((8, 6)), "odd": data((3,))}, path)
    ctx = jckpt.Context(device=NamedSharding(m42, P("data")))
    with pytest.raises(jckpt.InputError, match="not divisible by the Context's device sharding") \
            as info:
        jckpt.load(ctx, path)
    assert info.value.entry == "jckpt/odd" and info.value.file == str(path)
    assert "P()" in info.value.fix
    for leaf in (np.float32(1), jax.random.key(0)):
        jckpt.save(jckpt.Context(), {"s": leaf}, tmp_path / "one.jckpt")
        with pytest.raises(jckpt.InputError, match=r"shape \(\) has 0 axes, fewer than the 1"):
            jckpt.load(ctx, tmp_path / "one.jckpt")
    _, back = jckpt.load(jckpt.Context(device=NamedSharding(m42, P())), path)
    assert back["jckpt"]["odd"].sharding.spec == P()


def test_cast_partial_target_and_namespace(tmp_path, m42, m24):
    path = tmp_path / "s.jckpt"
    x = data((16, 8))
    jckpt.save(jckpt.Context(namespace="student"), {"a": put(x, m42, P("data", "model")),
                                                      "b": put(x, m42, P())}, path)
    s = NamedSharding(m24, P("a"))
    target = {"a": jax.ShapeDtypeStruct((16, 8), ml_dtypes.bfloat16, sharding=s)}
    with pytest.raises(MismatchError, match="dtype mismatch"):
        jckpt.restore(jckpt.Context(), target, path, namespace="student")
    with sh.record_reads() as log:
        back = jckpt.restore(jckpt.Context(), target, path, namespace="student", cast=True)
    assert back["a"].dtype == ml_dtypes.bfloat16 and back["a"].sharding == s
    assert all(n == x.nbytes // 4 for _, n in log)  # cast shard by shard, each read once
    np.testing.assert_array_equal(np.asarray(back["a"]), x.astype(ml_dtypes.bfloat16))


def test_directory_form_in_one_process(tmp_path, m42, m24):
    tree = sample_tree(m42)
    tree["key"] = jax.device_put(jax.random.split(jax.random.key(1), 8),
                                 NamedSharding(m42, P("data")))
    d = tmp_path / "ckpt"
    jckpt.save(jckpt.Context(), {"old": 1}, d)  # a file, replaced by the directory
    save_directory(jckpt.Context(), tree, d, metadata={"step": "3"})
    assert sorted(os.listdir(d)) == ["index.jckpt", "process_00000.jckpt"]
    assert not [n for n in os.listdir(tmp_path) if "stage" in n or "old" in n]
    meta = jckpt.describe(d).metadata_dict()
    assert meta.pop("jckpt.save").startswith("ckpt.jckpt-stage") and meta == {"step": "3"}
    s = NamedSharding(m24, P(None, "a"))
    with sh.record_reads() as log:
        back = jckpt.restore(jckpt.Context(), {
            "w": jax.ShapeDtypeStruct((16, 24), np.float32, sharding=s)}, d)
    assert all(n == 16 * 6 * 4 for _, n in log) and log
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(tree["w"]))
    _, loaded = jckpt.load(jckpt.Context(), d)
    for k, v in tree.items():
        if k == "key":
            np.testing.assert_array_equal(jax.random.key_data(loaded["jckpt"][k]),
                                          jax.random.key_data(v))
        else:
            np.testing.assert_array_equal(np.asarray(loaded["jckpt"][k]), np.asarray(v))
    # a second save (jckpt.save keeps the directory form) swaps the directory atomically
    jckpt.save(jckpt.Context(), {"w": tree["w"]}, d)
    assert os.path.isdir(d)
    assert [e.name for e in jckpt.describe(d).tensors] == ["jckpt/w"]
    one = tmp_path / "one.jckpt"  # consolidating gives one checked file
    jckpt.consolidate(d, one)
    reader = CheckpointReader(one)
    assert reader.verify() == [] and reader.header.tensors[0].slice is None
    np.testing.assert_array_equal(reader.decode(reader.header.tensors[0]), np.asarray(tree["w"]))


def test_incomplete_or_damaged_directory_is_refused(tmp_path, m42):
    d = tmp_path / "ckpt"
    save_directory(jckpt.Context(), {"w": put(data((8, 8)), m42, P("data"))}, d)
    piece = d / "process_00000.jckpt"
    raw = bytearray(piece.read_bytes())
    raw[-1] ^= 0xFF
    piece.write_bytes(bytes(raw))
    with pytest.raises(jckpt.ChecksumError):
        jckpt.consolidate(d, tmp_path / "x.jckpt")
    assert not (tmp_path / "x.jckpt").exists()
    os.unlink(d / "index.jckpt")
    with pytest.raises(FormatError, match="no index.jckpt"):
        jckpt.restore(jckpt.Context(), {"w": np.zeros((8, 8), np.float32)}, d)


def test_every_transfer_starts_before_any_is_awaited(tmp_path, m42, monkeypatch):
    tree = {"a": put(data((8, 8)), m42, P("data", "model")), "b": put(data((8, 4)), m42, P()),
            "c": put(data((16,)), m42, P("data"))}
    impl = type(tree["a"])
    events = []
    real_start, real_wait = impl.copy_to_host_async, transfers.await_host

    def start(self):
        events.append(("start", self.shape))
        return real_start(self)

    def wait(data):
        events.append(("wait", data.shape))
        return real_wait(data)

    monkeypatch.setattr(impl, "copy_to_host_async", start)
    monkeypatch.setattr(transfers, "await_host", wait)
    jckpt.save(jckpt.Context(), tree, tmp_path / "t.jckpt")
    kinds = [k for k, _ in events]
    # one transfer per distinct shard (8 + 1 + 4), each started before the first wait
    assert kinds.count("start") == 13 and kinds.count("wait") == 13, events
    assert kinds.index("wait") == 13
    assert all(shape != (8, 8) and shape != (16,) for _, shape in events)  # never the whole array


def test_needed_boxes_are_the_distinct_slices_of_this_processs_devices(m42):
    """What a restore plans its reads by: one box per distinct slice of a sharding over
    several devices (replicas share theirs); None where placing reads the whole array."""
    from jckpt.format.entries import Entry

    def entry(dims, prec="Single_prec", key_impl=None):
        return Entry(id=0, namespace="n", prec=prec, dims=dims, offset=0, byte_length=0,
                     key_impl=key_impl)

    def target(spec, shape=(16, 24)):
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(m42, spec))

    w = entry((16, 24))
    assert sh.needed_boxes(target(P("data", "model")), w, host=False, device=None) == [
        ((r, r + 4), (c, c + 12)) for r in range(0, 16, 4) for c in (0, 12)]
    assert sh.needed_boxes(target(P("data")), w, host=False, device=None) == [
        ((r, r + 4), (0, 24)) for r in range(0, 16, 4)]
    assert sh.needed_boxes(None, w, host=False, device=NamedSharding(m42, P(None, "model"))) == [
        ((0, 16), (0, 12)), ((0, 16), (12, 24))]                     # a load onto a sharding
    one = jax.sharding.SingleDeviceSharding(cpu_devices(1)[0])
    for leaf, e, host in [(data((16, 24)), w, False), (None, w, True), (None, w, False),
                          (jax.ShapeDtypeStruct((16, 24), np.float32, sharding=one), w, False),
                          (target(P("data"), (8, 24)), w, False),         # another shape
                          (target(P("data")), entry((16, 24), key_impl="threefry2x32"), False),
                          (target(P("data")), entry((16, 24), "Double_prec"), False)]:  # no x64
        assert sh.needed_boxes(leaf, e, host=host, device=None) is None, (leaf, e)
