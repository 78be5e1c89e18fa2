"""The fast decoder of entries laid out exactly as jckpt writes them.

A checkpoint of 100,000 leaves has a header of 100,000 entries; building a
generic S-expression tree for it and validating it field by field would
dominate a load. Entries in jckpt's canonical layout are instead matched in
one step (the pieces of a directory checkpoint, with their `slice` and
`global_dims`, included), by the C accelerator (`_canonical.c`, built with the package when
a compiler is available) or, without it, one regular expression. Anything
else (quoted atoms, padding, unknown fields, an inconsistent length) makes
`canonical_entries` answer `None` and the general reader of
`jckpt.format.header` decides, so every path accepts and produces
exactly the same headers (`tests/format/test_codec.py` checks the three agree).
The same extension encodes entries too (`jckpt.format.header_encoder`); `accelerator`
is None where it is not built.
"""

from __future__ import annotations

import dataclasses
import math
import re
from array import array
from collections.abc import Callable
from typing import Any

from jckpt.errors import FormatError
from jckpt.format import limits, precs
from jckpt.format.entries import INT_KINDS, MAX_INT64, Entry, Header
from jckpt.format.limits import MAX_NDIM, MAX_PATH_LENGTH, check_shape
from jckpt.format.sexp import SPLIT_QUOTED, Sexp, SexpError, Verbatim, unterminated
from jckpt.format.sexp import _unescape as unescape

_A = r"[!$%&'*+,\-./0-9:<=>?@A-Z\[\]^_`a-z{}~]+"
_PAIR = r"\([0-9]{1,19} [0-9]{1,19}\)"
_INTS = r"((?:[0-9]{1,19}(?: [0-9]{1,19})*+)?)"
_P = rf"\((?:k|a) {_A}\)|\((?:ki|i|f) -?[0-9]{{1,19}}\)"
_CANONICAL_ENTRY = re.compile(
    rf"\s*\(\(id ([0-9]{{1,19}})\) \(namespace ([A-Za-z_][A-Za-z0-9_]*)\) "
    rf"\(label \(((?:{_A}(?: {_A})*+)?)\)\) \(prec ([A-Za-z0-9_]+)\) "
    rf"\(dims \(((?:[0-9]{{1,19}}(?: [0-9]{{1,19}})*+)?)\)\) \(padding none\) "
    rf"\(offset ([0-9]{{1,19}})\) "
    rf"\(byte_length ([0-9]{{1,19}})\)"
    rf"(?: \(path \(((?:(?:{_P})(?: (?:{_P})){{0,{MAX_PATH_LENGTH - 1}}}+)?)\)\))?"
    rf"(?: \(checksum \(([A-Za-z0-9_]+) ([0-9a-f]+)\)\))?(?: \(key_impl ([A-Za-z0-9_]+)\))?"
    rf"(?: \(slice \(((?:{_PAIR}(?: {_PAIR})*+)?)\)\) \(global_dims \({_INTS}\)\))?\)", re.ASCII)
# A path of at most MAX_PATH_LENGTH components: a longer one (the general reader refuses it)
# ends the match. Lists are matched possessively: the engine kept a backtracking state an
# item (80 to 600 bytes of memory a byte of a crafted label or path of a million items).
# ASCII only (`\s` is no NBSP): what they match is as many characters as UTF-8 bytes, so the
# C decoder's byte offsets are the text's character positions
_CANONICAL_HEAD = re.compile(r"\(\(version [0-9]+\)\s*(?:\(alignment [0-9]+\)\s*)?\(tensors\s*\(",
                             re.ASCII)
_CANONICAL_TAIL = re.compile(r"\s*\)", re.ASCII)
_COMPONENT = re.compile(rf"\((k|ki|i|a|f) ({_A})\)")
_FIELDS = tuple(f.name for f in dataclasses.fields(Entry))


try:  # the same decoder in C (built with the package when a compiler is available)
    from jckpt.format import _canonical as accelerator
except ImportError:  # pragma: no cover - exercised where no compiler was available
    accelerator = None
_PREC_SIZES = {p: (p, precs.element_size(p)) for p in precs.ALL_PRECS}
_KINDS = ('k', 'ki', 'i', 'a', 'f')


