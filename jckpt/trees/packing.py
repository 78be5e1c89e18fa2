"""Many small arrays across the host link in one transfer, either way.

Onto an accelerator (`put_packed`): packed into one host buffer, then split
on the device. Off it (`take_packed`): joined on the device, then viewed on
the host (`split_on_host`).

A `device_put` per array costs a host-to-device transfer and a dispatch
each, tens of microseconds on a GPU: restoring 2,000 biases and norms costs
about as much as 2,000 transfers, whatever their size. Packed into one host
buffer, they cross in one transfer, and one compiled call cuts the device
buffer into the arrays by slicing and bitcasting, on the device. Compiling
that call for 2,000 arrays takes far longer than the 2,000 transfers it
saves (tens of seconds on the CPU backend), so it is never compiled on a
restore's path: the second restore of a layout compiles it on the background
thread (`jckpt.trees.compiled`), and restores after that use it. A layout
restored once travels array by array and costs no compilation.

This is for accelerators only: on the CPU a restored array aliases the
mapped file and nothing is copied at all (`jckpt.trees.placement`), and a
saved one is read in place (`jckpt.trees.to_host`).

The way off joins the arrays in one dispatched call compiled per layout. It
is compiled on a background thread the first time a layout is met, and used
from then on: a snapshot taken again and again never waits for XLA's
compiler, and the first one travels array by array.

>>> import jax, numpy as np
>>> xs = [np.arange(3, dtype=np.int32), np.ones((2, 2), np.float32)]
>>> put_packed(xs, jax.devices()[0]), put_packed(xs, jax.devices()[0])  # its split: not yet
(None, None)
>>> compiled.wait_all()  # (compiled in the background since the second; waited for here)
>>> a, b = put_packed(xs, jax.devices()[0])
>>> a.tolist(), b.dtype.name, b.shape
([0, 1, 2], 'float32', (2, 2))
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jckpt.trees import compiled

#: Arrays up to this many bytes travel packed (larger ones gain nothing from it).
PACK_BYTES = 1 << 20
#: Fewer small arrays than this for one device go one by one (not worth a compiled split).
PACK_MIN = 32
#: Bytes between packed arrays' starts are rounded to this, so every slice starts aligned.
PACK_ALIGN = 16

#: The dtypes a packed buffer is bitcast back to (whole bytes, known to every backend).
PACKABLE = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, ml_dtypes.bfloat16))

Layout = tuple[tuple[int, tuple[int, ...], np.dtype], ...]


def packable(array: np.ndarray) -> bool:
    """Whether `array` may travel in a packed buffer: small, non-empty, of a `PACKABLE` dtype."""
    return 0 < array.nbytes <= PACK_BYTES and array.dtype in PACKABLE


def layout_of(arrays: Sequence[np.ndarray]) -> tuple[Layout, int]:
    """`((offset, shape, dtype), ...)` of each array in the packed buffer, and its size in bytes.

    >>> layout_of([np.zeros(3, np.int8), np.zeros(2, np.float32)])[1]
    32
    """
    layout, offset = [], 0
    prod = math.prod
    for a in arrays:
        shape, dtype = a.shape, a.dtype  # (a jax array's nbytes costs microseconds a call)
        layout.append((offset, shape, dtype))
        offset += -(-(prod(shape) * dtype.itemsize) // PACK_ALIGN) * PACK_ALIGN
    return tuple(layout), offset


def pack(arrays: Sequence[np.ndarray], layout: Layout, size: int) -> np.ndarray:
    """One `uint8` host buffer holding every array's bytes (C order) at its layout offset."""
    buffer = np.zeros(size, np.uint8)
    for (offset, _, _), a in zip(layout, arrays):
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        buffer[offset:offset + flat.size] = flat
    return buffer


@functools.partial(jax.jit, static_argnums=1)
def _split(buffer: jax.Array, layout: Layout) -> list[jax.Array]:
    """The arrays of `layout`, cut out of the device buffer (one compiled call per layout)."""
    out = []
    for offset, shape, dtype in layout:
        n = math.prod(shape) * dtype.itemsize
        piece = jax.lax.slice(buffer, (offset,), (offset + n,))
        if dtype == np.bool_:
            value = piece != 0
        elif dtype.itemsize == 1:
            value = jax.lax.bitcast_convert_type(piece, dtype)
        else:
            value = jax.lax.bitcast_convert_type(piece.reshape(-1, dtype.itemsize), dtype)
        out.append(value.reshape(shape))
    return out


#: How many times a layout is restored before its split is compiled (in the background).
SPLIT_AFTER = 1


