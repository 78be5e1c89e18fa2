"""The summary of another tool's checkpoint: what `jckpt inspect model.safetensors` shows.

A safetensors, PyTorch, numpy, llm.c or orbax checkpoint is listed as
`jckpt.convert` would read it: each array's namespace, path, dtype, shape and
size, with the file's own metadata (safetensors' `__metadata__`, orbax's
`_CHECKPOINT_METADATA`), opened by `jckpt.adapters.tree_reader.open_foreign`:
files are read the way the converter reads them, mapped and never copied
where the format allows (safetensors, `.pt`, `.npy`, llm.c); an orbax
directory is described from its metadata alone.
Reading checks the file as a conversion would, so a damaged or crafted file
gets the converter's error.

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), 'w.npz')
>>> np.savez(path, w=np.zeros((2, 3), np.float32), b=np.zeros(3, np.float32))
>>> s = foreign_info(path, 'npz')
>>> [(e.path, e.dtype, e.shape) for e in s.entries]
[('b', 'float32', (3,)), ('w', 'float32', (2, 3))]
"""

from __future__ import annotations

import dataclasses
import html
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

from jckpt.adapters.tree_reader import open_foreign, stored_files
from jckpt.format._gc import paused
from jckpt.format.entries import path_name
from jckpt.tools.render import (
    REPR_ROWS,
    VALUE_WIDTH,
    column_table,
    format_shape,
    html_table,
    human_bytes,
    plural,
    printable,
    shorten,
)
from jckpt.tools.summary import _Totals, tree_size

_COLUMNS = ('namespace', 'path', 'dtype', 'shape', 'size')
_RIGHT = (4,)


class ArrayRow(NamedTuple):
    """One array of a foreign checkpoint: `namespace`, `path` (`a/b/0`), `dtype` (numpy's
    name), `shape`, `nbytes`. A named tuple: a listing makes one per array, 200,000 for a
    large safetensors file, and a tuple is made several times faster than a dataclass."""

    namespace: str
    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.path}"

    def to_dict(self) -> dict[str, Any]:
        return {**self._asdict(), 'shape': list(self.shape)}


@dataclasses.dataclass(frozen=True)
class ForeignInfo(_Totals):
    """The summary of a checkpoint in another format: `path`, `format`, `size` (bytes on
    disk, a sharded index's shards included), the file's `metadata` pairs and one `ArrayRow`
    per array (`entries`). `repr` prints a table; in Jupyter it renders as HTML; `to_dict`
    gives the JSON form."""

    path: str
    format: str
    size: int
    metadata: tuple[tuple[str, str], ...]
    entries: tuple[ArrayRow, ...]

    kind = 'foreign'

    def _description(self) -> str:
        return (f"{self.format} checkpoint, {plural(len(self.entries), 'array')} in "
                f"{plural(len(self.namespaces), 'namespace')}, "
                f"{human_bytes(self.payload_bytes)} of arrays, {human_bytes(self.size)} on disk; "
                f"jckpt convert makes it a jckpt file")

    def _columns(self, limit: int | None) -> list[Sequence[str]]:
        """The table's cells, column by column (each made in C, not a list per row)."""
        shown = self.entries if limit is None else self.entries[:limit]
        if not shown:
            return [()] * len(_COLUMNS)
        namespaces, paths, dtypes, shapes, sizes = zip(*shown)
        shape_text = {shape: format_shape(shape) for shape in set(shapes)}
        size_text = {n: human_bytes(n) for n in set(sizes)}
        return [namespaces, paths, dtypes, list(map(shape_text.__getitem__, shapes)),
                list(map(size_text.__getitem__, sizes))]

    @paused  # a list per row, and no cycle
    def render(self, limit: int | None = None, width: int | None = VALUE_WIDTH) -> str:
        """The text view: summary, metadata, the arrays' table (`limit` rows at most)."""
        columns = self._columns(limit)
        shown = len(columns[0])
        parts = [f"{self.path}: {self._description()}",
                 *(f"{printable(k)}: {shorten(v, width)}" for k, v in self.metadata), '']
        parts.append(column_table(_COLUMNS, columns, right=_RIGHT) if shown else '(no arrays)')
        if shown < len(self.entries):
            parts.append(f"... {len(self.entries) - shown} more arrays")
        return '\n'.join(parts)

    def __repr__(self) -> str:
        return self.render(limit=REPR_ROWS)

    def _repr_html_(self) -> str:
        meta = ''.join(f"<tr><th style=\"text-align:left\">{html.escape(k)}</th><td><code>"
                       f"{html.escape(shorten(v))}</code></td></tr>" for k, v in self.metadata)
        return (f"<div><p><b>{html.escape(self.path)}</b>: {html.escape(self._description())}"
                f"</p><table>{meta}</table>"
                f"{html_table(_COLUMNS, list(zip(*self._columns(REPR_ROWS))), right=_RIGHT)}</div>")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data."""
        return {'kind': self.kind, 'path': self.path, 'format': self.format, 'size': self.size,
                'metadata': dict(self.metadata), 'entries': [e.to_dict() for e in self.entries],
                'totals': {'entries': len(self.entries), 'payload_bytes': self.payload_bytes,
                           'namespaces': self.namespaces}}


@paused  # an object or more per array, and no cycle: the collector would walk them all
def foreign_info(path: str | os.PathLike, fmt: str) -> ForeignInfo:
    """The `ForeignInfo` of the checkpoint at `path`, in the format `fmt` (a name
    `jckpt.detect_format` gives); the format's reader's `FormatError` for a damaged file."""
    path = os.fspath(path)
    reader = open_foreign(path, fmt)
    specs = list(reader.specs())
    namespaces, paths, dtypes, shapes, sizes = zip(*specs) if specs else ((),) * 5
    names = {dtype: dtype.name for dtype in set(dtypes)}  # each dtype's name looked up once
    rows = map(ArrayRow._make, zip(namespaces, map(path_name, paths),  # columns zipped in C
                                   map(names.__getitem__, dtypes), map(tuple, shapes), sizes))
    size = sum(map(tree_size, stored_files(path)))  # an index's shards with it
    return ForeignInfo(path, fmt, size, tuple(reader.metadata), tuple(rows))


__all__ = ['ArrayRow', 'ForeignInfo', 'foreign_info']
