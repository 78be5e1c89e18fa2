"""A checkpoint in another format opened with a jckpt reader's surface: `header` and `decode`.

The tools that read headers and payloads (`jckpt.info`, `jckpt.diff`) take
a safetensors, `.pt`, numpy or llm.c file the way they take a jckpt file:
`open_foreign` reads it with its format's reader (mapped, never copied, where
the format allows) and describes each array as an `Entry`, with the
`(namespace, path)` identity the same tree saved by jckpt would have. A
directory format that registered a directory reader (orbax) opens through
that reader instead, from its metadata alone.

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), 'w.npz')
>>> np.savez(path, w=np.arange(3.0))
>>> reader = open_foreign(path, 'npz')
>>> [(e.name, e.dims) for e in reader.header.tensors], reader.decode(reader.header.tensors[0])
([('jckpt/w', (3,))], array([0., 1., 2.]))
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from jckpt.adapters import read_with_metadata
from jckpt.adapters.hf_index import index_shards
from jckpt.errors import FormatError
from jckpt.format import precs
from jckpt.format.entries import Entry, Header, KeyPath, entry_for, path_name
from jckpt.storage.backend import backend_for
from jckpt.storage.checkpoint import directory_format
from jckpt.trees.nested import flatten_plain

#: What a listing needs of an array: `(namespace, path, dtype, shape, payload bytes)`.
Spec = tuple[str, KeyPath, np.dtype, tuple[int, ...], int]


class TreeReader:
    """A file in another format, read whole by its format's reader, as a jckpt reader.

    Numbers (a `.pt` file's epoch) are 0-d arrays; strings and None hold no
    array. `header.writer` is the format's name; `header.metadata` what the
    file holds besides arrays (safetensors' `__metadata__`), `metadata` too. The header's
    entries are made when first asked for: `specs` describes the arrays
    without them, which is all a listing needs (`jckpt inspect` of 200,000
    arrays spent a fifth of its time making entries it did not use).
    """

    def __init__(self, path: str | os.PathLike, fmt: str) -> None:
        self.path = os.fspath(path)
        self.format = fmt
        tree, metadata = read_with_metadata(self.path, fmt)  # the file read once
        self._leaves: list[tuple[str, list[tuple[KeyPath, np.ndarray]]]] = []
        for ns, sub in tree.items():
            leaves = [(p, np.asarray(leaf)) for p, leaf in flatten_plain(sub)
                      if isinstance(leaf, (np.ndarray, np.generic, int, float, complex))]
            self._check_dtypes(ns, leaves)
            self._leaves.append((ns, leaves))
        self.metadata = tuple(metadata.items())

    @functools.cached_property
    def header(self) -> Header:
        """One `Entry` per array, ids counted per namespace, in each namespace's JAX order."""
        entries = [entry_for(ns, p, array.dtype, array.shape, id=ident)
                   for ns, leaves in self._leaves for ident, (p, array) in enumerate(leaves)]
        return Header(tensors=tuple(entries), writer=self.format, metadata=self.metadata)

    @functools.cached_property
    def _arrays(self) -> dict[tuple[str, KeyPath], np.ndarray]:
        return {(ns, p): array for ns, leaves in self._leaves for p, array in leaves}

    def specs(self) -> Iterator[Spec]:
        """`(namespace, path, dtype, shape, nbytes)` of each array, in the header's order."""
        return ((ns, p, a.dtype, a.shape, a.nbytes) for ns, leaves in self._leaves for p, a in leaves)

    def _check_dtypes(self, ns: str, leaves: list[tuple[KeyPath, np.ndarray]]) -> None:
        """Refuse the first leaf of a dtype jckpt cannot store (each dtype looked up once)."""
        unsupported = {dt for dt in {a.dtype for _, a in leaves} if not precs.is_supported(dt)}
        for p, array in leaves if unsupported else ():
            if array.dtype in unsupported:
                raise FormatError(f"an array of dtype {array.dtype} has no jckpt element type",
                                  file=self.path, entry=f"{ns}/{path_name(p)}",
                                  fix="the file holds what jckpt cannot represent")

    def decode(self, entry: Entry, *, mmap: bool = True, verify: bool = False,
               count: bool = True) -> np.ndarray:
        """The array of `entry` (one of `header`'s), as the format's reader gave it."""
        return self._arrays[entry.namespace, entry.path]  # type: ignore[index]


def open_foreign(path: str | os.PathLike, fmt: str) -> Any:
    """A reader of the checkpoint in format `fmt` at `path`: a registered directory reader
    where one claims the directory, else a `TreeReader`. Raises the format's `FormatError`
    for a damaged checkpoint."""
    path = os.fspath(path)
    found = directory_format(path) if backend_for(path).isdir(path) else None
    return found.open(path) if found is not None else TreeReader(path, fmt)


def stored_files(path: str | os.PathLike) -> list[str]:
    """The files the checkpoint at `path` is stored in: a Hugging Face index
    (`*.safetensors.index.json`, `pytorch_model.bin.index.json`) and the shards beside it that
    it names, else `path` alone (a directory counts as one). What "on disk" sums: the index
    alone is a few hundred bytes of a model's gigabytes."""
    path = os.fspath(path)
    return [path, *index_shards(path)]


__all__ = ['Spec', 'TreeReader', 'open_foreign', 'stored_files']
