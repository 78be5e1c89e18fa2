"""Leaf to host (to_host.host_leaves): what each kind of leaf becomes, transfers, refusals."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jckpt.errors import InputError
from jckpt.trees import placement, to_host
from tests.helpers import cpu_mesh


def host(leaf, **kw):
    return to_host.host_leaves([("ns/x", leaf)], **kw)[0]


def sharded(x, spec):
    mesh = cpu_mesh((4, 2), ("a", "b"))
    return jax.device_put(x, NamedSharding(mesh, spec))


# --- what each kind of leaf becomes ---------------------------------------------------------

def test_numpy_leaves_are_used_as_they_are_unless_copied():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    h = host(x)
    assert h.array is x and not h.private and h.shards == ()
    assert (h.dtype, h.shape, h.key_impl, h.nbytes) == (np.float32, (2, 3), None, 24)
    c = host(x, copy=True)
    assert c.private and not np.shares_memory(c.array, x)
    x[:] = -1  # the caller reuses its buffer: the copy is a snapshot
    assert c.array.tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("value,dtype", [(True, np.bool_), (7, np.int64), (0.5, np.float64),
                                         (1 + 2j, np.complex128), (np.float16(3), np.float16),
                                         (np.array(4, ml_dtypes.bfloat16), ml_dtypes.bfloat16)])
def test_scalars_become_0d_arrays(value, dtype):
    h = host(value)
    assert h.shape == () and h.dtype == dtype and h.array.item() == np.asarray(value).item()
    assert h.private == (not isinstance(value, np.ndarray))  # a new array, no one else holds it


def test_jax_arrays_come_to_host_and_copies_are_private():
    x = jax.device_put(jnp.arange(8.0), jax.devices("cpu")[0])
    h = host(x)
    assert isinstance(h.array, np.ndarray) and h.array.tolist() == list(range(8))
    assert h.dtype == np.float32 and h.shape == (8,)
    assert not h.private  # on the CPU, the host array may alias the device buffer
    c = host(x, copy=True)
    assert c.private and c.array.flags.writeable and not np.shares_memory(c.array, np.asarray(x))
    bf = host(jnp.ones((2, 2), jnp.bfloat16))
    assert bf.dtype == ml_dtypes.bfloat16 and bf.array.dtype == ml_dtypes.bfloat16


def test_typed_prng_keys_become_key_data_and_impl():
    one, many = jax.random.key(3), jax.random.split(jax.random.key(4), 5)
    rbg = jax.random.key(5, impl="rbg")
    hs = to_host.host_leaves([("k/one", one), ("k/many", many), ("k/rbg", rbg)])
    assert [h.key_impl for h in hs] == ["threefry2x32", "threefry2x32", "rbg"]
    assert [h.shape for h in hs] == [(2,), (5, 2), (4,)] and all(h.dtype == np.uint32 for h in hs)
    np.testing.assert_array_equal(hs[1].array, jax.random.key_data(many))
    alone = to_host.host_leaves([("k/many", many)])[0]
    assert alone.key_impl == "threefry2x32" and alone.array.shape == (5, 2)
    back = placement.place(hs[2].array, None, host=True, device=None, where="k/rbg",
                           key_impl=hs[2].key_impl)
    assert jax.dtypes.issubdtype(back.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(back), jax.random.key_data(rbg))


@pytest.mark.parametrize("leaf,message", [
    ("text", "leaf of type str is not an array"),
    (None, "leaf of type NoneType is not an array"),
    (jax.ShapeDtypeStruct((2,), jnp.float32), "ShapeDtypeStruct is not an array"),
    (np.array(["a"]), "dtype <U1 cannot be stored"),
    (np.array([object()]), "dtype object cannot be stored"),
    (2**70, "dtype object cannot be stored"),
])
def test_refusals_name_the_leaf(leaf, message):
    with pytest.raises(InputError, match=message) as info:
        to_host.host_leaves([("ns/ok", np.ones(2)), ("ns/bad", leaf)])
    assert info.value.entry == "ns/bad"
    with pytest.raises(InputError, match=message):
        to_host.host_leaves([("ns/bad", leaf)])


# --- sharded arrays, transfers, descriptions --------------------------------------------------

def test_sharded_arrays_whole_or_as_their_distinct_shards():
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    rows, full = sharded(x, P("a")), sharded(x, P())
    assert to_host.is_sharded(rows) and not to_host.is_sharded(jnp.ones(2))
    whole = host(rows)
    assert whole.shards == () and whole.array.tolist() == x.tolist()  # gathered
    h_rows, h_full = to_host.host_leaves([("r", rows), ("f", full)], pieces=True)
    assert h_rows.array is None and h_full.array is None
    assert len(h_rows.shards) == 4 and len(h_full.shards) == 1  # replicas are written once
    for box, data in h_rows.shards:
        got = to_host.await_host(data)
        assert got.tolist() == x[tuple(slice(a, b) for a, b in box)].tolist()
    assert h_rows.nbytes == x.nbytes
    assert to_host.host_leaves([("n", np.ones(3))], pieces=True)[0].shards == ()


def as_accelerator(monkeypatch):
    """Every sharding taken for one whose devices are not the CPU's (data to transfer)."""
    real = to_host._facts
    monkeypatch.setattr(to_host, "ACCELERATE", False)  # C stages only arrays known on the CPU
    monkeypatch.setattr(to_host, "_facts", lambda sharding: real(sharding)._replace(on_cpu=False))


