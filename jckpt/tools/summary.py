"""Header summaries of a checkpoint file and of a multi-process (directory) checkpoint.

A summary is read from the header alone (no payload is touched, no JAX is
imported), so it is instant even for very large files. Its `repr` is a
readable table, and in Jupyter it renders as an HTML table; `to_dict()`
gives the same content as plain JSON-ready data (what `jckpt inspect
--json` prints). `jckpt.info` picks the summary that fits a path (its module,
`jckpt.tools.info`, shows one of a file written and read back).

>>> from jckpt.format import Entry
>>> e = Entry(id=0, namespace='jckpt', prec='Single_prec', dims=(2, 3), offset=0,
...           byte_length=24, path=(('k', 'w'),))
>>> s = EntryInfo.from_entry(e, data_start=256)
>>> s.name, s.dtype, s.shape, s.mappable
('jckpt/w', 'float32', (2, 3), True)
"""

from __future__ import annotations

import collections
import dataclasses
import html
import operator
import os
from typing import TYPE_CHECKING, Any

from jckpt.format import precs, strict_json
from jckpt.format.header import Entry, path_name
from jckpt.format.names import GENERATION_KEY, LINEAGE_KEY, METRICS_KEY, STEP_KEY, TRAINER_STATE_KEY
from jckpt.format.payload import can_map
from jckpt.storage.backend import LOCAL, backend_for
from jckpt.storage.directory import DirectoryReader
from jckpt.tools.render import (
    REPR_ROWS,
    VALUE_WIDTH,
    format_shape,
    html_table,
    human_bytes,
    metadata_rows,
    plural,
    printable,
    shorten,
    text_table,
)


@dataclasses.dataclass(frozen=True)
class _ArrayFacts:
    """What an entry's header says of its array, common to a file's entry (`EntryInfo`) and a
    directory's assembled array (`ArrayInfo`).

    Attributes:
      namespace, path: the entry's identity (`path` as `a/b/0`; `n<id>`
        for path-less OCANNL entries).
      id: the entry's id within its namespace.
      prec: the stored element type's name in the header (`Single_prec`).
      dtype: the numpy name of the loaded dtype (`float32`; `void` for `Void_prec`).
      shape: the shape of the loaded array (a typed PRNG key's: the key array's, not its
        `jax.random.key_data`'s).
      nbytes: payload bytes stored.
    """

    namespace: str
    path: str
    id: int
    prec: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def name(self) -> str:
        """`namespace/path`, the name errors and `jckpt diff` use."""
        return f"{self.namespace}/{self.path}"


def _facts(entry: Entry) -> dict[str, Any]:
    """The `_ArrayFacts` fields of a header `Entry`, as keyword arguments."""
    return dict(namespace=entry.namespace,
                path=path_name(entry.path) if entry.path is not None else f"n{entry.id}",
                id=entry.id, prec=entry.prec,
                dtype=precs.dtype_name(entry.prec),
                shape=tuple(entry.array_shape), nbytes=entry.byte_length)


def _dtype_cell(dtype: str, key_impl: str | None) -> str:
    """The dtype column of a listing: a typed PRNG key shows its implementation."""
    return dtype if key_impl is None else f"key<{key_impl}>"


def _key_array(entry: Entry, dims: tuple | None) -> tuple | None:
    """A piece's `slice` or `global_dims` over the key array (`Entry.array_shape`): less a
    typed PRNG key's key-data dim."""
    return dims[:-1] if dims and entry.key_impl is not None else dims


