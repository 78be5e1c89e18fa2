"""Host arrays bound for one device each, put in batches: JAX's per-array routine, checked."""

import jax
import numpy as np

from jckpt.trees import batched_put
from tests.helpers import cpu_devices


def test_put_batch_places_as_device_put_does():
    """JAX's per-array transfer, one aval per shape and dtype, against `jax.device_put`."""
    device = cpu_devices(1)[0]
    one = jax.sharding.SingleDeviceSharding(device)
    arrays = [np.arange(4.0, dtype=np.float32), np.ones((2, 3), np.int8),
              np.arange(4.0, dtype=np.float32) + 1, np.zeros((), np.uint16), np.arange(3, dtype=np.int32)]
    dests = [device, device, one, one, device]
    got = batched_put._put_batch(arrays, dests)
    want = jax.device_put(arrays, dests)
    for g, w in zip(got, want):
        assert isinstance(g, jax.Array) and g.sharding == w.sharding and g.dtype == w.dtype
        assert np.array_equal(np.asarray(g), np.asarray(w))


def test_put_batch_falls_back_to_device_put_on_an_unexpected_answer(monkeypatch):
    monkeypatch.setattr(batched_put, "_transfer_routine", lambda: lambda *a: np.zeros(1))
    (got,) = batched_put._put_batch([np.arange(3.0)], [cpu_devices(1)[0]])
    assert isinstance(got, jax.Array) and got.tolist() == [0.0, 1.0, 2.0]
    monkeypatch.setattr(batched_put, "_transfer_routine", lambda: None)
    (got,) = batched_put._put_batch([np.arange(3.0)], [cpu_devices(1)[0]])
    assert isinstance(got, jax.Array) and got.tolist() == [0.0, 1.0, 2.0]
