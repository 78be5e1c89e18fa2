"""Regions of a checkpoint file: payloads written piece by piece into place, and hashed as written.

A sharded array is saved without gathering it whole on the host: each distinct
shard (or each piece of a directory checkpoint, when consolidating) whose rows
are long is written straight into its place in the payload, and the payload's
checksum is then computed from the written region; pieces with short rows are
copied into bands of the payload's rows, each written with one `pwrite` and
hashed on the way. `ShardedSource` is the `PayloadSource` that does this.

>>> import os, tempfile
>>> fd, path = tempfile.mkstemp()
>>> x = np.arange(6, dtype=np.float32).reshape(2, 3)
>>> src = ShardedSource((2, 3), x.dtype, [(((1, 2), (0, 3)), lambda: x[1:]),
...                                       (((0, 1), (0, 3)), lambda: x[:1])])
>>> from jckpt.storage.writer import Sink
>>> sink = Sink(fd)
>>> src.write(sink) == payload_mod.checksum(x); sink.flush()
True
>>> np.fromfile(path, np.float32).tolist()
[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
>>> os.close(fd); os.unlink(path)
"""

from __future__ import annotations

import dataclasses
import math
import mmap as mmap_mod
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jckpt.errors import StorageError
from jckpt.format import payload as payload_mod
from jckpt.format.boxes import Box, box_shape, box_size, box_slices, full_box

#: Payloads up to this size are assembled in one host buffer and written sequentially
#: (fewer system calls than one write per run); larger ones are written in place.
ASSEMBLE_BYTES = 4 << 20
#: Runs of at least this many bytes are written with one `pwrite` each; a payload with a
#: piece of shorter runs is assembled in bands of `BAND_BYTES` instead.
DIRECT_RUN_BYTES = 64 << 10
#: Bytes of a payload's leading rows assembled at once (at least one row) when its pieces'
#: runs are short: one `pwrite` per band, where scattering the runs through a mapping of the
#: file faulted every page in once per piece that crosses it (3x a plain write on a
#: 2-core machine, for weights sharded over both axes of a mesh).
BAND_BYTES = 8 << 20


def stored_bytes(array: np.ndarray) -> np.ndarray:
    """`array`'s payload bytes (C order, little-endian) as a flat `uint8` array."""
    return payload_mod.encode_payload(np.asarray(array))


@dataclasses.dataclass
class ShardedSource:
    """A payload assembled from pieces, each written straight into its place in the file.

    `shape` is the payload's array shape and `pieces` are `(box, get)`
    pairs whose boxes tile it; `get()` returns the piece's host array (for
    device shards, it waits for the transfer started earlier). A small payload
    (up to `ASSEMBLE_BYTES`) is assembled in one buffer and written at
    once. In a larger one, a piece whose rows are long is written with one
    `pwrite` per contiguous run, and one with short runs is scattered
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
        pieces = [(box, get) for box, get in self.pieces if box_size(box)]
        if any(_short_runs(self.shape, dtype, box) for box, _ in pieces):
            checksum = _write_bands(fd, base, self.shape, dtype, pieces)
        else:  # one piece on the host at a time
            for box, get in pieces:
                _write_box(fd, base, self.shape, dtype, box, _piece(box, get))
            checksum = hash_region(fd, base, nbytes)
        end = base + nbytes
        os.lseek(fd, end, os.SEEK_SET)
        sink.position = end
        return checksum

    def _write_assembled(self, sink: Any, dtype: np.dtype) -> tuple[str, str]:
        flat = self.assemble()
        sink.write(flat)
        return payload_mod.checksum(flat)

    def assemble(self) -> np.ndarray:
        """The whole payload assembled in one host buffer: its stored bytes, flat `uint8`.

        What a streamed upload sends (an object cannot be written in place).
        """
        buf = np.empty(self.shape, payload_mod.stored_dtype(self.dtype))
        for box, get in self.pieces:
            if box_size(box):
                buf[box_slices(box)] = _piece(box, get)
        return stored_bytes(buf)


def _piece(box: Box, get: Callable[[], Any]) -> np.ndarray:
    """A piece's host array, refused unless it has its box's shape (never broadcast)."""
    data = np.asarray(get())
    if tuple(data.shape) != box_shape(box):
        raise StorageError(f"piece {box} has shape {data.shape}, expected {box_shape(box)}")
    return data


def _runs(shape: tuple[int, ...], dtype: np.dtype, box: Box) -> tuple[int, int, int] | None:
    """`(j, run bytes, runs)` of `box` in the C-ordered payload: the last dimension it splits
    (those after it are whole, so each contiguous run spans `box[j]` x `shape[j+1:]`), the
    bytes of one run and how many there are; None when the box is one contiguous run."""
    split = [i for i in range(len(shape)) if box[i] != (0, shape[i])]
    if not split or box_size(full_box(shape)) == box_size(box):
        return None
    j = split[-1]
    return j, (box[j][1] - box[j][0]) * math.prod(shape[j + 1:]) * dtype.itemsize, \
        math.prod(box_shape(box)[:j])


def _short_runs(shape: tuple[int, ...], dtype: np.dtype, box: Box) -> bool:
    """Whether `box`'s runs are too short and too many to write one `pwrite` each."""
    runs = _runs(shape, dtype, box)
    return runs is not None and runs[1] < DIRECT_RUN_BYTES and runs[2] > 16