def _compile_split(device: Any, layout: Layout, size: int) -> Any:
    """`_split` compiled for a packed buffer of `size` bytes on `device`."""
    buffer = jax.ShapeDtypeStruct((size,), np.uint8, sharding=jax.sharding.SingleDeviceSharding(device))
    return _split.lower(buffer, layout).compile()


def put_packed(arrays: Sequence[np.ndarray], device: Any) -> list[jax.Array] | None:
    """`arrays` (each `packable`) on `device`: one transfer of their packed bytes, one split
    there; None where that split is not compiled (yet: see the module's note) or fails, and
    the caller sends them one by one.

    The results are committed to `device`, as `jax.device_put(array, device)`'s are.
    """
    layout, size = layout_of(arrays)
    split = compiled.ready(('split', device, layout), functools.partial(_compile_split, device, layout, size),
                           after=SPLIT_AFTER)
    if split is None:
        return None
    try:
        return list(split(jax.device_put(pack(arrays, layout, size), device)))
    except Exception:  # e.g. no device memory left for the packed buffer: one by one
        return None


# --------------------------------------------------------------------------- off the device

#: Arrays up to this many bytes leave a device joined: a transfer's fixed cost is about that of
#: moving 0.5 MB over a GPU's host link, so larger ones gain little, and the join costs room.
TAKE_BYTES = 1 << 16

def takeable(array: jax.Array) -> bool:
    """Whether `array` may leave its device joined: small, non-empty, of a `PACKABLE` dtype."""
    dtype = array.dtype
    return dtype in PACKABLE and 0 < math.prod(array.shape) * dtype.itemsize <= TAKE_BYTES


@functools.partial(jax.jit, static_argnums=1)
def _join(arrays: list[jax.Array], layout: Layout) -> jax.Array:
    """One `uint8` device array holding each array's bytes at its layout offset."""
    pieces = []
    for a, (_, _, dtype) in zip(arrays, layout):
        flat = (a.astype(jnp.uint8) if dtype == np.bool_ else
                jax.lax.bitcast_convert_type(a, jnp.uint8)).reshape(-1)
        pieces.append(flat)
        pad = -flat.size % PACK_ALIGN
        if pad:
            pieces.append(jnp.zeros(pad, jnp.uint8))
    return jnp.concatenate(pieces)


def _compile_join(sharding: Any, layout: Layout) -> Any:
    """`_join` compiled for arrays of `layout` on `sharding`."""
    specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for _, shape, dtype in layout]
    return _join.lower(specs, layout).compile()


def take_packed(arrays: Sequence[jax.Array]) -> tuple[jax.Array, Layout] | None:
    """`arrays` (each `takeable`, all of one single-device sharding) joined into one `uint8`
    array on their device by one dispatched call, and where each lies in it (read it back with
    `split_on_host`); None while that call compiles in the background, or if it failed.

    >>> import jax.numpy as jnp
    >>> xs = [jnp.arange(3.0), jnp.ones(2, jnp.int8)]
    >>> take_packed(xs) is None  # the first time: the join compiles in the background
    True
    >>> compiled.wait_all()  # (waited for here)
    >>> buffer, layout = take_packed(xs)
    >>> [a.tolist() for a in split_on_host(np.asarray(buffer), layout)]
    [[0.0, 1.0, 2.0], [1, 1]]
    """
    layout, _ = layout_of(arrays)
    sharding = arrays[0].sharding
    join = compiled.ready(('join', sharding, layout),
                          functools.partial(_compile_join, sharding, layout))
    if join is None:
        return None
    try:
        return join(list(arrays)), layout
    except Exception:  # e.g. no device memory left for the join: the caller goes one by one
        return None


def split_on_host(buffer: np.ndarray, layout: Layout) -> list[np.ndarray]:
    """The arrays of `layout` in a joined host buffer: views of it, no copies."""
    return [unpack_one(buffer, where) for where in layout]


def unpack_one(buffer: np.ndarray, where: tuple[int, tuple[int, ...], np.dtype]) -> np.ndarray:
    """The array at `where = (offset, shape, dtype)` of a joined host buffer (a view)."""
    offset, shape, dtype = where
    n = math.prod(shape) * dtype.itemsize
    return buffer[offset:offset + n].view(dtype).reshape(shape)


__all__ = ['PACKABLE', 'PACK_BYTES', 'PACK_MIN', 'TAKE_BYTES', 'layout_of', 'pack', 'packable',
           'put_packed', 'split_on_host', 'take_packed', 'takeable', 'unpack_one']
