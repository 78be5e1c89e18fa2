

def test_entry_for_builds_the_same_entry_as_the_dataclass_would():
    import numpy as np

    from jckpt.format.entries import Entry, entry_for
    got = entry_for('opt', (('k', 'mu'), ('i', 3)), np.dtype('float32'), (2, 3), id=7,
                    checksum=('xxh3_64', '0' * 16), key_impl='threefry2x32', offset=128,
                    slice=[(0, 2), (3, 6)], global_dims=[4, 6])
    want = Entry(id=7, namespace='opt', prec='Single_prec', dims=(2, 3), offset=128, byte_length=24,
                 label=('mu', '3'), path=(('k', 'mu'), ('i', 3)), checksum=('xxh3_64', '0' * 16),
                 key_impl='threefry2x32', slice=((0, 2), (3, 6)), global_dims=(4, 6))
    assert got == want and hash(got) == hash(want) and repr(got) == repr(want)
    assert type(got) is Entry


def test_loose_path_takes_a_string_key_that_writes_out_a_number_as_that_number():
    # orbax records every dict key as a string: an nnx.State's integer keys come back as '0'
    from jckpt.format.entries import loose_path as loose
    assert loose((("k", "1"), ("k", "0"))) == loose((("ki", 1), ("i", 0)))
    assert loose((("k", "-3"),)) == loose((("ki", -3),))
    for not_a_number in ("01", "-0", "+1", "1_0", " 1", "\u0661", "", "x1", "1" * 30):
        assert loose((("k", not_a_number),)) != loose((("i", 1),))
        assert loose((("k", not_a_number),)) == loose((("a", not_a_number),))


def test_a_typed_keys_array_shape_drops_its_key_datas_dim():
    """What a load returns: a scalar key stores key data of shape (2,) and is a key of shape ()."""
    import dataclasses

    from jckpt.format.entries import Entry
    key = Entry(0, 'n', 'Uint32_prec', (3, 2), 0, 24, key_impl='threefry2x32')
    assert (key.shape, key.array_shape) == ((3, 2), (3,))
    assert dataclasses.replace(key, dims=(2,)).array_shape == ()
    assert dataclasses.replace(key, key_impl=None).array_shape == (3, 2)
