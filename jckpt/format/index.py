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
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jckpt.errors import FormatError
from jckpt.format import limits, precs
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


def global_entry(e: Entry) -> Entry:
    """The whole array a piece entry `e` belongs to (dims = its `global_dims`, no slice)."""
    dims = tuple(e.global_dims or ())
    return Entry(id=e.id, namespace=e.namespace, prec=e.prec, dims=dims, offset=0,
                 byte_length=math.prod(dims) * precs.element_size(e.prec), label=e.label,
                 path=e.path, key_impl=e.key_impl)


# --- encoding ---------------------------------------------------------------------------------

def _array_fields(array: IndexedArray) -> list[Any]:
    e = array.entry
    fields: list[Any] = [['id', e.id], ['namespace', e.namespace], ['label', list(e.label)],
                         ['prec', e.prec], ['global_dims', list(e.dims)]]
    if e.path is not None:
        fields.append(['path', [[k, v] for k, v in e.path]])
    if e.key_impl is not None:
        fields.append(['key_impl', e.key_impl])
    fields.append(['pieces', [[fi, [[a, b] for a, b in box]] for fi, box in array.pieces]])
    return fields


def index_header(files: Sequence[str], process_count: int, arrays: Sequence[IndexedArray],
                 alignment: int, metadata: Mapping[str, str], *, writer: str) -> Header:
    """The index as a header with no tensors and a `sharded` field (see docs/format.md)."""
    sharded = ['sharded', [['layout', LAYOUT_VERSION], ['process_count', process_count],
                           ['files', list(files)], ['arrays', [_array_fields(a) for a in arrays]]]]
    return Header(tensors=(), alignment=alignment, writer=writer,
                  metadata=tuple(metadata.items()), extra=(_frozen(sharded),))


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
        raise _fail("files must be a list of process_NNNNN[.K].jckpt names", file)
    return files


def _pieces(node: Any, ndim: int, file_count: int, file: str,
            where: str) -> tuple[tuple[int, Box], ...]:
    """An array's `pieces`: `(FILE ((START STOP) ...))` each, in files that exist."""
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
    return tuple(pieces)


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
    pieces = _pieces(f.get('pieces', []), len(dims), file_count, file, where)
    if math.prod(dims) > _MAX_ELEMENTS:
        raise _fail(f"global_dims {dims} are absurdly large", file, where)
    try:
        limits.check_shape(dims, precs.element_size(prec))
    except ValueError as e:
        raise _fail(f"global_dims: {e}", file, where) from None
    why = check_tiling([b for _, b in pieces], dims)
    if why:
        raise _fail(f"pieces do not tile the array: {why}", file, where)
    entry = Entry(id=ident, namespace=namespace, prec=prec, dims=dims, offset=0,
                  byte_length=math.prod(dims) * precs.element_size(prec), label=tuple(label),
                  path=path, key_impl=key_impl if isinstance(key_impl, str) else None)
    return IndexedArray(entry, pieces)


def parse_index(header: Header, file: str) -> tuple[list[str], list[IndexedArray]]:
    """The piece file names and arrays of an index header; raises `FormatError`."""
    top = _sharded_fields(header, file)
    files = _piece_files(top, file)
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


__all__ = ['IndexedArray', 'global_entry', 'index_header', 'parse_index']
