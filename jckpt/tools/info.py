"""``jckpt.info(path)``: what a checkpoint holds, as a value that shows itself.

The summary is read from the header alone (no payload is touched, no JAX is
imported), so it is instant even for very large files. Its ``repr`` is a
readable table, and in Jupyter it renders as an HTML table; ``to_dict()``
gives the same content as plain JSON-ready data (what ``jckpt inspect
--json`` prints).

>>> import numpy as np, tempfile, os
>>> from jckpt.format import Entry, Header, lay_out
>>> from jckpt.storage import ArraySource, write_checkpoint
>>> path = os.path.join(tempfile.mkdtemp(), 'm.jckpt')
>>> e = Entry(id=0, namespace='jckpt', prec='Single_prec', dims=(2, 3), offset=0,
...           byte_length=24, path=(('k', 'w'),))
>>> _ = write_checkpoint(path, lay_out(Header(tensors=(e,))),
...                      [ArraySource(np.ones((2, 3), np.float32))], durable=False)
>>> s = info(path)
>>> s.entries[0].name, s.entries[0].shape, s.entries[0].mappable
('jckpt/w', (2, 3), True)

This module imports only the standard library (and the trainer state's key)
at import time; the codec is imported on first use, so ``import jckpt`` stays
light.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jckpt.format.names import GENERATION_KEY, KNOWN_KEYS, LINEAGE_KEY, METRICS_KEY, STEP_KEY, STEP_RE
from jckpt.services.trainer_state import TRAINER_STATE_KEY

if TYPE_CHECKING:
    from jckpt.format.header import Entry


#: Rows shown by ``repr`` and the HTML view before "... N more" (the CLI shows all).
REPR_ROWS = 40
#: Metadata values longer than this are shortened in the text and HTML views.
VALUE_WIDTH = 100


# --- small formatting helpers (shared with the command line) ----------------

def human_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'``: sizes for people (JSON keeps exact byte counts)."""
    value = float(n)
    for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
        if value < 1024 or unit == 'TiB':
            return f"{int(value)} B" if unit == 'B' else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError('unreachable')


def format_shape(shape: Sequence[int]) -> str:
    """``(784, 512)`` -> ``'(784, 512)'``, ``()`` -> ``'()'``, ``(3,)`` -> ``'(3,)'``."""
    return repr(tuple(shape))


