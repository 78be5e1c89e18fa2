"""The `jckpt` format itself, as an adapter: every namespace in one atomic write.

`read` is `jckpt.api.loading.load` with host arrays (zero-copy views of the
file); `write` stores every namespace of `{namespace: subtree}` in one
file published by a single rename (`jckpt.save` writes one namespace).

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), 'two.jckpt')
>>> write({'model': {'w': np.ones(2)}, 'opt': {'m': np.zeros(2)}}, path)
>>> sorted(read(path))
['model', 'opt']
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from jckpt.adapters import register_format
from jckpt.adapters._common import empty_record, host_items_with_keys
from jckpt.api.context import Context
from jckpt.format.entries import DEFAULT_ALIGNMENT, Header, KeyPath, entry_for
from jckpt.format.layout import written_header
from jckpt.format.names import EMPTY_NODES_KEY, INDEX_NAME, ORBAX_JSON_KEY, RESERVED_PREFIX
from jckpt.format.sniff import looks_like_header
from jckpt.storage.backend import LOCAL, backend_for
from jckpt.storage.checkpoint import open_checkpoint, reusing
from jckpt.storage.writer import ArraySource, write_checkpoint
from jckpt.trees.nested import with_recorded_empty_nodes


def sniff(path: str, head: bytes | None) -> bool:
    """A file whose first bytes start like a jckpt header
    (`looks_like_header`); or a directory checkpoint
    (multi-process), which holds `index.jckpt`."""
    if head is None:
        backend = backend_for(path)
        return INDEX_NAME in backend.list(path) if backend is not LOCAL else \
            os.path.isfile(os.path.join(path, INDEX_NAME))
    return looks_like_header(head)


def read(path: str) -> dict[str, Any]:
    """Every entry of the file (or directory checkpoint) as `{namespace: subtree}` of host
    numpy arrays, with `None` where the saved tree had a node without leaves (an optax
    `EmptyState`: recorded under `EMPTY_NODES_KEY`), so an orbax export keeps it; a
    namespace of such nodes alone (`optax.sgd`'s state) is there too. Every
    payload is checked against its checksum (`ChecksumError`): what is read here is written
    out again (`jckpt.convert`), and a damaged payload must not be sealed in another file."""
    return read_with_metadata(path)[0]


def read_metadata(path: str) -> dict[str, str]:
    """What the file holds besides arrays that another format would lose: the user's
    metadata and orbax's JSON items (what jckpt records of the tree itself is left out:
    the writer keeps the tree's structure by its own means)."""
    from jckpt.api.loading import describe

    return _kept_metadata(describe(path).metadata_dict())


def read_with_metadata(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """`(read(path), read_metadata(path))` from one opening of the checkpoint: its header
    (of a directory checkpoint, its index) is read and checked once, not three times, for
    `convert` and `jckpt inspect`."""
    from jckpt.api.loading import load  # JAX: imported only when a checkpoint is read

    with reusing(open_checkpoint(path)) as reader:
        _, tree = load(Context(host=True), path, verify=True)
    meta = reader.header.metadata_dict()
    return with_recorded_empty_nodes(tree, meta.get(EMPTY_NODES_KEY)), _kept_metadata(meta)


def _kept_metadata(meta: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in meta.items() if not k.startswith(RESERVED_PREFIX) or k == ORBAX_JSON_KEY}


def build_header(items: Sequence[tuple[str, KeyPath, Any]], *, alignment: int = DEFAULT_ALIGNMENT,
                 metadata: Sequence[tuple[str, str]] = (),
                 key_impls: Sequence[str | None] | None = None) -> Header:
    """A laid-out header for `(namespace, path, host array)` items, ids counted per namespace;
    `key_impls` names the PRNG implementation of the items that are typed keys' data."""
    next_id: dict[str, int] = {}
    entries = []
    impls = key_impls if key_impls is not None else [None] * len(items)
    for (ns, path, array), impl in zip(items, impls):
        ident = next_id.get(ns, 0)
        next_id[ns] = ident + 1
        entries.append(entry_for(ns, path, array.dtype, array.shape, id=ident, key_impl=impl))
    return written_header(entries, alignment, metadata=metadata)


def write_items(items: Sequence[tuple[str, KeyPath, Any]], path: str, *,
                alignment: int = DEFAULT_ALIGNMENT,
                metadata: Sequence[tuple[str, str]] = (),
                key_impls: Sequence[str | None] | None = None) -> Header:
    """Write host arrays as one jckpt file, atomically and durably; return the header."""
    header = build_header(items, alignment=alignment, metadata=metadata, key_impls=key_impls)
    return write_checkpoint(path, header, [ArraySource(a) for _, _, a in items])


def write(tree: Any, path: str, *, metadata: dict[str, str] | None = None) -> None:
    """Write `{namespace: subtree}` to one jckpt file (typed PRNG keys stay keys), with
    `metadata` (string pairs) in its header and the tree's nodes without leaves recorded."""
    path = os.fspath(path)
    items = host_items_with_keys(tree, path)
    meta = dict(metadata or {})
    empty = empty_record(tree)
    if empty is not None:
        meta[EMPTY_NODES_KEY] = empty
    write_items([(ns, p, a) for ns, p, a, _ in items], path, key_impls=[k for *_, k in items],
                metadata=tuple(meta.items()))


def register() -> None:
    register_format('jckpt', read=read, write=write, sniff=sniff, extensions=('.jckpt',),
                    read_metadata=read_metadata, keeps_metadata=True, replace=True,
                    read_with_metadata=read_with_metadata)
