"""How a target leaf takes a stored entry (targets): shapes, dtypes, weak types, PRNG keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jckpt
from jckpt.api import targets
from jckpt.format.entries import entry_for

CTX = jckpt.Context()


def entry(dtype, dims, key_impl=None):
    return entry_for("jckpt", (("k", "x"),), np.dtype(dtype), dims, id=0, key_impl=key_impl)


def takes(e, leaf):
    e = targets.as_target_takes(e, leaf, "f.jckpt", "jckpt/x")
    return e, targets.check_leaf(CTX, e, leaf, "f.jckpt", "jckpt/x")


def test_typed_key_entries_become_keys_or_their_data_as_the_target_asks():
    fry = entry("uint32", (3, 2), "threefry2x32")
    e, _ = takes(fry, jax.eval_shape(lambda: jax.random.split(jax.random.key(0), 3)))
    assert e.key_impl == "threefry2x32"
    e, want = takes(fry, jax.ShapeDtypeStruct((3, 2), jnp.uint32))
    assert e.key_impl is None and want == jnp.uint32
    with pytest.raises(jckpt.MismatchError, match="file has threefry2x32 keys, target has rbg"):
        takes(fry, jax.eval_shape(lambda: jax.random.split(jax.random.key(0, impl="rbg"), 3)))


def test_typed_keys_into_a_plain_target_of_their_own_shape_say_they_are_keys():
    """`inspect` shows a scalar key as `key<threefry2x32>` of shape `()`; restored into a
    scalar target it was refused as a shape mismatch against `(2,)`, its data's shape."""
    for leaf, what in ((jnp.zeros((3,), jnp.float32), "float32[3]"), (0.0, "a Python number"),
                       (jax.ShapeDtypeStruct((3,), jnp.uint32), "uint32[3]")):
        with pytest.raises(jckpt.MismatchError, match="holds typed PRNG keys") as e:
            takes(entry("uint32", (3, 2), "threefry2x32"), leaf)
        assert e.value.message.endswith(f"key<threefry2x32>[3], the target is {what}")
        assert "jax.ShapeDtypeStruct((3, 2), jnp.uint32)" in e.value.fix


def test_plain_key_data_becomes_keys_only_of_an_implementation_of_its_shape():
    e, _ = takes(entry("uint32", (2,)), jax.random.key(0))
    assert e.key_impl == "threefry2x32"
    e, _ = takes(entry("uint32", (4,)), jax.random.key(0, impl="rbg"))
    assert e.key_impl == "rbg"
    for plain in (entry("uint32", (3,)), entry("int32", (2,))):
        with pytest.raises(jckpt.MismatchError, match="not the key data"):
            takes(plain, jax.random.key(0))


def test_shapes_and_dtypes_are_checked_before_reading():
    with pytest.raises(jckpt.MismatchError, match=r"shape mismatch: file has \(2,\), target has \(3,\)"):
        takes(entry("float32", (2,)), np.zeros(3, np.float32))
    e, want = takes(entry("float32", (2,)), np.zeros(2, np.float64))
    with pytest.raises(jckpt.MismatchError, match="dtype mismatch: file has float32"):
        targets.as_stored_for(np.ones(2, np.float32), e, np.zeros(2), want, "f", "w", cast=False)
    cast = targets.as_stored_for(np.ones(2, np.float32), e, np.zeros(2), want, "f", "w", cast=True)
    assert np.asarray(cast[(slice(0, 2),)]).dtype == np.float64
    with pytest.raises(jckpt.InputError, match="target leaf of type str"):
        takes(entry("float32", (2,)), "w")


@pytest.mark.parametrize("stored,target,expected", [
    (np.float64(0.1), 0.0, np.float32(0.1)),  # rounded, as JAX rounds the Python number
    (np.float64(np.nan), 0.0, None), (np.float64(-np.inf), 0.0, np.float32(-np.inf)),
    (np.int64(7), 0, np.int32(7)), (np.complex128(0.1 + 1j), 0j, np.complex64(0.1 + 1j)),
])
def test_a_weak_target_takes_a_value_as_jax_takes_the_number(stored, target, expected):
    weak = jax.eval_shape(lambda: target)
    e = entry(stored.dtype, ())
    got = targets.as_stored_for(np.asarray(stored), e, weak, weak.dtype, "f", "w", cast=False)
    assert got.dtype == weak.dtype
    assert np.isnan(got) if expected is None else got == expected


