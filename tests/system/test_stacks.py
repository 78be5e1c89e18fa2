"""The stacks JAX users run (flax NNX and Linen, optax, equinox, orbax), driven as a user would.

Each test is one workflow, written the way the library's users write it:
build a state with the stack's own calls, checkpoint it through jckpt, and
get it back into what the stack's own "abstract state" call gives
(``jax.eval_shape``, ``nnx.eval_shape``). Stacks that are not installed skip
their tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt import adapters
from jckpt.api.multiprocess import save_directory
from jckpt.errors import InputError

CTX = jckpt.Context()


def _orbax():
    return pytest.importorskip("orbax.checkpoint")


def _adamw_state():
    optax = pytest.importorskip("optax")
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    tx = optax.adamw(1e-3)
    state = tx.init(params)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    _, state = tx.update(grads, state, params)  # count 1, non-zero moments
    return state


def _same(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- cast=True on scalars ------------------------------------------------------------------

@pytest.mark.parametrize("directory", [False, True], ids=["file", "directory"])
def test_cast_converts_scalars(tmp_path, directory):
    path = tmp_path / "s.jckpt"
    tree = {"step": jnp.int32(7), "loss": jnp.float32(1.5)}
    if directory:  # read through the directory reader's lazy arrays
        save_directory(CTX, tree, path)
    else:
        jckpt.save(CTX, tree, path)
    back = jckpt.restore(CTX, {"step": jax.ShapeDtypeStruct((), jnp.float32),
                               "loss": jax.ShapeDtypeStruct((), jnp.bfloat16)}, path, cast=True)
    assert back["step"].dtype == jnp.float32 and float(back["step"]) == 7.0
    assert back["loss"].dtype == jnp.bfloat16 and float(back["loss"]) == 1.5
    host = jckpt.restore(CTX, {"step": np.float64(0)}, path, cast=True)
    assert host["step"].dtype == np.float64 and host["step"] == 7.0


def test_ml_dtypes_scalars_cast(tmp_path):
    jckpt.save(CTX, {"x": np.float32(2.5)}, tmp_path / "x.jckpt")
    back = jckpt.restore(CTX, {"x": np.zeros((), ml_dtypes.bfloat16)}, tmp_path / "x.jckpt", cast=True)
    assert back["x"].dtype == ml_dtypes.bfloat16 and float(back["x"]) == 2.5


# --- jckpt -> orbax ---------------------------------------------------------------------------

def test_optax_state_exports_to_orbax_with_its_empty_states(tmp_path):
    ocp = _orbax()
    state = _adamw_state()
    abstract = jax.eval_shape(lambda: state)
    jckpt.save(CTX, state, tmp_path / "s.jckpt")
    restored = jckpt.restore(CTX, abstract, tmp_path / "s.jckpt")  # the tree, empty states and all
    adapters.write({"jckpt": restored}, tmp_path / "exported", format="orbax")
    with ocp.StandardCheckpointer() as checkpointer:
        back = checkpointer.restore(tmp_path / "exported" / "jckpt", abstract)
    _same(back, state)


def test_typed_prng_keys_cross_to_orbax_and_back(tmp_path):
    ocp = _orbax()
    tree = {"key": jax.random.key(3), "keys": jax.random.split(jax.random.key(1), 3),
            "rbg": jax.random.key(2, impl="rbg"), "w": jnp.ones(2)}
    abstract = jax.eval_shape(lambda: tree)
    jckpt.save(CTX, tree, tmp_path / "k.jckpt")
    jckpt.convert(tmp_path / "k.jckpt", tmp_path / "exported", format="orbax")
    with ocp.StandardCheckpointer() as checkpointer:
        back = checkpointer.restore(tmp_path / "exported" / "jckpt", abstract)
        checkpointer.save(tmp_path / "from_orbax", tree)
    _same(_data(back), _data(tree))
    jckpt.convert(tmp_path / "from_orbax", tmp_path / "o.jckpt")
    again = jckpt.restore(CTX, abstract, tmp_path / "o.jckpt")
    assert jax.dtypes.issubdtype(again["rbg"].dtype, jax.dtypes.prng_key)
    _same(_data(again), _data(tree))


def _is_key(x):
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _data(tree):
    return jax.tree_util.tree_map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


# --- metadata ---------------------------------------------------------------------------------

def test_save_refuses_metadata_that_is_not_strings(tmp_path):
    path = tmp_path / "m.jckpt"
    with pytest.raises(InputError, match=r"metadata key 'step' has the int value 3") as e:
        jckpt.save(CTX, {"w": np.ones(2)}, path, metadata={"step": 3})
    assert "str(" in e.value.fix and not path.exists()
    with pytest.raises(InputError, match="metadata key 3"):
        jckpt.save(CTX, {"w": np.ones(2)}, path, metadata={3: "x"})
    with pytest.raises(InputError, match="metadata must be a mapping"):
        jckpt.save(CTX, {"w": np.ones(2)}, path, metadata=[("step", "3")])
    jckpt.save(CTX, {"w": np.ones(2)}, path, metadata={"jckpt.note": "x", "step": "3"})
    assert jckpt.describe(path).metadata_dict()["step"] == "3"
