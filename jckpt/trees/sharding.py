"""Sharded arrays: box arithmetic, writing shards into place, and reading one device's slice.

A *box* is a tuple of ``(start, stop)`` pairs, one per dimension: the part of
a global array a shard, a stored piece or a device holds. Saving a sharded
``jax.Array`` writes each distinct shard once (replicas skipped) straight
into its place in the payload, after every transfer to host has been
started; nothing gathers the whole array on the host. Restoring builds each
device's shard from the mapped file, reading only that device's box.

>>> box_of((slice(0, 2), slice(None)), (4, 3))
((0, 2), (0, 3))
>>> intersect(((0, 2), (0, 3)), ((1, 4), (2, 3)))
((1, 2), (2, 3))
>>> coalesce([((0, 2), (0, 3)), ((2, 4), (0, 3))])
[((0, 4), (0, 3))]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jckpt.errors import InputError, MismatchError
from jckpt.format import precs
from jckpt.format.boxes import (  # noqa: F401  (box arithmetic, re-exported where it was)
    Box,
    box_of,
    box_shape,
    box_size,
    box_slices,
    check_tiling,
    coalesce,
    full_box,
    intersect,
)
from jckpt.storage.lazy import LazyArray, note_read, record_reads
from jckpt.storage.regions import ShardedSource

# --- saving ----------------------------------------------------------------------------

def is_sharded(leaf: Any) -> bool:
    """Whether ``leaf`` is a ``jax.Array`` spread over (or replicated on) several devices."""
    import jax
    return isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1


@functools.lru_cache(maxsize=1024)
def _owner_boxes(sharding: Any, shape: tuple[int, ...], process: int) -> dict[Any, Box]:
    """``{device: box}`` for the devices of ``process`` that write a distinct shard.

    Each distinct box is owned by the first device holding it in the
    sharding's device order, the same in every process, so each replicated
    piece is written exactly once across all processes.
    """
    owners: dict[Box, Any] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        owners.setdefault(box_of(index, shape), device)
    return {d: b for b, d in owners.items() if d.process_index == process}


def owned_shards(array: Any) -> list[tuple[Box, Any]]:
    """``(box, single-device array)`` for each distinct shard this process must write."""
    import jax
    shape = tuple(array.shape)
    plan = _owner_boxes(array.sharding, shape, jax.process_index())
    out = []
    for shard in array.addressable_shards:
        box = plan.get(shard.device)
        if box is not None:
            out.append((box, shard.data))
    return out


def start_transfers(shards: Sequence[tuple[Box, Any]]) -> None:
    """Start the device-to-host copy of each shard (they overlap; none is awaited)."""
    for _, data in shards:
        try:
            data.copy_to_host_async()
        except Exception:  # a backend without async copies: the copy happens on read
            pass


def await_host(data: Any) -> np.ndarray:
    """Wait for a shard's transfer to host (started by :func:`start_transfers`); its host array."""
    return np.asarray(data)


@dataclasses.dataclass
class HostLeaf:
    """One leaf ready to be written: its dtype and shape, and how to stream its payload."""

    dtype: np.dtype
    shape: tuple[int, ...]
    key_impl: str | None
    source: Any

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def prepare_leaves(items: Sequence[tuple[Any, Any]], namespace: str,
                   keystr: Callable[[Any], str]) -> list[HostLeaf]:
    """Check every leaf and start every transfer to host, before anything is awaited.

    Sharded arrays become :class:`ShardedSource` s (one piece per distinct
    shard); everything else is read to host whole. Raises
    :class:`~jckpt.errors.InputError` naming the leaf for anything that
    cannot be stored.
    """
    import jax

    from jckpt.storage.writer import ArraySource
    from jckpt.trees import placement

    staged: list[Any] = []
    for p, leaf in items:
        where = f"{namespace}/{keystr(p)}"
        key_impl = None
        if placement.is_prng_key(leaf):
            key_impl = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        if is_sharded(leaf):
            if not leaf.is_fully_addressable:
                raise InputError("array is not fully addressable from this process", entry=where,
                                 fix="save from every process of the multi-process run")
            if not precs.is_supported(np.dtype(leaf.dtype)):
                raise InputError(f"dtype {leaf.dtype} cannot be stored", entry=where,
                                 fix="cast to a supported dtype (see the format's prec table)")
            shards = owned_shards(leaf)
            start_transfers(shards)
            staged.append((where, leaf, key_impl, shards))
        else:
            if isinstance(leaf, jax.Array):
                placement.start_host_copies([leaf])
            staged.append((where, leaf, key_impl, None))
    out = []
    for where, leaf, key_impl, shards in staged:
        if shards is None:
            array, impl = placement.to_host(leaf, where)
            out.append(HostLeaf(array.dtype, tuple(array.shape), key_impl or impl,
                                ArraySource(array)))
        else:
            dtype = np.dtype(leaf.dtype)
            pieces = [(box, functools.partial(await_host, data)) for box, data in shards]
            out.append(HostLeaf(dtype, tuple(leaf.shape), key_impl,
                                ShardedSource(tuple(leaf.shape), dtype, pieces)))
    return out


# --- restoring -------------------------------------------------------------------------


def as_lazy(array: Any) -> LazyArray:
    """``array`` (numpy or lazy) as a :class:`LazyArray`."""
    if isinstance(array, LazyArray):
        return array
    return LazyArray(array.shape, array.dtype, lambda box: read_box(array, box))


def read_box(array: Any, box: Box, *, log: bool = True) -> np.ndarray:
    """Read ``box`` of ``array`` (a mapped view or a :class:`LazyArray`), logging the bytes."""
    if isinstance(array, LazyArray):
        return array.read(box)
    out = np.asarray(array)[box_slices(box)]
    if log:
        note_read(box, out.nbytes)
    return out


def read_index(array: Any, index: Any) -> np.ndarray:
    """Read the part of ``array`` that a device's shard ``index`` selects."""
    if not isinstance(index, tuple):
        index = (index,)
    return read_box(array, box_of(index, array.shape))


def check_fits(shape: Sequence[int], sharding: Any, *, file: str | None, where: str) -> None:
    """Raise :class:`MismatchError` when ``shape`` cannot be split by ``sharding``.

    JAX refuses arrays whose dims do not divide evenly by the mesh axes that
    shard them; this says so naming the leaf, before any byte is read.
    """
    import jax
    if not isinstance(sharding, jax.sharding.Sharding):
        return
    try:
        sharding.shard_shape(tuple(shape))
    except Exception as e:  # IndivisibleError / ValueError, depending on the JAX version
        spec = getattr(sharding, 'spec', None)
        raise MismatchError(
            f"shape {tuple(shape)} is not divisible by the target's sharding"
            + (f" {spec}" if spec is not None else "") + f": {str(e).splitlines()[0][:200]}",
            file=file, entry=where,
            fix="choose a PartitionSpec whose mesh axes divide every sharded dimension, "
                "or pad the array") from None


__all__ = ['Box', 'LazyArray', 'ShardedSource', 'box_of', 'check_fits', 'coalesce', 'intersect',
           'prepare_leaves', 'read_box', 'read_index', 'record_reads']