def _within_limits(entries: list[Entry]) -> bool:
    """Whether no entry needs `jckpt.format.limits`' checks (too many dims, an empty shape
    whose other dims are too large for any array, a key path too long): the general reader
    reports those. Empty shapes are checked here, not sent there wholesale: a header of
    many empty arrays took the slow general reader 50 bytes of memory per header byte."""
    return not any(len(e.dims) > MAX_NDIM or (not e.byte_length and e.dims and not _fits(e))
                   or (e.path is not None and len(e.path) > MAX_PATH_LENGTH) for e in entries)


def _fits(e: Entry) -> bool:
    """Whether an empty entry's shape is one numpy can build (its non-zero dims bounded)."""
    try:
        check_shape(e.dims, max(precs.element_size(e.prec), 1))
    except (ValueError, KeyError):
        return False
    return True


def _piece(slc: str, global_dims: str, dims: tuple[int, ...]
           ) -> tuple[tuple[tuple[int, int], ...] | None, tuple[int, ...] | None]:
    """A piece's `(slice, global_dims)` from their digits, or `(None, None)` unless
    `0 <= start <= stop <= global` and `stop - start` is the dim, in every dimension."""
    bounds = list(map(int, slc.replace('(', ' ').replace(')', ' ').split()))
    box = tuple(zip(bounds[0::2], bounds[1::2]))
    whole = tuple(map(int, global_dims.split()))
    if not (len(box) == len(whole) == len(dims) and all(
            a <= b <= g and b - a == d for (a, b), g, d in zip(box, whole, dims))):
        return None, None
    return box, whole


class RepeatedEntry(ValueError):
    """An entry of the tensors list repeats the one before it verbatim: a duplicate
    identity, found before the entries after it are built (`index`: its place)."""

    def __init__(self, index: int):
        super().__init__(f"duplicate entry identity: tensor #{index} repeats the one before it")
        self.index = index


def canonical_entries(text: str, *, accelerate: bool = True) -> tuple[list[Entry], int, int] | None:
    """Entries of a header laid out as jckpt writes it, or None to use the general reader.

    Returns `(entries, list_open, list_close)`: the positions of the
    parentheses around the tensors list, so the rest can be read generally.
    `accelerate=False` uses the regular expression even when the C
    accelerator is built (the tests compare the two).

    Raises `RepeatedEntry` at the first entry whose text is the one before it
    again (every reader refuses it): a crafted header of one entry repeated
    hundreds of thousands of times is refused after two entries, not after all
    of them are built.

    >>> e = ('((id 0) (namespace a) (label ()) (prec Single_prec) (dims ()) (padding none) '
    ...      '(offset 0) (byte_length 4))')
    >>> canonical_entries(f'((version 1) (tensors ({e} {e})))')
    Traceback (most recent call last):
    ...
    jckpt.format.fastpath.RepeatedEntry: duplicate entry identity: tensor #1 repeats the one before it
    """
    head = _CANONICAL_HEAD.match(text)
    if head is None:
        return None
    if accelerate and accelerator is not None:
        found = accelerator.decode_entries(text, head.end(), Entry, _FIELDS, _PREC_SIZES, _KINDS,
                                           MAX_PATH_LENGTH)
        if isinstance(found, int):
            raise RepeatedEntry(found)
        if found is None or not _within_limits(found[0]):
            return None
        return found[0], head.end() - 1, found[1]
    found = _regex_entries(text, head.end())
    return None if found is None else (found[0], head.end() - 1, found[1])


