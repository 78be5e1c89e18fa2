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
