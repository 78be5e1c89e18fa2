"""The streaming writer: header, then payloads one after another, never the whole file.

The header is written first with fixed-width placeholder checksums; each
payload is hashed while it streams to disk; the header is then rewritten in
place with the real checksums (same length, so no payload moves) and sealed
with its own checksum, its last field. The file
is published atomically by the backend holding the target (locally, a
`StagingFile` renamed over it).
"""

from __future__ import annotations

import dataclasses
import operator
import os
import struct
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from jckpt.errors import InputError, StorageError
from jckpt.format import payload as payload_mod
from jckpt.format.entries import check_namespaces
from jckpt.format.fastpath import accelerator
from jckpt.format.header import Entry, Header, encode_header_with_slots
from jckpt.format.header_seal import seal_header
from jckpt.storage.backend import backend_for
from jckpt.storage.publish import start_writeback, storage_error
from jckpt.storage.regions import ShardedSource


class Sink:
    """Sequential writes to a file descriptor, tracking the position.

    Writes under `SMALL_WRITE` bytes are gathered (up to `BUFFER_BYTES`,
    or `IOV_MAX` buffers) and written by one `os.writev`, so a checkpoint of
    many small arrays costs a few system calls rather than two per array, and
    no copy into a staging buffer of our own (whose fresh pages would fault on
    every save); larger ones go straight to the file. Reading `fd` flushes
    first: code that writes to the descriptor directly finds every earlier
    byte in place. With `writeback` (a durable write from the file's start), the
    disk is set to work behind every MiB written (`publish.start_writeback`),
    so the final fsync waits only for the tail.

    >>> import tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...     sink = Sink(f.fileno())
    ...     sink.write(b'ab'); sink.put_small(4, b'cd'); sink.flush()
    ...     _ = f.seek(0); f.read()
    b'ab\\x00\\x00cd'
    """

    SMALL_WRITE = 1 << 16
    BUFFER_BYTES = 1 << 20
    IOV_MAX = min(os.sysconf('SC_IOV_MAX'), 1024) if hasattr(os, 'sysconf') else 16

    def __init__(self, fd: int, position: int = 0, *, writeback: bool = False) -> None:
        self._fd = fd
        self.position = position
        self._pending: list = []  # buffers gathered for one writev
        self._gathered = 0  # their bytes
        self._writeback = writeback
        self._kicked = position  # writeback started for the bytes before this

    @property
    def fd(self) -> int:
        self.flush()
        return self._fd

    def flush(self) -> None:
        """Write out what is gathered."""
        pending, self._pending = self._pending, []
        left, self._gathered = self._gathered, 0
        while left:
            n = os.writev(self._fd, pending)
            left -= n
            if left:  # a short write: drop what was written, keep a partial rest
                k = 0
                while n >= len(pending[k]):
                    n -= len(pending[k])
                    k += 1
                pending = [memoryview(pending[k])[n:], *pending[k + 1:]]
        self._kick()

    def write(self, data) -> None:
        """Write `data` (any contiguous buffer); a small one is copied and gathered."""
        view = memoryview(data).cast('B')
        if view.nbytes < self.SMALL_WRITE:
            self._gather(view.tobytes(), view.nbytes)
            return
        self.flush()
        while view:
            n = os.write(self._fd, view)
            self.position += n
            view = view[n:]
        self._kick()

    def pad_to(self, position: int) -> None:
        if position > self.position:
            self.write(_zeros(position - self.position))

    def put_small(self, position: int, data) -> None:
        """Zero-pad to `position`, then gather `data` (a small flat byte buffer: its `len` is its
        size), by reference: it must not change before the next `flush`. One call of the
        writer's loop per small payload, where `pad_to` + `write` would be several."""
        if position > self.position:
            self._gather(_zeros(position - self.position), position - self.position)
        self._gather(data, len(data))

    def gather_run(self, entries: list[Entry], sources: list[PayloadSource], start: int,
                   base: int, sums: list) -> int:
        """`put_small` for the run of small payloads from `sources[start]` on, in C: each a
        `BytesSource` whose data fills its entry, at `base` + the entry's offset. Appends their
        checksums to `sums`; returns the index of the first source it did not take."""
        if accelerator is None:
            return start
        while True:
            stop, self.position, added = accelerator.gather_payloads(
                entries, sources, start, base, self.position, BytesSource, _ZEROS_VIEW,
                self._pending, sums, self.IOV_MAX, self.BUFFER_BYTES - self._gathered)
            self._gathered += added
            if stop in (start, len(sources)):
                return stop
            self.flush()  # a full batch (or a source left to Python: the next call says so)
            start = stop

    def _kick(self) -> None:
        """Start the disk on what was written since the last kick, once it is a MiB or more."""
        if self._writeback and self.position - self._kicked >= self.BUFFER_BYTES:
            start_writeback(self._fd, self._kicked, self.position - self._kicked)
            self._kicked = self.position

    def _gather(self, data, nbytes: int) -> None:
        self._pending.append(data)
        self.position += nbytes
        self._gathered += nbytes
        if self._gathered >= self.BUFFER_BYTES or len(self._pending) >= self.IOV_MAX:
            self.flush()


