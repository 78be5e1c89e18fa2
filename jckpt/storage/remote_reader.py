"""The remote reader: a checkpoint object read by ranges, with the surface of the local reader.

An object store has no mapping to hand out, so `RemoteReader` reads
what is asked and nothing else: the header with one ranged GET (two when it
is longer than the first, of 64 KiB or of the length of the header read before
under the same prefix: `header_guess`), each payload with concurrent ranged GETs written
straight into the array that is returned, runs of the small payloads asked
together in one GET each (concurrent, never bytes of payloads not asked beyond
short gaps), and, for a payload read box by box (a device's shard),
only the byte runs of that box (or, for many short runs, the rows they span,
fetched once for every box over them). It decodes with the
same codec functions as `jckpt.storage.reader.CheckpointReader`
(`decode_payload`, `check_extents`), so the two agree on every byte.

The object itself is behind a small interface, `RangeSource` (the
object store backend provides one), so this module knows nothing of any
store library. Every GET after the header is conditional on the ETag the
header was read with: an object replaced while it is read is an error, never
a mix of two checkpoints.

>>> src = BytesSource(b'')  # an in-memory object, for illustration
>>> try:
...     RemoteReader(src, 'memory://b/empty.jckpt')
... except FormatError as e:
...     print(e.message)
object is 0 bytes, shorter than the 4-byte header length
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import itertools
import math
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, TypeVar

import numpy as np

from jckpt.errors import CheckpointError, ChecksumError, FormatError
from jckpt.format import payload as payload_mod
from jckpt.format import precs
from jckpt.format.boxes import Box, box_shape, box_size, box_slices
from jckpt.format.header import Entry, Header, decode_header
from jckpt.format.header_seal import is_sealed
from jckpt.format.layout import check_extents
from jckpt.format.sniff import foreign_error
from jckpt.storage.lazy import FetchCache, LazyArray, note_read
from jckpt.storage.reader import COUNTS, verify_entries

#: The first GET asks for this many bytes: the header of most checkpoints, in one request.
HEAD_BYTES = 64 << 10
#: The most a header's first GET asks for on the strength of a header read before it.
MAX_HEADER_GUESS = 16 << 20
#: Prefixes whose last header length is remembered (`header_guess`), the oldest forgotten first.
_SEEN_PREFIXES = 256
_SEEN: collections.OrderedDict[str, int] = collections.OrderedDict()
_SEEN_LOCK = threading.Lock()
#: A payload below this size is read together with its small neighbours in one GET.
SMALL_PAYLOAD = 256 << 10
#: How far one GET of small neighbouring payloads reaches.
WINDOW_BYTES = 4 << 20
#: Small payloads this close are read by one GET; a box whose runs are shorter than this (and
#: more than 16) is read as the rows they span.
COALESCE_GAP = 1 << 20
#: Bytes of rows a reader keeps for the boxes of a column sharding (`FetchCache`).
ROWS_CACHE_BYTES = 1 << 30


class RangeSource(Protocol):
    """One stored object, read by ranges (the object store backend implements it)."""

    def head(self, length: int) -> tuple[bytes, int, str | None]:
        """The first `length` bytes (fewer if the object is shorter), its size and its version tag."""

    def read_into(self, dest: memoryview, offset: int, version: str | None) -> None:
        """Fill `dest` with the object's bytes from `offset`, refusing another version."""


class BytesSource:
    """A `RangeSource` over bytes in memory (for tests and examples)."""

    def __init__(self, data: bytes) -> None:
        self.data = bytes(data)

    def head(self, length: int) -> tuple[bytes, int, str | None]:
        return self.data[:length], len(self.data), None

    def read_into(self, dest: memoryview, offset: int, version: str | None) -> None:
        got = self.data[offset:offset + len(dest)]
        if len(got) != len(dest):
            raise FormatError("object ended early", fix="the object is truncated")
        dest[:] = got


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()
#: Set in a thread of the pool while it runs a call: a nested `concurrently` runs inline there.
_IN_POOL = threading.local()
T = TypeVar('T')
R = TypeVar('R')


def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of request threads, of at least `workers` threads (a larger one
    replaces it; the old one's threads end once no caller holds it)."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < workers:
            _POOL = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix='jckpt-get')
            _POOL_SIZE = workers
        return _POOL


