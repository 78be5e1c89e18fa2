"""Where a header's quoted atoms and comments lie, found on its bytes in place.

The scan for crafted repetitions (`jckpt.format.prescan`) and the balance check read a
header's parentheses outside its quoted atoms and comments. A copy of the text with those
blanked cost a byte a character (and a Python string a piece where comments or escapes
made `re.sub` do it); their places alone cost 4 bytes a bound, and the text is read where
it lies (a `memoryview` of the file's bytes). Quotes are paired on the bytes with numpy,
escapes counted; a text with comments, or a backslash before a quote outside any quoted
atom, is read by a regular expression in the tokenizer's order.

>>> text = b'((a "(") ; )\\n (b ")"))'
>>> [int(k) for k in find_blanks(text, np.frombuffer(text, np.uint8), None)]
[4, 6, 9, 12, 17, 19]
"""

from __future__ import annotations

import bisect
import re
from array import array
from collections.abc import Iterator

import numpy as np

#: The header's bytes as the scan reads them: in place, never copied.
Buffer = bytes | bytearray | memoryview
#: Bytes of text looked at at once: a quarter of a MiB, whose parentheses' temporaries (some
#: 30 bytes each) are a few MB at most, whatever the header's size.
CHUNK = 1 << 18


def chunks(codes: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """`(start, view)` of `codes` `CHUNK` bytes at a time."""
    for start in range(0, codes.size, CHUNK):
        yield start, codes[start:start + CHUNK]


#: A comment (group 1), or a quoted atom (its closing quote, group 2, missing at the end of
#: the text), in the tokenizer's order: a quote inside a comment opens nothing.
_BLANK = re.compile(rb'(;[^\n]*)|"[^"\\]*(?:\\.[^"\\]*)*(?:(")|\\?\Z)', re.DOTALL)
#: Most backslashes before a quote that are counted to tell whether it closes an atom (a
#: longer run: the regular expression tells).
_RUN = 64


def find_blanks(body: Buffer, codes: np.ndarray, skip: tuple[int, int] | None,
                open_end: bool = False) -> np.ndarray | None:
    """Where the quoted atoms and comments lie (and the inside of the list `skip` opens and
    closes), as sorted bounds: a parenthesis with an odd number of bounds before it is in
    one. Found on the bytes in place, 4 bytes a bound: no copy of the text. None when a
    quote is left open (the reader reports it), unless `open_end`: it then runs to the end.

    """
    kind = 'i' if codes.size < 1 << 31 else 'q'
    bounds = quotes(codes, kind) if not holds(codes, 59) else None
    if bounds is None:  # comments, or a backslash before a quote outside any quoted atom
        bounds = array(kind)
        for m in _BLANK.finditer(body):
            closed = m.lastindex
            if closed is None and not open_end:
                return None
            bounds.append(m.start())
            bounds.append(m.end() - (closed == 2))
    elif len(bounds) % 2:
        if not open_end:
            return None
        bounds.append(codes.size)
    if skip is not None and skip[1] > skip[0] + 1:
        at = bisect.bisect(bounds, skip[0])
        bounds[at:at] = array(kind, (skip[0], skip[1] - 1))
    return np.frombuffer(bounds, kind) if bounds else np.empty(0, kind)


def quotes(codes: np.ndarray, kind: str) -> array | None:
    """The quotes that open and close quoted atoms, in a text without comments: those after
    an even run of backslashes, paired in order; None when a quote after an odd run lies
    outside every pair (a backslash outside a quoted atom escapes nothing: the regular
    expression tells), or after a run longer than `_RUN`."""
    bounds = array(kind)
    escaped = []
    for start, chunk in chunks(codes):
        at = np.flatnonzero(chunk == 34) + start
        run, before = np.zeros(at.size, np.int32), at - 1
        while (lead := (codes[np.maximum(before, 0)] == 92) & (before >= 0)).any():
            run += lead
            before = np.where(lead, before - 1, -1)
            if run.max() > _RUN:
                return None
        bounds.frombytes(at[run % 2 == 0].astype(kind).tobytes())
        escaped.append(at[run % 2 == 1].astype(kind))  # (as the pairs': not them cast)
    paired = np.frombuffer(bounds, kind)
    for at in escaped:  # inside a pair, as they must be
        if np.any(np.searchsorted(paired, at) % 2 == 0):
            return None
    del paired
    return bounds


def holds(codes: np.ndarray, byte: int) -> bool:
    """Whether `byte` occurs in `codes`, looked for a chunk at a time."""
    return any(np.count_nonzero(chunk == byte) for _, chunk in chunks(codes))


def outside(chunk: np.ndarray, start: int, blanks: np.ndarray) -> np.ndarray | None:
    """The places of the parentheses of `chunk` (of the text from `start`) outside `blanks`;
    None when none of them is in one (then all are)."""
    lo, hi = np.searchsorted(blanks, np.array((start, start + chunk.size), blanks.dtype))
    if hi == lo and lo % 2 == 0:
        return None
    at = np.flatnonzero((chunk | 1) == 41) + start  # 40 and 41, '(' and ')'
    return at[(np.searchsorted(blanks[lo:hi], at.astype(blanks.dtype)) + lo) % 2 == 0]


def holding(codes: np.ndarray, blanks: np.ndarray) -> np.ndarray:
    """The bounds of the spans of `blanks` that hold a parenthesis: most quoted atoms hold
    none, and the passes over the text skip the chunks without one."""
    spans = []
    for start, chunk in chunks(codes):
        lo, hi = np.searchsorted(blanks, np.array((start, start + chunk.size), blanks.dtype))
        if hi > lo or lo % 2:
            at = np.flatnonzero((chunk | 1) == 41) + start
            bound = np.searchsorted(blanks[lo:hi], at.astype(blanks.dtype)) + lo
            spans.append(np.unique(bound[bound % 2 == 1] // 2))
    picked = np.unique(np.concatenate(spans)) if spans else np.empty(0, np.int64)
    return blanks.reshape(-1, 2)[picked].ravel()




__all__ = ['CHUNK', 'Buffer', 'chunks', 'find_blanks', 'holding', 'holds', 'outside', 'quotes']