@pytest.mark.parametrize("stored,target", [(np.float64(1e300), 0.0), (np.int64(2 ** 40), 0),
                                           (np.complex128(1e300), 0j)])
def test_a_weak_target_refuses_an_overflow(stored, target):
    weak = jax.eval_shape(lambda: target)
    with pytest.raises(jckpt.MismatchError, match="does not fit the target's weakly typed"):
        targets.as_stored_for(np.asarray(stored), entry(stored.dtype, ()), weak, weak.dtype, "f",
                              "w", cast=False)

def test_take_applies_restores_rules_to_an_array_already_read():
    """What a foreign-format manager step uses: plain key data into a key target becomes keys,
    a weak target takes the 64-bit value, another dtype is refused unless cast."""
    from jckpt.api.targets import take
    ctx = jckpt.Context()
    data = np.asarray(jax.random.key_data(jax.random.key(1)))
    e = entry_for('jckpt', (('k', 'rng'),), data.dtype, data.shape, id=0)
    array, leaf, where, impl = take(ctx, e, data, jax.random.key(0), 'f.npz', 'jckpt/rng', cast=False)
    assert impl == str(jax.random.key_impl(leaf)) and where == 'jckpt/rng' and array is data
    step = np.int64(7)
    e = entry_for('jckpt', (('k', 'step'),), step.dtype, (), id=0)
    weak = jax.eval_shape(lambda: 0)
    assert take(ctx, e, step, weak, 'f.npz', 'jckpt/step', cast=False)[0].dtype == np.int32
    with pytest.raises(jckpt.MismatchError, match="dtype mismatch"):
        take(ctx, e, step, jnp.zeros((), jnp.int32), 'f.npz', 'jckpt/step', cast=False)


@pytest.mark.parametrize('stored, target, expected', [
    (2.5, 0.0, 2.5), (3, 0.0, 3.0), (3, 0j, 3 + 0j), (True, 0, 1), (7, 0, 7), (True, False, True),
])
def test_a_python_number_target_takes_its_kind_or_a_narrower_one(tmp_path, stored, target,
                                                                  expected):
    path = tmp_path / 'n.jckpt'
    jckpt.save(jckpt.Context(), {'v': stored}, path)
    out = jckpt.restore(jckpt.Context(), {'v': target}, path)['v']
    assert out == expected and type(out) is type(target)


@pytest.mark.parametrize('stored, target', [(2.5, 0), (2, False), (1 + 2j, 0.0), (0.5, True)])
def test_a_python_number_target_refuses_to_narrow_without_cast(tmp_path, stored, target):
    """A float restored into `step=0` came back truncated (2.5 as 2), silently."""
    path = tmp_path / 'n.jckpt'
    jckpt.save(jckpt.Context(), {'v': stored}, path)
    with pytest.raises(jckpt.MismatchError, match=f"the target is the Python {type(target).__name__}") as e:
        jckpt.restore(jckpt.Context(), {'v': target}, path)
    assert e.value.entry == 'jckpt/v' and 'cast=True' in e.value.fix
    out = jckpt.restore(jckpt.Context(), {'v': target}, path, cast=True)['v']
    assert out == type(target)(stored.real if isinstance(stored, complex) else stored)


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="the hint is for processes with x64 off")
def test_a_64_bit_entry_into_a_32_bit_jax_target_says_that_x64_is_off(tmp_path):
    """A state saved with jax_enable_x64 on, restored into `jax.eval_shape`'s specs in a process
    with it off: the fix said only "pass cast=True, or fix the target's dtype", as if the user
    had asked for float32."""
    path = tmp_path / 'x64.jckpt'
    jckpt.save(jckpt.Context(), {'w': np.ones(3, np.float64), 'n': np.arange(2)}, path)
    target = jax.eval_shape(lambda: {'w': jnp.ones(3), 'n': jnp.arange(2)})
    with pytest.raises(jckpt.MismatchError, match="file has float64, target has float32") as e:
        jckpt.restore(jckpt.Context(), {'w': target['w']}, path)
    assert "jax_enable_x64" in e.value.fix and "cast=True" in e.value.fix
    with pytest.raises(jckpt.MismatchError, match="file has int64, target has int32") as e:
        jckpt.restore(jckpt.Context(), {'n': target['n']}, path)
    assert "jax_enable_x64" in e.value.fix
    with pytest.raises(jckpt.MismatchError) as e:  # a numpy target asked for float32 itself
        jckpt.restore(jckpt.Context(), {'w': np.zeros(3, np.float32)}, path)
    assert "jax_enable_x64" not in e.value.fix


