"""Host <-> device: the only module that moves array data between numpy and JAX.

Saving reads every device array to host (all transfers started with
``copy_to_host_async`` before any is awaited); restoring places each host
array (usually a view of the mapped file) onto the target's sharding, building
each device's shard from its own slice so a device reads only what it holds.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

from jckpt import sharding as sharding_mod
from jckpt.errors import FormatError, InputError
from jckpt.format import precs

_PY_SCALARS = (bool, int, float, complex)
_warned_x64 = False


def is_prng_key(x: Any) -> bool:
    """Whether ``x`` is a typed JAX PRNG key array."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def start_host_copies(leaves: list[Any]) -> None:
    """Start device-to-host transfers of every JAX array so they overlap."""
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and not is_prng_key(leaf):
            try:
                leaf.copy_to_host_async()
            except Exception:
                pass


def to_host(leaf: Any, where: str) -> tuple[np.ndarray, str | None]:
    """``(host array, key_impl)`` for one leaf to save; raises :class:`InputError`."""
    key_impl = None
    if is_prng_key(leaf):
        key_impl = str(jax.random.key_impl(leaf))
        leaf = jax.random.key_data(leaf)
    if isinstance(leaf, jax.Array):
        if not leaf.is_fully_addressable:
            raise InputError("array is not fully addressable from this process", entry=where,
                             fix="save from every process (multi-process checkpoints)")
        array = np.asarray(leaf)
    elif isinstance(leaf, (np.ndarray, np.generic)) or (
            isinstance(leaf, _PY_SCALARS)):
        array = np.asarray(leaf)
    else:
        raise InputError(f"leaf of type {type(leaf).__name__} is not an array", entry=where,
                         fix="store arrays or numbers only; put other values in metadata")
    if not precs.is_supported(array.dtype):
        raise InputError(f"dtype {array.dtype} cannot be stored", entry=where,
                         fix="cast to a supported dtype (see the format's prec table)")
    return array, key_impl


def _x64_ok(dtype: np.dtype) -> bool:
    return dtype.itemsize < 8 or (dtype.kind == 'c' and dtype.itemsize == 8) or bool(
        jax.config.jax_enable_x64)


def _warn_x64(where: str) -> None:
    global _warned_x64
    if not _warned_x64:
        _warned_x64 = True
        warnings.warn(f"{where}: 64-bit entries stay host numpy arrays because jax_enable_x64 "
                      "is off (set jax.config.update('jax_enable_x64', True) to get device "
                      "arrays)", stacklevel=3)


def default_placement(device: Any):
    """The sharding or device loaded arrays go to when nothing else says."""
    return device if device is not None else jax.local_devices()[0]  # addressable in every process


def put(array: np.ndarray, placement: Any) -> jax.Array:
    """Place a host array on a device or sharding, each device reading only its slice."""
    if isinstance(placement, jax.sharding.Sharding) and len(placement.device_set) > 1:
        return jax.make_array_from_callback(array.shape, placement,
                                            lambda index: sharding_mod.read_index(array, index))
    return jax.device_put(np.asarray(array), placement)


def place(array: np.ndarray, target: Any, *, host: bool, device: Any, where: str,
          key_impl: str | None = None, file: str | None = None) -> Any:
    """Turn a loaded host array into what ``target`` (a leaf, or None) asks for.

    Typed PRNG keys always come back as key arrays (numpy has no key dtype),
    even for host contexts; their raw data is ``jax.random.key_data(key)``.
    """
    placement = getattr(target, 'sharding', None) if target is not None else None
    if key_impl is not None:  # key data has a trailing dim the key's sharding lacks
        try:
            keys = jax.random.wrap_key_data(jax.device_put(np.asarray(array),
                                                           default_placement(device)),
                                            impl=key_impl)
        except (ValueError, TypeError) as e:  # an unknown impl, or data of the wrong shape
            raise FormatError(f"cannot rebuild PRNG keys of {key_impl!r}: {e}", file=file,
                              entry=where, fix="the entry's key_impl or dims are damaged") from None
        return keys if placement is None else jax.device_put(keys, placement)
    if isinstance(target, _PY_SCALARS) and not isinstance(target, np.generic):
        return type(target)(np.asarray(array).item())
    if isinstance(target, (np.ndarray, np.generic)):
        return np.asarray(array)
    if host and not isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        return np.asarray(array)
    if not _x64_ok(array.dtype):
        _warn_x64(where)
        return np.asarray(array)
    return put(array, placement if placement is not None else default_placement(device))