def test_every_transfer_starts_before_the_first_wait(monkeypatch):
    events = []
    impl = type(jnp.ones(1))
    real_start, real_wait = impl.copy_to_host_async, to_host.await_host
    as_accelerator(monkeypatch)
    monkeypatch.setattr(impl, "copy_to_host_async", lambda self: (events.append("start"),
                                                                  real_start(self)))
    monkeypatch.setattr(to_host, "await_host", lambda d: (events.append("wait"), real_wait(d))[1])
    hs = to_host.host_leaves([(f"ns/{i}", jnp.full(3, float(i))) for i in range(5)])
    assert events == ["start"] * 5 + ["wait"] * 5
    assert all(h.private for h in hs) and [h.array[0] for h in hs] == [0, 1, 2, 3, 4]


def test_fetch_false_checks_and_describes_without_transfers(monkeypatch):
    impl = type(jnp.ones(1))
    monkeypatch.setattr(impl, "copy_to_host_async", lambda self: pytest.fail("transferred"))
    as_accelerator(monkeypatch)
    leaves = [("a", jnp.ones((2, 3))), ("b", np.zeros(4, np.int8)), ("c", 5),
              ("d", sharded(np.ones((8, 2)), P("a")))]
    hs = to_host.host_leaves(leaves, fetch=False, pieces=True)
    assert [(h.shape, h.array, h.shards) for h in hs] == [((2, 3), None, ()), ((4,), None, ()),
                                                           ((), None, ()), ((8, 2), None, ())]
    with pytest.raises(InputError, match="cannot be stored"):
        to_host.host_leaves([("e", jnp.ones(2)), ("f", np.array(["x"]))], fetch=False)


# --- runs of plain leaves staged in C ------------------------------------------------------------

def every_kind():
    """Leaves of every kind: plain ones (numpy arrays of any layout, arrays on one CPU device)
    in runs between the others."""
    return [("a", np.arange(6, dtype=np.float32).reshape(2, 3)), ("b", jnp.arange(4)),
            ("c", jnp.ones((2, 2), jnp.bfloat16)), ("d", np.zeros((3, 2), np.int8, order="F")),
            ("e", np.float16(2)), ("f", 3), ("g", jax.random.key(0)),
            ("h", sharded(np.arange(16.0).reshape(8, 2), P("a"))), ("i", np.ones(2)[::2]),
            ("j", np.array([True, False])), ("k", np.zeros(2, ">f4")), ("l", jnp.zeros(()))]


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.skipif(to_host.accelerator is None, reason="the C accelerator is not built")
def test_leaves_staged_in_c_are_those_python_stages(monkeypatch, copy):
    leaves = every_kind()
    to_host.host_leaves(leaves)  # the types and shardings met are known from now on
    staged = []
    real = to_host._stage
    monkeypatch.setattr(to_host, "_stage", lambda where, *a, **kw: (staged.append(where),
                                                                    real(where, *a, **kw))[1])
    fast = to_host.host_leaves(leaves, pieces=True, copy=copy)
    assert staged == ["e", "f", "g", "h"]  # numbers, a key, a sharded array: the rest went through C
    seen = {id(leaf.sharding) for _, leaf in leaves if isinstance(leaf, jax.Array)} & set(to_host._SEEN)
    assert seen and all(to_host._SEEN[k][0] is not None for k in seen)  # known by identity now
    monkeypatch.setattr(to_host, "ACCELERATE", False)
    slow = to_host.host_leaves(leaves, pieces=True, copy=copy)
    for (where, leaf), f, s in zip(leaves, fast, slow):
        assert (f.dtype, f.shape, f.key_impl, f.private, len(f.shards)) == (
            s.dtype, s.shape, s.key_impl, s.private, len(s.shards)), where
        if s.array is not None:
            assert type(f.array) is np.ndarray and np.array_equal(f.array, s.array), where
            assert (f.array is leaf) == (s.array is leaf), where


def test_key_paths_under_a_namespace_are_named_in_refusals():
    ok = ((("k", "params"), ("i", 0)), np.ones(2))
    bad = ((("k", "params"), ("i", 1)), np.array(["x"]))
    with pytest.raises(InputError, match="cannot be stored") as info:
        to_host.host_leaves([ok, bad], namespace="ns")
    assert info.value.entry == "ns/params/1"