@dataclasses.dataclass(frozen=True)
class EntryInfo(_ArrayFacts):
    """One stored array, as `jckpt inspect` lists it.

    Attributes:
      namespace, path, id, prec, dtype, shape, nbytes: what its header says (`_ArrayFacts`).
      offset: payload offset relative to the data start.
      mappable: whether loading can map the payload instead of copying it.
      checksum: `'algorithm:hex'`, or None when the writer stored none.
      padded: whether the entry is OCANNL-padded (only its interior is stored).
      key_impl: the PRNG key implementation for typed-key leaves.
      slice, global_dims: for a piece of a sharded array, which part it is.
    """

    offset: int
    mappable: bool
    checksum: str | None = None
    padded: bool = False
    key_impl: str | None = None
    slice: tuple[tuple[int, int], ...] | None = None
    global_dims: tuple[int, ...] | None = None

    @classmethod
    def from_entry(cls, entry: Entry, data_start: int) -> EntryInfo:
        """Summarize a header `Entry` of a file whose data starts there."""
        return cls(**_facts(entry), offset=entry.offset, mappable=can_map(entry, data_start),
                   checksum=':'.join(entry.checksum) if entry.checksum else None,
                   padded=entry.padding is not None, key_impl=entry.key_impl,
                   slice=_key_array(entry, entry.slice), global_dims=_key_array(entry, entry.global_dims))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data."""
        d = dataclasses.asdict(self)
        d['shape'] = list(self.shape)
        if self.slice is not None:
            d['slice'] = [list(p) for p in self.slice]
        if self.global_dims is not None:
            d['global_dims'] = list(self.global_dims)
        return d


_COLUMNS = ('namespace', 'path', 'dtype', 'shape', 'size', 'offset', 'map')
_RIGHT = (4, 5)


def _entry_row(e: EntryInfo) -> list[str]:
    dtype = _dtype_cell(e.dtype, e.key_impl)
    shape = format_shape(e.shape)
    if e.global_dims is not None:
        shape += ' of ' + format_shape(e.global_dims)
    mapping = 'yes' if e.mappable else ('no (padded)' if e.padded else 'no')
    return [e.namespace, e.path, dtype, shape, human_bytes(e.nbytes), str(e.offset), mapping]


_NBYTES, _NAMESPACE = operator.attrgetter('nbytes'), operator.attrgetter('namespace')


class _Totals:
    """Totals shared by a file's and a directory checkpoint's summaries (over `entries`)."""

    if TYPE_CHECKING:  # a field of FileInfo, a property of DirectoryInfo
        @property
        def entries(self) -> tuple: ...

    @property
    def payload_bytes(self) -> int:
        """Total payload bytes."""
        return sum(map(_NBYTES, self.entries))

    @property
    def namespaces(self) -> dict[str, int]:
        """`{namespace: number of entries}`, in first-appearance order."""
        return dict(collections.Counter(map(_NAMESPACE, self.entries)))  # counted in C


@dataclasses.dataclass(frozen=True)
class FileInfo(_Totals):
    """The summary of one checkpoint file: its entries, totals and header metadata.

    `repr` prints a table (the first `REPR_ROWS` entries); in Jupyter
    it renders as HTML; `render` gives the full text and
    `to_dict` the JSON form.

    Attributes:
      path: the file.
      size: the file's size in bytes.
      data_start: where the payloads start (4 + header length).
      version, alignment, writer: from the header.
      metadata: the header's `(key, value)` string pairs, in order.
      entries: one `EntryInfo` per stored array, in payload order.
    """

    path: str
    size: int
    data_start: int
    version: int
    alignment: int
    writer: str | None
    metadata: tuple[tuple[str, str], ...]
    entries: tuple[EntryInfo, ...]

    kind = 'file'

    @property
    def mappable(self) -> int:
        """How many entries load as zero-copy views."""
        return sum(e.mappable for e in self.entries)

    def entry(self, name: str) -> EntryInfo:
        """The entry called `namespace/path` (KeyError if none)."""
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    def _description(self) -> str:
        ns = self.namespaces
        return (f"jckpt file, {plural(len(self.entries), 'entry')} in "
                f"{plural(len(ns), 'namespace')}, {human_bytes(self.payload_bytes)} of "
                f"payloads, file {human_bytes(self.size)}, alignment {self.alignment}")

    def _metadata_rows(self) -> list[tuple[str, str]]:
        return metadata_rows(self.writer, self.metadata)

    def _metadata_lines(self, width: int | None = VALUE_WIDTH) -> list[str]:
        return [f"{printable(label)}: {shorten(value, width)}" for label, value in self._metadata_rows()]

    def _totals_line(self) -> str:
        return (f"total: {plural(len(self.entries), 'entry')}, {human_bytes(self.payload_bytes)} "
                f"({self.payload_bytes} bytes), {self.mappable} of {len(self.entries)} mappable")

    def render(self, limit: int | None = None, width: int | None = VALUE_WIDTH) -> str:
        """The text view: summary, metadata, the entries' table, totals.

        `limit` caps the number of table rows and `width` the length of
        metadata values (`None`: no cap).
        """
        shown = self.entries if limit is None else self.entries[:limit]
        rows = [_entry_row(e) for e in shown]
        parts = [f"{self.path}: {self._description()}", *self._metadata_lines(width), '']
        parts.append(text_table(_COLUMNS, rows, right=_RIGHT) if rows else '(no entries)')
        if len(shown) < len(self.entries):
            parts.append(f"... {len(self.entries) - len(shown)} more entries")
        parts.append(self._totals_line())
        return '\n'.join(parts)

    def __repr__(self) -> str:
        return self.render(limit=REPR_ROWS)

    def _repr_html_(self) -> str:
        shown = self.entries[:REPR_ROWS]
        meta = ''.join(f"<tr><th style=\"text-align:left\">{html.escape(k)}</th>"
                       f"<td style=\"text-align:left\"><code>{html.escape(shorten(v))}"
                       f"</code></td></tr>"
                       for k, v in self._metadata_rows())
        more = (f"<p>... {len(self.entries) - len(shown)} more entries</p>"
                if len(shown) < len(self.entries) else '')
        return (f"<div><p><b>{html.escape(self.path)}</b>: {html.escape(self._description())}</p>"
                f"<table>{meta}</table>"
                f"{html_table(_COLUMNS, [_entry_row(e) for e in shown], right=_RIGHT)}{more}"
                f"<p>{html.escape(self._totals_line())}</p></div>")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (exact byte counts; metadata as a dict)."""
        return {
            'kind': self.kind, 'path': self.path, 'size': self.size,
            'data_start': self.data_start, 'version': self.version,
            'alignment': self.alignment, 'writer': self.writer,
            'metadata': dict(self.metadata),
            **known_metadata(dict(self.metadata)),
            'entries': [e.to_dict() for e in self.entries],
            'totals': {'entries': len(self.entries), 'payload_bytes': self.payload_bytes,
                       'mappable': self.mappable, 'namespaces': self.namespaces},
        }


