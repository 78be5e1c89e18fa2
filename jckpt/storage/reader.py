"""The reader: one open, header and extents checked before any payload is touched.

>>> # reader = CheckpointReader('model.jckpt'); reader.header.tensors[0].name
"""

from __future__ import annotations

import errno
import functools
import mmap as mmap_mod
import os
import struct
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from jckpt.errors import ChecksumError, FormatError, InUseError
from jckpt.format import payload as payload_mod
from jckpt.format import precs
from jckpt.format.boxes import Box, box_spans, full_box
from jckpt.format.fastpath import accelerator
from jckpt.format.header import Entry, Header, decode_header
from jckpt.format.header_seal import is_sealed
from jckpt.format.layout import check_extents
from jckpt.format.sniff import foreign_error
from jckpt.storage.publish import storage_error
from jckpt.storage.regular import open_regular


class IngestionCounts:
    """Process-wide counts of payloads mapped (zero-copy) and decoded (copied)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.mapped = 0
        self.decoded = 0

    def add(self, mapped: int, decoded: int) -> None:
        with self._lock:
            self.mapped += mapped
            self.decoded += decoded

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {'mapped': self.mapped, 'decoded': self.decoded}


COUNTS = IngestionCounts()

#: Needed ranges closer than this are advised as one (reading a short gap costs less than
#: a second request).
MERGE_GAP = 64 << 10
#: Bytes advised per call: a single `MADV_WILLNEED` reads no more than the device's
#: read-ahead window (8 MiB on a disk whose `read_ahead_kb` is 8192; 128 KiB by default) or
#: its largest request, and the kernel itself reads in chunks of 2 MiB.
ADVISE_BYTES = 2 << 20


def needed_ranges(spans: Iterable[tuple[int, int]], data_start: int, size: int,
                  page: int = mmap_mod.PAGESIZE) -> list[tuple[int, int]]:
    """`(start, length)` of the page-aligned file ranges holding the payload bytes `spans`
    (`(offset, length)` from the data start), sorted, those closer than `MERGE_GAP` merged;
    `[]` when they span the whole file's payloads (a whole-file read keeps the kernel's
    read-ahead, which streams it).

    >>> needed_ranges([(0, 100), (1 << 20, 100)], 4096, 2 << 20)
    [(4096, 4096), (1052672, 4096)]
    >>> needed_ranges([(0, 100), (200, 100)], 4096, 4396)
    []
    """
    ordered = sorted((data_start + offset, data_start + offset + n) for offset, n in spans if n)
    merged: list[list[int]] = []
    end = None  # the last span's end, before rounding: the gap skipped is the bytes not needed
    for lo, hi in ordered:
        gap, end = (None if end is None else lo - end), max(hi, end or 0)
        lo, hi = lo // page * page, min(size, -(-hi // page) * page)
        if merged and (gap < MERGE_GAP or lo <= merged[-1][1]):
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    if len(merged) == 1 and merged[0][0] - data_start < MERGE_GAP \
            and size - merged[0][1] < MERGE_GAP:
        return []
    return [(lo, hi - lo) for lo, hi in merged]


#: What a restore reads of one array: the boxes of it its devices need, None for all of it.
Need = tuple[Entry, Sequence[Box] | None]


def payload_spans(entry: Entry, box: Box, wanted: Iterable[Box] | None) -> list[tuple[int, int]]:
    """`(offset, length)` of the bytes of the stored payload `entry` (the part `box` of its
    array) that reading the boxes `wanted` of it touches: all of it for None, or for a padded
    payload; the plan of a partial read, made before any of it is read.

    >>> from types import SimpleNamespace
    >>> e = SimpleNamespace(offset=4096, byte_length=64, padding=None)
    >>> payload_spans(e, ((0, 4), (0, 4)), [((2, 4), (0, 4))]), payload_spans(e, (), None)
    ([(4128, 32)], [(4096, 64)])
    """
    if wanted is None or entry.padding:
        return [(entry.offset, entry.byte_length)]
    return [(entry.offset + start, n) for within in wanted  # (the trailing dims unsaid: whole)
            for start, n in box_spans(box, (*within[:len(box)], *box[len(within):]),
                                      entry.byte_length, MERGE_GAP)]


def _advise(mapping: mmap_mod.mmap, start: int, length: int) -> None:
    """Ask the kernel to read `length` bytes of `mapping` at `start` now (`MADV_WILLNEED`)."""
    mapping.madvise(mmap_mod.MADV_WILLNEED, start, length)


def advise_needed(mapping: mmap_mod.mmap, ranges: Iterable[tuple[int, int]],
                  budget: int | None = None) -> int:
    """Have the kernel read exactly `ranges` of the file `mapping` maps, ahead of their use.

    Without it, the first touch of each payload reads the kernel's read-around window
    about it (8 MiB on a disk whose `read_ahead_kb` is 8192), and a restore of one layer
    of nine read 1.35x its bytes; pages already read ahead are then found in the page
    cache, so touching them reads no more. Advice is a hint: a kernel that refuses it
    leaves the restore as it was.

    At most `advice_budget()` bytes are advised, the first ranges first: what the kernel
    reads ahead of its use must still be in memory when it is used (a process restoring its
    part of a checkpoint larger than its memory would otherwise read pages that are evicted
    before they are touched, and read them again). The rest is read as it is touched.
    `budget` (default `advice_budget()`) is what is left of it for this file; the bytes left
    after its ranges are returned, for the next file a restore reads.
    """
    budget = advice_budget() if budget is None else budget
    for start, length in ranges:
        for at in range(start, start + length, ADVISE_BYTES):
            n = min(ADVISE_BYTES, start + length - at, budget)
            if n <= 0:
                return 0
            try:
                _advise(mapping, at, n)
            except (OSError, ValueError):
                return 0
            budget -= n
    return budget


def advice_budget() -> int:
    """How many bytes a restore may have the kernel read ahead of their use: a quarter of
    the memory free now (a default of 1 GiB where the system does not say).

    >>> advice_budget() > 0
    True
    """
    try:
        return os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') // 4
    except (ValueError, OSError):
        return 1 << 30


@functools.cache
def _mappable_precs() -> dict[str, tuple[np.dtype, int]]:
    """Prec -> (dtype, itemsize) of the precs whose decoded shape is their dims (all but
    `Void_prec` and `Uint4x32_prec`), for `map_payloads`."""
    out = {}
    for prec in precs.ALL_PRECS - {precs.VOID, precs.UINT4X32}:
        dtype = precs.dtype_of(prec)
        if dtype.itemsize and precs.element_size(prec) == dtype.itemsize:
            out[prec] = (dtype, dtype.itemsize)
    return out


class CheckpointReader:
    """An open checkpoint file: its validated header and a private mapping of its bytes.

    The mapping is copy-on-write (`MAP_PRIVATE`) and lives as long as any
    array viewing it, even after the file is replaced or removed.
    `follow_symlinks=False` refuses a file that is a symbolic link (for
    names read from another file, such as a directory checkpoint's pieces).
    `mapped=False` checks the header alone and maps nothing (`describe`: a
    mapping and its removal were a tenth of reading a small step's header).
    """

    def __init__(self, path: str | os.PathLike, *, follow_symlinks: bool = True,
                 mapped: bool = True) -> None:
        self.path = os.fspath(path)
        self._mapped = mapped
        try:
            f = open_regular(self.path, follow_symlinks=follow_symlinks)
        except FileNotFoundError:
            raise FormatError("no such checkpoint file", file=self.path,
                              fix="check the path, or save a checkpoint there first") from None
        except IsADirectoryError:
            raise FormatError("is a directory, not a checkpoint file", file=self.path,
                              fix="pass the checkpoint file inside it") from None
        except OSError as e:
            if e.errno == errno.ELOOP and not follow_symlinks:
                raise FormatError("is a symbolic link, which a checkpoint's own files must not be",
                                  file=self.path, fix="replace the link by the file it points to")\
                    from None
            raise storage_error(e, "opening the checkpoint", self.path) from e
        with f:
            self._read_head(f.fileno())

    def _read_head(self, fd: int) -> None:
        """Read and check the header of the open file `fd`, and map the file (unless not
        `mapped`: a reader of the header alone, `describe`'s, which reads no payload)."""
        try:
            st = os.fstat(fd)
            self.size = st.st_size
            #: ``(st_dev, st_ino)`` of the file read, to tell if ``path`` was replaced since.
            self.file_id = (st.st_dev, st.st_ino)
            first = os.pread(fd, 4, 0)
            if len(first) < 4:
                raise FormatError(f"file is {len(first)} bytes, shorter than the 4-byte header "
                                  "length", file=self.path, fix="the file is truncated or empty")
            (hlen,) = struct.unpack('>I', first)
            if 4 + hlen > self.size:
                message = f"header length {hlen} extends past the end of the file ({self.size} bytes)"
                raise foreign_error(os.pread(fd, 16, 0), message, self.path) or FormatError(
                    message, file=self.path, fix="the file is truncated or not a checkpoint")
            raw = first + os.pread(fd, hlen, 4)
            if len(raw) != 4 + hlen:
                raise FormatError("file changed size while being read", file=self.path)
            self.header: Header = decode_header(raw, file=self.path)
            #: Whether the header carries its checksum (checked as it was decoded).
            self.sealed = is_sealed(raw)
            self.data_start = 4 + hlen
            check_extents(self.header, self.data_start, self.size, file=self.path)
            mapped = self.size and self._mapped
            self._map = mmap_mod.mmap(fd, 0, access=mmap_mod.ACCESS_COPY) if mapped else b''
        except OSError as e:
            raise storage_error(e, "reading the checkpoint", self.path) from e

    @property
    def buffer(self):
        """The whole file's bytes (a private mapping)."""
        return self._map

    def decode(self, entry: Entry, *, mmap: bool = True, verify: bool = False,
               count: bool = True) -> np.ndarray:
        """The entry's array: a view of the mapping when allowed, else a copy."""
        if verify:
            self.verify_entry(entry)
        array, mapped = payload_mod.decode_payload(self._map, entry, data_start=self.data_start,
                                                   mmap=mmap, file=self.path)
        if count:
            COUNTS.add(int(mapped), int(not mapped))
        return array

    def decode_all(self, entries: Sequence[Entry], *, mmap: bool = True,
                   verify: bool = False) -> list[np.ndarray]:
        """`decode` of each entry, the mapped views made in one C call where it is built.

        >>> import tempfile, os, jckpt
        >>> path = os.path.join(tempfile.mkdtemp(), 'a.jckpt')
        >>> jckpt.save(jckpt.Context(), {'w': np.arange(3.0)}, path)
        >>> r = CheckpointReader(path)
        >>> [a.tolist() for a in r.decode_all(r.header.tensors)]
        [[0.0, 1.0, 2.0]]
        """
        entries = list(entries)
        if verify:
            for entry in entries:
                self.verify_entry(entry)
        arrays: list = []
        mapped = 0
        if mmap and accelerator is not None and self.size:
            mapped = accelerator.map_payloads(self._map, entries, self.data_start, len(self._map),
                                              _mappable_precs(), np.frombuffer, arrays)
        else:
            arrays = [None] * len(entries)
        COUNTS.add(mapped, 0)
        for i, array in enumerate(arrays):
            if array is None:  # padded, empty, a prec of another shape: the general decoder
                arrays[i] = self.decode(entries[i], mmap=mmap)
        return arrays

    def advise(self, needs: Sequence[Need], *, verify: bool = False, mmap: bool = True) -> None:
        """Have the kernel read now exactly what decoding `needs` will read (`advise_needed`),
        so that touching it reads none of its neighbours: the bytes of the boxes asked of
        each array, or the whole payloads of those whose boxes are None, or of every one when
        they are `verify`'d (a checksum covers a payload whole) or copied (not `mmap`).
        Nothing when that is all the file's payloads, which the kernel's read-ahead streams.

        >>> import tempfile, os, jckpt
        >>> path = os.path.join(tempfile.mkdtemp(), 'a.jckpt')
        >>> jckpt.save(jckpt.Context(), {'w': np.ones((4, 3)), 'b': np.ones(2)}, path)
        >>> reader = CheckpointReader(path)
        >>> reader.advise([(reader.header.tensors[1], [((0, 2), (0, 3))])])  # half of w
        """
        whole = verify or not mmap
        if not (self.size and self._mapped) or ((whole or all(b is None for _, b in needs)) and len(
                {e.id for e, _ in needs}) == len(self.header.tensors)):
            return  # every payload whole (a restore of all of it): left to the read-ahead
        spans: list[tuple[int, int]] = []
        for e, boxes in needs:
            if whole or boxes is None:
                spans.append((e.offset, e.byte_length))
            else:
                spans.extend(payload_spans(e, full_box(e.dims), boxes))
        self.advise_spans(spans)

    def advise_spans(self, spans: Iterable[tuple[int, int]], budget: int | None = None) -> int:
        """`advise_needed` of the payload bytes `spans` (`(offset, length)` from the data
        start); the budget left (all of it where nothing is mapped)."""
        budget = advice_budget() if budget is None else budget
        if not (self.size and self._mapped):
            return budget
        return advise_needed(self._map, needed_ranges(spans, self.data_start, self.size), budget)

    def payload_bytes(self, entry: Entry) -> memoryview:
        start = self.data_start + entry.offset
        return memoryview(self._map)[start:start + entry.byte_length]

    def verify_entry(self, entry: Entry) -> None:
        """Raise `ChecksumError` if the payload does not match its checksum."""
        if entry.checksum is None:
            return
        algo, expected = entry.checksum
        if algo != payload_mod.CHECKSUM_ALGORITHM:
            return  # an algorithm this version does not know: nothing to compare
        with self.payload_bytes(entry) as view:
            actual = payload_mod.checksum(view)[1]
        if actual != expected.lower():
            raise ChecksumError(f"checksum mismatch: stored {expected}, computed {actual}",
                                file=self.path, entry=entry.name,
                                fix="the payload is corrupt; restore the file from a good copy")

    def verify(self, entries: Iterable[Entry] | None = None) -> list[ChecksumError]:
        """Check every (or the given) entry's checksum; return the failures."""
        return verify_entries(self, entries)


def verify_entries(reader, entries: Iterable[Entry] | None = None) -> list[ChecksumError]:
    """`reader.verify_entry` for every (or the given) entry; the failures, in order.

    Shared by the readers of local files and of objects in a store.
    """
    bad = []
    for e in reader.header.tensors if entries is None else entries:
        try:
            reader.verify_entry(e)
        except ChecksumError as err:
            bad.append(err)
    return bad


def reopen(reader: CheckpointReader, action: str) -> int:
    """A descriptor of the file `reader` read, to copy its payloads from: `InUseError` if the
    path holds another file since (another writer's), whose bytes the header would not fit."""
    try:
        fd = os.open(reader.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise storage_error(e, action, reader.path) from e
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != reader.file_id:
        os.close(fd)
        raise InUseError("the file was replaced since it was read", file=reader.path,
                         fix="run it again; let one writer at a time write a path (a "
                             "jckpt.Mirror or CheckpointManager holds a lease for that)")
    return fd