def shorten(text: str, width: int | None = VALUE_WIDTH) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis (None: never cut)."""
    text = text.replace('\n', ' ')
    return text if width is None or len(text) <= width else text[:width - 3] + '...'


def plural(n: int, word: str) -> str:
    """``plural(1, 'entry')`` -> ``'1 entry'``; ``plural(2, 'entry')`` -> ``'2 entries'``."""
    if n == 1:
        return f"{n} {word}"
    if word.endswith('y') and word[-2:-1] not in ('a', 'e', 'i', 'o', 'u'):
        return f"{n} {word[:-1]}ies"
    return f"{n} {word}s"


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
               right: Sequence[int] = ()) -> str:
    """Rows as aligned plain-text columns (``right``: indices of right-aligned columns).

    >>> print(text_table(['a', 'size'], [['x', 1], ['yy', 22]], right=[1]))
    a   size
    x      1
    yy    22
    """
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append('  '.join(parts).rstrip())
    return '\n'.join(lines)


def html_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
               right: Sequence[int] = ()) -> str:
    """Rows as an HTML table (every cell escaped)."""
    def cell(tag: str, i: int, c: Any) -> str:
        style = ' style="text-align:right"' if i in right else ' style="text-align:left"'
        return f"<{tag}{style}>{html.escape(str(c))}</{tag}>"
    head = ''.join(cell('th', i, h) for i, h in enumerate(headers))
    body = ''.join('<tr>' + ''.join(cell('td', i, c) for i, c in enumerate(r)) + '</tr>'
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# --- the summary values -----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EntryInfo:
    """One stored array, as ``jckpt inspect`` lists it.

    Attributes:
      namespace, path: the entry's identity (``path`` as ``a/b/0``; ``n<id>``
        for path-less OCANNL entries).
      id: the entry's id within its namespace.
      prec: the stored element type's name in the header (``Single_prec``).
      dtype: the numpy name of the loaded dtype (``float32``; ``void`` for ``Void_prec``).
      shape: the shape of the loaded array.
      nbytes: payload bytes stored in the file.
      offset: payload offset relative to the data start.
      mappable: whether loading can map the payload instead of copying it.
      checksum: ``'algorithm:hex'``, or None when the writer stored none.
      padded: whether the entry is OCANNL-padded (only its interior is stored).
      key_impl: the PRNG key implementation for typed-key leaves.
      slice, global_dims: for a piece of a sharded array, which part it is.
    """

    namespace: str
    path: str
    id: int
    prec: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int
    mappable: bool
    checksum: str | None = None
    padded: bool = False
    key_impl: str | None = None
    slice: tuple[tuple[int, int], ...] | None = None
    global_dims: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        """``namespace/path``, the name errors and ``jckpt diff`` use."""
        return f"{self.namespace}/{self.path}"

    @classmethod
    def from_entry(cls, entry: Entry, data_start: int) -> EntryInfo:
        """Summarize a header :class:`~jckpt.format.Entry` of a file whose data starts there."""
        from jckpt.format import precs
        from jckpt.format.header import path_name
        from jckpt.format.payload import can_map

        dtype = 'void' if entry.prec == precs.VOID else str(entry.dtype.name)
        return cls(namespace=entry.namespace,
                   path=path_name(entry.path) if entry.path is not None else f"n{entry.id}",
                   id=entry.id, prec=entry.prec, dtype=dtype, shape=tuple(entry.shape),
                   nbytes=entry.byte_length, offset=entry.offset,
                   mappable=can_map(entry, data_start),
                   checksum=':'.join(entry.checksum) if entry.checksum else None,
                   padded=entry.padding is not None, key_impl=entry.key_impl,
                   slice=entry.slice, global_dims=entry.global_dims)

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
    dtype = e.dtype if e.key_impl is None else f"key<{e.key_impl}>"
    shape = format_shape(e.shape)
    if e.global_dims is not None:
        shape += ' of ' + format_shape(e.global_dims)
    mapping = 'yes' if e.mappable else ('no (padded)' if e.padded else 'no')
    return [e.namespace, e.path, dtype, shape, human_bytes(e.nbytes), str(e.offset), mapping]


class _Totals:
    """Totals shared by a file's and a directory checkpoint's summaries (over ``entries``)."""

    if TYPE_CHECKING:  # a field of FileInfo, a property of DirectoryInfo
        @property
        def entries(self) -> tuple: ...

    @property
    def payload_bytes(self) -> int:
        """Total payload bytes."""
        return sum(e.nbytes for e in self.entries)

    @property
    def namespaces(self) -> dict[str, int]:
        """``{namespace: number of entries}``, in first-appearance order."""
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.namespace] = out.get(e.namespace, 0) + 1
        return out


@dataclasses.dataclass(frozen=True)
class FileInfo(_Totals):
    """The summary of one checkpoint file: its entries, totals and header metadata.

    ``repr`` prints a table (the first :data:`REPR_ROWS` entries); in Jupyter
    it renders as HTML; :meth:`render` gives the full text and
    :meth:`to_dict` the JSON form.

    Attributes:
      path: the file.
      size: the file's size in bytes.
      data_start: where the payloads start (4 + header length).
      version, alignment, writer: from the header.
      metadata: the header's ``(key, value)`` string pairs, in order.
      entries: one :class:`EntryInfo` per stored array, in payload order.
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
        """The entry called ``namespace/path`` (KeyError if none)."""
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
        return [f"{label}: {shorten(value, width)}" for label, value in self._metadata_rows()]

    def _totals_line(self) -> str:
        return (f"total: {plural(len(self.entries), 'entry')}, {human_bytes(self.payload_bytes)} "
                f"({self.payload_bytes} bytes), {self.mappable} of {len(self.entries)} mappable")

    def render(self, limit: int | None = None, width: int | None = VALUE_WIDTH) -> str:
        """The text view: summary, metadata, the entries' table, totals.

        ``limit`` caps the number of table rows and ``width`` the length of
        metadata values (``None``: no cap).
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


def metadata_rows(writer: str | None,
                  metadata: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """``(label, value)`` pairs to show: writer, the known keys by name, then user metadata."""
    rows = [('writer', writer if writer is not None else '(not recorded)')]
    meta = dict(metadata)
    rows += [(label, _pretty_value(meta[key])) for key, label in KNOWN_KEYS.items() if key in meta]
    rows += [(key, _pretty_value(value)) for key, value in metadata if key not in KNOWN_KEYS]
    return rows


def known_metadata(meta: dict[str, str]) -> dict[str, Any]:
    """The mirror's and manager's metadata decoded for scripts: ``step``, ``metrics``,
    ``trainer_state`` (parsed JSON), ``lineage``, ``generation`` (only those present)."""
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
                out[name] = json.loads(meta[key])
            except ValueError:
                out[name] = meta[key]
    if LINEAGE_KEY in meta:
        out['lineage'] = meta[LINEAGE_KEY]
    return out


def _pretty_value(value: str) -> str:
    """A metadata value for display: JSON made compact, anything else as is."""
    text = value.strip()
    if text[:1] in ('{', '['):
        try:
            return json.dumps(json.loads(text), separators=(', ', ': '))
        except ValueError:
            pass
    return value


def file_info(path: str | os.PathLike) -> FileInfo:
    """The :class:`FileInfo` of one checkpoint file (header only; payloads untouched)."""
    from jckpt.storage.reader import CheckpointReader

    reader = CheckpointReader(path)
    h = reader.header
    return FileInfo(path=reader.path, size=reader.size, data_start=reader.data_start,
                    version=h.version, alignment=h.alignment, writer=h.writer,
                    metadata=tuple(h.metadata),
                    entries=tuple(EntryInfo.from_entry(e, reader.data_start) for e in h.tensors))


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """One array of a multi-process (directory) checkpoint, assembled from its pieces.

    Attributes:
      namespace, path, id, prec, dtype, shape, nbytes, key_impl: as for
        :class:`EntryInfo`, for the whole (global) array.
      pieces: how many stored pieces tile it.
      files: the piece files holding them.
      mappable: whether every piece can be mapped instead of copied.
    """

    namespace: str
    path: str
    id: int
    prec: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    pieces: int
    files: tuple[str, ...]
    mappable: bool
    key_impl: str | None = None

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.path}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d['shape'], d['files'] = list(self.shape), list(self.files)
        return d


@dataclasses.dataclass(frozen=True)
class PieceFileInfo:
    """One piece file of a directory checkpoint (``process_00000.jckpt``)."""

    name: str
    size: int
    entries: int
    payload_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_ARRAY_COLUMNS = ('namespace', 'path', 'dtype', 'shape', 'size', 'pieces', 'map')


def _array_row(a: ArrayInfo) -> list[str]:
    dtype = a.dtype if a.key_impl is None else f"key<{a.key_impl}>"
    return [a.namespace, a.path, dtype, format_shape(a.shape), human_bytes(a.nbytes),
            str(a.pieces), 'yes' if a.mappable else 'no']


@dataclasses.dataclass(frozen=True)
class DirectoryInfo(_Totals):
    """The summary of a multi-process checkpoint: a directory of piece files and an index.

    Attributes:
      path: the directory.
      size: bytes of all its files.
      alignment, writer, metadata: from the index.
      arrays: one :class:`ArrayInfo` per global array.
      files: one :class:`PieceFileInfo` per piece file.
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


