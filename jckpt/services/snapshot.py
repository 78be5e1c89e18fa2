"""A snapshot: a tree's leaves copied into host buffers, and the entries that describe them.

A `Slot` holds one snapshot's host buffers and is reused from snapshot
to snapshot; `Slot.fill` is the only step of a background save that the
training loop waits for. `build_entries` turns the host arrays into
entries with their checksums (on the writer's thread), and
`content_digest` says when two snapshots would write the same
generation, so an unchanged state is not written again.

>>> import numpy as np
>>> leaves = [('jckpt', (('k', 'w'),), np.ones(3, np.float32))]
>>> items = Slot(0).fill(leaves)
>>> entries, sources = build_entries(items)
>>> entries[0].name, entries[0].dims
('jckpt/w', (3,))
>>> content_digest(entries, {'note': 'a'}) == content_digest(entries, {'note': 'b'})
False
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jckpt.api.context import Context
from jckpt.format import payload as payload_mod
from jckpt.format.entries import Entry, KeyPath, entry_for
from jckpt.format.names import RESERVED_PREFIX
from jckpt.storage.writer import ArraySource
from jckpt.trees import placement
from jckpt.trees import pytree as tree_mod

#: A leaf as submitted: ``(namespace, path, leaf)``; the leaf is anything a tree may hold.
Leaf = tuple[str, KeyPath, Any]

#: What makes two generations equal (see :func:`content_digest`).
Digest = tuple[tuple[tuple[Any, ...], ...], tuple[tuple[str, str], ...]]


class HostLeaf(NamedTuple):
    """One leaf of a snapshot, on the host: where it goes and its private copy."""

    namespace: str
    path: KeyPath
    array: np.ndarray
    key_impl: str | None


def namespace_leaves(trees: Mapping[str, Any]) -> list[Leaf]:
    """`(namespace, path, leaf)` of every leaf of `{namespace: tree}`, refusing a bad namespace."""
    leaves: list[Leaf] = []
    for namespace, tree in trees.items():
        Context(namespace=namespace)  # validates the name
        leaves.extend((namespace, p, leaf) for p, leaf in tree_mod.flatten(tree))
    return leaves


class Slot:
    """One snapshot's worth of host buffers, reused from snapshot to snapshot."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.buffers: list[np.ndarray] = []

    def fill(self, leaves: Sequence[Leaf]) -> list[HostLeaf]:
        """Copy every leaf into this slot's buffers (device-to-host for JAX arrays).

        The leaves come to host through `jckpt.trees.placement.host_leaves`,
        so every device transfer is started before any is awaited. A private
        host array (what a transfer from an accelerator made) is adopted as
        it is; anything else (a CPU or numpy leaf, which may alias memory the
        caller will reuse) is copied into the slot's buffer of its shape.
        """
        hosts = placement.host_leaves(
            [(tree_mod.leaf_name(namespace, path), leaf) for namespace, path, leaf in leaves])
        buffers = [h.array if h.private else self._copy(i, h.array) for i, h in enumerate(hosts)]
        self.buffers = buffers
        return [HostLeaf(namespace, path, array, h.key_impl)
                for (namespace, path, _), array, h in zip(leaves, buffers, hosts)]

    def _copy(self, i: int, host: np.ndarray) -> np.ndarray:
        """`host` copied into this slot's `i`-th buffer (a new one if that does not fit)."""
        buf = self.buffers[i] if i < len(self.buffers) else None
        if buf is None or buf.shape != host.shape or buf.dtype != host.dtype or not buf.flags.writeable:
            buf = np.empty(host.shape, host.dtype)
        np.copyto(buf, host)
        return buf


def _array_checksum(array: np.ndarray) -> tuple[str, str]:
    hasher = payload_mod.new_hasher()
    for chunk in payload_mod.iter_payload_chunks(array):
        hasher.update(chunk)
    return payload_mod.hasher_checksum(hasher)


def build_entries(items: Sequence[HostLeaf]) -> tuple[tuple[Entry, ...], tuple[ArraySource, ...]]:
    """Entries (with checksums, ids per namespace in order) and payload sources for `items`."""
    next_ids: dict[str, int] = {}
    entries, sources = [], []
    for namespace, path, array, key_impl in items:
        ident = next_ids.get(namespace, 0)
        next_ids[namespace] = ident + 1
        sum_ = _array_checksum(array)
        entries.append(entry_for(namespace, path, array.dtype, array.shape, id=ident,
                                 checksum=sum_, key_impl=key_impl))
        sources.append(ArraySource(array, sum_))
    return tuple(entries), tuple(sources)


def content_digest(entries: Sequence[Entry], metadata: Mapping[str, str]) -> Digest:
    """What makes two generations equal: entries' identity, type, shape, checksum, user metadata."""
    return (tuple((e.namespace, e.path, e.prec, e.dims, e.key_impl, e.checksum) for e in entries),
            tuple(sorted((k, v) for k, v in metadata.items() if not k.startswith(RESERVED_PREFIX))))


__all__ = ['Digest', 'HostLeaf', 'Leaf', 'Slot', 'build_entries', 'content_digest',
           'namespace_leaves']