def _write_box(fd: int, base: int, shape: tuple[int, ...], dtype: np.dtype, box: Box,
               data: np.ndarray) -> None:
    """Write `data` (the contents of `box`, whose runs are long or few) into the C-ordered
    payload at `base`: one `pwrite` per run."""
    flat = stored_bytes(data.astype(dtype, copy=False))
    found = _runs(shape, dtype, box)
    if found is None:
        _pwrite_all(fd, flat, base)
        return
    j, run, runs = found
    strides = [math.prod(shape[d + 1:]) * dtype.itemsize for d in range(len(shape))]
    rows = flat.reshape(runs, run)
    lead = box_shape(box)[:j]
    for n, idx in enumerate(np.ndindex(*lead) if lead else [()]):
        offset = base + sum((box[d][0] + i) * strides[d] for d, i in enumerate(idx)) \
            + box[j][0] * strides[j]
        _pwrite_all(fd, rows[n], offset)


def _write_bands(fd: int, base: int, shape: tuple[int, ...], dtype: np.dtype,
                 pieces: Sequence[tuple[Box, Callable[[], Any]]]) -> tuple[str, str]:
    """Write the payload at `base` from its pieces (`(box, get)` pairs that tile it) a band
    of leading rows at a time, each band assembled in one buffer, hashed and written with
    one `pwrite`; the payload's checksum. A piece is fetched when a band first needs it and
    let go after the last one does: on the host, only the pieces of the current rows."""
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    per_band = max(1, BAND_BYTES // max(row_bytes, 1))
    hasher = payload_mod.new_hasher()
    held: dict[int, np.ndarray] = {}
    for top in range(0, shape[0], per_band):
        bottom = min(shape[0], top + per_band)
        band = np.empty((bottom - top, *shape[1:]), dtype)
        for n, (box, get) in enumerate(pieces):
            first, last = max(box[0][0], top), min(box[0][1], bottom)
            if first < last:
                data = held[n] if n in held else held.setdefault(n, _piece(box, get))
                band[(slice(first - top, last - top), *box_slices(box[1:]))] = \
                    data[first - box[0][0]:last - box[0][0]]
            if box[0][1] <= bottom:
                held.pop(n, None)
        flat = stored_bytes(band)
        hasher.update(flat)
        _pwrite_all(fd, flat, base + top * row_bytes)
    return payload_mod.hasher_checksum(hasher)


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = data.data.cast('B')
    while view:
        n = os.pwrite(fd, view[:1 << 30], offset)
        if n <= 0:
            raise StorageError("the disk accepted no bytes while writing a shard")
        view = view[n:]
        offset += n


def hash_region(fd: int, offset: int, length: int) -> tuple[str, str]:
    """The payload checksum of `length` bytes of the file at `offset` (as written)."""
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


__all__ = ['ASSEMBLE_BYTES', 'DIRECT_RUN_BYTES', 'ShardedSource', 'hash_region', 'stored_bytes']
