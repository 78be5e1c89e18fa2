"""Device to host transfers (transfers.start_host_copies): pinned copies, their fallbacks,
replicas, and small arrays joined."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jckpt.trees import to_host, transfers
from tests.helpers import cpu_mesh


def sharded(x, spec):
    return jax.device_put(x, NamedSharding(cpu_mesh((4, 2), ("a", "b")), spec))


def test_pinned_copies_land_in_pinned_memory_and_stay_the_values_at_the_transfer():
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")  # default backend
    xs = [jnp.arange(6.0).reshape(2, 3), jnp.ones(4, jnp.int8), jax.device_put(jnp.zeros(3), pinned)]
    moved = transfers.start_host_copies(xs, snapshot=True)
    assert [m.sharding.memory_kind for m in moved] == ["pinned_host"] * 3
    views = [transfers.await_host(m) for m in moved]
    donate = jax.jit(lambda a: a * 0 - 1, donate_argnums=0)
    for x in xs[:2]:
        donate(x)  # the caller donates what it handed over
    assert [v.tolist() for v in views] == [[[0, 1, 2], [3, 4, 5]], [1] * 4, [0, 0, 0]]
    # an array already in pinned memory is copied too, never aliased
    assert views[2].ctypes.data != np.asarray(xs[2]).ctypes.data


def test_without_pinned_memory_a_transfer_is_a_plain_one(monkeypatch):
    started = []
    impl = type(jnp.ones(1))
    real = impl.copy_to_host_async
    monkeypatch.setattr(impl, "copy_to_host_async", lambda self: (started.append(1), real(self)))
    x = jnp.arange(3.0)
    assert transfers.start_host_copies([x]) == [x] and started == [1]
    monkeypatch.setattr(transfers, "_MEMORIES", {})
    monkeypatch.setattr(transfers, "SNAPSHOT_MEMORY", "no_such_memory")
    assert transfers._in_memory(x.sharding, "no_such_memory") is None
    assert transfers.start_host_copies([x], snapshot=True) == [x] and started == [1, 1]


def test_a_refused_pinned_transfer_falls_back_to_a_plain_one_and_says_so(monkeypatch, caplog):
    def refuse(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: pinned pool")
    x = jnp.arange(3.0)
    monkeypatch.setattr(transfers.jax, "device_put", refuse)
    monkeypatch.setattr(transfers, "_REFUSED", [])
    with caplog.at_level("WARNING", logger="jckpt"):
        moved = transfers.start_host_copies([x, x], snapshot=True)
        transfers.start_host_copies([x], snapshot=True)
    assert moved == [x, x] and transfers.await_host(moved[0]).tolist() == [0, 1, 2]
    assert len([r for r in caplog.records if "pinned_host memory refused" in r.message]) == 1


def test_leaves_of_an_accelerator_go_to_pinned_memory_in_one_transfer(accelerator, monkeypatch):
    calls = []
    real = transfers.jax.device_put
    monkeypatch.setattr(transfers.jax, "device_put",
                        lambda *a, **k: (calls.append(len(a[0])), real(*a, **k))[1])
    xs = [jnp.full(3, float(i)) for i in range(4)] + [jax.random.key(7)]
    hs = to_host.host_leaves([(f"ns/{i}", x) for i, x in enumerate(xs)], snapshot=True)
    assert calls == [5] and all(h.private for h in hs)
    assert [h.array[0] for h in hs[:4]] == [0, 1, 2, 3] and hs[4].key_impl is not None
    assert hs[4].array.tolist() == np.asarray(jax.random.key_data(xs[4])).tolist()


def test_shards_go_to_pinned_memory_too(accelerator, monkeypatch):
    x = np.arange(16.0).reshape(8, 2)
    h = to_host.host_leaves([("ns/x", sharded(x, P("a")))], pieces=True, snapshot=True)[0]
    assert {d.sharding.memory_kind for _, d in h.shards} == {"pinned_host"}
    for box, data in h.shards:
        assert transfers.await_host(data).tolist() == x[tuple(slice(a, b) for a, b in box)].tolist()


@pytest.mark.parametrize("host_memory", ["pinned_host", None])
def test_small_arrays_of_an_accelerator_travel_joined_once_their_join_is_compiled(accelerator, monkeypatch,
                                                                                  host_memory):
    from jckpt.trees import compiled
    monkeypatch.setattr(transfers, "SNAPSHOT_MEMORY", host_memory)
    monkeypatch.setattr(compiled, "_CALLS", {})
    sent = []
    real = transfers._start
    monkeypatch.setattr(transfers, "_start", lambda a, m: (sent.append(len(a)), real(a, m))[1])
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.standard_normal(5 + i % 7).astype(np.float32)) for i in range(40)]
    xs += [jnp.asarray(rng.random(3) > 0.5), jnp.int8(-3), jnp.ones(1 << 15)]  # the last: large
    want = [np.array(x) for x in xs]
    first = to_host.host_leaves([(f"ns/{i}", x) for i, x in enumerate(xs)], snapshot=True)
    compiled.wait_all()  # compiled in the background meanwhile
    leaves = [(f"ns/{i}", x) for i, x in enumerate(xs)]
    second = to_host.host_leaves(leaves, snapshot=True)
    plain = to_host.host_leaves(leaves)  # a one-shot save: one by one, no join
    assert [h.array.tobytes() for h in plain] == [w.tobytes() for w in want]
    assert sent == [43, 2, 43]  # one by one; then the large one and the small ones joined
    for hs in (first, second):
        assert all(h.private for h in hs)
        assert [h.array.tobytes() for h in hs] == [w.tobytes() for w in want]
        assert [h.array.dtype for h in hs] == [w.dtype for w in want]
    jax.jit(lambda t: [x * 0 for x in t], donate_argnums=0)(xs)
    assert [h.array.tobytes() for h in second] == [w.tobytes() for w in want]


def test_a_replicated_array_moves_one_copy_and_a_sharded_one_travels_plainly(accelerator, monkeypatch):
    x = np.arange(16.0).reshape(8, 2)
    replicated, split = sharded(x, P()), sharded(x, P("a"))
    moved = transfers.start_host_copies([replicated, split], snapshot=True)
    assert moved[0].sharding.memory_kind == "pinned_host" and len(moved[0].devices()) == 1
    assert moved[1] is split  # numpy gathers its shards
    assert [transfers.await_host(m).tolist() for m in moved] == [x.tolist()] * 2
