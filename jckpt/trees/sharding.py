"""Sharded arrays: box arithmetic, writing shards into place, and reading one device's slice.

A *box* is a tuple of ``(start, stop)`` pairs, one per dimension: the part of
a global array a shard, a stored piece or a device holds. Saving a sharded
``jax.Array`` writes each distinct shard once (replicas skipped) straight
into its place in the payload, after every transfer to host has been
started (:func:`jckpt.trees.placement.host_leaves` picks the shards and
starts the transfers); nothing gathers the whole array on the host.
Restoring builds each device's shard from the mapped file, reading only that
device's box. Nothing here imports JAX at module level, nor
:mod:`jckpt.trees.placement`.

>>> box_of((slice(0, 2), slice(None)), (4, 3))
((0, 2), (0, 3))
>>> intersect(((0, 2), (0, 3)), ((1, 4), (2, 3)))
((1, 2), (2, 3))
>>> coalesce([((0, 2), (0, 3)), ((2, 4), (0, 3))])
[((0, 4), (0, 3))]
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap as mmap_mod
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from jckpt.errors import MismatchError, StorageError
from jckpt.format import payload as payload_mod

Box = tuple[tuple[int, int], ...]

#: Payloads up to this size are assembled in one host buffer and written sequentially
#: (fewer system calls than one write per run); larger ones are written in place.
ASSEMBLE_BYTES = 4 << 20
#: Runs of at least this many bytes are written with one ``pwrite`` each; a piece with
#: shorter runs is scattered through a shared mapping of the file instead.
DIRECT_RUN_BYTES = 64 << 10


# --- boxes ---------------------------------------------------------------------------

def box_of(index: Sequence[Any], shape: Sequence[int]) -> Box:
    """The box a numpy-style index of slices selects from an array of ``shape``."""
    out = []
    for i, d in enumerate(shape):
        s = index[i] if i < len(index) else slice(None)
        if isinstance(s, slice):
            start, stop, step = s.indices(d)
            if step != 1:
                raise ValueError(f"strided index {s} is not a box")
            out.append((start, max(start, stop)))
        else:
            s = int(s)
            out.append((s, s + 1))
    return tuple(out)


def box_slices(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    """Slices selecting ``box`` (relative to ``origin``'s start when given)."""
    if origin is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def box_shape(box: Box) -> tuple[int, ...]:
    """Extent of ``box`` along each dimension."""
    return tuple(b - a for a, b in box)


def box_size(box: Box) -> int:
    """Number of elements in ``box``."""
    return math.prod(box_shape(box))


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole array of ``shape``."""
    return tuple((0, int(d)) for d in shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when they do not overlap."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _merge(a: Box, b: Box) -> Box | None:
    """``a`` and ``b`` joined when their union is itself a box."""
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


def check_tiling(boxes: Sequence[Box], shape: Sequence[int]) -> str | None:
    """Why ``boxes`` do not tile an array of ``shape`` exactly (None when they do)."""
    whole = full_box(shape)
    total = 0
    for b in boxes:
        if len(b) != len(whole) or (box_size(b) and intersect(b, whole) != b):
            return f"piece {b} lies outside the array's dims {tuple(shape)}"
        total += box_size(b)
    if total != math.prod(shape):
        return (f"pieces hold {total} elements but the array has {math.prod(shape)}: "
                "a piece is missing or duplicated")
    nonempty = [b for b in boxes if box_size(b)]
    if len(nonempty) <= 4096:
        for i, a in enumerate(nonempty):
            for b in nonempty[i + 1:]:
                if intersect(a, b) is not None:
                    return f"pieces {a} and {b} overlap"
    return None


# --- saving ----------------------------------------------------------------------------

def stored_bytes(array: np.ndarray) -> np.ndarray:
    """``array``'s payload bytes (C order, little-endian) as a flat ``uint8`` array."""
    return payload_mod.encode_payload(np.asarray(array))


@dataclasses.dataclass
class ShardedSource:
    """A payload assembled from pieces, each written straight into its place in the file.

    ``shape`` is the payload's array shape and ``pieces`` are ``(box, get)``
    pairs whose boxes tile it; ``get()`` returns the piece's host array (for
    device shards, it waits for the transfer started earlier). A small payload
    (up to :data:`ASSEMBLE_BYTES`) is assembled in one buffer and written at
    once. In a larger one, a piece whose rows are long is written with one
    ``pwrite`` per contiguous run, and one with short runs is scattered
    through a shared mapping of the file; the checksum is then computed by
    hashing the written region.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: Sequence[tuple[Box, Callable[[], Any]]]

    def write(self, sink: Any) -> tuple[str, str]:
        dtype = payload_mod.stored_dtype(self.dtype)
        nbytes = math.prod(self.shape) * dtype.itemsize
        if nbytes <= ASSEMBLE_BYTES:
            return self._write_assembled(sink, dtype)
        base = sink.position
        fd = sink.fd
        for box, get in self.pieces:
            if box_size(box) == 0:
                continue
            data = np.asarray(get())
            if tuple(data.shape) != box_shape(box):
                raise StorageError(f"piece {box} has shape {data.shape}, expected "
                                   f"{box_shape(box)}")
            _write_box(fd, base, self.shape, dtype, box, data)
        end = base + nbytes
        os.lseek(fd, end, os.SEEK_SET)
        sink.position = end
        return hash_region(fd, base, nbytes)

    def _write_assembled(self, sink: Any, dtype: np.dtype) -> tuple[str, str]:
        buf = np.empty(self.shape, dtype)
        for box, get in self.pieces:
            if box_size(box):
                buf[box_slices(box)] = get()
        flat = stored_bytes(buf)
        sink.write(flat)
        return payload_mod.checksum(flat)


def _write_box(fd: int, base: int, shape: tuple[int, ...], dtype: np.dtype, box: Box,
               data: np.ndarray) -> None:
    """Write ``data`` (the contents of ``box``) into the C-ordered payload at ``base``."""
    item = dtype.itemsize
    data = data.astype(dtype, copy=False)
    flat = stored_bytes(data)
    ndim = len(shape)
    split = [i for i in range(ndim) if box[i] != (0, shape[i])]
    if not split or box_size(full_box(shape)) == box_size(box):
        _pwrite_all(fd, flat, base)
        return
    j = split[-1]  # dims after j are whole: each run spans box[j] x shape[j+1:]
    inner = math.prod(shape[j + 1:])
    run = (box[j][1] - box[j][0]) * inner * item
    runs = math.prod(box_shape(box)[:j])
    strides = [math.prod(shape[d + 1:]) * item for d in range(ndim)]
    if run >= DIRECT_RUN_BYTES or runs <= 16:
        rows = flat.reshape(runs, run)
        lead = box_shape(box)[:j]
        for n, idx in enumerate(np.ndindex(*lead) if lead else [()]):
            offset = base + sum((box[d][0] + i) * strides[d] for d, i in enumerate(idx)) \
                + box[j][0] * strides[j]
            _pwrite_all(fd, rows[n], offset)
        return
    # Short runs: map the rows the box spans and let numpy scatter the piece.
    first = base + box[0][0] * strides[0]
    last = base + box[0][1] * strides[0]
    _ensure_size(fd, last)
    start = first - first % mmap_mod.ALLOCATIONGRANULARITY
    with mmap_mod.mmap(fd, last - start, access=mmap_mod.ACCESS_WRITE, offset=start) as m:
        view = np.frombuffer(m, dtype=dtype, count=(last - first) // item,
                             offset=first - start).reshape((box[0][1] - box[0][0], *shape[1:]))
        view[(slice(None), *box_slices(box[1:]))] = data
        del view


def _ensure_size(fd: int, size: int) -> None:
    if os.fstat(fd).st_size < size:
        os.ftruncate(fd, size)


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = data.data.cast('B')
    while view:
        n = os.pwrite(fd, view[:1 << 30], offset)
        if n <= 0:
            raise StorageError("the disk accepted no bytes while writing a shard")
        view = view[n:]
        offset += n


def hash_region(fd: int, offset: int, length: int) -> tuple[str, str]:
    """The payload checksum of ``length`` bytes of the file at ``offset`` (as written)."""
    hasher = payload_mod.new_hasher()
    if length == 0:
        return payload_mod.hasher_checksum(hasher)
    start = offset - offset % mmap_mod.ALLOCATIONGRANULARITY
    with mmap_mod.mmap(fd, offset + length - start, access=mmap_mod.ACCESS_READ,
                       offset=start) as m:
        with memoryview(m) as view:
            pos = offset - start
            end = pos + length
            while pos < end:
                n = min(end - pos, payload_mod.CHUNK_BYTES)
                hasher.update(view[pos:pos + n])
                pos += n
    return payload_mod.hasher_checksum(hasher)


# --- restoring -------------------------------------------------------------------------

class _ReadLog(threading.local):
    records: list[tuple[Box, int]] | None = None


_READS = _ReadLog()
_READS_LOCK = threading.Lock()
_ALL_LOGS: list[list[tuple[Box, int]]] = []


@contextlib.contextmanager
def record_reads() -> Iterator[list[tuple[Box, int]]]:
    """Collect ``(box, bytes read from the checkpoint)`` for every shard read while active.

    The check that each device reads only its slice: a restore onto a mesh
    of N devices logs N boxes, each with the bytes of one shard.

    >>> with record_reads() as log:
    ...     _ = read_box(np.arange(8.0).reshape(2, 4), ((0, 2), (2, 4)))
    >>> log
    [(((0, 2), (2, 4)), 32)]
    """
    log: list[tuple[Box, int]] = []
    with _READS_LOCK:
        _ALL_LOGS.append(log)
    try:
        yield log
    finally:
        with _READS_LOCK:
            _ALL_LOGS.remove(log)


def note_read(box: Box, nbytes: int) -> None:
    """Report ``nbytes`` read from a checkpoint for ``box`` to active :func:`record_reads`."""
    if _ALL_LOGS:
        with _READS_LOCK:
            for log in _ALL_LOGS:
                log.append((box, nbytes))


class LazyArray:
    """An array not read yet: ``shape``, ``dtype``, and a function reading any box of it.

    Restore hands one of these to placement, which asks each device's box
    through :func:`read_box`; ``np.asarray`` reads the whole array.
    """

    def __init__(self, shape: tuple[int, ...], dtype: Any,
                 read: Callable[[Box], np.ndarray]) -> None:
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._read = read

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def read(self, box: Box) -> np.ndarray:
        """The contents of ``box`` as a new array."""
        return self._read(box)

    def astype(self, dtype: Any, copy: bool = True) -> LazyArray:
        """The same array converted to ``dtype`` box by box (nothing is read now)."""
        dtype = np.dtype(dtype)
        if dtype == self.dtype and not copy:
            return self
        return LazyArray(self.shape, dtype, lambda box: self._read(box).astype(dtype))

    def __getitem__(self, index: Any) -> np.ndarray:
        if not isinstance(index, tuple):
            index = (index,)
        return self.read(box_of(index, self.shape))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.read(full_box(self.shape))
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"LazyArray(shape={self.shape}, dtype={self.dtype})"


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
           'read_box', 'read_index', 'record_reads']
