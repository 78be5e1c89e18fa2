"""Bounds on untrusted input that no real checkpoint reaches, checked before anything is built.

Every reader (the header codec, the directory index, the foreign-format
adapters) hands shapes, dtypes, integers, key paths and JSON it read from a
file through these functions before a numpy constructor, `int()` or a
recursive walk sees them, so a crafted file gets a `ValueError` here
(which each reader reports as a `FormatError` naming
the file) instead of a numpy `ValueError`, a `RecursionError` or an
allocation far beyond the file.

>>> check_shape((2, 3), 4)
(2, 3)
>>> check_shape((0, 10**30), 4)
Traceback (most recent call last):
...
ValueError: shape (0, 1000000000000000000000000000000) is larger than any array (2**63 - 1 bytes)
>>> json_loads('{"loss": 1.5}')
{'loss': 1.5}
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

#: Most dimensions an array may have (numpy's own limit: 32 before numpy 2, 64 since).
MAX_NDIM = 64 if int(np.__version__.split('.')[0]) >= 2 else 32
#: Most digits (sign excluded) of an integer in a header: any 64-bit integer fits in 19.
MAX_INT_DIGITS = 20
#: Most components of a key path (a real model's paths are under 20 deep).
MAX_PATH_LENGTH = 256
#: Deepest nesting of JSON values and of pickled containers a reader builds.
MAX_NESTING = 100
#: Largest header alignment: a header and every payload are padded up to it, so a tiny file
#: that names a huge one would make every rewrite allocate and write that much. 16 MiB is
#: far beyond any page or block size a checkpoint aligns to.
MAX_ALIGNMENT = 1 << 24
#: What the padded entries of one file may rebuild in all, as a multiple of the file's size
#: (plus 1 MiB): padding costs header bytes only, so without a bound per file a few KB of
#: header could make a reader allocate gigabytes.
PADDED_ALLOCATION_FACTOR = 64
#: The largest array, in bytes, numpy can describe (and any 64-bit offset can address).
MAX_BYTES = 2**63 - 1

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def check_shape(shape: Any, itemsize: int) -> tuple[int, ...]:
    """`shape` as a tuple of ints that numpy can build an array of `itemsize` bytes with.

    Refuses non-integers (`True` included), negative dims, more than
    `MAX_NDIM` dims and shapes whose non-zero dims multiply past
    `MAX_BYTES` (numpy refuses those even when another dim is 0).
    """
    if not isinstance(shape, (tuple, list)):
        raise ValueError(f"shape {shape!r} is not a sequence of integers")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"shape has {len(shape)} dimensions, more than {MAX_NDIM}")
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_))
               for d in shape):
        raise ValueError(f"shape {tuple(shape)!r} holds something other than integers")
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"shape {dims} has a negative dimension")
    if math.prod(max(d, 1) for d in dims) * max(itemsize, 1) > MAX_BYTES:
        raise ValueError(f"shape {dims} is larger than any array (2**63 - 1 bytes)")
    return dims


def valid_alignment(alignment: Any) -> bool:
    """Whether `alignment` is an int from 1 to `MAX_ALIGNMENT` (`bool` excluded)."""
    return isinstance(alignment, int) and not isinstance(alignment, bool) \
        and 1 <= alignment <= MAX_ALIGNMENT


def check_itemsize(dtype: np.dtype) -> np.dtype:
    """Refuse a dtype of zero-sized elements (`'U0'`, `'S0'`): no array data has that form."""
    if dtype.itemsize == 0:
        raise ValueError(f"dtype {dtype.str!r} has elements of 0 bytes")
    return dtype


def check_path_length(length: int) -> None:
    """Refuse a key path of more than `MAX_PATH_LENGTH` components."""
    if length > MAX_PATH_LENGTH:
        raise ValueError(f"key path of {length} components is deeper than {MAX_PATH_LENGTH}")


def json_depth(text: str) -> int:
    """How deeply the arrays and objects of JSON `text` nest (strings skipped)."""
    structural = _JSON_STRING.sub('', text)
    codes = np.frombuffer(structural.encode('utf-8', 'surrogatepass'), dtype=np.uint8)
    steps = np.isin(codes, (91, 123)).astype(np.int32) - np.isin(codes, (93, 125)).astype(np.int32)
    return int(np.cumsum(steps).max()) if steps.size else 0


def json_loads(text: str | bytes) -> Any:
    """`json.loads`, refusing nesting deeper than `MAX_NESTING` with a ValueError
    (`json.loads` itself raises `RecursionError`, and what walks the result later would too)."""
    if isinstance(text, (bytes, bytearray)):
        text = text.decode('utf-8')
    if json_depth(text) > MAX_NESTING:
        raise ValueError(f"JSON nests deeper than {MAX_NESTING}")
    return json.loads(text)


__all__ = ['MAX_ALIGNMENT', 'MAX_BYTES', 'MAX_INT_DIGITS', 'MAX_NDIM', 'MAX_NESTING',
           'MAX_PATH_LENGTH', 'PADDED_ALLOCATION_FACTOR', 'check_itemsize', 'check_path_length',
           'check_shape', 'json_depth', 'json_loads', 'valid_alignment']