def concurrently(call: Callable[[T], R], items: Iterable[T], limit: int) -> list[R]:
    """`call(item)` for each of `items`, at most `limit` at once, in the pool the reads of ranges
    use: the results in order, or the first item's error (in order) that failed. One item, a
    `limit` of 1, or a call from inside the pool (a read that opens another reader) runs inline:
    a pool thread never waits on the pool.

    A store's requests are mostly waiting (10-50 ms each on a real bucket), so what is asked
    of many objects (the headers of a manager's steps) goes `limit` at a time, the store's
    `concurrency`, not one after another.

    >>> concurrently(lambda n: n * n, range(5), 2)
    [0, 1, 4, 9, 16]
    """
    items = list(items)
    if limit <= 1 or len(items) < 2 or getattr(_IN_POOL, 'busy', False):
        return [call(item) for item in items]
    pool, slots, failed = _pool(limit), threading.BoundedSemaphore(limit), threading.Event()

    def run(item: T) -> R:
        _IN_POOL.busy = True
        try:
            return call(item)
        except BaseException:
            failed.set()  # nothing more is sent: the error is raised once those in flight end
            raise
        finally:
            _IN_POOL.busy = False
            slots.release()
    futures = []
    for item in items:
        slots.acquire()
        if failed.is_set():
            break
        futures.append(pool.submit(run, item))
    return [f.result() for f in futures]


def read_ranges(source: RangeSource, ranges: list[tuple[int, memoryview]], version: str | None, *,
                part: int, concurrency: int, entry_at: Callable[[int], str | None] | None = None) -> None:
    """Fill each `(offset, dest)` from `source`, in parts of `part` bytes, `concurrency` at once.
    A failed read's `CheckpointError` names the entry `entry_at` gives for its offset."""
    jobs = [(offset + start, dest[start:start + part])
            for offset, dest in ranges for start in range(0, len(dest), part)]

    def read(job: tuple[int, memoryview]) -> None:
        offset, dest = job
        try:
            source.read_into(dest, offset, version)
        except CheckpointError as e:
            if e.entry is None and entry_at is not None:
                e.entry = entry_at(offset)
            raise
    concurrently(read, jobs, concurrency)


def join_spans(spans: Iterable[tuple[int, int]], *, gap: int, reach: int) -> Iterator[tuple[int, int]]:
    """`spans` (`(start, end)`, ascending) joined into the windows one GET each reads: a span
    starting at most `gap` bytes past a window's end, and ending within `reach` bytes of its
    start, joins it. Lazy, so the first window costs only the spans it looks at.

    >>> list(join_spans([(0, 10), (12, 20), (5000, 5010), (5010, 6100)], gap=100, reach=1000))
    [(0, 20), (5000, 5010), (5010, 6100)]
    """
    window: tuple[int, int] | None = None
    for start, end in spans:
        if window is not None and start - window[1] <= gap and end - window[0] <= reach:
            window = (window[0], max(window[1], end))
            continue
        if window is not None:
            yield window
        window = (start, end)
    if window is not None:
        yield window


def box_runs(shape: tuple[int, ...], item: int, box: Box) -> tuple[list[int], int]:
    """The byte offsets of the contiguous runs that `box` covers in a C-ordered payload, and their length.

    >>> box_runs((4, 6), 1, ((1, 3), (0, 6)))   # two whole rows: one run
    ([6], 12)
    >>> box_runs((4, 6), 1, ((1, 3), (2, 4)))   # a block: one run per row
    ([8, 14], 2)
    """
    ndim = len(shape)
    split = [d for d in range(ndim) if box[d] != (0, shape[d])]
    strides = [math.prod(shape[d + 1:]) * item for d in range(ndim)]
    if not split:
        return [0], math.prod(shape) * item
    j = split[-1]
    run = (box[j][1] - box[j][0]) * strides[j]
    lead = box_shape(box)[:j]
    base = sum(box[d][0] * strides[d] for d in range(j + 1))
    offsets = [base + sum(i * strides[d] for d, i in enumerate(idx)) for idx in np.ndindex(*lead)]
    return offsets, run


