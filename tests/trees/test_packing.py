"""Small arrays packed into one transfer and split on the device: values, dtypes, placement."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.trees import batched_put, compiled, packing

ARRAYS = [np.arange(5, dtype=np.int32), np.array([True, False, True]), np.float32(2.5),
          np.arange(6, dtype=np.float16).reshape(2, 3), np.array([-3, 4], np.int8),
          np.array([1.5, -2.25], ml_dtypes.bfloat16), np.arange(12, dtype=np.uint16).reshape(3, 2, 2),
          np.array([7], np.uint8), np.arange(4, dtype=np.float32)[::2]]  # not contiguous


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    """No layout compiled or asked for before the test."""
    monkeypatch.setattr(compiled, "_CALLS", {})
    monkeypatch.setattr(compiled, "_ASKED", {})


def test_packed_arrays_arrive_whole_and_exact():
    device = jax.devices()[-1]  # default backend: an accelerator when there is one
    arrays = [np.asarray(a) for a in ARRAYS]
    assert packing.put_packed(arrays, device) is None  # a layout seen once: nothing compiled
    assert packing.put_packed(arrays, device) is None  # the second time: compiling
    compiled.wait_all()
    out = packing.put_packed(arrays, device)
    for got, want in zip(out, ARRAYS):
        want = np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.devices() == {device} and got.committed


def test_layout_keeps_every_slice_aligned():
    layout, size = packing.layout_of([np.zeros(3, np.int8), np.zeros(5, np.float32), np.zeros(1)])
    assert [o for o, _, _ in layout] == [0, 16, 48] and size == 64
    assert all(o % packing.PACK_ALIGN == 0 for o, _, _ in layout)


def test_only_small_arrays_of_whole_byte_dtypes_pack():
    assert packing.packable(np.zeros(4, np.float32))
    assert not packing.packable(np.zeros(0, np.float32))
    assert not packing.packable(np.zeros(packing.PACK_BYTES // 4 + 1, np.float32))
    assert not packing.packable(np.zeros(4, np.complex64))
    assert not packing.packable(np.zeros(4, ml_dtypes.int4))


def test_restore_packs_small_leaves_bound_for_an_accelerator(tmp_path, monkeypatch):
    """With the device taken for an accelerator, many small leaves go in one packed transfer."""
    tree = {f"b{i:03d}": np.full((i % 7) + 1, i, np.float32) for i in range(packing.PACK_MIN + 8)}
    tree["big"] = np.ones(packing.PACK_BYTES // 4 + 1, np.float32)
    tree["step"] = np.int32(9)
    path = tmp_path / "c.jckpt"
    jckpt.save(jckpt.Context(), tree, path)
    calls, splits = [], []
    real = packing.put_packed
    monkeypatch.setattr(batched_put, "_accelerator", lambda dest: jax.devices()[0])  # default backend

    def spied(arrays, device):
        packed = real(arrays, device)
        calls.append((len(arrays), packed is not None))
        return packed
    monkeypatch.setattr(packing, "put_packed", spied)
    monkeypatch.setattr(packing, "_split", counting(packing._split, splits))
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    for restored in range(3):
        out = jckpt.restore(jckpt.Context(), spec, path)
        for k, v in tree.items():
            assert isinstance(out[k], jax.Array)
            np.testing.assert_array_equal(np.asarray(out[k]), v)
        compiled.wait_all()
        # the first restore compiles nothing; the second starts the split's compilation
        assert len(splits) == (0 if restored == 0 else 1)
    small = packing.PACK_MIN + 9  # every small leaf, the scalar too; not the big one
    assert calls == [(small, False), (small, False), (small, True)]  # packed once compiled


class counting:
    """A jitted function whose lowerings are counted (a compilation follows each)."""

    def __init__(self, jitted, counts):
        self.jitted, self.counts = jitted, counts

    def lower(self, *args):
        self.counts.append(1)
        return self.jitted.lower(*args)


def test_few_small_leaves_go_one_by_one(tmp_path, monkeypatch):
    path = tmp_path / "c.jckpt"
    jckpt.save(jckpt.Context(), {"a": jnp.ones(3), "b": jnp.zeros(2)}, path)
    monkeypatch.setattr(batched_put, "_accelerator", lambda dest: jax.devices()[0])  # default backend
    monkeypatch.setattr(packing, "put_packed", lambda *a: pytest.fail("packed"))
    out = jckpt.restore(jckpt.Context(), {"a": jnp.zeros(3), "b": jnp.ones(2)}, path)
    assert out["a"].tolist() == [1, 1, 1]


def test_on_the_cpu_nothing_is_packed():
    cpu = jax.devices("cpu")[0]
    assert batched_put._accelerator(cpu) is None
    assert batched_put._accelerator(jax.sharding.SingleDeviceSharding(cpu)) is None


# --- off the device: joined there, viewed on the host ----------------------------------------

def compiled_join(arrays):
    """`packing.take_packed(arrays)` once its join has compiled (waited for here)."""
    if packing.take_packed(arrays) is None:
        compiled.wait_all()
    return packing.take_packed(arrays)


def test_joined_arrays_come_back_whole_and_exact_as_views_of_one_buffer():
    device = jax.devices()[-1]  # default backend: an accelerator when there is one
    arrays = [jax.device_put(a, device) for a in ARRAYS]
    buffer, layout = compiled_join(arrays)
    assert buffer.dtype == np.uint8 and buffer.shape == (packing.layout_of(arrays)[1],)
    host = np.asarray(buffer)
    out = packing.split_on_host(host, layout)
    for got, want in zip(out, ARRAYS):
        want = np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        assert np.shares_memory(got, host)


def test_only_small_device_arrays_of_whole_byte_dtypes_are_joined():
    assert packing.takeable(jnp.zeros(4)) and not packing.takeable(jnp.zeros(0))
    assert not packing.takeable(jnp.zeros(packing.TAKE_BYTES // 4 + 1))
    assert not packing.takeable(jnp.zeros(4, jnp.complex64))


def test_a_join_that_fails_to_compile_leaves_arrays_to_travel_alone(monkeypatch):
    monkeypatch.setattr(compiled, "_CALLS", {})
    monkeypatch.setattr(packing, "_compile_join", lambda *a: 1 / 0)
    xs = [jnp.ones(3), jnp.zeros(2)]
    assert packing.take_packed(xs) is None
    compiled.wait_all()
    assert packing.take_packed(xs) is None


def test_a_join_that_fails_when_called_leaves_arrays_to_travel_alone(monkeypatch):
    def broken(arrays):
        raise RuntimeError("RESOURCE_EXHAUSTED: no room for the join")
    monkeypatch.setattr(compiled, "ready", lambda key, compile: broken)
    assert packing.take_packed([jnp.ones(3), jnp.zeros(2)]) is None
