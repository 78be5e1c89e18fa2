"""Immutable images of accelerator arrays, taken on the device in one dispatched call.

A background save must let the training loop go on at once, and the loop may
donate the very buffers it just submitted to its next step. On an
accelerator the snapshot is therefore a copy made *on the device*: one jitted
call copies every submitted array into buffers the snapshot owns, and
returns as soon as it is dispatched; the writer thread moves the image to
host memory later (`drain`), while training proceeds. XLA orders the copy
before any later step that donates or overwrites the source, so the image is
the state at submit, bit for bit.

Each slot keeps its image buffers: the next snapshot of the same shapes is
copied *into* them (the old image is donated to the copy), so a steady
state allocates no device memory per snapshot. An image needs room on the
device; `has_room` asks the device's memory statistics, and a writer falls
back to a direct copy to host when there is none.

>>> import jax, numpy as np
>>> x = jax.numpy.arange(4.0)
>>> (image,) = take_image([x], None)
>>> np.asarray(image).tolist(), image is x
([0.0, 1.0, 2.0, 3.0], False)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from jckpt.errors import InputError

#: Fraction of a device's free memory an image may take when the caller sets no limit.
FREE_FRACTION = 0.9


def _data(x: jax.Array) -> jax.Array:
    """A typed PRNG key's data; any other array as it is."""
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


@jax.jit
def _copy(arrays: list[jax.Array]) -> list[jax.Array]:
    """Fresh device buffers holding `arrays` (a typed key's data for a key)."""
    return [lax.dynamic_update_slice(jax.numpy.zeros_like(_data(a)), _data(a), (0,) * _data(a).ndim)
            for a in arrays]


@functools.partial(jax.jit, donate_argnums=0)
def _copy_into(old: list[jax.Array], arrays: list[jax.Array]) -> list[jax.Array]:
    """`arrays` written into the donated buffers of `old` (same shapes): no new device memory."""
    return [lax.dynamic_update_slice(o, _data(a), (0,) * o.ndim) for o, a in zip(old, arrays)]


def _signature(arrays: Sequence[jax.Array]) -> list[tuple[Any, ...]]:
    """What must agree for an old image to be reused: the image's shape, dtype and sharding."""
    out = []
    for a in arrays:
        data = jax.eval_shape(_data, a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a
        out.append((data.shape, data.dtype, a.sharding))
    return out


def take_image(arrays: Sequence[jax.Array], old: Sequence[jax.Array] | None) -> list[jax.Array]:
    """Device copies of `arrays` (dispatched, not awaited), in `old`'s buffers when they fit.

    `old` is the previous image of the same slot, no longer needed (its
    snapshot is durable): it is donated when every shape, dtype and sharding
    matches, and simply dropped otherwise.
    """
    arrays = list(arrays)
    if old is not None and len(old) == len(arrays) and not any(o.is_deleted() for o in old) \
            and [(o.shape, o.dtype, o.sharding) for o in old] == _signature(arrays):
        return _copy_into(list(old), arrays)
    return _copy(arrays)


def check_limit(limit: int | None) -> None:
    """Refuse a cap on an image's bytes that is not None or a number of bytes >= 0."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InputError(f"device_image_bytes must be a number of bytes >= 0 or None, not "
                         f"{limit!r:.80}", fix="pass None to let the devices' free memory decide")


def image_bytes(arrays: Sequence[jax.Array]) -> int:
    """Device bytes an image of `arrays` takes (every addressable shard, replicas included)."""
    return sum(s.data.nbytes for a in arrays for s in a.addressable_shards)


def has_room(arrays: Sequence[jax.Array], limit: int | None) -> bool:
    """Whether an image of `arrays` fits: within `limit` bytes (None: no cap of the caller's),
    and within the free memory of every device it lives on, where the device reports it."""
    need = image_bytes(arrays)
    if limit is not None and need > limit:
        return False
    per_device: dict[Any, int] = {}
    for a in arrays:
        for s in a.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    for device, nbytes in per_device.items():
        stats = _memory_stats(device)
        if stats and 'bytes_limit' in stats:
            free = stats['bytes_limit'] - stats.get('bytes_in_use', 0)
            if nbytes > FREE_FRACTION * free:
                return False
    return True


def _memory_stats(device: Any) -> dict[str, int] | None:
    try:
        return device.memory_stats()
    except Exception:  # a backend without statistics (the CPU answers None)
        return None


def drain(images: Sequence[jax.Array]) -> list[Any]:
    """The images in host memory: every transfer started, then each awaited."""
    for a in images:
        try:
            a.copy_to_host_async()
        except Exception:  # a backend without async copies: the copy happens on read
            pass
    return [np.asarray(a) for a in images]


__all__ = ['FREE_FRACTION', 'check_limit', 'drain', 'has_room', 'image_bytes', 'take_image']