def _regex_entries(text: str, start: int) -> tuple[list[Entry], int] | None:
    """What the C accelerator's `decode_entries` gives, with the regular expression."""
    scanner = _CANONICAL_ENTRY.scanner(text, start)
    entries: list[Entry] = []
    append = entries.append
    new = object.__new__
    setattr_ = object.__setattr__  # Entry is frozen; this bypasses its __setattr__
    element_size = precs.element_size
    prod = math.prod
    int_kinds = INT_KINDS
    findall = _COMPONENT.findall
    pos = start
    last = ''
    while (m := scanner.match()) is not None:
        if (entry := m[0].lstrip(' \t\n\r\f\v')) == last:
            raise RepeatedEntry(len(entries))
        last = entry
        (ident, namespace, label, prec, dims, offset, byte_length, path, algo, digest,
         key_impl, slc, global_dims) = m.groups()
        if prec not in precs.ALL_PRECS:
            return None
        dims = tuple(map(int, dims.split())) if dims else ()
        byte_length, offset = int(byte_length), int(offset)
        if prod(dims) * element_size(prec) != byte_length or \
                byte_length > MAX_INT64 or offset > MAX_INT64:
            return None  # let the general reader report it
        if path is not None:
            path = tuple([(k, int(v)) if k in int_kinds else (k, v) for k, v in findall(path)])
        if global_dims is not None:
            slc, global_dims = _piece(slc, global_dims, dims)
            if slc is None:
                return None  # let the general reader report it
        e = new(Entry)
        for name, value in zip(_FIELDS, (
                int(ident), namespace, prec, dims, offset, byte_length,
                tuple(label.split(' ')) if label else (), None, path,
                (algo, digest) if algo is not None else None, key_impl, slc, global_dims, ())):
            setattr_(e, name, value)
        append(e)
        pos = m.end()
    tail = _CANONICAL_TAIL.match(text, pos)
    if tail is None or text[tail.end() - 1] != ')' or not _within_limits(entries):
        return None
    return entries, tail.end() - 1


# --- the fields around the entries ---------------------------------------------------------------

_BLANKS = r"[ \t\r\n]*"
#: An atom as jckpt writes it: bare (no character the readers treat specially), or quoted.
_ATOM = rf'(?:{_A}|"[^"\\]*(?:\\.[^"\\]*)*")'
#: A header's fields before its tensors list, and after it (`(tensors ...)` closed), laid out
#: as jckpt writes them: no field twice, none unknown, every metadata pair `(KEY VALUE)` of atoms.
_SHELL_HEAD = re.compile(
    rf"\(\(version ([0-9]{{1,19}})\){_BLANKS}(?:\(alignment ([0-9]{{1,19}})\){_BLANKS})?"
    rf"\(tensors{_BLANKS}", re.ASCII)
_SHELL_TAIL = re.compile(
    rf"{_BLANKS}\)(?:{_BLANKS}\(writer ({_ATOM})\))?"
    rf"(?:{_BLANKS}\(metadata \(((?:\({_ATOM} {_ATOM}\)(?: \({_ATOM} {_ATOM}\))*)?)\)\))?"
    rf"(?:{_BLANKS}\(header_checksum \(xxh3_64 ([0-9A-Fa-f]{{16}})\)\))?{_BLANKS}\){_BLANKS}",
    re.ASCII | re.DOTALL)
_SHELL_PAIR = re.compile(rf"\(({_ATOM}) ({_ATOM})\)", re.ASCII | re.DOTALL)


def _atom(text: str) -> str:
    return unescape(text[1:-1]) if text[:1] == '"' else text


def canonical_shell(text: str, cut: tuple[int, int] | None = None) -> Sexp | None:
    """The parsed header of `text`, its tensors list read as `()` (the list `cut` opens and
    closes, as `canonical_entries` finds it; else an empty one), when its other fields are
    laid out as jckpt writes them; None to use the general reader (and its scan for crafted
    repetitions). Matched in place: a header of a few entries and a metadata list of
    tens of MB is not copied to cut its entries out.

    A step's header is a few entries and a metadata list: the general reader's scan and
    parse of those few hundred bytes cost ten times the rest of its decoding. What this
    accepts, the scan passes (no field twice, no pair repeated: a repeat is left to it) and
    `parse` reads as the same tree, so `header_from_sexp` gives the same header or error.

    >>> canonical_shell('((version 1) (tensors ()) (metadata ((a "b c"))))')
    [['version', '1'], ['tensors', []], ['metadata', [['a', 'b c']]]]
    """
    if cut is None:
        head = _SHELL_HEAD.match(text)
        if head is None or not text.startswith('()', head.end()):
            return None
        cut = (head.end(), head.end() + 1)
    else:
        head = _SHELL_HEAD.fullmatch(text, 0, cut[0])
    tail = _SHELL_TAIL.fullmatch(text, cut[1] + 1)
    if head is None or tail is None:
        return None
    version, alignment = head.groups()
    writer, pairs, digest = tail.groups()
    tree: list[Sexp] = [['version', version]]
    if alignment is not None:
        tree.append(['alignment', alignment])
    tree.append(['tensors', []])
    try:
        if writer is not None:
            tree.append(['writer', _atom(writer)])
        if pairs is not None:
            found: list[Sexp] = []
            last = None
            for pair in _SHELL_PAIR.finditer(pairs):
                if pair[0] == last:
                    return None  # a pair repeated verbatim: the scan's to judge
                last = pair[0]
                found.append([_atom(pair[1]), _atom(pair[2])])
            tree.append(['metadata', found])
    except SexpError:
        return None  # a quoted atom the reader refuses: its error
    if digest is not None:
        tree.append(['header_checksum', ['xxh3_64', digest]])
    return tree