_ZEROS = bytes(1 << 16)
_ZEROS_VIEW = memoryview(_ZEROS)


def _zeros(n: int) -> bytes | memoryview:
    """`n` zero bytes (a view of a shared block where it is big enough)."""
    return _ZEROS_VIEW[:n] if n <= len(_ZEROS) else bytes(n)


class PayloadSource(Protocol):
    """Something that can stream one entry's payload into a `Sink`."""

    def write(self, sink: Sink) -> tuple[str, str] | None:
        """Write exactly the entry's `byte_length` bytes; return its checksum."""


#: Payloads below this size are hashed in one call and gathered by the sink.
SMALL_PAYLOAD = 1 << 16
#: Absolute alignment at which XLA's CPU client uses host memory in place (no copy).
ALIAS_ALIGNMENT = 64


_EVOLVERS: dict[type, tuple] = {}


def _evolve(entry: Entry, **changes) -> Entry:
    """`dataclasses.replace` for the writer's hot loops, several times cheaper.

    A slotted dataclass is copied field by field through its slot descriptors
    (no `__init__`, no introspection per call); anything else goes through
    `dataclasses.replace`.
    """
    cls = type(entry)
    spec = _EVOLVERS.get(cls)
    if spec is None:
        names = tuple(f.name for f in dataclasses.fields(cls))
        slots = tuple(cls.__dict__.get(n) for n in names)
        if not all(isinstance(d, types.MemberDescriptorType) for d in slots):
            slots = None
        spec = _EVOLVERS[cls] = (names, operator.attrgetter(*names), slots)
    names, values, slots = spec
    if slots is None:
        return dataclasses.replace(entry, **changes)
    new = object.__new__(cls)
    for name, slot, value in zip(names, slots, values(entry)):
        slot.__set__(new, changes[name] if name in changes else value)
    return new


def pad_for_aliasing(raw: bytes, header: Header) -> bytes:
    """`raw` with whitespace added inside the header, so more payload bytes start 64-byte aligned.

    The spaces go before the header's closing parenthesis, so the text stays
    the same S-expression and `HLEN` still follows the format's rule
    (`round_up(4 + len(text), alignment) - 4`); the data start stays a
    multiple of the alignment and no offset or checksum position changes (the
    header checksum, which covers the length prefix and the spaces, is redone).
    Only the absolute position moves, and that decides whether JAX on the CPU
    can use a mapped payload in place: it needs 64-byte alignment, one step
    above the default alignment of 32. The padding (0 or 32 bytes at the
    default) is the one that puts the most payload bytes on 64.
    """
    a = header.alignment
    if not header.tensors or a < 16 or a >= ALIAS_ALIGNMENT or ALIAS_ALIGNMENT % a:
        return raw
    best, best_bytes = 0, -1
    for pad in range(0, ALIAS_ALIGNMENT, a):
        start = len(raw) + pad
        aligned = sum(e.byte_length for e in header.tensors
                      if (start + e.offset) % ALIAS_ALIGNMENT == 0)
        if aligned > best_bytes:
            best, best_bytes = pad, aligned
    if not best:
        return raw
    body = raw[4:]
    close = len(body.rstrip(b' ')) - 1  # the header's closing parenthesis
    return seal_header(struct.pack('>I', len(body) + best) + body[:close] + b' ' * best
                       + body[close:])


