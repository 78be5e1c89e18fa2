"""A safetensors header checked and its tensors viewed in bulk: the reader's fast path.

A file of 200,000 small tensors spent seconds in per-tensor Python: a JSON hook
for duplicate keys on every object, a shape check, an offsets check and one
`np.frombuffer` per tensor. Here every check the reader makes runs over whole
columns instead (`set`s of types, one numpy pass over the offsets), and the views
come from one strided window per (dtype, shape) indexed by position.

`layout` only ACCEPTS: on anything it cannot prove well formed it returns None,
and the reader runs its per-tensor checks, which name the entry and the fault.
So the error messages have one source, and this module no second one.

>>> header = {'w': {'dtype': 'F32', 'shape': [2], 'data_offsets': [0, 8]}}
>>> text = '{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
>>> found = layout(header, None, text, 8, {'F32': np.dtype('<f4')})
>>> found.names, found.shapes, found.begins
(['w'], [(2,)], [0])
"""

from __future__ import annotations

import math
from itertools import chain
from operator import itemgetter
from typing import Any, NamedTuple

import numpy as np

from jckpt.adapters._common import array_view
from jckpt.format import limits

_FIELDS = ('dtype', 'shape', 'data_offsets')


class Layout(NamedTuple):
    """The tensors of a checked header, as columns in header order: `names`, `dtypes`
    (numpy), `shapes` (tuples) and `begins` (data offsets, relative to the data start)."""

    names: list[str]
    dtypes: list[np.dtype]
    shapes: list[tuple[int, ...]]
    begins: list[int]


def _only(values: Any, *kinds: type) -> bool:
    """Whether every value's type is one of `kinds` (exactly: `bool` is not `int`)."""
    return set(map(type, values)) <= set(kinds)


def _no_duplicates(header: dict, metadata: dict | None, text: str, fields: int) -> bool:
    """Whether the JSON `text` that parsed (keeping the last of equal keys) to `header` and
    `metadata` held no key twice: its key separators (`:` outside strings) are exactly the
    keys parsed. Colons inside strings are those of the parsed names and metadata, unless
    one is spelled as an escape (then say no; the caller's per-key check decides)."""
    if '\\u003a' in text or '\\u003A' in text:
        return False
    keys = len(header) + fields + (0 if metadata is None else 1 + len(metadata))
    metadata = metadata or {}
    in_strings = (''.join(header).count(':') + ''.join(metadata).count(':')
                  + ''.join(metadata.values()).count(':'))
    return text.count(':') - in_strings == keys


def _columns(infos: list) -> tuple[list, list, list] | None:
    """`(dtypes, shapes, offsets)` of the tensor infos when each is an object of exactly
    the three fields, a string, a list of ints and a list of two ints; None otherwise."""
    if not (_only(infos, dict) and set(map(len, infos)) <= {3}):
        return None
    try:
        dtypes, shapes, offsets = (list(map(itemgetter(f), infos)) for f in _FIELDS)
    except KeyError:
        return None
    if not (_only(dtypes, str) and _only(shapes, list) and _only(offsets, list)
            and set(map(len, offsets)) <= {2} and _only(chain.from_iterable(shapes), int)
            and _only(chain.from_iterable(offsets), int)):
        return None
    return dtypes, shapes, offsets


def _sizes(keys: list[tuple[str, tuple[int, ...]]], known: dict[str, np.dtype]) -> dict | None:
    """`{(dtype, shape): bytes}` for every distinct pair when each dtype is `known` and each
    shape passes `limits.check_shape`; None otherwise."""
    sizes = {}
    for dtype, shape in set(keys):
        if dtype not in known:
            return None
        try:
            limits.check_shape(shape, known[dtype].itemsize)
        except ValueError:
            return None
        sizes[dtype, shape] = math.prod(shape) * known[dtype].itemsize
    return sizes


def _tiled(offsets: list, expected: list[int], size: int) -> bool:
    """Whether the `[begin, end]` pairs span `expected` bytes each and, sorted, tile the
    `size` data bytes exactly (no overlap, gap, truncation or trailing bytes)."""
    if not offsets:
        return size == 0
    try:
        flat = np.fromiter(chain.from_iterable(offsets), np.int64, 2 * len(offsets))
    except OverflowError:  # past 2**63: no file is that large, the per-tensor check says so
        return False
    begins, ends = flat[0::2], flat[1::2]
    if not np.array_equal(ends - begins, np.asarray(expected, np.int64)):
        return False
    order = np.lexsort((ends, begins))
    begins, ends = begins[order], ends[order]
    return bool(begins[0] == 0 and ends[-1] == size and np.array_equal(begins[1:], ends[:-1]))


def layout(header: dict, metadata: dict | None, text: str, size: int,
           known: dict[str, np.dtype]) -> Layout | None:
    """The `Layout` of a parsed header over `size` data bytes, when every check passes; None
    when any fails. `header`: the tensor infos, `metadata`: the `__metadata__` object taken
    out of it (None when there was none), `text`: the JSON they parsed from."""
    infos = list(header.values())
    columns = _columns(infos)
    if columns is None:
        return None
    dtypes, shapes, offsets = columns
    if not _no_duplicates(header, metadata, text, 3 * len(infos)):
        return None
    keys = list(zip(dtypes, map(tuple, shapes)))
    sizes = _sizes(keys, known)
    if sizes is None or not _tiled(offsets, list(map(sizes.__getitem__, keys)), size):
        return None
    return Layout(list(header), [known[d] for d in dtypes], [k[1] for k in keys],
                  [o[0] for o in offsets])


def views(buffer: Any, start: int, found: Layout, file: str) -> dict[str, np.ndarray]:
    """`{name: array}` of a checked layout whose data starts at `start` of `buffer`: zero-copy
    views where aligned (one strided window per dtype and shape, indexed by position),
    copies where a foreign writer left a tensor misaligned (`array_view`)."""
    groups: dict[tuple[np.dtype, tuple[int, ...]], list[int]] = {}
    for i, key in enumerate(zip(found.dtypes, found.shapes)):
        groups.setdefault(key, []).append(i)
    out: list[Any] = [None] * len(found.names)
    for (dtype, shape), members in groups.items():
        positions = np.asarray([found.begins[i] for i in members], np.int64) + start
        aligned = positions % dtype.itemsize == 0
        window = _window(buffer, dtype, shape)
        for i, at in zip(np.asarray(members)[aligned].tolist(),
                         (positions[aligned] // dtype.itemsize).tolist()):
            out[i] = np.empty(shape, dtype) if window is None else (
                window[at] if shape else window[at].reshape(()))
        for i in np.asarray(members)[~aligned].tolist():
            out[i] = array_view(buffer, dtype, shape, start + found.begins[i], file, found.names[i])
    return dict(zip(found.names, out))


def _window(buffer: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray | None:
    """`buffer` as overlapping C-ordered arrays of `shape`, one starting at each element of
    `dtype` (`window[k]` is the array at byte `k * itemsize`); None for empty shapes.
    A 0-d shape gets an axis of 1 (`window[k]` would be a numpy scalar, not an array)."""
    elements = math.prod(shape)
    if elements == 0:
        return None
    dims = shape or (1,)
    strides = [dtype.itemsize] * (len(dims) + 1)
    for d in range(len(dims) - 1, 0, -1):
        strides[d] = strides[d + 1] * dims[d]
    count = len(buffer) // dtype.itemsize - elements + 1
    window = np.ndarray((count, *dims), dtype, buffer=buffer, strides=tuple(strides))
    return window


__all__ = ['Layout', 'layout', 'views']