# --- the pieces of a directory index, kept as text ---------------------------------------------

#: Blanks between the tokens of a pieces list: jckpt writes one space, a person's editor
#: (or the docs' example, broken for reading) may write any run of these.
_W = r"[ \t\r\n]"
_NUM = r"[0-9]{1,18}+"
_PAIR = rf"\({_W}*+{_NUM}{_W}++{_NUM}{_W}*+\)"
_PIECE = rf"\({_W}*+{_NUM}{_W}*+\({_W}*+(?:{_PAIR}(?:{_W}*+{_PAIR})*+)?{_W}*+\){_W}*+\)"
#: An index's `(pieces (...))` as jckpt writes it, blanks aside (possessive: linear, no
#: backtracking).
_PIECES_FIELD = re.compile(
    rf"\({_W}*+pieces{_W}*+(\({_W}*+(?:{_PIECE}(?:{_W}*+{_PIECE})*+)?{_W}*+\)){_W}*+\)")
#: The start of a `(pieces (...))` field left to the general reader (one that is not
#: kept as text; a kept one reads `(pieces %jckpt-list-N)`).
_LOOSE_FIELD = re.compile(rf"\({_W}*+pieces{_W}*+\(")
#: A quoted atom first in its list, where a field's name stands.
_QUOTED_NAME = re.compile(r'\([ \t\r\n]*+"')
#: The atom that stands for an index's piece list kept as text (`%jckpt-list-N`).
PLACEHOLDER = '%jckpt-list-'


class _Kept:
    """The pieces lists cut out of a text, by placeholder name: where each lies in the text
    (two 8-byte numbers a list, not a string and a dict slot: a crafted index of hundreds
    of thousands of arrays held some 200 bytes a list before its scan began)."""

    def __init__(self, text: str, starts: array, stops: array):
        self._text, self._starts, self._stops = text, starts, stops

    def _number(self, name: object) -> int | None:
        if not (isinstance(name, str) and name.startswith(PLACEHOLDER)):
            return None
        digits = name[len(PLACEHOLDER):]
        if not (digits.isascii() and digits.isdigit() and str(int(digits)) == digits):
            return None
        n = int(digits)
        return n if n < len(self._starts) else None

    def __contains__(self, name: object) -> bool:
        return self._number(name) is not None

    def __getitem__(self, name: str) -> str:
        n = self._number(name)
        if n is None:
            raise KeyError(name)
        return self._text[self._starts[n]:self._stops[n]]

    def __len__(self) -> int:
        return len(self._starts)


def _splice_lists(text: str) -> tuple[str, _Kept] | None:
    """`text` with each canonical pieces list replaced by a placeholder atom, and the lists;
    None when there is none, or comments or escapes make the text not plain enough. Read
    in place and written a batch of lists at a time: no copy of the text but the result."""
    if PLACEHOLDER in text or 'pieces' not in text:
        return None
    quoted = [m.span() for m in SPLIT_QUOTED.finditer(text)]
    if quoted and unterminated(['', text[slice(*quoted[-1])], '']):
        return None
    spans = [(0, 0), *quoted, (len(text), len(text))]
    structural = [(spans[k][1], spans[k + 1][0]) for k in range(len(spans) - 1)]
    if any(text.find(c, a, b) >= 0 for a, b in structural for c in ';#\\'):
        return None
    starts, stops = array('q'), array('q')
    out: list[str] = []
    batch: list[str] = []
    at = 0
    for a, b in structural:
        for m in _PIECES_FIELD.finditer(text, a, b):
            batch += (text[at:m.start()], f"(pieces {PLACEHOLDER}{len(starts)})")
            starts.append(m.start(1))
            stops.append(m.end(1))
            at = m.end()
            if len(batch) >= _BATCH:
                out.append(''.join(batch))
                batch.clear()
    if not starts:
        return None
    out.append(''.join(batch) + text[at:])
    return ''.join(out), _Kept(text, starts, stops)


