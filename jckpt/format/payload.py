"""Payload bytes: arrays to stored bytes and back, and their checksums.

Stored bytes are the elements in C order, little-endian. Encoding makes no
copy when the array already is in that form; decoding returns a zero-copy
view over the buffer when the payload is unpadded and its absolute offset is a
multiple of the element size, and a decoded copy otherwise.

>>> x = np.arange(6, dtype='>i4').reshape(2, 3).T      # big-endian, transposed
>>> bytes(encode_payload(x)[:8])
b'\\x00\\x00\\x00\\x00\\x03\\x00\\x00\\x00'
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from jckpt.errors import FormatError
from jckpt.format import precs
from jckpt.format.header import Entry
from jckpt.format.limits import MAX_BYTES, MAX_NDIM
from jckpt.format.limits import PADDED_ALLOCATION_FACTOR as PADDED_ALLOCATION_FACTOR

CHECKSUM_ALGORITHM = 'xxh3_64'
#: Hex digits of a stored checksum; fixed so a header can be written before its payloads.
CHECKSUM_HEX_DIGITS = 16
CHECKSUM_PLACEHOLDER = (CHECKSUM_ALGORITHM, '0' * CHECKSUM_HEX_DIGITS)
CHUNK_BYTES = 64 << 20


def stored_dtype(dtype: np.dtype) -> np.dtype:
    """The little-endian form of `dtype` (the form payloads are stored in)."""
    dtype = np.dtype(dtype)
    return dtype.newbyteorder('<') if dtype.byteorder == '>' else dtype


def is_stored_form(array: np.ndarray) -> bool:
    """Whether `array`'s memory already is its payload (C order, little-endian)."""
    return array.flags.c_contiguous and array.dtype.byteorder != '>'


def flat_bytes(array: Any) -> memoryview | np.ndarray:
    """The memory of a C-contiguous array (numpy, or a `jax.Array` on a CPU device) as flat bytes.

    A `memoryview` of the array's own buffer cast to bytes: one buffer export, no
    new array object (for thousands of small leaves, most of what a save spent
    per leaf); the checksum and the write read it in place. Where the buffer
    protocol does not give that (JAX exports no `bfloat16`, `int4` or `float8`
    buffer; `memoryview` casts no empty or complex view), the array as numpy
    viewed as `uint8`. The C accelerator (`host_entries`) follows the same rule.

    >>> flat_bytes(np.arange(2, dtype=np.uint16)).tolist()
    [0, 0, 1, 0]
    """
    try:
        view = memoryview(array)
        return view if view.ndim == 1 and view.format == 'B' else view.cast('B')
    except (TypeError, ValueError, BufferError):
        return np.asarray(array).reshape(-1).view(np.uint8)


def encode_payload(array: np.ndarray) -> np.ndarray:
    """The payload bytes of `array` as a flat `uint8` array.

    A view (no copy) when `array` is C-contiguous and little-endian; a
    converted copy otherwise (non-contiguous, Fortran-ordered, big-endian).
    """
    array = np.asarray(array)
    if array.dtype.byteorder == '>':
        array = array.astype(stored_dtype(array.dtype), order='C')
    elif not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array.reshape(-1).view(np.uint8)


def iter_payload_chunks(array: np.ndarray, chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
    """The payload of `array` as successive `uint8` chunks of about `chunk_bytes`.

    An array in stored form yields views of its own memory; any other array is
    converted one block of leading-axis rows at a time, so a copy never holds
    more than about `chunk_bytes`.
    """
    array = np.asarray(array)
    if is_stored_form(array) or array.ndim == 0:
        flat = encode_payload(array)
        for start in range(0, flat.size, chunk_bytes):
            yield flat[start:start + chunk_bytes]
        return
    row_bytes = max(1, array[0].nbytes if array.shape[0] else 1)
    rows = max(1, chunk_bytes // row_bytes)
    for start in range(0, array.shape[0], rows):
        yield encode_payload(array[start:start + rows])


def checksum(data) -> tuple[str, str]:
    """`('xxh3_64', HEX)` of a bytes-like object."""
    return (CHECKSUM_ALGORITHM, f'{xxhash.xxh3_64_intdigest(data):0{CHECKSUM_HEX_DIGITS}x}')


def new_hasher() -> xxhash.xxh3_64:
    """A streaming hasher for `CHECKSUM_ALGORITHM`."""
    return xxhash.xxh3_64()


def hasher_checksum(hasher: xxhash.xxh3_64) -> tuple[str, str]:
    """The `(algorithm, hex)` pair of a finished streaming hasher."""
    return (CHECKSUM_ALGORITHM, f'{hasher.intdigest():0{CHECKSUM_HEX_DIGITS}x}')


def can_map(entry: Entry, data_start: int) -> bool:
    """Whether the payload can be a zero-copy view: unpadded and element-aligned."""
    size = precs.item_size(entry.prec)
    return entry.padding is None and size > 0 and (data_start + entry.offset) % size == 0


def decode_payload(buffer, entry: Entry, *, data_start: int, mmap: bool = True,
                   file: str | None = None) -> tuple[np.ndarray, bool]:
    """Decode `entry` from `buffer` (the whole file's bytes or a mapping of it).

    Returns `(array, mapped)`: `mapped` is True when `array` is a
    zero-copy view of `buffer` (only when `mmap` is True and
    `can_map` holds). Padded entries are rebuilt into a `dims`-shaped
    buffer filled with the pad value.
    """
    if entry.prec == precs.VOID:
        raise FormatError("Void_prec entries hold no data and cannot be loaded", file=file,
                          entry=entry.name, fix="load the other entries by restoring a target")
    dtype = entry.dtype
    start = data_start + entry.offset
    if start + entry.byte_length > len(buffer):
        raise FormatError("payload extends past the end of the file", file=file,
                          entry=entry.name, fix="the file is truncated")
    shape = entry.shape
    logical = shape if entry.padding is None else \
        entry.logical_dims + ((4,) if entry.prec == precs.UINT4X32 else ())
    if len(logical) > MAX_NDIM or math.prod([d for d in shape if d]) * dtype.itemsize \
            > MAX_BYTES:  # numpy refuses such shapes even when a zero dim makes them empty
        raise FormatError(f"dims {entry.dims} are beyond what numpy can represent (at most "
                          f"{MAX_NDIM} dims, sizes below 2**63)", file=file, entry=entry.name,
                          fix="the header's dims are damaged")
    count = math.prod(logical)
    if mmap and entry.padding is None and dtype.itemsize and start % dtype.itemsize == 0:  # can_map
        return np.frombuffer(buffer, dtype=dtype, count=count, offset=start).reshape(shape), True
    region = np.frombuffer(buffer, dtype=dtype, count=count, offset=start).reshape(logical).copy()
    if entry.padding is None:
        return region, False
    full_bytes = math.prod(entry.shape) * dtype.itemsize
    if full_bytes > PADDED_ALLOCATION_FACTOR * len(buffer) + (1 << 20):
        raise FormatError(f"padded entry would need {full_bytes} bytes, far more than the file "
                          "holds", file=file, entry=entry.name,
                          fix="the header's dims or padding are damaged")
    try:
        with np.errstate(all='ignore'):  # an out-of-range pad value casts as numpy casts it
            fill = np.array(entry.padding.value).astype(dtype)
    except (ValueError, OverflowError):
        fill = np.zeros((), dtype)
    out = np.full(entry.shape, fill, dtype=dtype)
    index = tuple(slice(lo, d - hi) for d, (lo, hi) in zip(entry.dims, entry.padding.pairs))
    out[index] = region
    return out, False
