"""Sharded arrays on restore: reading one device's slice, and checking a sharding fits.

A *box* is a tuple of ``(start, stop)`` pairs, one per dimension: the part of
a global array a shard, a stored piece or a device holds (the arithmetic is in
:mod:`jckpt.format.boxes`, re-exported here). Restoring builds each device's
shard from the mapped file, reading only that device's box through a
:class:`~jckpt.storage.lazy.LazyArray`; saving's side (each distinct shard to
host once) is in :mod:`jckpt.trees.placement`, and writing shards into place in
:mod:`jckpt.storage.regions`.

>>> box_of((slice(0, 2), slice(None)), (4, 3))
((0, 2), (0, 3))
>>> intersect(((0, 2), (0, 3)), ((1, 4), (2, 3)))
((1, 2), (2, 3))
>>> coalesce([((0, 2), (0, 3)), ((2, 4), (0, 3))])
[((0, 4), (0, 3))]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jckpt.errors import MismatchError
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


def as_lazy(array: Any) -> LazyArray:
    """``array`` (numpy or lazy) as a :class:`LazyArray`."""
    if isinstance(array, LazyArray):
        return array
    return LazyArray(array.shape, array.dtype, lambda box: read_box(array, box))


def read_box(array: Any, box: Box, *, log: bool = True) -> np.ndarray:
    """Read ``box`` of ``array`` (a mapped view or a :class:`LazyArray`), logging the bytes."""
    if isinstance(array, LazyArray):
        return array.read(box)
    out = np.asarray(np.asarray(array)[box_slices(box)])  # a 0-d index gives a numpy scalar
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
           'read_box', 'read_index', 'record_reads']
