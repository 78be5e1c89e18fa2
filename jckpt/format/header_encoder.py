"""The header's encoding to bytes: its S-expression text, length prefix, padding and seal.

`encode_header` writes what `jckpt.format.header.decode_header` reads back
(`docs/format.md`): a 4-byte big-endian length, then the S-expression text
padded with spaces so that the data starts at a multiple of the alignment.
A header of 100,000 entries is written often (twice per save), so the
entries' text is written by the C accelerator (`_canonical.c`, see
`jckpt.format.fastpath`) when it is built. It writes exactly what
`_encode_entry`, the reference, writes, and hands back to it each entry it
does not handle (padding, extra fields, integers beyond 64 bits, values of
unusual types), so the bytes are the same with or without it.

>>> e = Entry(id=0, namespace='jckpt', label=('w',), prec='Single_prec', dims=(2,),
...           offset=0, byte_length=8, path=(('k', 'w'),))
>>> header_text(Header(tensors=(e,)))[:60]
'((version 1)\\n (alignment 32)\\n (tensors\\n  (((id 0) (namespace'
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Sequence

from jckpt.errors import FormatError, InputError
from jckpt.format import fastpath, header_seal
from jckpt.format.entries import INT_KINDS, Entry, Header, KeyPath, round_up
from jckpt.format.sexp import dumps, float_atom, quote

#: What separates two entries in the tensors list, and what opens the list.
_SEPARATOR = '\n   '
_OPEN = ' (tensors\n  ('
_FIELDS = tuple(f.name for f in dataclasses.fields(Entry))

#: `quote` remembered: the same keys (`kernel`, `bias`, `mu`, `layer_0`) recur in thousands of entries.
_quote = functools.lru_cache(maxsize=1 << 16)(quote)


def _encode_path(path: KeyPath) -> str:
    return '(' + ' '.join([f'({k} {v})' if k in INT_KINDS else f'({k} {_quote(v)})'
                           for k, v in path]) + ')'


def _encode_entry(e: Entry) -> tuple[str, int | None]:
    """The entry's text, and where its checksum digits start in it (None if no checksum).

    The reference encoding: the C accelerator writes the same text, and calls this for
    every entry it does not handle itself.
    """
    if e.padding is None:
        padding = 'none'
    else:
        pairs = ' '.join(f'({lo} {hi})' for lo, hi in e.padding.pairs)
        padding = f'(({pairs}) {float_atom(e.padding.value)})'
    dims = ' '.join(map(str, e.dims))
    label = ' '.join(map(_quote, e.label))
    parts = [f'((id {e.id}) (namespace {_quote(e.namespace)}) (label ({label})) '
             f'(prec {e.prec}) (dims ({dims})) (padding {padding}) (offset {e.offset}) '
             f'(byte_length {e.byte_length})']
    if e.path is not None:
        parts.append(f' (path {_encode_path(e.path)})')
    slot = None
    if e.checksum is not None:
        algo = f' (checksum ({quote(e.checksum[0])} '
        slot = sum(map(len, parts)) + len(algo)
        parts.append(f'{algo}{quote(e.checksum[1])}))')
    if e.key_impl is not None:
        parts.append(f' (key_impl {quote(e.key_impl)})')
    if e.slice is not None:
        parts.append(' (slice (' + ' '.join(f'({a} {b})' for a, b in e.slice) + '))')
    if e.global_dims is not None:
        parts.append(' (global_dims (' + ' '.join(map(str, e.global_dims)) + '))')
    for field in e.extra:
        parts.append(' ' + dumps(field))
    parts.append(')')
    return ''.join(parts), slot


def _accelerated(entries: Sequence[Entry], start: int) -> tuple[bytes, list[int | None]] | None:
    """The entries' text (ASCII bytes) and slots from the C accelerator; None without it, or
    when an entry's text is not ASCII (which Python then writes, with its own offsets)."""
    encode = getattr(fastpath.accelerator, 'encode_entries', None)
    return None if encode is None else encode(entries, Entry, _FIELDS, _encode_entry, start)


def encode_entries(entries: Sequence[Entry], start: int = 0, *, accelerate: bool = True
                   ) -> tuple[str, list[int | None]]:
    """The entries' texts, one per line as a header holds them, and where each one's
    checksum digits start (counted from `start`; None for an entry without a checksum).

    `accelerate=False` encodes in Python even when the C accelerator is built (the tests
    compare the two).

    >>> e = Entry(id=3, namespace='n', prec='Byte_prec', dims=(), offset=0, byte_length=1,
    ...           checksum=('xxh3_64', '0' * 16))
    >>> text, slots = encode_entries([e, e], start=10)
    >>> [text[s - 10 - 8:s - 10 + 16] for s in slots]
    ['xxh3_64 0000000000000000', 'xxh3_64 0000000000000000']
    """
    found = _accelerated(entries, start) if accelerate else None
    if found is not None:
        return found[0].decode('ascii'), found[1]
    texts: list[str] = []
    slots: list[int | None] = []
    pos = start
    for e in entries:
        text, slot = _encode_entry(e)
        slots.append(None if slot is None else pos + slot)
        texts.append(text)
        pos += len(text) + len(_SEPARATOR)
    return _SEPARATOR.join(texts), slots


