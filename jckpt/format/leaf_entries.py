"""The entries and payload sources of many small host arrays, built in one C call.

A save of thousands of small leaves spends most of its Python time, per
leaf, on a flat byte view of the array, its checksum, a payload source and
an `Entry` (`jckpt.format.entries.entry_for`). `build` does that work for
a run of leaves in the C accelerator (`_canonical.c`, `host_entries`),
producing exactly what the Python path produces, and stops at the first leaf
it does not handle (a large, non-contiguous or big-endian array, a sharded
leaf, a dtype or a path outside the common case): the caller builds that one
in Python and calls again from the next. Without the accelerator nothing is
built here.

>>> import numpy as np
>>> entries, sources = [], []
>>> leaf = (np.dtype('float32'), (2,), None, np.zeros(2, np.float32))
>>> done, cursor = build('jckpt', [(('k', 'w'),)], [leaf], start=0, first_id=1, cursor=0,
...                      alignment=32, small_limit=1 << 16,
...                      source_type=tuple, entries=entries, sources=sources)
>>> (done, cursor, entries[0].label) if accelerator is not None else (1, 8, ('w',))
(1, 8, ('w',))
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from jckpt.format import precs
from jckpt.format.entries import Entry, KeyPath
from jckpt.format.fastpath import _FIELDS, accelerator
from jckpt.format.limits import MAX_PATH_LENGTH
from jckpt.format.payload import CHECKSUM_ALGORITHM

_UINT8 = np.dtype(np.uint8)


@functools.cache
def _dtype_precs() -> dict[np.dtype, tuple[str, int]]:
    """Every storable native dtype -> `(prec, bytes per element)`, as `entry_for` computes them."""
    found = {}
    for prec in precs.ALL_PRECS - {precs.VOID}:
        dtype = precs.dtype_of(prec).newbyteorder('=')
        found[dtype] = (precs.prec_of(dtype), precs.element_size(precs.prec_of(dtype)))
    return found


def build(namespace: str, paths: list[KeyPath], hosts: list[Any], *, start: int, first_id: int,
          cursor: int, alignment: int, small_limit: int, source_type: Callable[..., Any],
          entries: list[Entry], sources: list[Any]) -> tuple[int, int]:
    """Append the entries and sources of `hosts[start:]` until one C does not handle.

    Args:
      namespace, paths: where each leaf is stored.
      hosts: tuples `(dtype, shape, key_impl, array, ...)` (host leaves).
      start: the first leaf to build; `first_id` is its id, the next ones count up.
      cursor: where the payloads so far end; each offset is it rounded up to `alignment`.
      small_limit: the arrays built are smaller than this many bytes.
      source_type: the payload source's type, a 2-tuple type built as `(flat uint8 data,
        checksum)` (the storage layer's; this layer does not import it).
      entries, sources: appended to.

    Returns:
      `(stop, cursor)`: the index of the first leaf not built (`len(hosts)` when all were)
      and where the payloads built end.
    """
    if accelerator is None:
        return start, cursor
    return accelerator.host_entries(
        namespace, paths, hosts, start, first_id, cursor, alignment, small_limit, MAX_PATH_LENGTH,
        _dtype_precs(), xxhash.xxh3_64_intdigest, CHECKSUM_ALGORITHM, Entry, _FIELDS, source_type,
        _UINT8, np.asarray, entries, sources)


__all__ = ['accelerator', 'build']