#: Pieces of the spliced text joined at once (a few MB of small strings at most).
_BATCH = 1 << 16


def _quoted_pieces(parts: list[str], k: int) -> bool:
    """Whether quoted atom `parts[k]` is a `pieces` field's name: `("pieces" (...`. Where it
    stands is looked at first: a quoted value repeated 400,000 times (metadata) was unescaped
    each time before being found to be no field's name, 2 s for a 14 MB header."""
    if not (parts[k - 1].rstrip(' \t\r\n').endswith('(') and k + 1 < len(parts)
            and parts[k + 1].lstrip(' \t\r\n').startswith('(')):
        return False
    body = parts[k][1:-1]
    try:
        return (unescape(body) if '\\' in body else body) == 'pieces'
    except ValueError:
        return False


def loose_piece_lists(text: str) -> int:
    """How many lists the general reader would build for the pieces of a directory index in
    `text` that are not kept as text: every list from the first such `(pieces (...))`
    field on (its name quoted or escaped too; lists in comments counted as well), 0 when
    there is none. What `with_canonical_lists` bounds before it parses."""
    if 'pieces' not in text and '\\' not in text:  # no field of that name, even escaped
        return 0
    if _LOOSE_FIELD.search(text) is None and _QUOTED_NAME.search(text) is None:
        return 0  # each of the loop's finds below is one of these in the whole text
    parts = SPLIT_QUOTED.split(text)
    for k, part in enumerate(parts):
        m = _LOOSE_FIELD.search(part) if k % 2 == 0 else None
        if m is not None:
            return part.count('(', m.start()) + sum(p.count('(') for p in parts[k + 2::2])
        if k % 2 and _quoted_pieces(parts, k):
            return sum(p.count('(') for p in parts[k + 1::2])
    return 0


def _check_loose(text: str, file: str | None) -> None:
    lists = loose_piece_lists(text)
    if lists > limits.MAX_LOOSE_INDEX_LISTS:
        raise FormatError(
            f"directory index whose pieces are not laid out as jckpt writes them holds "
            f"{lists} lists from its first such pieces field on, more than the general reader "
            f"takes ({limits.MAX_LOOSE_INDEX_LISTS})", file=file,
            fix="the index was not written by jckpt (or was edited): write the pieces as "
                "((FILE ((START STOP) ...)) ...) with plain decimal numbers and no comments "
                "or quotes, or restore the directory from a good copy")


def _restored(x: Any, lists: _Kept, found: list[str]) -> Any:
    """`x` (an extra field) with each placeholder atom replaced by its list, as `Verbatim`."""
    if isinstance(x, tuple):
        return tuple([_restored(v, lists, found) for v in x])
    if isinstance(x, str) and x in lists:
        found.append(x)
        return Verbatim(lists[x])
    return x


def with_canonical_lists(text: str, decode: Callable[[str], Header], file: str | None = None
                         ) -> Header:
    """`decode(text)`, but with a directory index's pieces lists kept as text.

    An index of a million pieces would otherwise be parsed into millions of
    small lists; each canonical `(pieces (...))` is instead cut out before
    parsing and put back, in the header's extra fields, as one `Verbatim`
    atom that `jckpt.format.index` reads with numpy. Whenever that does
    not give exactly what decoding the whole text gives (a placeholder landing
    outside the extra fields, a refusal), the whole text is decoded instead.
    Pieces lists left to the general reader are bounded first (`loose_piece_lists`,
    `FormatError` naming `file` beyond `limits.MAX_LOOSE_INDEX_LISTS`): it builds
    about 700 bytes per piece, and a crafted index of millions cost seconds and gigabytes.
    """
    spliced = _splice_lists(text)
    _check_loose(text if spliced is None else spliced[0], file)
    if spliced is not None:
        try:
            header = decode(spliced[0])
        except FormatError:
            header = None
        if header is not None:
            found: list[str] = []
            extra = _restored(header.extra, spliced[1], found)
            if len(found) == len(spliced[1]):
                return dataclasses.replace(header, extra=extra)
        _check_loose(text, file)  # every list to the general reader now
    return decode(text)


__all__ = ['PLACEHOLDER', 'RepeatedEntry', 'accelerator', 'canonical_entries', 'canonical_shell',
           'loose_piece_lists', 'with_canonical_lists']
