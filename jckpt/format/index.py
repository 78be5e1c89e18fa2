"""The directory index: which piece of which array lies in which piece file.

A directory checkpoint (`docs/format.md`, "Directory checkpoints") holds one
piece file per process and `index.jckpt`: a header with no tensors and one
`sharded` field naming the piece files and, for every array, its global
entry and the boxes of its pieces. `index_header` builds that header and
`parse_index` reads it back, refusing (with
`FormatError`) anything malformed, including pieces
that do not tile their array exactly. Pure functions, like the rest of the codec.

>>> e = Entry(id=0, namespace='jckpt', prec='Single_prec', dims=(4,), offset=0,
...           byte_length=16, label=('w',), path=(('k', 'w'),))
>>> arrays = [IndexedArray(e, ((0, ((0, 2),)), (1, ((2, 4),))))]
>>> h = index_header(['process_00000.jckpt', 'process_00001.jckpt'], 2, arrays, 32, {},
...                  writer='jckpt')
>>> parse_index(h, 'index.jckpt') == (['process_00000.jckpt', 'process_00001.jckpt'], arrays)
True
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jckpt.errors import FormatError
from jckpt.format import limits, precs
from jckpt.format._gc import paused
from jckpt.format.boxes import Box, check_tiling
from jckpt.format.header import (
    Entry,
    Header,
    KeyPath,
    _decode_path,
    _fail,
    _fields,
    _int,
    _int_list,
    path_name,
)
from jckpt.format.names import LAYOUT_VERSION, PIECE_RE
from jckpt.format.sexp import SexpError, Verbatim, parse

#: Global arrays above this many elements are refused as a damaged index.
_MAX_ELEMENTS = 2**62


@dataclasses.dataclass(frozen=True)
class IndexedArray:
    """One array of a directory checkpoint: its global entry and where its pieces are.

    `pieces` are `(file number, box)` pairs: the number indexes the
    index's list of piece files, and the boxes tile `entry.dims` exactly.
    """

    entry: Entry
    pieces: tuple[tuple[int, Box], ...]

    @functools.cached_property
    def bounds(self) -> np.ndarray:
        """The pieces' boxes as one `(pieces, ndim, 2)` int64 array, for searching them all
        at once (which pieces a box needs, whether they tile the array)."""
        boxes = [box for _, box in self.pieces]
        ndim = len(self.entry.dims)
        pairs = list(itertools.chain.from_iterable(boxes))
        if set(map(len, boxes)) - {ndim} or set(map(len, pairs)) - {2}:
            raise ValueError(f"pieces of {self.entry.name} are not boxes of {ndim} dimensions")
        flat = np.fromiter(itertools.chain.from_iterable(pairs), dtype=np.int64, count=2 * len(pairs))
        return flat.reshape(len(boxes), ndim, 2)


def global_entry(e: Entry) -> Entry:
    """The whole array a piece entry `e` belongs to (dims = its `global_dims`, no slice)."""
    dims = tuple(e.global_dims or ())
    return Entry(id=e.id, namespace=e.namespace, prec=e.prec, dims=dims, offset=0,
                 byte_length=math.prod(dims) * precs.element_size(e.prec), label=e.label,
                 path=e.path, key_impl=e.key_impl)


# --- encoding ---------------------------------------------------------------------------------

def _array_fields(array: IndexedArray) -> tuple[Any, ...]:
    """An array's fields, frozen as a header holds them (a million pieces: built directly)."""
    e = array.entry
    fields: list[Any] = [['id', e.id], ['namespace', e.namespace], ['label', list(e.label)],
                         ['prec', e.prec], ['global_dims', list(e.dims)]]
    if e.path is not None:
        fields.append(['path', [[k, v] for k, v in e.path]])
    if e.key_impl is not None:
        fields.append(['key_impl', e.key_impl])
    return (*_frozen(fields), ('pieces', _pieces_text(array)))


def _pieces_text(array: IndexedArray) -> Verbatim:
    """`((FILE ((START STOP) ...)) ...)`, formatted at once: a million pieces in a second."""
    n, ndim = len(array.pieces), len(array.entry.dims)
    try:
        files = np.array([fi for fi, _ in array.pieces], dtype=np.int64).reshape(n, 1)
        table = np.concatenate([files, array.bounds.reshape(n, 2 * ndim)], axis=1)
    except (ValueError, OverflowError):  # boxes of other ranks, or numbers beyond 64 bits
        return Verbatim('(' + ' '.join([f"({fi} ({' '.join([f'({a} {b})' for a, b in box])}))"
                                        for fi, box in array.pieces]) + ')')
    piece = '(%d (' + ' '.join(['(%d %d)'] * ndim) + '))'
    return Verbatim('(' + ' '.join([piece] * n) % tuple(table.ravel().tolist()) + ')')


