"""Boxes: the part of an array a shard, a stored piece or a device holds.

A *box* is a tuple of `(start, stop)` pairs, one per dimension. A directory
checkpoint's index records each piece of an array as a box, and its codec
checks that the pieces tile the array exactly; sharded writes and lazy reads
copy between boxes. Pure arithmetic on tuples: no numpy, no JAX.

>>> box_of((slice(0, 2), slice(None)), (4, 3))
((0, 2), (0, 3))
>>> intersect(((0, 2), (0, 3)), ((1, 4), (2, 3)))
((1, 2), (2, 3))
>>> coalesce([((0, 2), (0, 3)), ((2, 4), (0, 3))])
[((0, 4), (0, 3))]
>>> check_tiling([((0, 2),), ((2, 4),)], (4,)) is None
True
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

Box = tuple[tuple[int, int], ...]


def box_of(index: Sequence[Any], shape: Sequence[int]) -> Box:
    """The box a numpy-style index of slices selects from an array of `shape`."""
    out = []
    for i, d in enumerate(shape):
        s = index[i] if i < len(index) else slice(None)
        if isinstance(s, slice):
            start, stop, step = s.indices(d)
            if step != 1:
                raise ValueError(f"strided index {s} is not a box")
            out.append((start, max(start, stop)))
        else:  # an integer, counted from the end when negative, as numpy does
            k = int(s)
            if not -d <= k < d:
                raise IndexError(f"index {k} is out of bounds for a dimension of size {d}")
            k = k + d if k < 0 else k
            out.append((k, k + 1))
    return tuple(out)


def box_slices(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    """Slices selecting `box` (relative to `origin`'s start when given)."""
    if origin is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def box_shape(box: Box) -> tuple[int, ...]:
    """Extent of `box` along each dimension."""
    return tuple(b - a for a, b in box)


def box_size(box: Box) -> int:
    """Number of elements in `box`."""
    return math.prod(box_shape(box))


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole array of `shape`."""
    return tuple((0, int(d)) for d in shape)


def box_spans(box: Box, within: Box, nbytes: int, gap: int = 0) -> list[tuple[int, int]]:
    """`(start, length)` of the bytes holding `within` among the `nbytes` of `box` stored in C
    order, ascending; runs fewer than `gap` bytes apart joined (reading a short gap costs less
    than a second request). All `nbytes` where an element is not whole bytes.

    What a reader of part of a stored payload asks for: a box over the leading dim is one
    run; one over inner dims is a run per row, which `gap` joins when the rows skipped are
    short. The spans cover exactly `within`'s bytes when `gap` is 0.

    >>> box_spans(((0, 4), (0, 8)), ((2, 3), (0, 8)), 128)      # one row of 32 bytes
    [(64, 32)]
    >>> box_spans(((0, 4), (0, 8)), ((1, 3), (0, 4)), 128)      # half of two rows
    [(32, 16), (64, 16)]
    >>> box_spans(((0, 4), (0, 8)), ((1, 3), (0, 4)), 128, gap=64)
    [(32, 48)]
    >>> box_spans(((0, 3), (0, 3)), ((1, 2), (0, 3)), 5)        # 4-bit elements
    [(0, 5)]
    """
    count = box_size(box)
    if not count or nbytes % count or not box:
        return [(0, nbytes)] if nbytes else []
    rel = [(a - o, b - o) for (a, b), (o, _) in zip(within, box)]
    if any(lo >= hi for lo, hi in rel):
        return []
    strides = [nbytes // count] * len(box)
    for k in range(len(box) - 2, -1, -1):
        strides[k] = strides[k + 1] * (box[k + 1][1] - box[k + 1][0])
    k = len(box) - 1
    first, length = rel[k][0] * strides[k], (rel[k][1] - rel[k][0]) * strides[k]
    while k:  # join the runs of the next dim out while they are close enough
        skipped, rows = strides[k - 1] - length, rel[k - 1][1] - rel[k - 1][0]
        if rows > 1 and skipped and skipped >= gap:
            break
        k -= 1
        first, length = first + rel[k][0] * strides[k], (rows - 1) * strides[k] + length
    outer = itertools.product(*(range(lo, hi) for lo, hi in rel[:k]))
    return [(first + sum(i * s for i, s in zip(at, strides)), length) for at in outer]


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they do not overlap."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _merge(a: Box, b: Box) -> Box | None:
    """`a` and `b` joined when their union is itself a box."""
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(differ) != 1:
        return None
    i = differ[0]
    (a0, a1), (b0, b1) = a[i], b[i]
    if a1 == b0:
        return (*a[:i], (a0, b1), *a[i + 1:])
    if b1 == a0:
        return (*a[:i], (b0, a1), *a[i + 1:])
    return None


def coalesce(boxes: Sequence[Box]) -> list[Box]:
    """Join adjacent boxes whose union is a box, until none can be joined.

    A process usually holds one contiguous block of an array; this turns its
    shards into that one block (and leaves other layouts as several boxes).
    """
    out = sorted(set(boxes))
    merged = True
    while merged:
        merged = False
        for i in range(len(out)):
            for j in range(i + 1, len(out)):
                m = _merge(out[i], out[j])
                if m is not None:
                    out[i] = m
                    del out[j]
                    merged = True
                    break
            if merged:
                break
    return out


def check_tiling(boxes: Sequence[Box] | np.ndarray, shape: Sequence[int]) -> str | None:
    """Why `boxes` do not tile an array of `shape` exactly (None when they do).

    The usual answer (they do) is found with numpy, at a cost linear in the
    boxes and the grid their edges cut; anything else is looked at box by box,
    to say which piece is at fault.
    """
    if _tile_exactly(boxes, shape):
        return None
    twice = _listed_twice(boxes)  # at numpy's speed: a crafted index repeats one piece
    if twice is not None:         # millions of times, and the loop below took minutes
        return f"piece {twice} is listed twice: pieces overlap"
    if isinstance(boxes, np.ndarray):  # (boxes, ndim, 2), as a directory index holds them
        boxes = [tuple(map(tuple, b)) for b in boxes.tolist()]
    whole = full_box(shape)
    total = 0
    for b in boxes:
        if len(b) != len(whole) or (box_size(b) and intersect(b, whole) != b):
            return f"piece {b} lies outside the array's dims {tuple(shape)}"
        total += box_size(b)
    if total != math.prod(shape):
        return (f"pieces hold {total} elements but the array has {math.prod(shape)}: "
                "a piece is missing or duplicated")
    return _first_overlap([b for b in boxes if box_size(b)], shape)


def _listed_twice(boxes: Sequence[Box] | np.ndarray) -> Box | None:
    """A non-empty box that `boxes` hold twice, or None (also when they are too few to be
    worth asking, or not all integers of 64 bits)."""
    if len(boxes) < 1024:  # the loop is quick enough
        return None
    if not isinstance(boxes, np.ndarray):
        try:
            boxes = np.asarray(boxes, dtype=np.int64)
        except (ValueError, TypeError, OverflowError):
            return None
    if boxes.dtype.kind not in 'iu' or boxes.ndim != 3:
        return None
    flat = boxes.reshape(len(boxes), -1)
    rows = flat[np.lexsort(flat.T[::-1])] if flat.shape[1] else flat  # (np.unique of rows:
    same = (rows[1:] == rows[:-1]).all(axis=1)                        # 10 s a million)
    lo, hi = boxes[:1, :, 0], boxes[:1, :, 1]  # (the shape of one box, to reshape rows by)
    pairs = rows[1:][same].reshape(-1, *lo.shape[1:], 2)
    full = (pairs[..., 1] > pairs[..., 0]).all(axis=1) if hi.size else np.ones(len(pairs), bool)
    hit = np.flatnonzero(full)  # empty boxes hold nothing, however often they are listed
    return tuple(map(tuple, pairs[hit[0]].tolist())) if hit.size else None


def _distinct(values: np.ndarray) -> np.ndarray:
    """`np.unique(values)` of integers, by one sort: numpy 2's `unique` hashes, and took
    seconds for the four million edges of a million pieces."""
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]


#: The most cells `check_tiling` paints (4 bytes each): pieces cut finer are refused.
MAX_TILING_CELLS = 1 << 22


#: Boxes of more dimensions than this are checked box by box (the count below takes 2**ndim passes).
_COUNTED_NDIM = 6


def _tile_exactly(boxes: Sequence[Box] | np.ndarray, shape: Sequence[int]) -> bool:
    """Whether `boxes`, all non-empty, tile `shape` exactly; False also when unsure.

    Counts how many boxes cover each cell of the grid the boxes' edges cut: a
    +1/-1 at each box's corners (inclusion-exclusion), summed along every axis.
    The boxes tile the array when every cell is covered exactly once.
    """
    ndim = len(shape)
    if not len(boxes) or not 0 < ndim <= _COUNTED_NDIM:
        return False
    try:
        b = np.asarray(boxes, dtype=np.int64)
        dims = np.asarray(shape, dtype=np.int64)
    except (ValueError, TypeError, OverflowError):  # ragged, or beyond 64 bits
        return False
    if b.shape != (len(boxes), ndim, 2):
        return False
    lo, hi = b[..., 0], b[..., 1]
    if not ((lo >= 0) & (lo < hi) & (hi <= dims)).all():
        return False
    cuts = [_distinct(np.concatenate(([0, dims[i]], lo[:, i], hi[:, i]))) for i in range(ndim)]
    if math.prod(len(c) - 1 for c in cuts) > MAX_TILING_CELLS:
        return False
    grid = tuple(len(c) for c in cuts)
    starts = [np.searchsorted(c, lo[:, i]) for i, c in enumerate(cuts)]
    stops = [np.searchsorted(c, hi[:, i]) for i, c in enumerate(cuts)]
    corners = np.zeros(math.prod(grid), dtype=np.int32)
    for corner in itertools.product((0, 1), repeat=ndim):  # each pass costs the boxes, not the grid
        at = np.ravel_multi_index([stops[i] if c else starts[i] for i, c in enumerate(corner)], grid)
        np.add.at(corners, at, -1 if sum(corner) % 2 else 1)
    cover = corners.reshape(grid)
    for axis in range(ndim):
        np.cumsum(cover, axis=axis, out=cover)
    return bool((cover[(slice(0, -1),) * ndim] == 1).all())


def _first_overlap(boxes: Sequence[Box], shape: Sequence[int]) -> str | None:
    """Why two of `boxes` overlap, or None: each box is painted on the grid that the
    boxes' own edges cut, so the cost is that grid's size, never pairs of boxes."""
    if len(boxes) < 2:
        return None
    cuts = [sorted({0, d, *(edge for b in boxes for edge in b[i])}) for i, d in enumerate(shape)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > MAX_TILING_CELLS:
        return (f"pieces are cut into {cells} cells, more than the {MAX_TILING_CELLS} "
                "a reader checks")
    where = [{edge: k for k, edge in enumerate(c)} for c in cuts]
    owner = np.full([len(c) - 1 for c in cuts], -1, dtype=np.int32)
    for n, b in enumerate(boxes):
        region = owner[tuple(slice(where[i][a], where[i][z]) for i, (a, z) in enumerate(b))]
        taken = region[region >= 0]
        if taken.size:
            return f"pieces {boxes[int(taken[0])]} and {b} overlap"
        region[...] = n
    return None


__all__ = ['MAX_TILING_CELLS', 'Box', 'box_of', 'box_shape', 'box_size', 'box_slices', 'box_spans',
           'check_tiling', 'coalesce', 'full_box', 'intersect']