def test_shardings_known_by_identity_stay_few_and_right(monkeypatch):
    monkeypatch.setattr(to_host, "_SEEN", {})
    monkeypatch.setattr(to_host, "_SEEN_MAX", 2)
    arrays = [jax.device_put(np.ones(2), jax.devices("cpu")[0]) for _ in range(3)]
    arrays.append(sharded(np.ones((8, 2)), P("a")))
    facts = [to_host._facts(a.sharding) for a in arrays]
    assert len(to_host._SEEN) <= 2
    assert [f.several for f in facts] == [False, False, False, True] and all(f.on_cpu for f in facts)
    assert to_host._facts(arrays[-1].sharding) is facts[-1]  # found again, by identity
    assert to_host._SEEN[id(arrays[-1].sharding)][0] is arrays[-1].sharding


# --- transfers into pinned host memory -------------------------------------------------------

def test_pinned_copies_land_in_pinned_memory_and_stay_the_values_at_the_transfer():
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")  # default backend
    xs = [jnp.arange(6.0).reshape(2, 3), jnp.ones(4, jnp.int8), jax.device_put(jnp.zeros(3), pinned)]
    moved = to_host.start_host_copies(xs, snapshot=True)
    assert [m.sharding.memory_kind for m in moved] == ["pinned_host"] * 3
    views = [to_host.await_host(m) for m in moved]
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
    assert to_host.start_host_copies([x]) == [x] and started == [1]
    monkeypatch.setattr(to_host, "_MEMORIES", {})
    monkeypatch.setattr(to_host, "SNAPSHOT_MEMORY", "no_such_memory")
    assert to_host._in_memory(x.sharding, "no_such_memory") is None
    assert to_host.start_host_copies([x], snapshot=True) == [x] and started == [1, 1]


def test_a_refused_pinned_transfer_falls_back_to_a_plain_one_and_says_so(monkeypatch, caplog):
    def refuse(*a, **k):
        raise RuntimeError("RESOURCE_EXHAUSTED: pinned pool")
    x = jnp.arange(3.0)
    monkeypatch.setattr(to_host.jax, "device_put", refuse)
    monkeypatch.setattr(to_host, "_REFUSED", [])
    with caplog.at_level("WARNING", logger="jckpt"):
        moved = to_host.start_host_copies([x, x], snapshot=True)
        to_host.start_host_copies([x], snapshot=True)
    assert moved == [x, x] and to_host.await_host(moved[0]).tolist() == [0, 1, 2]
    assert len([r for r in caplog.records if "pinned_host memory refused" in r.message]) == 1


def test_leaves_of_an_accelerator_go_to_pinned_memory_in_one_transfer(monkeypatch):
    calls = []
    real = to_host.jax.device_put
    monkeypatch.setattr(to_host.jax, "device_put",
                        lambda *a, **k: (calls.append(len(a[0])), real(*a, **k))[1])
    as_accelerator(monkeypatch)
    xs = [jnp.full(3, float(i)) for i in range(4)] + [jax.random.key(7)]
    hs = to_host.host_leaves([(f"ns/{i}", x) for i, x in enumerate(xs)], snapshot=True)
    assert calls == [5] and all(h.private for h in hs)
    assert [h.array[0] for h in hs[:4]] == [0, 1, 2, 3] and hs[4].key_impl is not None
    assert hs[4].array.tolist() == np.asarray(jax.random.key_data(xs[4])).tolist()


def test_shards_go_to_pinned_memory_too(monkeypatch):
    as_accelerator(monkeypatch)
    x = np.arange(16.0).reshape(8, 2)
    h = to_host.host_leaves([("ns/x", sharded(x, P("a")))], pieces=True, snapshot=True)[0]
    assert {d.sharding.memory_kind for _, d in h.shards} == {"pinned_host"}
    for box, data in h.shards:
        assert to_host.await_host(data).tolist() == x[tuple(slice(a, b) for a, b in box)].tolist()


@pytest.mark.parametrize("host_memory", ["pinned_host", None])
def test_small_arrays_of_an_accelerator_travel_joined_once_their_join_is_compiled(monkeypatch,
                                                                                  host_memory):
    from jckpt.trees import compiled
    as_accelerator(monkeypatch)
    monkeypatch.setattr(to_host, "SNAPSHOT_MEMORY", host_memory)
    monkeypatch.setattr(compiled, "_CALLS", {})
    sent = []
    real = to_host._start
    monkeypatch.setattr(to_host, "_start", lambda a, m: (sent.append(len(a)), real(a, m))[1])
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


def test_a_replicated_array_moves_one_copy_and_a_sharded_one_travels_plainly(monkeypatch):
    as_accelerator(monkeypatch)
    x = np.arange(16.0).reshape(8, 2)
    replicated, split = sharded(x, P()), sharded(x, P("a"))
    moved = to_host.start_host_copies([replicated, split], snapshot=True)
    assert moved[0].sharding.memory_kind == "pinned_host" and len(moved[0].devices()) == 1
    assert moved[1] is split  # numpy gathers its shards
    assert [to_host.await_host(m).tolist() for m in moved] == [x.tolist()] * 2