def known_metadata(meta: dict[str, str]) -> dict[str, Any]:
    """The mirror's and manager's metadata decoded for scripts: `step`, `metrics`,
    `trainer_state` (parsed JSON), `lineage`, `generation` (only those present)."""
    out: dict[str, Any] = {}
    for key, name in ((STEP_KEY, 'step'), (GENERATION_KEY, 'generation')):
        if key in meta:
            try:
                out[name] = int(meta[key])
            except ValueError:
                out[name] = meta[key]
    for key, name in ((METRICS_KEY, 'metrics'), (TRAINER_STATE_KEY, 'trainer_state')):
        if key in meta:
            try:
                out[name] = strict_json.loads(meta[key])
            except ValueError:
                out[name] = meta[key]
    if LINEAGE_KEY in meta:
        out['lineage'] = meta[LINEAGE_KEY]
    return out


def file_info(path: str | os.PathLike, reader: Any = None) -> FileInfo:
    """The `FileInfo` of one checkpoint file (header only; payloads untouched); `reader`: the
    file already opened (by `classify`, for an object)."""
    reader = reader or backend_for(path).open(os.fspath(path))
    h = reader.header
    return FileInfo(path=reader.path, size=reader.size, data_start=reader.data_start,
                    version=h.version, alignment=h.alignment, writer=h.writer,
                    metadata=tuple(h.metadata),
                    entries=tuple(EntryInfo.from_entry(e, reader.data_start) for e in h.tensors))


@dataclasses.dataclass(frozen=True)
class ArrayInfo(_ArrayFacts):
    """One array of a multi-process (directory) checkpoint, assembled from its pieces.

    Attributes:
      namespace, path, id, prec, dtype, shape, nbytes, key_impl: as for
        `EntryInfo`, for the whole (global) array.
      pieces: how many stored pieces tile it.
      files: the piece files holding them.
      mappable: whether every piece can be mapped instead of copied.
    """

    pieces: int
    files: tuple[str, ...]
    mappable: bool
    key_impl: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d['shape'], d['files'] = list(self.shape), list(self.files)
        return d


@dataclasses.dataclass(frozen=True)
class PieceFileInfo:
    """One piece file of a directory checkpoint (`process_00000.jckpt`)."""

    name: str
    size: int
    entries: int
    payload_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_ARRAY_COLUMNS = ('namespace', 'path', 'dtype', 'shape', 'size', 'pieces', 'map')


def _array_row(a: ArrayInfo) -> list[str]:
    return [a.namespace, a.path, _dtype_cell(a.dtype, a.key_impl), format_shape(a.shape),
            human_bytes(a.nbytes), str(a.pieces), 'yes' if a.mappable else 'no']