@dataclasses.dataclass(frozen=True)
class ArraySource:
    """A host numpy array, encoded chunk by chunk (no copy when already stored form).

    `checksum`, when known (see `array_source`; a snapshot hashes its arrays
    as it builds their entries), is returned as it is: the payload is written
    without hashing it again, so a stale one is caught only by verifying.
    """

    array: np.ndarray
    checksum: tuple[str, str] | None = None

    def write(self, sink: Sink) -> tuple[str, str]:
        array = self.array
        if array.nbytes < SMALL_PAYLOAD and payload_mod.is_stored_form(array):
            data = payload_mod.encode_payload(array)  # a view: one hash, one buffered write
            sink.write(data)
            return self.checksum or payload_mod.checksum(data)
        hasher = None if self.checksum else payload_mod.new_hasher()
        for chunk in payload_mod.iter_payload_chunks(array):
            if hasher is not None:
                hasher.update(chunk)
            sink.write(chunk)
        return self.checksum or payload_mod.hasher_checksum(hasher)


class BytesSource(NamedTuple):
    """A small payload already in stored form, with its checksum: one buffered write.

    (A named tuple: one is made per small leaf of every save, and a tuple is
    several times cheaper to make than a frozen dataclass.)
    """

    data: memoryview | np.ndarray  # flat bytes: `payload.flat_bytes` of the array
    checksum: tuple[str, str]

    def write(self, sink: Sink) -> tuple[str, str]:
        sink.write(self.data)
        return self.checksum


def array_source(array: np.ndarray) -> tuple[ArraySource | BytesSource, tuple[str, str]]:
    """The source of a host array's payload, and the checksum its entry can carry from the start.

    A small array in stored form is hashed now, so its entry is written with
    its real checksum and nothing is patched or rebuilt after the payloads
    stream; a larger one (hashed while it streams, in one pass over its
    memory) gets the fixed-width placeholder.

    >>> source, checksum = array_source(np.zeros(4, np.float32))
    >>> checksum == source.checksum != payload_mod.CHECKSUM_PLACEHOLDER
    True
    """
    if array.nbytes < SMALL_PAYLOAD and payload_mod.is_stored_form(array):
        data = payload_mod.flat_bytes(array)  # stored form already: its memory is the payload
        known = payload_mod.checksum(data)
        return BytesSource(data, known), known
    return ArraySource(array), payload_mod.CHECKSUM_PLACEHOLDER


@dataclasses.dataclass(frozen=True)
class CopySource:
    """A payload kept verbatim from an existing file (appending)."""

    fd: int
    offset: int
    length: int
    checksum: tuple[str, str] | None

    def write(self, sink: Sink) -> tuple[str, str]:
        src, remaining = self.offset, self.length
        if self.checksum is None:  # an entry from a writer without checksums: add one
            hasher = payload_mod.new_hasher()
            while remaining:
                chunk = os.pread(self.fd, min(remaining, payload_mod.CHUNK_BYTES), src)
                if not chunk:
                    raise StorageError("source file ended early while copying a kept payload")
                hasher.update(chunk)
                sink.write(chunk)
                src += len(chunk)
                remaining -= len(chunk)
            return payload_mod.hasher_checksum(hasher)
        while remaining:
            fd = sink.fd  # flushes what is gathered: a failure there is the write's, raised
            try:
                n = os.copy_file_range(self.fd, fd, remaining, src, sink.position)
            except (OSError, AttributeError):  # not here, or not between these files: copy
                n = min(remaining, payload_mod.CHUNK_BYTES)
                sink.write(os.pread(self.fd, n, src))
            else:
                if n == 0:
                    raise StorageError("source file ended early while copying a kept payload")
                os.lseek(fd, n, os.SEEK_CUR)  # an explicit offset leaves the position alone
                sink.position += n
            src += n
            remaining -= n
        return self.checksum


