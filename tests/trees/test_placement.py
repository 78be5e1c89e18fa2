"""Host to device (placement.place, place_all)."""

import threading
import warnings
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jckpt
from jckpt.errors import FormatError
from jckpt.format.boxes import box_shape
from jckpt.storage.lazy import LazyArray
from jckpt.trees import placement
from tests.helpers import cpu_devices, cpu_mesh


def test_place_all_follows_each_target():
    requests = [(np.arange(3.0, dtype=np.float32), None, "w", None),
                (np.array(7), 0, "step", None),
                (np.ones(2, np.float32), np.zeros(2), "np", None),
                (np.ones(2, np.float32), jax.ShapeDtypeStruct((2,), jnp.float32), "spec", None)]
    w, step, as_np, spec = placement.place_all(requests, host=False, device=None)
    assert isinstance(w, jax.Array) and w.tolist() == [0, 1, 2]
    assert step == 7 and type(step) is int
    assert isinstance(as_np, np.ndarray) and isinstance(spec, jax.Array)
    on_host = placement.place_all(requests[:1], host=True, device=None)[0]
    assert isinstance(on_host, np.ndarray)


def test_damaged_key_data_is_a_format_error():
    with pytest.raises(FormatError, match="cannot rebuild PRNG keys"):
        placement.place(np.zeros(3, np.uint32), None, host=False, device=None, where="k",
                        key_impl="threefry2x32")


def test_a_weakly_typed_target_comes_back_weakly_typed(tmp_path):
    """A Linen TrainState's `step=0` (and an `lr=0.1`) are weak under jax.eval_shape; a strong
    value restored there made every jitted step compile again after a resume."""
    import jckpt
    ctx = jckpt.Context()
    live = jax.device_put({'step': jnp.asarray(7), 'lr': jnp.asarray(0.1), 'w': jnp.ones(3)},
                          jax.devices()[0])  # default backend
    assert live['step'].weak_type and live['lr'].weak_type and not live['w'].weak_type
    jckpt.save(ctx, live, tmp_path / 'w.jckpt')
    target = jax.eval_shape(lambda: {'step': 0, 'lr': 0.1, 'w': jnp.ones(3)})
    for into in (target, live):
        got = jckpt.restore(ctx, into, tmp_path / 'w.jckpt')
        assert {k: (v.dtype, v.weak_type) for k, v in got.items()} == {
            k: (v.dtype, v.weak_type) for k, v in live.items()}
        assert int(got['step']) == 7 and float(got['lr']) == np.float32(0.1)
    step = jax.jit(lambda s: s['step'] + 1)
    step(live)
    step(got)
    assert step._cache_size() == 1  # no second compilation


def test_place_all_decides_each_kind_of_request_as_place_does(monkeypatch):
    """Requests that differ only in the array's dtype, the target's type or its sharding are
    each placed as `place` places them alone, in any order."""
    device = cpu_devices(1)[0]
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    weak = jax.ShapeDtypeStruct((2,), jnp.float32, weak_type=True)
    on_device = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    f32 = np.ones(2, np.float32)
    requests = [(f32, spec, "a", None), (np.ones(2, np.float64), spec, "b", None),
                (f32, np.zeros(2), "c", None), (f32, on_device, "d", None), (f32, spec, "e", None),
                (f32, weak, "w", None), (f32, spec, "s", None),
                (np.ones(2, np.uint32), None, "k", "threefry2x32")]
    monkeypatch.setattr(placement, "_warned_x64", False)
    with pytest.warns(UserWarning, match="64-bit") if not jax.config.jax_enable_x64 else nullcontext():
        got = placement.place_all(requests, host=False, device=None)
    for value, (array, target, where, key_impl) in zip(got, requests):
        want = placement.place(array, target, host=False, device=None, where=where, key_impl=key_impl)
        assert type(value) is type(want) and value.dtype == want.dtype
        assert getattr(value, "sharding", None) == getattr(want, "sharding", None)
        assert getattr(value, "weak_type", None) == getattr(want, "weak_type", None), where


def test_place_all_decides_once_for_equal_shardings(monkeypatch):
    """A target built from arrays (`ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)`)
    gives each leaf an equal sharding object of its own: decided once, not once per leaf, and
    placed where each asks."""
    device = cpu_devices(1)[0]
    specs = [jax.ShapeDtypeStruct((2,), jnp.float32,
                                  sharding=jax.sharding.SingleDeviceSharding(device))
             for _ in range(5)]
    assert specs[0].sharding is not specs[1].sharding and specs[0].sharding == specs[1].sharding
    asked = []
    plain = placement.plain_target
    monkeypatch.setattr(placement, 'plain_target', lambda *a, **k: asked.append(a) or plain(*a, **k))
    requests = [(np.full(2, i, np.float32), spec, f"w{i}", None) for i, spec in enumerate(specs)]
    got = placement.place_all(requests, host=False, device=None)
    assert len(asked) == 1
    assert [v.tolist() for v in got] == [[i, i] for i in range(5)]
    assert all(v.sharding == specs[0].sharding for v in got)


