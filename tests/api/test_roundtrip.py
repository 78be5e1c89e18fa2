"""Bit-exact round trips of random pytrees (hypothesis), every storable dtype."""

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jckpt
import jckpt.trees.pytree
from jckpt.format import precs
from tests.helpers import LAYOUTS, laid_out

DTYPES = [precs.dtype_of(p) for p in sorted(precs.ALL_PRECS - {"Void_prec", "Uint4x32_prec"})]


@st.composite
def arrays(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    raw = draw(st.binary(min_size=int(np.prod(shape)) * dtype.itemsize,
                         max_size=int(np.prod(shape)) * dtype.itemsize))
    array = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()  # any bits, NaNs included
    return laid_out(array, draw(st.sampled_from(LAYOUTS)))


@st.composite
def prng_keys(draw):
    impl = draw(st.sampled_from(["threefry2x32", "rbg", "unsafe_rbg"]))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3))
    return jax.random.split(jax.random.key(draw(st.integers(0, 2**31 - 1)), impl=impl),
                            int(np.prod(shape))).reshape(shape)


keys = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), min_size=0,
               max_size=6)
trees = st.recursive(st.one_of(arrays(), arrays(), prng_keys()), lambda c: st.one_of(
    st.dictionaries(keys, c, max_size=4), st.lists(c, max_size=3),
    st.tuples(c, c)), max_leaves=12)


def bits(x):
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(x)), bits(jax.random.key_data(x))
    x = np.asarray(x)
    return x.dtype.newbyteorder("<") if x.dtype.byteorder == ">" else x.dtype, \
        np.ascontiguousarray(x).astype(x.dtype.newbyteorder("<")).tobytes(), x.shape


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.data_too_large])
@given(tree=trees, alignment=st.sampled_from([1, 32, 64]), mmap=st.booleans())
def test_roundtrip_bit_exact(tmp_path_factory, tree, alignment, mmap):
    path = tmp_path_factory.mktemp("rt") / "t.jckpt"
    jckpt.save(jckpt.Context(alignment=alignment), tree, path)
    back = jckpt.restore(jckpt.Context(host=True), tree, path, mmap=mmap)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
        assert bits(a) == bits(b)
    _, loaded = jckpt.load(jckpt.Context(host=True), path, mmap=mmap)
    flat = dict(jckpt.trees.pytree.flatten(loaded["jckpt"])) if jax.tree.leaves(tree) else {}
    for p, leaf in jckpt.trees.pytree.flatten(tree):
        assert bits(flat[p]) == bits(leaf)