def is_directory_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a multi-process checkpoint (a directory with an index file)."""
    from jckpt.format.names import INDEX_NAME

    return os.path.isfile(os.path.join(os.fspath(path), INDEX_NAME))


def directory_info(path: str | os.PathLike) -> DirectoryInfo:
    """The :class:`DirectoryInfo` of a multi-process checkpoint (headers only)."""
    from jckpt.format import precs
    from jckpt.format.header import path_name
    from jckpt.format.payload import can_map
    from jckpt.storage.directory import DirectoryReader
    from jckpt.storage.reader import CheckpointReader

    reader = DirectoryReader(path)
    files = []
    piece_maps: dict[tuple[int, Any, Any], bool] = {}
    for fi, name in enumerate(reader.files):
        r = CheckpointReader(os.path.join(reader.path, name), follow_symlinks=False)
        for e in r.header.tensors:
            piece_maps[(fi, e.identity, e.slice)] = can_map(e, r.data_start)
        files.append(PieceFileInfo(reader.files[fi], r.size, len(r.header.tensors),
                                   sum(e.byte_length for e in r.header.tensors)))
    arrays = []
    for a in reader.arrays.values():
        e = a.entry
        arrays.append(ArrayInfo(
            namespace=e.namespace,
            path=path_name(e.path) if e.path is not None else f"n{e.id}", id=e.id, prec=e.prec,
            dtype='void' if e.prec == precs.VOID else e.dtype.name, shape=tuple(e.shape),
            nbytes=e.byte_length, pieces=len(a.pieces),
            files=tuple(sorted({reader.files[fi] for fi, _ in a.pieces})),
            mappable=all(piece_maps.get((fi, e.identity, box), False) for fi, box in a.pieces),
            key_impl=e.key_impl))
    h = reader.header
    return DirectoryInfo(path=reader.path, size=_tree_size(reader.path), alignment=h.alignment,
                         writer=h.writer, metadata=tuple(h.metadata), arrays=tuple(arrays),
                         files=tuple(files))


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One step of a checkpoint manager directory.

    Attributes:
      step: the step number (from the name ``step_00000100.jckpt``).
      path: the step's file (or directory, for a multi-process save).
      kind: ``'file'`` or ``'directory'``.
      size: bytes on disk (all files, for a directory).
      entries, payload_bytes: from the step's header (None when unknown).
      metrics: the metrics saved with the step.
      generation, lineage: the writer's generation counter and lineage id.
      error: why the step could not be read (None when it could).
    """

    step: int
    path: str
    kind: str
    size: int
    entries: int | None = None
    payload_bytes: int | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    generation: int | None = None
    lineage: str | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ManagerInfo:
    """The summary of a checkpoint manager directory: a table of its steps.

    ``best`` ranks the readable steps by ``best_metric`` (``best_mode``
    ``'min'`` or ``'max'``; ties go to the later step, as the manager ranks
    them); ``latest`` is the highest readable step.
    """

    path: str
    steps: tuple[StepInfo, ...]
    best_metric: str | None = None
    best_mode: str = 'min'

    kind = 'manager'

    @property
    def metric_names(self) -> list[str]:
        """Every metric name saved with any step, sorted."""
        return sorted({k for s in self.steps for k in s.metrics})

    @property
    def latest(self) -> int | None:
        readable = [s.step for s in self.steps if s.error is None]
        return max(readable) if readable else None

    @property
    def best(self) -> int | None:
        if self.best_metric is None:
            return None
        sign = 1 if self.best_mode == 'min' else -1
        scored = [(sign * s.metrics[self.best_metric], -s.step) for s in self.steps
                  if s.error is None and self.best_metric in s.metrics
                  and s.metrics[self.best_metric] == s.metrics[self.best_metric]]
        return -min(scored)[1] if scored else None

    @property
    def size(self) -> int:
        return sum(s.size for s in self.steps)

    def _description(self) -> str:
        parts = [f"checkpoint manager directory, {plural(len(self.steps), 'step')}, "
                 f"{human_bytes(self.size)}"]
        if self.latest is not None:
            parts.append(f"latest {self.latest}")
        if self.best is not None:
            parts.append(f"best {self.best} by {self.best_metric} ({self.best_mode})")
        return ', '.join(parts)

    def _rows(self) -> tuple[list[str], list[list[str]], list[int]]:
        metrics = self.metric_names
        headers = ['step', 'size', 'entries', 'generation', *metrics, 'note']
        rows = []
        latest, best = self.latest, self.best
        for s in self.steps:
            notes = [n for n, hit in (('latest', s.step == latest), ('best', s.step == best)) if hit]
            if s.kind == 'directory':
                notes.append('multi-process')
            if s.error is not None:
                notes.append(f"unreadable: {shorten(s.error, 60)}")
            rows.append([str(s.step), human_bytes(s.size),
                         '?' if s.entries is None else str(s.entries),
                         '' if s.generation is None else str(s.generation),
                         *[f"{s.metrics[m]:.6g}" if m in s.metrics else '' for m in metrics],
                         ', '.join(notes)])
        right = [0, 1, 2, 3, *range(4, 4 + len(metrics))]
        return headers, rows, right

    def _lineage_line(self) -> str | None:
        lineages = sorted({s.lineage for s in self.steps if s.lineage is not None})
        if not lineages:
            return None
        return f"lineage{'s' if len(lineages) > 1 else ''}: {', '.join(lineages)}"

    def render(self, limit: int | None = None, width: int | None = VALUE_WIDTH) -> str:
        """The text view: summary, lineage, and one row per step (the last ``limit``)."""
        headers, rows, right = self._rows()
        shown = rows if limit is None else rows[-limit:]
        parts = [f"{self.path}: {self._description()}"]
        if (line := self._lineage_line()) is not None:
            parts.append(line)
        parts.append('')
        if len(shown) < len(rows):
            parts.append(f"... {len(rows) - len(shown)} earlier steps")
        parts.append(text_table(headers, shown, right=right) if rows else '(no steps)')
        return '\n'.join(parts)

    def __repr__(self) -> str:
        return self.render(limit=REPR_ROWS)

    def _repr_html_(self) -> str:
        headers, rows, right = self._rows()
        line = self._lineage_line()
        return (f"<div><p><b>{html.escape(self.path)}</b>: {html.escape(self._description())}</p>"
                + (f"<p>{html.escape(line)}</p>" if line else '')
                + html_table(headers, rows[-REPR_ROWS:], right=right) + '</div>')

    def to_dict(self) -> dict[str, Any]:
        return {'kind': self.kind, 'path': self.path, 'size': self.size,
                'latest': self.latest, 'best': self.best, 'best_metric': self.best_metric,
                'best_mode': self.best_mode, 'steps': [s.to_dict() for s in self.steps]}