class _Device:
    def __init__(self, platform, id):
        self.platform, self.id = platform, id

    def __repr__(self):
        return f"{self.platform}:{self.id}"


def test_specs_without_a_sharding_warn_only_where_one_of_several_accelerators_takes_them():
    """`jax.eval_shape` gives no shardings: a restore into it put a sharded model on one GPU."""
    gpus = [_Device('gpu', i) for i in range(4)]
    with pytest.warns(UserWarning, match=r"m.jckpt: 2 target leaves \(jckpt/w, ...\) are "
                                         r"ShapeDtypeStructs without a sharding .* gpu:0, of the 4"):
        placement.warn_unsharded_specs(['jckpt/w', 'jckpt/b'], 'm.jckpt', gpus)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        placement.warn_unsharded_specs([], 'm.jckpt', gpus)
        placement.warn_unsharded_specs(['jckpt/w'], 'm.jckpt', gpus[:1])
        placement.warn_unsharded_specs(['jckpt/w'], 'm.jckpt', [_Device('cpu', i) for i in range(8)])


def test_restore_names_the_unsharded_array_specs(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(placement, 'warn_unsharded_specs', lambda specs, path: seen.append(specs))
    path = tmp_path / 'm.jckpt'
    jckpt.save(jckpt.Context(), {'w': np.ones(4), 'step': 3, 'b': np.ones(2)}, path)
    mesh = jax.sharding.Mesh(np.array(cpu_devices()[:2]), ('d',))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target = {'w': jax.ShapeDtypeStruct((4,), np.float64), 'step': jax.ShapeDtypeStruct((), np.int64),
              'b': jax.ShapeDtypeStruct((2,), np.float64, sharding=replicated)}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # 64-bit without x64
        jckpt.restore(jckpt.Context(), target, path)
        jckpt.restore(jckpt.Context(device=cpu_devices()[1]), target, path)  # said where
        jckpt.restore(jckpt.Context(host=True), target, path)
    assert seen == [['jckpt/w']]


@pytest.mark.parametrize("spec", [(), (None,), ("x",)])
def test_restored_keys_lay_their_data_out_as_the_target_keys_do(tmp_path, spec):
    """Keys put with `P()` and with `P(None)` show one sharding over data laid out two ways; keys
    restored with their data laid out the other way made a jitted step compile again."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = cpu_mesh((8,), ("x",))
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(mesh, PartitionSpec(*spec)))
    ctx = jckpt.Context()
    jckpt.save(ctx, {"k": keys}, str(tmp_path / "k.jckpt"))
    got = jckpt.restore(ctx, {"k": keys}, str(tmp_path / "k.jckpt"))["k"]
    assert jax.random.key_data(got).sharding == jax.random.key_data(keys).sharding
    step = jax.jit(lambda k: jax.random.key_data(k).sum())
    assert int(step(got)) == int(step(keys))
    if hasattr(step, "_cache_size"):
        assert step._cache_size() == 1
    spec_target = jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=keys.sharding)
    from_spec = jckpt.restore(ctx, {"k": spec_target}, str(tmp_path / "k.jckpt"))["k"]
    again = jax.device_put(jax.random.split(jax.random.key(0), 8), keys.sharding)
    assert jax.random.key_data(from_spec).sharding == jax.random.key_data(again).sharding


def test_keys_from_a_directory_are_read_box_by_box(tmp_path):
    """Typed PRNG keys of a directory checkpoint were read whole on the host before each
    device took its box: every process read every piece of them."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jckpt.api.multiprocess import save_directory
    from jckpt.storage.lazy import record_reads

    keys = jax.random.split(jax.random.key(0), 8)
    save_directory(jckpt.Context(durable=False), {"k": keys}, str(tmp_path / "ckpt"))
    target = jax.ShapeDtypeStruct((8,), keys.dtype,
                                  sharding=NamedSharding(cpu_mesh((8,), ("x",)), PartitionSpec("x")))
    with record_reads() as log:
        got = jckpt.restore(jckpt.Context(), {"k": target}, str(tmp_path / "ckpt"))["k"]
    assert sorted(log) == [(((i, i + 1), (0, 2)), 8) for i in range(8)]
    assert np.array_equal(jax.random.key_data(got), jax.random.key_data(keys))


@pytest.mark.parametrize("device", [0, 3])
def test_keys_restored_onto_one_device_of_a_mesh_keep_the_targets_sharding(tmp_path, device):
    """Keys bound for a one-device mesh went to the default device first: on it, they came
    back with a `SingleDeviceSharding` (another sharding than the target's, so another
    compilation of a step); elsewhere, they were copied there after."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    keys = jax.random.split(jax.random.key(0), 4)
    jckpt.save(jckpt.Context(durable=False), {"k": keys}, str(tmp_path / "k.jckpt"))
    mesh = Mesh(np.array(cpu_devices()[device:device + 1]), ("x",))
    for spec in [(), (None,), ("x",)]:
        sharding = NamedSharding(mesh, PartitionSpec(*spec))
        target = jax.ShapeDtypeStruct((4,), keys.dtype, sharding=sharding)
        got = jckpt.restore(jckpt.Context(), {"k": target}, str(tmp_path / "k.jckpt"))["k"]
        assert got.sharding == sharding == jax.device_put(keys, sharding).sharding
        assert np.array_equal(jax.random.key_data(got), jax.random.key_data(keys))


def test_a_weakly_typed_target_keeps_its_sharding(tmp_path):
    """Making the restored value weakly typed ran a JAX operation, whose result JAX put in
    device memory and with its own spec: a step count bound for host memory (`unpinned_host`)
    came back in device memory, and one replicated with `P()` came back as `P(None)`."""
    from jax.sharding import NamedSharding, PartitionSpec

    jckpt.save(jckpt.Context(durable=False), {"n": np.arange(8, dtype=np.int32)},
               str(tmp_path / "n.jckpt"))
    mesh = cpu_mesh((2, 4), ("x", "y"))
    for spec, memory in [((), None), ((), "unpinned_host"), (("x",), "unpinned_host"),
                         (("y",), "pinned_host")]:
        sharding = NamedSharding(mesh, PartitionSpec(*spec), memory_kind=memory)
        target = jax.ShapeDtypeStruct((8,), np.int32, sharding=sharding, weak_type=True)
        got = jckpt.restore(jckpt.Context(), {"n": target}, str(tmp_path / "n.jckpt"))["n"]
        assert got.weak_type and got.sharding == sharding, (spec, memory, got.sharding)
        assert np.array_equal(got, np.arange(8))


def test_a_weakly_typed_target_off_the_mesh_in_context_comes_back_weakly_typed(tmp_path):
    """Under `jax.set_mesh`, a weakly typed target on another mesh (or on one device) came
    back strongly typed: JAX refused the operation that makes it weak for an array off the
    mesh in context, and the value was kept as it was."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

    jckpt.save(jckpt.Context(durable=False), {"step": np.int32(7)}, str(tmp_path / "s.jckpt"))
    other = Mesh(np.array(cpu_devices()[4:6]), ("z",))
    with jax.set_mesh(cpu_mesh((2,), ("x",))):
        for sharding in (NamedSharding(other, PartitionSpec()), SingleDeviceSharding(cpu_devices()[5])):
            target = jax.ShapeDtypeStruct((), np.int32, sharding=sharding, weak_type=True)
            got = jckpt.restore(jckpt.Context(), {"step": target}, str(tmp_path / "s.jckpt"))["step"]
            assert got.weak_type and got.sharding == sharding and int(got) == 7


def test_place_all_reads_lazy_arrays_concurrently():
    # a lazily read array is an object store's payload, each box a request: placing one after
    # another made a restore with verify=False wait on each request before making the next
    barrier, alone = threading.Barrier(2, timeout=10), []

    def read(box):
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            alone.append(box)
            barrier.reset()
        return np.ones(box_shape(box), np.float32)

    mesh = cpu_mesh((2,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    requests = [(LazyArray((4,), np.float32, read), jax.ShapeDtypeStruct((4,), np.float32,
                                                                          sharding=sharding), w, None)
                for w in ("a", "b")]
    placed = placement.place_all(requests, host=False, device=None)
    assert [np.asarray(p).tolist() for p in placed] == [[1.0] * 4] * 2
    assert alone == []


def test_only_an_array_placed_on_other_processes_devices_is_beyond_this_process():
    """What makes a multi-process `restore` meet the others: in one process, nothing is."""
    from jax.sharding import AbstractMesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    on_mesh = NamedSharding(cpu_mesh((4,), ("x",)), P("x"))
    local = [np.zeros(3), 3, np.float32(1), jnp.ones(2), jax.device_put(np.ones(8), on_mesh),
             jax.ShapeDtypeStruct((8,), jnp.float32, sharding=on_mesh),
             jax.ShapeDtypeStruct((8,), jnp.float32)]
    assert not any(placement.beyond_this_process(x, host=False, device=None) for x in local)
    abstract = NamedSharding(AbstractMesh((4,), ("x",)), P("x"))  # its devices are not known
    assert placement.beyond_this_process(jax.ShapeDtypeStruct((8,), jnp.float32, sharding=abstract),
                                         host=False, device=None)