def header_guess(url: str) -> int:
    """Bytes the first GET of the object `url` asks for: `HEAD_BYTES`, or, where a longer header
    was read under the same prefix (a manager's steps, a run's checkpoints side by side), that
    header's length and `HEAD_BYTES` more (up to `MAX_HEADER_GUESS`): a header as long as
    the one before, or a little longer, is read in one request, not two in turn, with the
    small payloads after it as a short header's GET brings them (not fetched again).

    >>> remember_header('memory://doc-guess/run/step_1.jckpt', 200_000)
    >>> header_guess('memory://doc-guess/run/step_2.jckpt'), header_guess('memory://doc-guess/x')
    (265536, 65536)
    """
    with _SEEN_LOCK:
        seen = _SEEN.get(url.rpartition('/')[0], 0)
    return min(MAX_HEADER_GUESS, seen + HEAD_BYTES) if seen > HEAD_BYTES else HEAD_BYTES


def remember_header(url: str, length: int) -> None:
    """Note that the object `url`'s header (with its length field) is `length` bytes."""
    prefix = url.rpartition('/')[0]
    with _SEEN_LOCK:
        _SEEN[prefix] = length
        _SEEN.move_to_end(prefix)
        while len(_SEEN) > _SEEN_PREFIXES:
            _SEEN.popitem(last=False)