@paused  # a million pieces are millions of tuples, and no cycles among them
def index_header(files: Sequence[str], process_count: int, arrays: Sequence[IndexedArray],
                 alignment: int, metadata: Mapping[str, str], *, writer: str) -> Header:
    """The index as a header with no tensors and a `sharded` field (see docs/format.md)."""
    top = _frozen([['layout', LAYOUT_VERSION], ['process_count', process_count],
                   ['files', list(files)]])
    sharded = ('sharded', (*top, ('arrays', tuple([_array_fields(a) for a in arrays]))))
    return Header(tensors=(), alignment=alignment, writer=writer,
                  metadata=tuple(metadata.items()), extra=(sharded,))


def _frozen(x: Any) -> Any:
    """`x` as a header's extra field holds it: tuples of atoms (integers written out)."""
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(v) for v in x)
    return str(x) if isinstance(x, int) else x


# --- decoding ---------------------------------------------------------------------------------

def _thawed(x: Any) -> Any:
    """An extra field (tuples) as the header's field readers take it (lists)."""
    return [_thawed(v) for v in x] if isinstance(x, tuple) else x


def _count(atom: Any, what: str, file: str, entry: str | None = None) -> int:
    """A non-negative integer atom."""
    n = _int(atom, what, file, entry)
    if n < 0:
        raise _fail(f"{what} must be a non-negative integer, got {n}", file, entry)
    return n


def _sharded_fields(header: Header, file: str) -> dict[str, Any]:
    """The fields of the index's `sharded` field, its layout version checked."""
    field = next((f for f in header.extra if isinstance(f, tuple) and f and f[0] == 'sharded'),
                 None)
    if field is None or len(field) != 2:
        raise _fail("index has no sharded field", file)
    top = _fields(_thawed(field[1]), 'sharded', file)
    layout = _count(top.get('layout'), 'layout', file)
    if layout != LAYOUT_VERSION:
        raise FormatError(f"unsupported directory layout {layout}", file=file,
                          fix="read it with the jckpt release that wrote it")
    return top


def _piece_files(top: dict[str, Any], file: str) -> list[str]:
    files = top.get('files')
    if not (isinstance(files, list) and all(isinstance(n, str) and PIECE_RE.match(n)
                                            for n in files)):
        raise _fail("files must be a list of process_NNNNN[.K][.TAG].jckpt names", file)
    return files


def _check_process_count(top: dict[str, Any], files: list[str], file: str) -> None:
    """Refuse a `process_count` the files disagree with: each of processes 0 to N-1 writes
    its `process_NNNNN[.TAG].jckpt` (empty or not), no other process writes any, and no
    file is named twice (two file numbers would then be one file)."""
    count = _count(top.get('process_count'), 'process_count', file)
    found = [PIECE_RE.match(n) for n in files]
    first = {int(m.group(1)) for m in found if m is not None and m.group(2) is None}
    if len(set(files)) != len(files):
        raise _fail("files names a piece file twice", file)
    beyond = [n for n, m in zip(files, found) if m is not None and int(m.group(1)) >= count]
    if count < 1 or beyond or len(first) != count:
        why = (f"{beyond[0]} is of a process beyond them" if beyond else
               f"files hold the first piece file of {len(first)} processes")
        raise FormatError(f"process_count {count} disagrees with files: {why}", file=file,
                          fix="the directory is damaged or was assembled from several saves; "
                              "restore it from a good copy")


def index_files(header: Header, file: str) -> list[str]:
    """Only the piece file names of an index header (its arrays are not read); raises `FormatError`.

    What a writer replacing a directory checkpoint in an object store needs
    to know of the one it replaces: which pieces to delete once its own index is in.
    """
    return list(_piece_files(_sharded_fields(header, file), file))


