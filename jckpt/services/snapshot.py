"""A snapshot: a tree's leaves held immutable at submit, and the entries that describe them.

A `Slot` holds one snapshot's buffers (host buffers for numpy leaves, device
images for jax arrays) and is reused from snapshot to snapshot;
`Slot.take` is the only step of a background save that the training loop
waits for, and `Snapshot.drain` brings what is still on a device to host on
the writer's thread. `build_entries` turns the host arrays into entries with
their checksums (on the writer's thread too), and `content_digest` says when
two snapshots would write the same generation, so an unchanged state is not
written again.

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

import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jckpt.api.context import Context
from jckpt.errors import InputError
from jckpt.format import payload as payload_mod
from jckpt.format._gc import paused
from jckpt.format.entries import Entry, KeyPath, entry_for, path_name
from jckpt.format.fastpath import accelerator
from jckpt.format.names import EMPTY_NODES_KEY, RESERVED_PREFIX
from jckpt.storage.writer import ArraySource
from jckpt.trees import image, to_host
from jckpt.trees import pytree as tree_mod

log = logging.getLogger('jckpt')

#: A leaf as submitted: `(namespace, path, leaf)`; the leaf is anything a tree may hold.
Leaf = tuple[str, KeyPath, Any]

#: What makes two generations equal (see `content_digest`).
Digest = tuple[tuple[tuple[Any, ...], ...], tuple[tuple[str, str], ...]]


class SnapshotLeaf(NamedTuple):
    """One leaf of a snapshot, on the host: where it goes and its private copy."""

    namespace: str
    path: KeyPath
    array: np.ndarray
    key_impl: str | None


@paused  # on the training loop's time: a collection walking its live objects costs 100+ ms
def namespace_leaves(trees: Mapping[str, Any]) -> list[Leaf]:
    """`(namespace, path, leaf)` of every leaf of `{namespace: tree}`, refusing a bad namespace."""
    leaves: list[Leaf] = []
    for namespace, tree in trees.items():
        Context(namespace=namespace)  # validates the name
        leaves.extend((namespace, p, leaf) for p, leaf in tree_mod.flatten(tree))
    _check_text(leaves)
    return leaves


def _check_text(leaves: Sequence[Leaf]) -> None:
    """Refuse a key no UTF-8 text holds (a lone surrogate, `os.fsdecode`'s of a bad byte) when
    the tree is given: a mirror or manager writes in the background, where the header's
    encoding would fail, the call long returned."""
    def keys(path: KeyPath) -> str:
        return '\n'.join(str(v) for _, v in path)

    try:  # one pass over the text keys (a 100,000-leaf tree: 20 ms, not 70); the leaf on failure
        '\n'.join([v for _, p, _ in leaves for _, v in p if type(v) is str]).encode('utf-8')
    except UnicodeEncodeError:
        for namespace, path, _ in leaves:
            try:
                keys(path).encode('utf-8')
            except UnicodeEncodeError:
                shown = f"{namespace}/{path_name(path)}".encode('utf-8', 'backslashreplace')
                raise InputError("a key of the leaf's path holds a lone surrogate, which no UTF-8 "
                                 "text, and so no header, can hold", entry=shown.decode(),
                                 fix="drop the character, or encode the text "
                                     "(text.encode('utf-8', 'surrogateescape').hex())") from None


def empty_nodes_metadata(trees: Mapping[str, Any]) -> dict[str, str]:
    """The metadata entry (`EMPTY_NODES_KEY`) recording the key paths of `{namespace: tree}`'s
    nodes without leaves, as `save` records them; `{}` when there are none.

    >>> empty_nodes_metadata({'opt': [{'count': 1}, (), None]})
    {'jckpt.empty_nodes': '{"opt": [[["i", 1]], [["i", 2]]]}'}
    """
    text = tree_mod.empty_nodes_record(trees)
    return {} if text is None else {EMPTY_NODES_KEY: text}


class Snapshot:
    """A slot's snapshot as submit took it: host arrays, and device images still to drain.

    Taking it is what the training loop waits for; `drain` (on the writer's
    thread) brings the device images to host memory.
    """

    def __init__(self, leaves: Sequence[Leaf], hosts: list[Any], imaged: list[int],
                 images: list[Any], key_impls: list[str | None]) -> None:
        self._leaves = [(namespace, path) for namespace, path, _ in leaves]
        self._hosts = hosts
        self._imaged = imaged
        self.images = images
        self._key_impls = key_impls

    @property
    def on_device(self) -> bool:
        """Whether some leaves were imaged on their device (and are drained later)."""
        return bool(self._imaged)

    def drain(self) -> list[SnapshotLeaf]:
        """Every leaf in host memory, in submit order (device images transferred now)."""
        arrays = list(self._hosts)
        for i, array in zip(self._imaged, image.drain(self.images)):
            arrays[i] = array
        return [SnapshotLeaf(namespace, path, array, impl)
                for (namespace, path), array, impl in zip(self._leaves, arrays, self._key_impls)]


class Slot:
    """One snapshot's worth of buffers, host and device, reused from snapshot to snapshot.

    Args:
      index: the slot's number.
      image_limit: bytes a device image may take (None: as much as the devices have free;
        0: never image, copy accelerator arrays to host at submit).
    """

    def __init__(self, index: int, image_limit: int | None = None) -> None:
        self.index = index
        self.image_limit = image_limit
        self.buffers: dict[int, np.ndarray] = {}
        self._images = image.Images()

    @paused  # the loop waits for this: no cyclic collection in the middle of it
    def take(self, leaves: Sequence[Leaf]) -> Snapshot:
        """Snapshot `leaves` the fastest way that survives donation and overwriting of them.

        * jax arrays (on an accelerator or the CPU): an image on their device,
          one dispatched copy into this slot's previous image
          (`jckpt.trees.image.Images`), when the devices have room for it;
          else a transfer to host memory now (into pinned buffers the runtime
          reuses, small arrays joined: `jckpt.trees.transfers.start_host_copies`),
          or a copy for a CPU array.
        * numpy leaves: copied into this slot's host buffers, allocated once
          and reused from snapshot to snapshot (no page faults after the first).
        """
        with to_host.naming_unusable(lambda: ((tree_mod.leaf_name(namespace, path), leaf)
                                              for namespace, path, leaf in leaves)):
            return self._take(leaves)

    def _take(self, leaves: Sequence[Leaf]) -> Snapshot:
        arrays = [leaf for _, _, leaf in leaves]
        devices = image.imageable_indices(arrays)
        if devices and not image.has_room([arrays[i] for i in devices], self.image_limit):
            log.info("no device room for a snapshot image: copying to host at submit")
            devices = []
        imaged = set(devices)
        rest = [i for i in range(len(leaves)) if i not in imaged] if imaged else range(len(leaves))
        described = _host_leaves(leaves, devices, fetch=False)
        hosts = _host_leaves(leaves, rest, snapshot=True, keep_cpu=True)  # copied below
        images = self._images.take([arrays[i] for i in devices]) if devices else []
        staged: list[Any] = [None] * len(leaves)
        impls: list[str | None] = [None] * len(leaves)
        for i, h in zip(devices, described):
            staged[i], impls[i] = h.array, h.key_impl  # drained later
        copies: list[tuple[np.ndarray, np.ndarray]] = []
        buffers = self.buffers
        for i, h in zip(rest, hosts):
            impls[i] = h.key_impl
            if h.private:  # a transfer's own fresh buffer
                staged[i] = h.array
                continue
            buf = buffers.get(i)
            if buf is None or buf.shape != h.shape or buf.dtype != h.dtype:
                buf = buffers[i] = np.empty(h.shape, h.dtype)  # reused by later snapshots
            staged[i] = buf
            copies.append((buf, h.array))
        copy_all(copies)
        return Snapshot(leaves, staged, devices, images, impls)

    def fill(self, leaves: Sequence[Leaf]) -> list[SnapshotLeaf]:
        """`take` the leaves and `drain` them at once: every leaf in host memory."""
        return self.take(leaves).drain()


def _host_leaves(leaves: Sequence[Leaf], indices: Sequence[int], **options: Any) -> list[Any]:
    """`to_host.host_leaves` of `leaves[i]` for `i` in `indices`, a run of one namespace at a
    time (so that a leaf is named only in an error, not for every leaf of every snapshot)."""
    out: list[Any] = []
    for namespace, run in itertools.groupby(indices, key=lambda i: leaves[i][0]):
        out.extend(to_host.host_leaves([(leaves[i][1], leaves[i][2]) for i in run],
                                       namespace=namespace, **options))
    return out


def copy_all(copies: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """`np.copyto(dst, src)` for every pair: the one part of a host snapshot the loop waits for.
    A source may be a jax array on the CPU, copied from its buffer (no numpy view made).

    (Splitting large copies across threads was measured on a 2-core machine
    and was slower: one thread already keeps memory busy.)
    """
    if accelerator is not None:  # plain buffers alike are copied in C, in one call
        left = accelerator.copy_arrays([d for d, _ in copies], [s for _, s in copies])
        copies = [copies[i] for i in left]
    for dst, src in copies:
        np.copyto(dst, src)


def _array_checksum(array: np.ndarray) -> tuple[str, str]:
    hasher = payload_mod.new_hasher()
    for chunk in payload_mod.iter_payload_chunks(array):
        hasher.update(chunk)
    return payload_mod.hasher_checksum(hasher)


def build_entries(items: Sequence[SnapshotLeaf]) -> tuple[tuple[Entry, ...], tuple[ArraySource, ...]]:
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


__all__ = ['Digest', 'SnapshotLeaf', 'Leaf', 'Slot', 'Snapshot', 'build_entries',
           'content_digest', 'copy_all', 'empty_nodes_metadata', 'namespace_leaves']