class RemoteReader:
    """A checkpoint object: its validated header, its payloads read by range on demand.

    The same surface as `jckpt.storage.reader.CheckpointReader`
    (`header`, `data_start`, `size`, `decode`, `payload_bytes`, `verify`),
    so `load`, `restore`, `verify` and the tools read an object as they read
    a file. `remote` is True: checksums are verified by default (see
    `jckpt.api.loading`), and a large payload read without verification is
    a `LazyArray` that fetches only the boxes asked of it.
    """

    remote = True

    def __init__(self, source: RangeSource, url: str, *, part: int = 16 << 20,
                 concurrency: int = 8) -> None:
        self.path = url
        self.source, self.part, self.concurrency = source, part, concurrency
        first, self.size, self.version = source.head(header_guess(url))
        #: What identifies the object read (its ETag), to tell if it was replaced since.
        self.file_id = self.version
        if len(first) < 4:
            raise FormatError(f"object is {len(first)} bytes, shorter than the 4-byte header length",
                              file=url, fix="the object is truncated or empty")
        (hlen,) = struct.unpack('>I', first[:4])
        if 4 + hlen > self.size:
            message = f"header length {hlen} extends past the end of the object ({self.size} bytes)"
            raise foreign_error(bytes(first[:16]), message, url) or FormatError(
                message, file=url, fix="the object is truncated or not a checkpoint")
        raw = first[:4 + hlen]
        if len(raw) < 4 + hlen:
            rest = bytearray(4 + hlen - len(raw))
            source.read_into(memoryview(rest), len(raw), self.version)
            raw = bytes(raw) + bytes(rest)
        self.header: Header = decode_header(raw, file=url)
        remember_header(url, len(raw))
        #: Whether the header carries its checksum (checked as it was decoded).
        self.sealed = is_sealed(raw)
        self.data_start = 4 + hlen
        check_extents(self.header, self.data_start, self.size, file=url)
        ordered = sorted(self.header.tensors, key=lambda e: (e.offset, e.byte_length))
        self._spans = [(e.offset, e.offset + e.byte_length) for e in ordered]
        self._starts = [s for s, _ in self._spans]
        self._names = [e.name for e in ordered]
        self._window: tuple[int, np.ndarray] | None = None
        #: The rows fetched for boxes of short runs, by `(offset, length)`: the boxes of a column
        #: sharding span the same rows (in whatever order the devices come), and each device's
        #: fetched them all again.
        self._rows = FetchCache(ROWS_CACHE_BYTES)
        self._whole: np.ndarray | None = None
        #: The bytes the header's GET brought: a small checkpoint's payloads too, read from here.
        self._first = np.frombuffer(first, np.uint8)
        self._lock = threading.Lock()

    # --- bytes ------------------------------------------------------------------------------

    def _fetch(self, start: int, length: int) -> np.ndarray:
        """`length` bytes at payload offset `start`, fetched concurrently into one new buffer
        (what the header's GET brought of them copied, not asked again)."""
        out = np.empty(length, np.uint8)
        self._read([(self.data_start + start, memoryview(out))])
        return out

    def _read(self, ranges: list[tuple[int, memoryview]]) -> None:
        """Fill each `(object offset, dest)`: what the header's GET brought is copied from it,
        the rest fetched (concurrently, in parts)."""
        rest = []
        for at, dest in ranges:
            have = max(0, min(len(dest), self._first.size - at))
            dest[:have] = self._first[at:at + have].data
            if have < len(dest):
                rest.append((at + have, dest[have:]))
        read_ranges(self.source, rest, self.version, part=self.part, concurrency=self.concurrency,
                    entry_at=self._entry_at)

    def _entry_at(self, at: int) -> str | None:
        """The name of the entry whose payload holds object offset `at` (None: the header)."""
        i = bisect.bisect_right(self._starts, at - self.data_start) - 1
        return self._names[i] if at >= self.data_start and i >= 0 else None

    def _small(self, entry: Entry) -> np.ndarray:
        """A small payload, read with the small payloads that follow it in one GET."""
        start, end = entry.offset, entry.offset + entry.byte_length
        with self._lock:
            window = self._window
            if window is not None and window[0] <= start and end <= window[0] + window[1].size:
                return window[1][start - window[0]:end - window[0]]
            following = itertools.takewhile(lambda span: span[1] - span[0] < SMALL_PAYLOAD,
                                            self._spans[bisect.bisect_left(self._starts, start):])
            _, reach = next(join_spans(following, gap=COALESCE_GAP, reach=WINDOW_BYTES))
            data = self._fetch(start, reach - start)
            self._window = (start, data)
        return data[:end - start]

    def payload(self, entry: Entry) -> np.ndarray:
        """The entry's stored bytes as a `uint8` array (fetched now)."""
        if self._whole is not None:
            start = entry.offset
            return self._whole[self.data_start + start:self.data_start + start + entry.byte_length]
        if entry.byte_length < SMALL_PAYLOAD:
            return self._small(entry)
        return self._fetch(entry.offset, entry.byte_length)

    @property
    def buffer(self) -> np.ndarray:
        """The whole object's bytes (fetched on first use, concurrently)."""
        if self._whole is None:
            whole = np.empty(self.size, np.uint8)
            self._read([(0, memoryview(whole))])
            self._whole = whole
        return self._whole

    def payload_bytes(self, entry: Entry) -> memoryview:
        return memoryview(self.payload(entry))

    # --- arrays -----------------------------------------------------------------------------

    def decode(self, entry: Entry, *, mmap: bool = True, verify: bool = False,
               count: bool = True) -> np.ndarray | LazyArray:
        """The entry's array, read now; without `verify` a large one is a `LazyArray` read box by box."""
        if self._lazy(entry, verify):
            return LazyArray(entry.shape, entry.dtype, lambda box: self.read_box(entry, box))
        data = self.payload(entry) if entry.prec != precs.VOID else np.empty(0, np.uint8)
        return self._array(entry, data, verify, count)

    def decode_all(self, entries: Sequence[Entry], *, mmap: bool = True,
                   verify: bool = False) -> list[np.ndarray | LazyArray]:
        """`decode` of each entry, the payloads read now fetched together: `concurrency` GETs in
        flight across entries, not one entry's at a time (a model of many tensors of a few MiB,
        each one GET, was read one GET after another). The small payloads asked are read in
        windows of their own runs (`join_spans`), not with the payloads stored after them.

        >>> import tempfile, os, jckpt
        >>> path = os.path.join(tempfile.mkdtemp(), 'a.jckpt')
        >>> jckpt.save(jckpt.Context(), {'w': np.arange(3.0)}, path)
        >>> r = RemoteReader(BytesSource(open(path, 'rb').read()), 'memory://b/a.jckpt')
        >>> [a.tolist() for a in r.decode_all(r.header.tensors)]
        [[0.0, 1.0, 2.0]]
        """
        entries = list(entries)
        ahead = {i: np.empty(e.byte_length, np.uint8) for i, e in enumerate(entries)
                 if e.byte_length >= SMALL_PAYLOAD and self._whole is None and not self._lazy(e, verify)}
        small = {i: e for i, e in enumerate(entries) if i not in ahead and self._whole is None
                 and 0 < e.byte_length < SMALL_PAYLOAD and e.prec != precs.VOID}
        windows = [(start, np.empty(end - start, np.uint8)) for start, end in join_spans(
            sorted({(e.offset, e.offset + e.byte_length) for e in small.values()}), gap=COALESCE_GAP,
            reach=WINDOW_BYTES)]
        self._read([(self.data_start + entries[i].offset, memoryview(out)) for i, out in ahead.items()]
                   + [(self.data_start + start, memoryview(out)) for start, out in windows])
        starts = [start for start, _ in windows]
        for i, e in small.items():
            start, out = windows[bisect.bisect_right(starts, e.offset) - 1]
            ahead[i] = out[e.offset - start:e.offset - start + e.byte_length]
        return [self._array(e, ahead[i], verify, True) if i in ahead else self.decode(e, verify=verify)
                for i, e in enumerate(entries)]

    def _lazy(self, entry: Entry, verify: bool) -> bool:
        """Whether `decode` gives a `LazyArray` (read box by box) rather than the array."""
        return (not verify and entry.byte_length >= SMALL_PAYLOAD and entry.padding is None
                and entry.key_impl is None and entry.prec != precs.VOID and bool(entry.shape)
                and self._whole is None)

    def _array(self, entry: Entry, data: np.ndarray, verify: bool, count: bool) -> np.ndarray:
        if verify:
            self._check(entry, data)
        array, _ = payload_mod.decode_payload(data, entry, data_start=-entry.offset, mmap=True,
                                              file=self.path)
        if count:
            COUNTS.add(0, 1)
        return array

    def read_box(self, entry: Entry, box: Box) -> np.ndarray:
        """The contents of `box` of `entry`: only its byte runs are fetched, close ones together."""
        dtype, shape = entry.dtype, entry.shape
        item = dtype.itemsize
        offsets, run = box_runs(shape, item, box)
        if box_size(box) == 0:
            return np.empty(box_shape(box), dtype)
        if run >= COALESCE_GAP or len(offsets) <= 16:
            out = np.empty(box_size(box) * item, np.uint8)
            view = memoryview(out)
            self._read([(self.data_start + entry.offset + o, view[i * run:(i + 1) * run])
                        for i, o in enumerate(offsets)])
            note_read(box, out.nbytes)
            return out.view(dtype).reshape(box_shape(box))
        # Short runs: fetch the rows the box spans at once and slice them (kept for the next
        # box, another device's, over the same rows).
        row = math.prod(shape[1:]) * item
        start, length = entry.offset + box[0][0] * row, (box[0][1] - box[0][0]) * row

        def fetch() -> np.ndarray:  # a box served from rows fetched before reads nothing
            fetched = self._fetch(start, length)
            note_read(box, fetched.nbytes)
            return fetched
        rows = self._rows.get((start, length), fetch)
        block = rows.view(dtype).reshape((box[0][1] - box[0][0], *shape[1:]))
        return np.ascontiguousarray(block[(slice(None), *box_slices(box[1:]))])

    def _check(self, entry: Entry, data: np.ndarray) -> None:
        if entry.checksum is None or entry.checksum[0] != payload_mod.CHECKSUM_ALGORITHM:
            return
        actual = payload_mod.checksum(data)[1]
        if actual != entry.checksum[1].lower():
            raise ChecksumError(f"checksum mismatch: stored {entry.checksum[1]}, computed {actual}",
                                file=self.path, entry=entry.name,
                                fix="the object is damaged; restore it from a good copy")

    def verify_entry(self, entry: Entry) -> None:
        """Raise `ChecksumError` if the payload does not match its checksum."""
        self._check(entry, self.payload(entry))

    def verify(self, entries: Iterable[Entry] | None = None) -> list[ChecksumError]:
        """Check every (or the given) entry's checksum; return the failures."""
        return verify_entries(self, entries)

    def __repr__(self) -> str:
        return f"RemoteReader({self.path!r}, size={self.size})"


__all__ = ['BytesSource', 'RangeSource', 'RemoteReader', 'box_runs', 'concurrently', 'header_guess',
           'read_ranges', 'remember_header']