@functools.lru_cache(maxsize=16)
def _piece_list(ndim: int) -> re.Pattern[str]:
    """A pieces list of `ndim` dimensions as jckpt writes it, numbers of at most 18 digits (so
    that they fit 64 bits): `((0 ((0 2) (0 4))) (1 ((2 4) (0 4))))`, with any blanks
    (spaces, tabs, line breaks) where jckpt writes one space or none."""
    w, num = r"[ \t\r\n]", "[0-9]{1,18}+"
    pair = rf"\({w}*+{num}{w}++{num}{w}*+\)"
    pairs = '' if ndim == 0 else rf"{pair}(?:{w}*+{pair}){{{ndim - 1}}}"
    piece = rf"\({w}*+{num}{w}*+\({w}*+{pairs}{w}*+\){w}*+\)"
    return re.compile(rf"\({w}*+(?:{piece}(?:{w}*+{piece})*+)?{w}*+\)")  # possessive: linear


def _check_one_per_file(numbers: np.ndarray, file: str, where: str) -> None:
    """Refuse two pieces of one array in one file (a file holds an identity once, so the
    reader could find only one of them): also what bounds an array's pieces by the files."""
    ordered = np.sort(numbers)
    twice = ordered[1:][ordered[1:] == ordered[:-1]]
    if twice.size:
        raise _fail(f"two pieces are in piece file number {int(twice[0])}: a piece file holds "
                    "one piece of an array at most", file, where)


def _pieces_at_once(text: str, ndim: int, file_count: int, file: str, where: str
                    ) -> tuple[tuple[tuple[int, Box], ...], np.ndarray] | None:
    """`_pieces` of a well-formed list kept as text, read with one regular expression and
    numpy; None for anything else (reading it piece by piece then says what is wrong)."""
    if not _piece_list(ndim).fullmatch(text):
        return None
    blank = text.translate(_PARENTHESES)
    numbers = np.fromstring(blank, dtype=np.int64, sep=' ') \
        if not blank.isspace() else np.empty(0, np.int64)  # (numpy reads one number from blanks)
    table = numbers.reshape(-1, 1 + 2 * ndim)
    if len(table) and table[:, 0].max() >= file_count:
        return None
    _check_one_per_file(table[:, 0], file, where)  # before a tuple is built: the cost of
    return _as_pieces(table, ndim), table[:, 1:].reshape(len(table), ndim, 2)


def _as_pieces(table: np.ndarray, ndim: int) -> tuple[tuple[int, Box], ...]:
    """Rows `FILE START STOP ...` as `(file, ((start, stop), ...))` tuples, built by zips."""
    columns = table.T.tolist()
    pairs = [zip(columns[1 + 2 * k], columns[2 + 2 * k]) for k in range(ndim)]
    return tuple(zip(columns[0], zip(*pairs) if ndim else itertools.repeat(())))


_PARENTHESES = str.maketrans('()', '  ')


def _pieces(node: Any, ndim: int, file_count: int, file: str,
            where: str) -> tuple[tuple[tuple[int, Box], ...], np.ndarray | None]:
    """An array's `pieces`: `(FILE ((START STOP) ...))` each, in files that exist; and
    their `IndexedArray.bounds` when read at once."""
    if isinstance(node, Verbatim):  # as jckpt writes it: read at once, else piece by piece
        found = _pieces_at_once(node, ndim, file_count, file, where)
        if found is not None:
            return found
        lists = node.count('(')
        if lists > limits.MAX_LOOSE_INDEX_LISTS:  # the general reader's cost, refused unpaid
            raise _fail(f"pieces are not boxes of {ndim} dimensions in files 0 to "
                        f"{file_count - 1}, and their {lists} lists are more than the general "
                        f"reader takes ({limits.MAX_LOOSE_INDEX_LISTS}) to say which", file, where)
        try:
            node = parse(node)
        except SexpError as e:
            raise _fail(f"pieces are not a well-formed list: {e}", file, where) from None
    pieces = []
    for p in node if isinstance(node, list) else [node]:
        if not (isinstance(p, list) and len(p) == 2 and isinstance(p[1], list)
                and len(p[1]) == ndim):
            raise _fail("piece must be (FILE ((START STOP) ...))", file, where)
        fi = _count(p[0], 'piece file', file, where)
        if fi >= file_count:
            raise _fail(f"piece file number {fi} is not in files", file, where)
        box = []
        for pair in p[1]:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise _fail("piece slice must be ((START STOP) ...)", file, where)
            box.append((_count(pair[0], 'slice', file, where), _count(pair[1], 'slice', file, where)))
        pieces.append((fi, tuple(box)))
    _check_one_per_file(np.array([fi for fi, _ in pieces], dtype=np.int64), file, where)
    return tuple(pieces), None