def _head(header: Header) -> str:
    """The header's text up to its first entry (or its whole empty tensors list)."""
    head = f'((version {header.version})\n (alignment {header.alignment})\n'
    return head + (_OPEN if header.tensors else ' (tensors ())')


def _tail(header: Header, sealed: bool) -> str:
    """The header's text after its last entry."""
    lines = ['))' if header.tensors else '']
    if header.writer is not None:
        lines.append(f' (writer {quote(header.writer)})')
    if header.metadata:
        lines.append(' (metadata (' + ' '.join(f'({quote(k)} {quote(v)})'
                                               for k, v in header.metadata) + '))')
    lines.extend(' ' + dumps(field) for field in header.extra
                 if not (field and field[0] == header_seal.HEADER_CHECKSUM_FIELD))
    if sealed:
        lines.append(header_seal.UNSEALED_FIELD)
    return '\n'.join(lines) + ')'


def header_text(header: Header) -> str:
    """The S-expression text of `header`, without length prefix, padding or header checksum."""
    head = _head(header)
    return head + encode_entries(header.tensors, len(head))[0] + _tail(header, False)


def encode_header_with_slots(header: Header, *, header_checksum: bool = True
                             ) -> tuple[bytes, list[int | None]]:
    """`encode_header`, plus the byte offset of each entry's checksum digits.

    A writer that hashes payloads while streaming them writes the header first
    with fixed-width placeholder digits and later patches the real ones in at
    these offsets, instead of encoding the header twice; it then calls
    `seal_header` on the patched bytes. (The text is ASCII: every non-ASCII byte is
    escaped, so character and byte offsets agree.)
    """
    try:
        head_text = _head(header)
        head, tail = head_text.encode('utf-8'), _tail(header, header_checksum).encode('utf-8')
        start = 4 + len(head_text)
        found = _accelerated(header.tensors, start) if header.tensors else (b'', [])
        if found is None:
            text, slots = encode_entries(header.tensors, start, accelerate=False)
            found = text.encode('utf-8'), slots
    except UnicodeEncodeError:  # a lone surrogate: no text holds it, so no header can
        raise _unencodable(header) from None
    body, slots = found
    length = len(head) + len(body) + len(tail)
    size = round_up(4 + length, header.alignment)
    if size - 4 > 0xFFFFFFFF:
        raise FormatError(f"header of {length} bytes does not fit the 32-bit length field",
                          fix="split the checkpoint into several files")
    parts = [struct.pack('>I', size - 4), head, body, tail, b' ' * (size - 4 - length)]
    if header_checksum:  # the seal is the last field: its digits end 3 bytes before the tail's end
        digest = header_seal.unsealed_digest(parts).encode('ascii')
        parts[3] = tail[:-19] + digest + tail[-3:]
    return b''.join(parts), slots


def _unencodable(header: Header) -> InputError:
    """The error naming the first name or metadata text of `header` that is not UTF-8 text
    (a lone surrogate, as `os.fsdecode` makes of a file name's undecodable byte)."""
    def bad(text: object) -> bool:
        try:
            str(text).encode('utf-8')
        except UnicodeEncodeError:
            return True
        return False

    fix = "drop the character, or encode the text (text.encode('utf-8', 'surrogateescape').hex())"
    for e in header.tensors:
        if any(bad(x) for x in (e.namespace, *e.label, *(v for _, v in e.path or ()))):
            shown = '/'.join(str(x).encode('utf-8', 'backslashreplace').decode()
                             for x in (e.namespace, *e.label))
            return InputError("a key of the leaf's path holds a lone surrogate, which no UTF-8 "
                              "text, and so no header, can hold", entry=shown[:200], fix=fix)
    for k, v in header.metadata:
        if bad(k) or bad(v):
            return InputError(f"metadata key {k!r:.60} (or its value) holds a lone surrogate, "
                              "which no UTF-8 text, and so no header, can hold", fix=fix)
    return InputError("the header holds a lone surrogate, which no UTF-8 text can hold", fix=fix)


def encode_header(header: Header, *, header_checksum: bool = True) -> bytes:
    """The file's first bytes: big-endian HLEN, then the space-padded header text.

    The result's length is a multiple of `header.alignment`, so the payloads
    that follow start aligned. The header's last field is its own checksum (see
    `seal_header`); `header_checksum=False` leaves it out, as older files did.
    """
    return encode_header_with_slots(header, header_checksum=header_checksum)[0]


__all__ = ['encode_entries', 'encode_header', 'encode_header_with_slots', 'header_text']