@dataclasses.dataclass(frozen=True)
class ReaderSource:
    """A payload kept verbatim from a checkpoint read by range (an object in a store).

    `CopySource` copies between descriptors; an object has none, so its
    payload is fetched whole (concurrent ranged GETs) and streamed to the sink.
    """

    reader: Any
    entry: Entry

    def write(self, sink: Sink) -> tuple[str, str]:
        data = self.reader.payload(self.entry)
        sink.write(data)
        return self.entry.checksum if self.entry.checksum is not None else payload_mod.checksum(data)


def with_placeholders(header: Header) -> Header:
    """`header` with a fixed-width placeholder checksum on every entry that has none
    (`header` itself when every entry has one)."""
    if all(e.checksum is not None for e in header.tensors):
        return header
    return dataclasses.replace(header, tensors=tuple(
        e if e.checksum is not None else _evolve(e, checksum=payload_mod.CHECKSUM_PLACEHOLDER)
        for e in header.tensors))


def write_checkpoint(target: str | os.PathLike, header: Header,
                     sources: Sequence[PayloadSource], *, durable: bool = True,
                     on_payload: Callable[[Entry], None] | None = None) -> Header:
    """Write `header` (already laid out) and the payloads, then publish atomically.

    `sources[i]` streams the payload of `header.tensors[i]`; entries
    without a checksum get the one computed while streaming (entries with one,
    kept from another file, keep theirs). Returns the header as written. On any failure the staging
    file is removed and the target is left as it was. A namespace no reader accepts is refused
    (`InputError`) before any byte is written, as `save` refuses it in its `Context`.
    """
    target = os.fspath(target)
    backend = backend_for(target)  # refuses a URL no backend serves, before any work
    if len(sources) != len(header.tensors):
        raise InputError(f"{len(sources)} payload sources for {len(header.tensors)} entries",
                         file=target, fix="give one source per entry of the header")
    check_namespaces(header.tensors, file=target)
    if getattr(backend, 'streams', False) and all(type(s) in STREAMED for s in sources):
        return stream_arrays(backend, target, header, sources, on_payload)  # an object: no spool file
    draft = with_placeholders(header)
    raw, slots = encode_header_with_slots(draft)
    raw = pad_for_aliasing(raw, draft)
    data_start = len(raw)
    known = draft is header  # every checksum known already (small payloads): the header is final
    with backend.create(target, durable=durable) as staging:
        try:
            sink = Sink(staging.fd, writeback=durable)
            sink.write(seal_header(raw) if known else raw)
            sink.flush()  # the header on its own: payloads gather after it
            sums = _write_payloads(sink, draft.tensors, sources, data_start, target, on_payload)
            changed = [i for i, (e, s) in enumerate(zip(draft.tensors, sums)) if e.checksum != s]
            if changed or not known:
                patched = _patched(raw, draft.tensors, slots, sums, changed, target)
                os.pwrite(staging.fd, seal_header(patched), 0)
        except OSError as e:
            raise storage_error(e, "writing the checkpoint", target) from e
        staging.publish()
    if not changed:
        return header
    tensors = list(header.tensors)
    for i in changed:
        tensors[i] = _evolve(tensors[i], checksum=sums[i])
    return dataclasses.replace(header, tensors=tuple(tensors))


def _patched(raw: bytes, entries: Sequence[Entry], slots: Sequence[int | None],
             sums: Sequence[tuple[str, str] | None], changed: Sequence[int], target: str) -> bytearray:
    """The header text `raw` with the checksums computed while streaming in their slots."""
    patched = bytearray(raw)
    for i in changed:
        e, slot, value = entries[i], slots[i], sums[i]
        digits = value[1].encode('ascii') if value is not None else b''
        if slot is None or value is None or e.checksum is None or len(digits) != len(e.checksum[1]):
            raise StorageError("a payload checksum of unexpected width", file=target, entry=e.name)
        patched[slot:slot + len(digits)] = digits
    return patched