def _tree_size(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def step_info(step: int, path: str) -> StepInfo:
    """The :class:`StepInfo` of one manager step (never raises for a damaged step)."""
    from jckpt.errors import CheckpointError

    kind = 'directory' if os.path.isdir(path) else 'file'
    try:
        fi: FileInfo | DirectoryInfo = directory_info(path) if kind == 'directory' \
            else file_info(path)
    except CheckpointError as e:
        size = _tree_size(path) if kind == 'directory' else (
            os.path.getsize(path) if os.path.exists(path) else 0)
        return StepInfo(step, path, kind, size, error=str(e.message))
    known = known_metadata(dict(fi.metadata))
    metrics = known.get('metrics')
    metrics = {str(k): float(v) for k, v in metrics.items()} if isinstance(metrics, dict) else {}
    generation = known.get('generation')
    return StepInfo(step, path, kind, fi.size, len(fi.entries), fi.payload_bytes, metrics,
                    generation if isinstance(generation, int) else None, known.get('lineage'))


def is_manager_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding ``step_NNNNNNNN.jckpt`` steps."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return False
    return any(STEP_RE.match(name) for name in os.listdir(path))


def manager_info(path: str | os.PathLike, *, best_metric: str | None = None,
                 best_mode: str = 'min') -> ManagerInfo:
    """The :class:`ManagerInfo` of a checkpoint manager directory (headers only).

    ``best_metric`` defaults to ``loss`` when the steps record it, else to the
    first metric name in sorted order.
    """
    from jckpt.errors import InputError

    path = os.fspath(path)
    if best_mode not in ('min', 'max'):
        raise InputError(f"best_mode must be 'min' or 'max', not {best_mode!r}")
    found = sorted((int(m.group(1)), name) for name in os.listdir(path)
                   if (m := STEP_RE.match(name)))
    steps = tuple(step_info(step, os.path.join(path, name)) for step, name in found)
    names = sorted({k for s in steps for k in s.metrics})
    if best_metric is None and names:
        best_metric = 'loss' if 'loss' in names else names[0]
    return ManagerInfo(path, steps, best_metric, best_mode)


def foreign_format(path: str | os.PathLike) -> str | None:
    """The name of the other format a file is in (``'npz'``, ``'safetensors'``, ...), if a
    format adapter recognises it; None for jckpt files and unrecognised ones."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return None
    try:
        from jckpt.adapters import detect_format

        name = detect_format(path)
    except Exception:  # no adapters, or nobody recognises it
        return None
    return None if name in ('jckpt', 'ocannl') else name


def not_jckpt_error(path: str | os.PathLike, fmt: str) -> Exception:
    """The error for a file in another format, with the command that converts it."""
    from jckpt.errors import FormatError

    path = os.fspath(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    return FormatError(f"this file is in {fmt} format, not a jckpt checkpoint", file=path,
                       fix=f"convert it first: jckpt convert {path} {stem}.jckpt "
                           "(or jckpt.convert in Python)")


def info(path: str | os.PathLike, *, best_metric: str | None = None,
         best_mode: str = 'min') -> FileInfo | DirectoryInfo | ManagerInfo:
    """A summary of the checkpoint at ``path``, read from its header alone.

    Returns a value whose ``repr`` is a table of namespaces, paths, dtypes,
    shapes, sizes, offsets and whether each payload can be memory-mapped,
    with totals and the header's metadata (writer, step, trainer state,
    lineage, ...). In Jupyter it renders as an HTML table.

    A multi-process checkpoint (a directory with an index) gives a
    :class:`DirectoryInfo`: the global arrays and the piece files holding
    them. A checkpoint manager directory (``step_00000100.jckpt`` steps) gives a
    :class:`ManagerInfo` instead: a table of steps, sizes and metrics, with
    the latest step and the best one by ``best_metric`` (``best_mode``
    ``'min'`` or ``'max'``).

    Raises :class:`~jckpt.errors.FormatError` naming the file when it is
    missing or not a valid checkpoint (and, for a file in another format
    such as safetensors or npz, the conversion that reads it).

    Example::

        >>> jckpt.info("ckpt.jckpt")                 # doctest: +SKIP
        ckpt.jckpt: jckpt file, 3 entries in 1 namespace, 1.5 MiB of payloads, ...
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        if is_directory_checkpoint(path):
            return directory_info(path)
        if is_manager_directory(path):
            return manager_info(path, best_metric=best_metric, best_mode=best_mode)
        from jckpt.errors import FormatError
        from jckpt.format.names import INDEX_NAME, PIECE_RE

        if any(PIECE_RE.match(n) for n in os.listdir(path)):
            raise FormatError(f"piece files but no {INDEX_NAME}: a multi-process save that did "
                              "not finish; it is not a checkpoint", file=path,
                              fix="use the previous complete checkpoint")

        raise FormatError("directory holds no checkpoint (no index.jckpt, no "
                          "step_NNNNNNNN.jckpt steps)", file=path,
                          fix="pass a checkpoint file, a multi-process checkpoint directory or a "
                              "checkpoint manager's directory")
    from jckpt.errors import FormatError

    try:
        return file_info(path)
    except FormatError:
        fmt = foreign_format(path)
        if fmt is None:
            raise
        raise not_jckpt_error(path, fmt) from None


__all__ = ['ArrayInfo', 'DirectoryInfo', 'EntryInfo', 'FileInfo', 'ManagerInfo', 'PieceFileInfo',
           'StepInfo', 'directory_info', 'file_info', 'info', 'manager_info']
