"""Arrays read lazily, box by box, and the log of the bytes each read took from a checkpoint.

A directory checkpoint's reader hands out `LazyArray` s that read only
the stored pieces overlapping the box asked of them; restore asks each
device's box, so no device's shard costs more than its own bytes.
`record_reads` lets a test (or a benchmark) see that.

>>> a = LazyArray((2, 4), 'float32', lambda box: np.zeros([b - a for a, b in box], 'float32'))
>>> a[0:1, 2:4].shape, a
((1, 2), LazyArray(shape=(2, 4), dtype=float32))
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jckpt.format.boxes import Box, box_of, full_box

_READS_LOCK = threading.Lock()
_ALL_LOGS: list[list[tuple[Box, int]]] = []


@contextlib.contextmanager
def record_reads() -> Iterator[list[tuple[Box, int]]]:
    """Collect `(box, bytes read from the checkpoint)` for every shard read while active.

    The check that each device reads only its slice: a restore onto a mesh
    of N devices logs N boxes, each with the bytes of one shard.

    >>> with record_reads() as log:
    ...     note_read(((0, 2), (2, 4)), 32)
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
    """Report `nbytes` read from a checkpoint for `box` to active `record_reads`."""
    if _ALL_LOGS:
        with _READS_LOCK:
            for log in _ALL_LOGS:
                log.append((box, nbytes))


class LazyArray:
    """An array not read yet: `shape`, `dtype`, and a function reading any box of it.

    Restore hands one of these to placement, which asks each device's box
    through `jckpt.trees.sharding.read_box`; `np.asarray` reads the whole array.
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
        """The contents of `box` as a new array (an `ndarray` even for a 0-d box)."""
        return np.asarray(self._read(box))

    def astype(self, dtype: Any, copy: bool = True) -> LazyArray:
        """The same array converted to `dtype` box by box (nothing is read now)."""
        dtype = np.dtype(dtype)
        if dtype == self.dtype and not copy:
            return self
        return LazyArray(self.shape, dtype, lambda box: self.read(box).astype(dtype))

    def __getitem__(self, index: Any) -> np.ndarray:
        if not isinstance(index, tuple):
            index = (index,)
        return self.read(box_of(index, self.shape))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.read(full_box(self.shape))
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"LazyArray(shape={self.shape}, dtype={self.dtype})"


class FetchCache:
    """Arrays fetched for one box and kept for the next boxes over them (other devices'), up
    to `budget` bytes, the oldest dropped first.

    >>> cache = FetchCache(budget=16)
    >>> cache.get('a', lambda: np.zeros(2)).tolist(), cache.get('a', lambda: 1 / 0).tolist()
    ([0.0, 0.0], [0.0, 0.0])
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._kept: dict[Any, np.ndarray] = {}  # insertion order: the oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Any, fetch: Callable[[], np.ndarray]) -> np.ndarray:
        """The array kept under `key`, or `fetch()`'s, then kept."""
        with self._lock:
            found = self._kept.get(key)
        if found is not None:
            return found
        data = fetch()
        with self._lock:
            old = self._kept.pop(key, None)  # another thread fetched it meanwhile
            self._bytes -= 0 if old is None else old.nbytes
            self._kept[key] = data
            self._bytes += data.nbytes
            while self._bytes > self.budget and len(self._kept) > 1:
                old = self._kept.pop(next(iter(self._kept)))
                self._bytes -= old.nbytes
        return data


__all__ = ['FetchCache', 'LazyArray', 'note_read', 'record_reads']