def test_a_numpy_scalar_target_gets_a_numpy_scalar(tmp_path):
    path = tmp_path / 'n.jckpt'
    jckpt.save(jckpt.Context(), {'v': np.float32(1.5), 'a': np.ones(())}, path)
    out = jckpt.restore(jckpt.Context(), {'v': np.float32(0), 'a': np.zeros(())}, path)
    assert type(out['v']) is np.float32 and out['v'] == 1.5
    assert type(out['a']) is np.ndarray and out['a'].shape == ()


def test_a_target_leaf_no_file_stores_is_named_as_such_whether_stored_or_not(tmp_path):
    """A function or string among the target's leaves (an equinox module's activation) is
    named as what it is, with the split that restores the arrays alone: the file can hold no
    such leaf, so "not in the checkpoint" would send the user looking for it there."""
    path = tmp_path / "m.jckpt"
    jckpt.save(CTX, {"w": np.ones(2, np.float32)}, path)
    target = {"act": jax.nn.relu, "w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    with pytest.raises(jckpt.InputError, match=r"target leaf of type \w+ \(.*relu.*\) is not an "
                                               r"array, a spec or a number") as e:
        jckpt.restore(CTX, target, path)
    assert e.value.entry == "jckpt/act" and e.value.file.endswith("m.jckpt")
    assert "eqx.partition" in e.value.fix
    with pytest.raises(jckpt.InputError, match="target leaf of type str") as e:
        takes(entry("float32", (2,)), "w")  # one the file has an entry for
    assert e.value.entry == "jckpt/x" and e.value.file == "f.jckpt"


def test_cast_into_a_narrow_int_saturates_and_names_the_entry(tmp_path):
    # numpy's own cast let a bare RuntimeWarning out and gave machine-dependent values
    import warnings

    import ml_dtypes
    path = str(tmp_path / 'f.jckpt')
    stored = np.array([1.9, np.nan, 1e10, -1e10, -3.0], np.float32)
    jckpt.save(jckpt.Context(durable=False), {'a': stored}, path)
    for target, want in ((jnp.zeros(5, jnp.int4), [1, 0, 7, -8, -3]),
                         (np.zeros(5, ml_dtypes.int4), [1, 0, 7, -8, -3]),
                         (np.zeros(5, np.uint8), [1, 0, 255, 0, 0])):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter('always')
            got = jckpt.restore(jckpt.Context(), {'a': target}, path, cast=True)['a']
        assert np.asarray(got).astype(int).tolist() == want
        assert [type(w.message) for w in seen] == [UserWarning]
        assert 'jckpt/a' in str(seen[0].message) and 'nan became 0' in str(seen[0].message)
    assert np.asarray(jnp.asarray(stored).astype(jnp.int4)).astype(int).tolist() == [1, 0, 7, -8, -3]


def test_cast_values_keeps_int64_saturated_and_is_quiet_when_all_fit():
    big = np.array([2.0**63, -2.0**63, 5.0])
    with pytest.warns(UserWarning, match='1 value'):
        out = targets.cast_values(big, np.dtype(np.int64), 'a.jckpt', 'jckpt/x')
    assert out.tolist() == [2**63 - 1, -2**63, 5]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert targets.cast_values(np.arange(3.0), np.dtype(np.int8), 'a', 'b').tolist() == [0, 1, 2]