def _array_path(f: dict[str, Any], file: str, n: int) -> tuple[str, int, KeyPath | None, str]:
    """An array's namespace, id, path and the name errors give it."""
    namespace = f.get('namespace')
    if not isinstance(namespace, str):
        raise _fail("namespace missing", file, f"#{n}")
    ident = _count(f.get('id'), 'id', file, f"#{n}")
    path = _decode_path(f['path'], file, f"#{n}") if 'path' in f else None
    where = f"{namespace}/{path_name(path) if path is not None else f'n{ident}'}"
    return namespace, ident, path, where


def _array(node: Any, n: int, file_count: int, file: str) -> IndexedArray:
    """Array `#n` of the index: its global entry, and pieces that tile it exactly."""
    f = _fields(node, f"array #{n}", file, f"#{n}")
    namespace, ident, path, where = _array_path(f, file, n)
    prec = f.get('prec')
    if not isinstance(prec, str) or prec not in precs.ALL_PRECS or prec == precs.VOID:
        raise _fail(f"bad prec {prec!r}", file, where)
    dims = _int_list(f.get('global_dims'), 'global_dims', file, where)
    if any(d < 0 for d in dims):
        raise _fail(f"negative dim in global_dims {dims}", file, where)
    label = f.get('label', [])
    if not (isinstance(label, list) and all(isinstance(x, str) for x in label)):
        raise _fail("label must be a list of atoms", file, where)
    key_impl = f.get('key_impl')
    pieces, bounds = _pieces(f.get('pieces', []), len(dims), file_count, file, where)
    if math.prod(dims) > _MAX_ELEMENTS:
        raise _fail(f"global_dims {dims} are absurdly large", file, where)
    try:
        limits.check_shape(dims, precs.element_size(prec))
    except ValueError as e:
        raise _fail(f"global_dims: {e}", file, where) from None
    why = check_tiling([b for _, b in pieces] if bounds is None else bounds, dims)
    if why:
        raise _fail(f"pieces do not tile the array: {why}", file, where)
    entry = Entry(id=ident, namespace=namespace, prec=prec, dims=dims, offset=0,
                  byte_length=math.prod(dims) * precs.element_size(prec), label=tuple(label),
                  path=path, key_impl=key_impl if isinstance(key_impl, str) else None)
    array = IndexedArray(entry, pieces)
    if bounds is not None:  # read already: the cached property need not build it again
        array.__dict__['bounds'] = bounds
    return array


@paused  # a million pieces are millions of tuples, and no cycles among them
def parse_index(header: Header, file: str) -> tuple[list[str], list[IndexedArray]]:
    """The piece file names and arrays of an index header; raises `FormatError`."""
    top = _sharded_fields(header, file)
    files = _piece_files(top, file)
    _check_process_count(top, files, file)
    nodes = top.get('arrays')
    if not isinstance(nodes, list):
        raise _fail("arrays must be a list", file)
    arrays = []
    seen = set()
    for n, node in enumerate(nodes):
        array = _array(node, n, len(files), file)
        if array.entry.identity in seen:
            raise _fail("duplicate array", file, array.entry.name)
        seen.add(array.entry.identity)
        arrays.append(array)
    return list(files), arrays


def overlapping(array: IndexedArray, box: Box) -> list[tuple[int, Box, Box]]:
    """`(file number, piece box, common box)` of every piece of `array` that `box` needs.

    The pieces are searched at once (`array.bounds`), so planning a restore
    of one shard of each of 1,000 arrays of 1,024 pieces costs milliseconds.
    """
    if not array.pieces:
        return []
    want = np.array(box, dtype=np.int64).reshape(len(box), 2)
    lo = np.maximum(array.bounds[:, :, 0], want[:, 0])
    hi = np.minimum(array.bounds[:, :, 1], want[:, 1])
    hit = np.flatnonzero((lo < hi).all(axis=1))
    columns = np.stack([lo[hit], hi[hit]], axis=2).reshape(len(hit), 2 * len(box)).T.tolist()
    commons = zip(*[zip(columns[2 * k], columns[2 * k + 1]) for k in range(len(box))]) \
        if box else itertools.repeat(())
    return [(*array.pieces[i], common) for i, common in zip(hit.tolist(), commons)]


__all__ = ['IndexedArray', 'global_entry', 'index_files', 'index_header', 'overlapping',
           'parse_index']
