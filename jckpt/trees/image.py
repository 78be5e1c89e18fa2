"""Immutable images of jax arrays, taken on their device without waiting for the copy.

A background save must let the training loop go on at once, and the loop may
donate the very buffers it just submitted to its next step. The snapshot of
a jax array is therefore a copy made *on its device* (an accelerator, or the
CPU for arrays of `CPU_IMAGE_BYTES` or more): dispatched, not awaited; the
writer thread moves the image to host memory later (`drain`; on the CPU
that is a view, no copy), while training proceeds. XLA orders the copy before any later step that donates or
overwrites the source, so the image is the state at submit, bit for bit.

`Images` keeps a slot's image from snapshot to snapshot. The first snapshot
of a tree copies each array into fresh buffers (`jax.device_put` with
`may_alias=False`: no compilation), and meanwhile compiles, on a background
thread, one call that copies the whole tree *into* the previous image's
buffers (donated). From then on a snapshot of the same shapes allocates no
memory and faults in no page: it is that one dispatched call. An image needs
room on the device; `has_room` asks the device's memory statistics, and a
writer falls back to a direct copy to host when there is none.

>>> import jax, numpy as np
>>> x = jax.numpy.arange(4.0)
>>> (image,) = take_image([x])
>>> np.asarray(image).tolist(), image is x
([0.0, 1.0, 2.0, 3.0], False)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from jckpt.errors import InputError
from jckpt.trees import compiled, facts, transfers

#: Fraction of a device's free memory an image may take when the caller sets no limit.
FREE_FRACTION = 0.9

#: Bytes from which a CPU array is imaged rather than copied at submit. Measured on 2,000
#: float32 arrays of 4 KB: a snapshot took 21-30 ms as host copies, 37 ms as an image.
CPU_IMAGE_BYTES = 1 << 16

#: A runtime operand every image copy also reduces. XLA's CPU client runs a call it
#: counts as cheap (under 1,000 flops) inline, on the caller's thread, and a copy counts
#: no flops however many bytes it moves; the token's 2,048-element sum lets the copy be
#: dispatched like any training step. It is noise beside a copy on an accelerator.
_TOKEN = np.zeros(2048, np.float32)

Signature = tuple[tuple[Any, ...], ...]


def _data(x: jax.Array) -> jax.Array:
    """A typed PRNG key's data (its own buffer, not a copy); any other array as it is."""
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


@functools.partial(jax.jit, donate_argnums=0)
def _copy_into(old: list[jax.Array], arrays: list[jax.Array], token: Any) -> tuple[list, Any]:
    """`arrays` written into the donated buffers of `old` (same shapes): no new device memory."""
    return [lax.dynamic_update_slice(o, a, (0,) * o.ndim) for o, a in zip(old, arrays)], token.sum()


def _signature(arrays: Sequence[jax.Array]) -> Signature:
    """What must agree for an old image to be reused: each array's shape, dtype and sharding."""
    return tuple((a.shape, a.dtype, a.sharding) for a in arrays)


def _compile(signature: Signature) -> Any:
    """`_copy_into` compiled for images of `signature`."""
    specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
             for shape, dtype, sharding in signature]
    return _copy_into.lower(specs, specs, _TOKEN).compile()


def imageable(leaf: Any) -> bool:
    """Whether `leaf` is snapshotted as an image: a jax array this process holds whole, on an
    accelerator, or on the CPU when it has at least `CPU_IMAGE_BYTES` (a smaller one is
    copied to a warm host buffer faster than an image of it is described and dispatched)."""
    return bool(imageable_indices([leaf]))


def imageable_indices(leaves: Sequence[Any]) -> list[int]:
    """The indices of the leaves that `imageable` says yes to, in one pass (a snapshot asks
    this of thousands of leaves on the training loop's time)."""
    out = []
    array_type, of = jax.Array, facts.of
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, array_type):
            continue
        placed = of(leaf.sharding)  # asked once per sharding
        if placed.whole and (not placed.on_cpu or
                             math.prod(leaf.shape) * leaf.dtype.itemsize >= CPU_IMAGE_BYTES):
            out.append(i)
    return out


def take_image(arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """Fresh device copies of `arrays` (a typed key's data for a key): dispatched, not awaited."""
    return list(jax.device_put([_data(a) for a in arrays], may_alias=False))


class Images:
    """One slot's device image, reused from snapshot to snapshot (see the module's text).

    The slot calls `take` only once the previous image is durable and no
    host view of it is left: a viewed buffer cannot be donated, and would
    then be copied around rather than reused.
    """

    def __init__(self) -> None:
        self._image: list[jax.Array] | None = None
        self._signature: Signature | None = None  # the image's
        self._copy: Any = None  # the compiled copy into an image of that signature, once ready

    def take(self, arrays: Sequence[jax.Array]) -> list[jax.Array]:
        """An image of `arrays`, in the previous image's buffers when the compiled copy is ready."""
        data = [_data(a) for a in arrays]
        signature = _signature(data)
        old, self._image = self._image, None
        if signature != self._signature:  # other shapes: the old image cannot hold them
            self._signature, self._copy, old = signature, None, None
        if self._copy is None:
            self._copy = compiled.ready(('image', signature), functools.partial(_compile, signature))
        if self._copy is not None and old is not None and not any(o.is_deleted() for o in old):
            image, _ = self._copy(old, data, _TOKEN)
        else:
            image = list(jax.device_put(data, may_alias=False))
        self._image = list(image)
        return self._image


def check_limit(limit: int | None) -> None:
    """Refuse a cap on an image's bytes that is not None or a number of bytes >= 0."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InputError(f"device_image_bytes must be a number of bytes >= 0 or None, not "
                         f"{limit!r:.80}", fix="pass None to let the devices' free memory decide")


def device_bytes(arrays: Sequence[jax.Array]) -> dict[Any, int]:
    """`{device: bytes}` an image of `arrays` takes on each device (every addressable shard,
    replicas included). An array on one device is counted whole, without listing its shards:
    a snapshot of thousands of small arrays asks this on the training loop's time."""
    per_device: dict[Any, int] = {}
    for a in arrays:
        device = facts.of(a.sharding).device  # asked once per sharding
        if device is not None:
            per_device[device] = per_device.get(device, 0) + math.prod(a.shape) * a.dtype.itemsize
            continue
        for s in a.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    return per_device


def image_bytes(arrays: Sequence[jax.Array]) -> int:
    """Device bytes an image of `arrays` takes (every addressable shard, replicas included)."""
    return sum(device_bytes(arrays).values())


def has_room(arrays: Sequence[jax.Array], limit: int | None) -> bool:
    """Whether an image of `arrays` fits: within `limit` bytes (None: no cap of the caller's),
    and within the free memory of every device it lives on, where the device reports it."""
    per_device = device_bytes(arrays)
    if limit is not None and sum(per_device.values()) > limit:
        return False
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
    """The images in host memory (a snapshot's transfers, `transfers.start_host_copies`): every
    transfer started, then each awaited; an image on the CPU is viewed in place."""
    on_device = [i for i, a in enumerate(images) if not facts.of(a.sharding).on_cpu]
    moved = dict(zip(on_device, transfers.start_host_copies([images[i] for i in on_device],
                                                          snapshot=True)))
    return [transfers.await_host(moved.get(i, a)) for i, a in enumerate(images)]


__all__ = ['CPU_IMAGE_BYTES', 'FREE_FRACTION', 'Images', 'check_limit', 'device_bytes', 'drain',
           'has_room', 'image_bytes', 'imageable', 'imageable_indices', 'take_image']