def test_cast_from_complex_into_a_real_target_names_the_dropped_imaginary_part(tmp_path):
    """numpy's bare ComplexWarning ("Casting complex values to real discards the imaginary
    part") came out, naming neither the file nor the entry; into an integer the real part
    wrapped (300 into int8 became 44) where JAX's astype saturates it (127)."""
    import warnings

    path = str(tmp_path / 'c.jckpt')
    jckpt.save(jckpt.Context(durable=False), {'w': np.array([1 + 2j, 3 + 0j, 5 - 1j], np.complex64),
                                              'i': np.array([300 + 1j], np.complex128),
                                              'z': np.array([4 + 0j], np.complex64)}, path)
    target = {'w': jnp.zeros(3, jnp.float32), 'i': jnp.zeros(1, jnp.int8), 'z': jnp.zeros(1, jnp.float32),
              'b': jnp.zeros(1, bool)}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter('always')
        got = jckpt.restore(jckpt.Context(), {k: target[k] for k in ('w', 'i', 'z')}, path, cast=True)
    assert np.asarray(got['w']).tolist() == [1.0, 3.0, 5.0] and np.asarray(got['z']).tolist() == [4.0]
    assert np.asarray(got['i']).tolist() == [127]  # the real part, then saturated as JAX does
    messages = sorted(str(w.message) for w in seen if 'imaginary' in str(w.message))
    assert [type(w.message) for w in seen if 'imaginary' in str(w.message)] == [UserWarning] * 2
    assert not [w for w in seen if issubclass(w.category, np.exceptions.ComplexWarning)]
    assert messages[1].startswith(f'{path}: entry jckpt/w: cast=True dropped the imaginary part of '
                                  '2 value(s) converting complex64 to float32 (the first: (1+2j)')
    assert messages[0].startswith(f'{path}: entry jckpt/i: ') and '(300+1j)' in messages[0]


def test_a_weakly_typed_float_target_takes_a_stored_int_as_a_python_float_does(tmp_path):
    # a weak float32 (jnp.asarray(1.0)) refused the stored int a Python 0.0 took
    path = str(tmp_path / 'n.jckpt')
    jckpt.save(jckpt.Context(durable=False), {'step': 3, 'flag': True, 'big': 2**53 + 1}, path)
    ctx = jckpt.Context()
    for target in (jnp.asarray(1.0), jax.ShapeDtypeStruct((), jnp.float32, weak_type=True)):
        got = jckpt.restore(ctx, {'step': target, 'flag': target}, path)
        assert (got['step'].dtype, float(got['step']), float(got['flag'])) == (jnp.float32, 3.0, 1.0)
        assert got['step'].weak_type
        with pytest.raises(jckpt.MismatchError, match='does not fit'):  # float32 rounds it
            jckpt.restore(ctx, {'big': target}, path)
    assert jckpt.restore(ctx, {'step': 0.0}, path)['step'] == 3.0
    with pytest.raises(jckpt.MismatchError):  # never the reverse: a float into a weak int
        jckpt.save(ctx, {'x': 2.5}, path)
        jckpt.restore(ctx, {'x': jnp.asarray(1)}, path)


def test_leaves_of_one_kind_are_checked_once_and_every_other_on_its_own(tmp_path, monkeypatch):
    """A model's many leaves are of a few kinds (shape, dtype, sharding): a restore checks each
    kind once, and a leaf of another shape (or any leaf it cannot group) is still refused by
    name."""
    path = tmp_path / "m.jckpt"
    jckpt.save(CTX, {f"w{i}": np.full(2, i, np.float32) for i in range(6)}, path)
    asked = []
    check = targets.check_leaf
    monkeypatch.setattr(targets, "check_leaf", lambda *a, **k: asked.append(a[3]) or check(*a, **k))
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    got = jckpt.restore(CTX, {f"w{i}": spec for i in range(6)}, path)
    assert len(asked) == 1 and [got[f"w{i}"].tolist() for i in range(6)] == [[i, i] for i in range(6)]
    target = {f"w{i}": np.zeros(2, np.float32) for i in range(6)} | {"w4": np.zeros(3, np.float32)}
    with pytest.raises(jckpt.MismatchError, match=r"shape mismatch: file has \(2,\), target has \(3,\)"
                       ) as e:
        jckpt.restore(CTX, target, path)
    assert e.value.entry == "jckpt/w4"
