"""Host to device (placement.place, place_all)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jckpt.errors import FormatError
from jckpt.trees import placement


def test_place_all_follows_each_target():
    requests = [(np.arange(3.0, dtype=np.float32), None, "w", None),
                (np.array(7), 0, "step", None),
                (np.ones(2, np.float32), np.zeros(2), "np", None),
                (np.ones(2, np.float32), jax.ShapeDtypeStruct((2,), jnp.float32), "spec", None)]
    w, step, as_np, spec = placement.place_all(requests, host=False, device=None)
    assert isinstance(w, jax.Array) and w.tolist() == [0, 1, 2]
    assert step == 7 and type(step) is int
    assert isinstance(as_np, np.ndarray) and isinstance(spec, jax.Array)
    on_host = placement.place_all(requests[:1], host=True, device=None)[0]
    assert isinstance(on_host, np.ndarray)


def test_damaged_key_data_is_a_format_error():
    with pytest.raises(FormatError, match="cannot rebuild PRNG keys"):
        placement.place(np.zeros(3, np.uint32), None, host=False, device=None, where="k",
                        key_impl="threefry2x32")
