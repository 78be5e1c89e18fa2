"""Leaf to host (to_host.host_leaves): what each kind of leaf becomes, transfers, refusals."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jckpt.errors import InputError
from jckpt.trees import facts, placement, to_host, transfers
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
    (2**70, "an integer of 22 digits does not fit 64 bits"),
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
    assert facts.is_sharded(rows) and not facts.is_sharded(jnp.ones(2))
    whole = host(rows)
    assert whole.shards == () and whole.array.tolist() == x.tolist()  # gathered
    h_rows, h_full = to_host.host_leaves([("r", rows), ("f", full)], pieces=True)
    assert h_rows.array is None and h_full.array is None
    assert len(h_rows.shards) == 4 and len(h_full.shards) == 1  # replicas are written once
    for box, data in h_rows.shards:
        got = transfers.await_host(data)
        assert got.tolist() == x[tuple(slice(a, b) for a, b in box)].tolist()
    assert h_rows.nbytes == x.nbytes
    assert to_host.host_leaves([("n", np.ones(3))], pieces=True)[0].shards == ()


def test_every_transfer_starts_before_the_first_wait(accelerator, monkeypatch):
    events = []
    impl = type(jnp.ones(1))
    real_start, real_wait = impl.copy_to_host_async, transfers.await_host
    monkeypatch.setattr(impl, "copy_to_host_async", lambda self: (events.append("start"),
                                                                  real_start(self)))
    monkeypatch.setattr(transfers, "await_host", lambda d: (events.append("wait"), real_wait(d))[1])
    hs = to_host.host_leaves([(f"ns/{i}", jnp.full(3, float(i))) for i in range(5)])
    assert events == ["start"] * 5 + ["wait"] * 5
    assert all(h.private for h in hs) and [h.array[0] for h in hs] == [0, 1, 2, 3, 4]


def test_fetch_false_checks_and_describes_without_transfers(accelerator, monkeypatch):
    impl = type(jnp.ones(1))
    monkeypatch.setattr(impl, "copy_to_host_async", lambda self: pytest.fail("transferred"))
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
    seen = {id(leaf.sharding) for _, leaf in leaves if isinstance(leaf, jax.Array)} & set(facts.SEEN)
    assert seen and all(facts.SEEN[k][0] is not None for k in seen)  # known by identity now
    monkeypatch.setattr(to_host, "ACCELERATE", False)
    slow = to_host.host_leaves(leaves, pieces=True, copy=copy)
    for (where, leaf), f, s in zip(leaves, fast, slow):
        assert (f.dtype, f.shape, f.key_impl, f.private, len(f.shards)) == (
            s.dtype, s.shape, s.key_impl, s.private, len(s.shards)), where
        if s.array is not None:
            assert type(f.array) is np.ndarray and np.array_equal(f.array, s.array), where
            assert (f.array is leaf) == (s.array is leaf), where


@pytest.mark.skipif(to_host.accelerator is None, reason="the C accelerator is not built")
def test_keep_cpu_leaves_the_cpu_arrays_staged_in_c_as_they_are():
    """For a caller that copies from their buffers at once: no numpy view is made of them."""
    leaves = every_kind()
    to_host.host_leaves(leaves)  # the types and shardings met are known from now on
    kept = to_host.host_leaves(leaves, keep_cpu=True)
    plain = to_host.host_leaves(leaves)
    for (where, leaf), k, p in zip(leaves, kept, plain):
        assert (k.dtype, k.shape, k.key_impl, k.private) == (p.dtype, p.shape, p.key_impl, p.private)
        assert np.array_equal(np.asarray(k.array), p.array), where
        on_cpu = isinstance(leaf, jax.Array) and where not in ("g", "h")  # a key, a sharded one
        assert (k.array is leaf) == (on_cpu or p.array is leaf), where


def test_key_paths_under_a_namespace_are_named_in_refusals():
    ok = ((("k", "params"), ("i", 0)), np.ones(2))
    bad = ((("k", "params"), ("i", 1)), np.array(["x"]))
    with pytest.raises(InputError, match="cannot be stored") as info:
        to_host.host_leaves([ok, bad], namespace="ns")
    assert info.value.entry == "ns/params/1"


def donated(n=8):
    """A jax array whose buffer a jitted step took (donate_argnums)."""
    x = jnp.arange(float(n))
    jax.jit(lambda a: a * 2, donate_argnums=0)(x)
    return x


def test_a_donated_array_is_named_not_a_bare_runtime_error():
    x = donated()
    assert x.is_deleted()
    key = jax.random.key(0)
    jax.jit(lambda k: jax.random.fold_in(k, 1), donate_argnums=0)(key)
    for leaf in (x, key):
        with pytest.raises(InputError, match="has been deleted") as e:
            to_host.host_leaves([('ns/ok', np.ones(2)), ('ns/w', leaf)])
        assert e.value.entry == 'ns/w' and 'the state the step returned' in e.value.fix
    with pytest.raises(InputError, match="has been deleted") as e:  # key paths, named on demand
        to_host.host_leaves([((('k', 'w'),), x)], namespace='ns', snapshot=True)
    assert e.value.entry == 'ns/w'


def test_a_tracer_is_named_not_a_bare_attribute_error():
    seen = []

    def step(a):
        with pytest.raises(InputError, match="is a tracer") as e:
            to_host.host_leaves([('ns/w', a)])
        seen.append(e.value)
        return a

    jax.jit(step)(jnp.ones(3))
    assert seen[0].entry == 'ns/w' and 'outside the jitted function' in seen[0].fix


def test_other_failures_pass_through_and_live_leaves_are_not_blamed():
    assert to_host.unusable_leaf([('a', np.ones(2)), ('b', jnp.ones(2)), ('c', 3)]) is None
    with pytest.raises(ZeroDivisionError):
        with to_host.naming_unusable(lambda: [('a', jnp.ones(2))]):
            1 / 0  # noqa: B018
    with pytest.raises(InputError, match="not an array"):  # a CheckpointError stays itself
        to_host.host_leaves([('ns/s', 'text'), ('ns/w', donated())])


def test_leaves_no_file_can_hold_say_why():
    """float0 (a gradient of an integer input) was told to cast to a supported dtype, and an
    integer beyond 64 bits that "dtype object cannot be stored"."""
    g = jax.grad(lambda x, i: x, argnums=(0, 1), allow_int=True)(1.0, 3)[1]
    with pytest.raises(InputError, match="float0 array .* holds no values") as e:
        to_host.host_leaves([('ns/g', g)])
    assert e.value.entry == 'ns/g' and 'None' in e.value.fix
    for big in (2**64, -2**63 - 1, 10**400):
        with pytest.raises(InputError, match="does not fit 64 bits") as e:
            to_host.host_leaves([('ns/n', big)])
        assert e.value.entry == 'ns/n'
    assert to_host.host_leaves([('ns/n', 2**64 - 1)])[0].dtype == np.uint64
