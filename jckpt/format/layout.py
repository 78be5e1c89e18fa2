"""Payload offsets: planning them for a writer, checking them for a reader.

>>> plan_layout([12, 5, 4], 32)
(0, 32, 64)
>>> plan_layout([12, 5, 4], 1)
(0, 12, 17)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from jckpt.errors import FormatError
from jckpt.format import precs
from jckpt.format.header import Entry, Header, round_up
from jckpt.format.limits import PADDED_ALLOCATION_FACTOR
from jckpt.version import __version__

#: The `writer` field of every header this version of jckpt writes.
WRITER = f"jckpt {__version__}"


def plan_layout(byte_lengths: Sequence[int], alignment: int = 32) -> tuple[int, ...]:
    """Offsets (relative to the data start) for payloads of these lengths, in order.

    Each payload starts at the cursor rounded up to `alignment`; nothing
    follows the last one.
    """
    offsets = []
    cursor = 0
    for n in byte_lengths:
        offset = round_up(cursor, alignment)
        offsets.append(offset)
        cursor = offset + n
    return tuple(offsets)


def lay_out(header: Header) -> Header:
    """`header` with every entry's offset replaced by `plan_layout`'s."""
    offsets = plan_layout([e.byte_length for e in header.tensors], header.alignment)
    return dataclasses.replace(header, tensors=tuple(
        e if e.offset == o else dataclasses.replace(e, offset=o)
        for e, o in zip(header.tensors, offsets)))


def written_header(entries: Sequence[Entry], alignment: int, *,
                   metadata: Sequence[tuple[str, str]] = (), extra: tuple = ()) -> Header:
    """The laid-out header jckpt writes for `entries`, in payload order: every writer
    (save, directory pieces, staging, rewrites, adapters) builds its header here.

    >>> import numpy as np
    >>> from jckpt.format.entries import entry_for
    >>> e = entry_for('jckpt', (('k', 'w'),), np.float32, (3,), id=0)
    >>> h = written_header([e, e], 64, metadata=[('step', '7')])
    >>> [t.offset for t in h.tensors], h.writer == WRITER, h.metadata_dict()
    ([0, 64], True, {'step': '7'})
    """
    return lay_out(Header(tensors=tuple(entries), alignment=alignment, writer=WRITER,
                          metadata=tuple(metadata), extra=extra))


def data_size(header: Header) -> int:
    """Bytes of DATA the header describes (end of the last payload)."""
    return max((e.offset + e.byte_length for e in header.tensors), default=0)


def _truncation(header: Header, data_start: int, size: int,
                file: str | None) -> FormatError | None:
    """The error for a file shorter than its header says (None when every payload fits): the
    first entry past the end in file order (a cut payload before an empty one at the same
    offset), how many entries lie past it, and the size the file should have.

    >>> from jckpt.format.entries import entry_for
    >>> import numpy as np
    >>> h = written_header([entry_for('jckpt', (('k', k),), np.float32, (2,), id=i)
    ...                     for i, k in enumerate('abc')], 8)
    >>> print(_truncation(h, 100, 110, 'm.jckpt'))  # doctest: +NORMALIZE_WHITESPACE
    m.jckpt: entry jckpt/b: the file is truncated: it is 110 bytes where its header describes
    124; 2 of 3 entries lie past its end, from this one (payload [8, 16) extends past the end
    of the file (10 data bytes)) (fix: the file was cut short (an interrupted copy, download or
    write): restore it from another copy)
    """
    available = size - data_start
    cut = sorted((e for e in header.tensors if e.offset + e.byte_length > available),
                 key=lambda e: (e.offset, -e.byte_length))
    if not cut:
        return None
    first, n = cut[0], len(header.tensors)
    return FormatError(
        f"the file is truncated: it is {size} bytes where its header describes "
        f"{data_start + data_size(header)}; {len(cut)} of {n} entr{'y' if n == 1 else 'ies'} "
        f"lie{'s' if len(cut) == 1 else ''} past its end, from this one (payload "
        f"[{first.offset}, {first.offset + first.byte_length}) extends past the end of the file "
        f"({available} data bytes))", file=file, entry=first.name,
        fix="the file was cut short (an interrupted copy, download or write): restore it from "
            "another copy")


def check_extents(header: Header, data_start: int, size: int, file: str | None = None) -> None:
    """Refuse payloads that extend past the end of the file or overlap each other, and padded
    entries that would rebuild more than `PADDED_ALLOCATION_FACTOR`
    times the file's size in all."""
    truncation = _truncation(header, data_start, size, file)
    if truncation is not None:
        raise truncation
    spans = []
    padded = 0
    for e in header.tensors:
        if e.padding is not None:
            padded += math.prod(e.dims) * precs.element_size(e.prec)
        if e.byte_length:
            spans.append((e.offset, e.offset + e.byte_length, e))
    spans.sort(key=lambda s: s[0])
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise FormatError(f"payload overlaps the payload of {a.name}", file=file,
                              entry=b.name, fix="the file is damaged; re-save it")
    if padded > PADDED_ALLOCATION_FACTOR * size + (1 << 20):
        raise FormatError(f"padded entries would rebuild {padded} bytes in all, far more than the "
                          f"file holds (over {PADDED_ALLOCATION_FACTOR} times its size)", file=file,
                          fix="the header's dims or padding are damaged")