@dataclasses.dataclass(frozen=True)
class DirectoryInfo(_Totals):
    """The summary of a multi-process checkpoint: a directory of piece files and an index.

    Attributes:
      path: the directory.
      size: bytes of all its files.
      alignment, writer, metadata: from the index.
      arrays: one `ArrayInfo` per global array.
      files: one `PieceFileInfo` per piece file.
    """

    path: str
    size: int
    alignment: int
    writer: str | None
    metadata: tuple[tuple[str, str], ...]
    arrays: tuple[ArrayInfo, ...]
    files: tuple[PieceFileInfo, ...]

    kind = 'directory'

    @property
    def entries(self) -> tuple[ArrayInfo, ...]:
        """The arrays (the same name as a file's entries, for code that handles both)."""
        return self.arrays

    def _description(self) -> str:
        return (f"multi-process checkpoint directory, {plural(len(self.arrays), 'array')} in "
                f"{plural(len(self.namespaces), 'namespace')}, {human_bytes(self.payload_bytes)} "
                f"in {plural(len(self.files), 'piece file')}, {human_bytes(self.size)} on disk")

    def _metadata_rows(self) -> list[tuple[str, str]]:
        return metadata_rows(self.writer, self.metadata)

    def render(self, limit: int | None = None, width: int | None = VALUE_WIDTH) -> str:
        """The text view: summary, metadata, the arrays, the piece files."""
        shown = self.arrays if limit is None else self.arrays[:limit]
        parts = [f"{self.path}: {self._description()}",
                 *[f"{k}: {shorten(v, width)}" for k, v in self._metadata_rows()], '']
        parts.append(text_table(_ARRAY_COLUMNS, [_array_row(a) for a in shown], right=(4, 5))
                     if shown else '(no arrays)')
        if len(shown) < len(self.arrays):
            parts.append(f"... {len(self.arrays) - len(shown)} more arrays")
        parts.append('')
        parts.append(text_table(('file', 'size', 'entries'),
                                [[f.name, human_bytes(f.size), f.entries] for f in self.files],
                                right=(1, 2)))
        parts.append(f"total: {plural(len(self.arrays), 'array')}, "
                     f"{human_bytes(self.payload_bytes)} ({self.payload_bytes} bytes)")
        return '\n'.join(parts)

    def __repr__(self) -> str:
        return self.render(limit=REPR_ROWS)

    def _repr_html_(self) -> str:
        meta = html_table(('', ''), [(k, shorten(v)) for k, v in self._metadata_rows()])
        arrays = html_table(_ARRAY_COLUMNS, [_array_row(a) for a in self.arrays[:REPR_ROWS]],
                            right=(4, 5))
        files = html_table(('file', 'size', 'entries'),
                           [[f.name, human_bytes(f.size), f.entries] for f in self.files],
                           right=(1, 2))
        return (f"<div><p><b>{html.escape(self.path)}</b>: {html.escape(self._description())}</p>"
                f"{meta}{arrays}{files}</div>")

    def to_dict(self) -> dict[str, Any]:
        return {'kind': self.kind, 'path': self.path, 'size': self.size,
                'alignment': self.alignment, 'writer': self.writer,
                'metadata': dict(self.metadata), **known_metadata(dict(self.metadata)),
                'arrays': [a.to_dict() for a in self.arrays],
                'files': [f.to_dict() for f in self.files],
                'totals': {'arrays': len(self.arrays), 'payload_bytes': self.payload_bytes,
                           'namespaces': self.namespaces}}


def directory_info(path: str | os.PathLike) -> DirectoryInfo:
    """The `DirectoryInfo` of a multi-process checkpoint (headers only)."""
    reader = DirectoryReader(path, check_pieces=True)  # a missing piece said as restore says it
    files, mappable = _piece_files(reader)
    arrays = tuple(_array_info(reader, a, mappable) for a in reader.arrays.values())
    h = reader.header
    size = tree_size(reader.path) if reader.backend is LOCAL else \
        reader.index.size + sum(f.size for f in files)  # an object store: the pieces and the index
    return DirectoryInfo(path=reader.path, size=size, alignment=h.alignment,
                         writer=h.writer, metadata=tuple(h.metadata), arrays=arrays,
                         files=tuple(files))


def _piece_files(reader: DirectoryReader) -> tuple[list[PieceFileInfo], dict[tuple, bool]]:
    """Each piece file's summary, and whether each stored piece can be mapped, by
    `(file index, identity, slice)`."""
    files = []
    mappable: dict[tuple[int, Any, Any], bool] = {}
    for fi, name in enumerate(reader.files):
        r = reader.backend.open(os.path.join(reader.path, name), follow_symlinks=False)
        for e in r.header.tensors:
            mappable[(fi, e.identity, e.slice)] = can_map(e, r.data_start)
        files.append(PieceFileInfo(name, r.size, len(r.header.tensors),
                                   sum(e.byte_length for e in r.header.tensors)))
    return files, mappable


def _array_info(reader: DirectoryReader, a: Any, mappable: dict[tuple, bool]) -> ArrayInfo:
    """The `ArrayInfo` of one global array (`a`: the reader's record of it)."""
    e = a.entry
    return ArrayInfo(
        **_facts(e), pieces=len(a.pieces),
        files=tuple(sorted({reader.files[fi] for fi, _ in a.pieces})),
        mappable=all(mappable.get((fi, e.identity, box), False) for fi, box in a.pieces),
        key_impl=e.key_impl)


def tree_size(path: str) -> int:
    """Bytes of the file `path`, or of every file under the directory `path` (a prefix in a
    bucket too); symbolic links counted as links, 0 if missing."""
    return backend_for(path).size(path)


__all__ = ['ArrayInfo', 'DirectoryInfo', 'EntryInfo', 'FileInfo', 'PieceFileInfo', 'directory_info',
           'file_info', 'known_metadata', 'tree_size']
