"""The streaming writer: header, then payloads one after another, never the whole file.

The header is written first with fixed-width placeholder checksums; each
payload is hashed while it streams to disk; the header is then rewritten in
place with the real checksums (same length, so no payload moves). The file
is published atomically by :class:`~jckpt.storage.publish.StagingFile`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from jckpt.errors import StorageError
from jckpt.format import payload as payload_mod
from jckpt.format.header import Entry, Header, encode_header_with_slots
from jckpt.storage.publish import StagingFile, storage_error


class Sink:
    """Sequential writes to a file descriptor, tracking the position."""

    def __init__(self, fd: int, position: int = 0) -> None:
        self.fd = fd
        self.position = position

    def write(self, data) -> None:
        view = memoryview(data).cast('B')
        while view:
            n = os.write(self.fd, view)
            self.position += n
            view = view[n:]

    def pad_to(self, position: int) -> None:
        if position > self.position:
            self.write(bytes(position - self.position))


class PayloadSource(Protocol):
    """Something that can stream one entry's payload into a :class:`Sink`."""

    def write(self, sink: Sink) -> tuple[str, str] | None:
        """Write exactly the entry's ``byte_length`` bytes; return its checksum."""


@dataclasses.dataclass(frozen=True)
class ArraySource:
    """A host numpy array, encoded chunk by chunk (no copy when already stored form)."""

    array: np.ndarray

    def write(self, sink: Sink) -> tuple[str, str]:
        hasher = payload_mod.new_hasher()
        for chunk in payload_mod.iter_payload_chunks(self.array):
            hasher.update(chunk)
            sink.write(chunk)
        return payload_mod.hasher_checksum(hasher)


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
            try:
                n = os.copy_file_range(self.fd, sink.fd, remaining, src, sink.position)
                # copy_file_range with an explicit offset leaves the file position alone
                os.lseek(sink.fd, n, os.SEEK_CUR)
            except (OSError, AttributeError):
                n = min(remaining, payload_mod.CHUNK_BYTES)
                sink.write(os.pread(self.fd, n, src))
                src += n
                remaining -= n
                continue
            if n == 0:
                raise StorageError("source file ended early while copying a kept payload")
            sink.position += n
            src += n
            remaining -= n
        return self.checksum


def with_placeholders(header: Header) -> Header:
    """``header`` with a fixed-width placeholder checksum on every entry that has none."""
    return dataclasses.replace(header, tensors=tuple(
        e if e.checksum is not None else dataclasses.replace(
            e, checksum=payload_mod.CHECKSUM_PLACEHOLDER) for e in header.tensors))


def write_checkpoint(target: str | os.PathLike, header: Header,
                     sources: Sequence[PayloadSource], *, durable: bool = True,
                     on_payload: Callable[[Entry], None] | None = None) -> Header:
    """Write ``header`` (already laid out) and the payloads, then publish atomically.

    ``sources[i]`` streams the payload of ``header.tensors[i]``; entries
    without a checksum get the one computed while streaming (entries with one,
    kept from another file, keep theirs). Returns the header as written. On any failure the staging
    file is removed and the target is left as it was.
    """
    target = os.fspath(target)
    draft = with_placeholders(header)
    raw, slots = encode_header_with_slots(draft)
    data_start = len(raw)
    with StagingFile(target, durable=durable) as staging:
        try:
            sink = Sink(staging.fd)
            sink.write(raw)
            sums = []
            for entry, source in zip(draft.tensors, sources):
                sink.pad_to(data_start + entry.offset)
                before = sink.position
                sums.append(source.write(sink))
                if sink.position - before != entry.byte_length:
                    raise StorageError(f"wrote {sink.position - before} bytes for an entry of "
                                       f"{entry.byte_length}", file=target, entry=entry.name)
                if on_payload is not None:
                    on_payload(entry)
            final = dataclasses.replace(header, tensors=tuple(
                dataclasses.replace(e, checksum=s) for e, s in zip(header.tensors, sums)))
            patched = bytearray(raw)
            for e, slot, value in zip(draft.tensors, slots, sums):
                digits = value[1].encode('ascii') if value is not None else b''
                if e.checksum == value:
                    continue
                if slot is None or value is None or len(digits) != len(e.checksum[1]):
                    raise StorageError("a payload checksum of unexpected width", file=target,
                                       entry=e.name)
                patched[slot:slot + len(digits)] = digits
            os.pwrite(staging.fd, patched, 0)
        except OSError as e:
            raise storage_error(e, "writing the checkpoint", target) from e
        staging.publish()
    return final