def _write_payloads(sink: Sink, entries: Sequence[Entry], sources: Sequence[PayloadSource],
                    data_start: int, target: str, on_payload: Callable[[Entry], None] | None
                    ) -> list[tuple[str, str] | None]:
    """Stream each entry's payload to its offset (after `data_start`); their checksums."""
    sums: list[tuple[str, str] | None] = []
    entries, sources = list(entries), list(sources)
    i = 0
    while i < len(entries):
        if on_payload is None:  # runs of small payloads gathered in C, where it is built
            i = sink.gather_run(entries, sources, i, data_start, sums)
            if i == len(entries):
                break
        entry, source = entries[i], sources[i]
        i += 1
        if type(source) is BytesSource and len(source.data) == entry.byte_length:
            sink.put_small(data_start + entry.offset, source.data)  # the many-small-leaves path
            sums.append(source.checksum)
        else:
            sink.pad_to(data_start + entry.offset)
            before = sink.position
            sums.append(source.write(sink))
            if sink.position - before != entry.byte_length:
                raise StorageError(f"wrote {sink.position - before} bytes for an entry of "
                                   f"{entry.byte_length}", file=target, entry=entry.name)
        if on_payload is not None:
            on_payload(entry)
    sink.flush()
    return sums


#: The payload sources a streamed upload takes (`stream_arrays`): host arrays and sharded payloads.
STREAMED = (ArraySource, BytesSource, ShardedSource)
Streamed = ArraySource | BytesSource | ShardedSource


def _chunks(source: Streamed):
    """A streamed source's stored bytes, in chunks (a sharded payload is assembled on the host)."""
    if type(source) is ShardedSource:
        return [source.assemble()]
    if type(source) is BytesSource:
        return [source.data]
    return payload_mod.iter_payload_chunks(source.array)


def array_checksum(source: Streamed) -> tuple[str, str]:
    """The payload checksum of a streamed source (its own when known), without writing it anywhere."""
    if getattr(source, 'checksum', None) is not None:
        return source.checksum
    hasher = payload_mod.new_hasher()
    for chunk in _chunks(source):
        hasher.update(chunk)
    return payload_mod.hasher_checksum(hasher)


def stream_arrays(backend: Any, target: str, header: Header, sources: Sequence[Streamed],
                  on_payload: Callable[[Entry], None] | None = None) -> Header:
    """Host arrays to a backend that streams uploads (an object store), with no spool file.

    The payloads are hashed first (far faster than any upload), so the header
    is final before its first byte is sent; then the header and the payloads
    stream into one upload (`backend.stream`), which publishes the object whole
    only once every byte is in, and aborts it if anything fails. A sharded
    payload is assembled on the host twice (to hash it, then to send it), one
    payload at a time.
    """
    final = dataclasses.replace(header, tensors=tuple(
        _evolve(e, checksum=array_checksum(s)) for e, s in zip(header.tensors, sources)))
    raw, _ = encode_header_with_slots(final)
    raw = pad_for_aliasing(raw, final)
    size = len(raw) + max((e.offset + e.byte_length for e in final.tensors), default=0)

    def chunks():
        yield raw
        position = 0
        for entry, source in zip(final.tensors, sources):
            if entry.offset > position:
                yield bytes(entry.offset - position)
            written = 0
            for chunk in _chunks(source):
                written += chunk.nbytes
                yield chunk
            if written != entry.byte_length:
                raise StorageError(f"wrote {written} bytes for an entry of {entry.byte_length}",
                                   file=target, entry=entry.name)
            position = entry.offset + entry.byte_length
            if on_payload is not None:
                on_payload(entry)

    backend.stream(target, chunks(), size)
    return final

