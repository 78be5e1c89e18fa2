"""The header checksum: a hash of a file's header bytes, written as the header's last field.

A bit flip in the header that still parses (a renamed entry, a changed
offset) is otherwise invisible: payload checksums cover only the payloads.
`docs/format.md` ("The header checksum") defines the field:
`(header_checksum (xxh3_64 HEX))`, the last top-level field, whose 16 digits
are the xxh3_64 hash of bytes 0 to 4 + HLEN (length prefix and padding
included) with those digits read as `0`s. A writer therefore patches the
digits in place once everything else in the header is final, and readers
that do not know the field (older jckpt, OCANNL) ignore it.

`jckpt.format.header` writes the field and checks it on every decode; a
header without it (an older file) decodes as before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import xxhash

from jckpt.errors import FormatError
from jckpt.format.sexp import Sexp

#: The top-level field that holds the header's own checksum; always the header's last field.
HEADER_CHECKSUM_FIELD = 'header_checksum'
#: The hash of the header checksum, and how many hex digits it is written with.
HEADER_CHECKSUM_ALGORITHM = 'xxh3_64'
UNSEALED = '0' * 16
#: The field as a writer appends it (with a leading space), before its digits are filled in.
UNSEALED_FIELD = f' ({HEADER_CHECKSUM_FIELD} ({HEADER_CHECKSUM_ALGORITHM} {UNSEALED}))'
#: How far before the end of the header text the header checksum field is looked for.
_SEAL_WINDOW = 4096
_SEAL_TAIL = re.compile(rb'\(\s*header_checksum\s+\(\s*xxh3_64\s+([0-9A-Fa-f]{16})\s*\)\s*\)'
                        rb'\s*\)\s*\Z')


def _seal_slot(raw: bytes | bytearray | memoryview) -> int | None:
    """Where the 16 digits of the header checksum start in `raw` (None when it has none).

    `raw` is the file's first `4 + HLEN` bytes; the field is the last of the header.
    """
    end = len(raw)
    while end > 4:  # past the padding, which can be longer than the window (a large alignment)
        blanks = bytes(raw[max(4, end - _SEAL_WINDOW):end])
        kept = len(blanks.rstrip())
        end -= len(blanks) - kept
        if kept:
            break
    start = max(4, end - _SEAL_WINDOW)
    m = _SEAL_TAIL.search(bytes(raw[start:end]))
    return None if m is None else start + m.start(1)


def is_sealed(raw: bytes | bytearray | memoryview) -> bool:
    """Whether the header `raw` (the file's first `4 + HLEN` bytes) ends with a checksum.

    A header without one (an older or OCANNL-written file) is read as it is, unchecked.
    """
    return _seal_slot(raw) is not None


def _seal_digest(raw: bytes | bytearray | memoryview, slot: int) -> str:
    """The header checksum of `raw`: its hash with the digits at `slot` read as zeros."""
    view = memoryview(raw)
    hasher = xxhash.xxh3_64(view[:slot])
    hasher.update(UNSEALED.encode('ascii'))
    hasher.update(view[slot + 16:])
    return f'{hasher.intdigest():016x}'


def unsealed_digest(parts: Iterable[bytes]) -> str:
    """The header checksum of the header `b''.join(parts)`, whose digits are still `UNSEALED`.

    What `seal_header` writes, for a writer that has its header in pieces and its
    digits in a known place: it hashes the pieces without joining them first.
    """
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return f'{hasher.intdigest():016x}'


def seal_header(raw: bytes | bytearray) -> bytes:
    """`raw` (a file's first `4 + HLEN` bytes) with its header checksum digits filled in.

    The checksum is the xxh3_64 hash of those bytes, length prefix and padding
    included, with its own 16 digits read as `0`s, so it can be patched in
    place once everything else in the header is final (docs/format.md, "The
    header checksum"). A header without the field is returned unchanged.

    >>> text = b'((version 1) (tensors ()) (header_checksum (xxh3_64 0000000000000000)))'
    >>> raw = seal_header(len(text).to_bytes(4, 'big') + text)
    >>> raw[-19:-3], check_header_checksum(raw)
    (b'7981459e84c08018', True)
    """
    slot = _seal_slot(raw)
    if slot is None:
        return bytes(raw)
    view = memoryview(raw)  # one copy in all (a header can be tens of megabytes)
    return b''.join((view[:slot], _seal_digest(view, slot).encode('ascii'), view[slot + 16:]))


def check_header_checksum(raw: bytes | bytearray | memoryview, tree: Sexp | None = None,
                          file: str | None = None) -> bool:
    """Whether `raw` carries a header checksum; raises `FormatError` when it is wrong.

    `tree` is the parsed header, when the caller has it: a `header_checksum`
    field that is not the header's last, not `(xxh3_64 HEX)` with 16 digits,
    or not where the bytes end is refused too.
    """
    if tree is not None:
        if not isinstance(tree, list) or not any(
                isinstance(f, list) and f[:1] == [HEADER_CHECKSUM_FIELD] for f in tree):
            return False  # no checksum (an older file), or no header to speak of
    slot = _seal_slot(raw)
    last = tree[-1] if tree else None
    if slot is None or (tree is not None and not (
            isinstance(last, list) and last[:1] == [HEADER_CHECKSUM_FIELD])):
        if tree is None:
            return False
        raise FormatError("header_checksum must be the header's last field, "
                          f"({HEADER_CHECKSUM_FIELD} ({HEADER_CHECKSUM_ALGORITHM} HEX)) with 16 hex "
                          "digits", file=file,
                          fix="the file is damaged or was not written by a compatible writer")
    written = bytes(raw[slot:slot + 16]).decode('ascii').lower()
    actual = _seal_digest(raw, slot)
    if written != actual:
        raise FormatError(
            f"header checksum mismatch: the header says {written}, its bytes hash to {actual}",
            file=file, fix="the header was damaged after it was written (a bit flipped on disk or "
            "in transit): restore the file from a copy or use an earlier checkpoint")
    return True


__all__ = ['HEADER_CHECKSUM_ALGORITHM', 'HEADER_CHECKSUM_FIELD', 'UNSEALED', 'UNSEALED_FIELD',
           'check_header_checksum', 'is_sealed', 'seal_header', 'unsealed_digest']
