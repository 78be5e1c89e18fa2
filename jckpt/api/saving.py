"""`save`: a pytree to one checkpoint file, atomically.

The steps, each a function below: flatten the tree and bring every leaf to
host (`jckpt.trees.to_host.host_leaves`: every transfer started
before any is awaited, sharded arrays as their distinct shards); build one
entry per leaf (`jckpt.format.entries.entry_for`), merged with the
entries an appending save keeps; publish the file (the writer streams each
payload, hashing it, then renames the file over `path`).

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), 'model.jckpt')
>>> save(Context(), {'w': np.ones((2, 3)), 'step': 7}, path)
>>> from jckpt.api.loading import describe
>>> [e.name for e in describe(path).tensors]
['jckpt/step', 'jckpt/w']
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jckpt.api import progress as progress_mod
from jckpt.api.agreement import refusing
from jckpt.api.context import Context, check_context
from jckpt.api.multiprocess import save_directory
from jckpt.api.pairing import refused_save
from jckpt.errors import CheckpointError, FormatError, InputError, naming_file
from jckpt.format import leaf_entries
from jckpt.format._gc import paused
from jckpt.format.entries import Entry, Header, KeyPath, entry_for, round_up
from jckpt.format.layout import written_header
from jckpt.format.limits import check_alignment
from jckpt.format.metadata import check_metadata, empty_nodes_text
from jckpt.format.names import EMPTY_NODES_KEY, INDEX_NAME
from jckpt.format.payload import CHECKSUM_PLACEHOLDER
from jckpt.storage import staging
from jckpt.storage.backend import LOCAL, backend_for, checked_path, folder_path_error, names_folder
from jckpt.storage.object_store import MISSING_OBJECT
from jckpt.storage.reader import CheckpointReader, reopen
from jckpt.storage.regions import ShardedSource
from jckpt.storage.writer import (
    SMALL_PAYLOAD,
    ArraySource,
    BytesSource,
    CopySource,
    ReaderSource,
    array_source,
    write_checkpoint,
)
from jckpt.trees import pytree as tree_mod
from jckpt.trees import to_host, transfers
from jckpt.trees.nested import check_one_tree

PathLike = str | os.PathLike


@paused
def save(ctx: Context, tree: Any, path: PathLike, *, appending: bool = False,
         alignment: int | None = None, metadata: Mapping[str, str] | None = None,
         progress: bool = False) -> None:
    """Write `tree` to `path` under `ctx.namespace`, atomically and (by default) durably.

    Payloads stream to a staging file next to `path` (never the whole file in
    memory), each hashed as it goes; the file is fsynced and renamed over
    `path`, so a reader sees the old file or the new one, never a mix.

    Args:
      ctx: the context (namespace, alignment, durability).
      tree: a pytree of arrays (`jax.Array`, numpy, Python numbers, typed PRNG keys).
      path: the checkpoint file; a directory checkpoint when several processes
        save together (`jax.process_count() > 1`: call `save` from every one)
        or when `path` already holds one.
      appending: keep every entry of an existing file at `path` that `tree`
        does not replace (matched by namespace and path), with its id. `tree`
        and the entries kept in its namespace must form one tree (`InputError`).
      alignment: payload alignment for this file (default `ctx.alignment`).
      metadata: string pairs stored in the header (merged over an appended file's); a
        value that is not a string, or a key starting with `jckpt.` (reserved for what
        jckpt records: a mirror's lineage and generation, a manager's step), is an
        `InputError` naming its key.
      progress: draw a progress bar on stderr while writing (only when stderr is a terminal).

    Raises:
        InputError: before touching the file, when a leaf cannot be stored.
        StorageError: if the disk fails; the previous file at `path` is left intact.

    Example:
        ```python
        jckpt.save(jckpt.Context(), {"params": params, "step": 100}, "ckpt.jckpt")
        ```
    """
    with refusing(functools.partial(refused_save, path), process=jax.process_index(),
                  processes=jax.process_count()):
        ctx = check_context(ctx, appending=appending, progress=progress)  # first: names a tree as ctx
        path = checked_path(path)
        refused: InputError | None = None
        try:
            metadata = check_metadata(metadata, path)  # refused before anything is written
        except InputError as e:  # a directory save refuses it once it took its turn, in every process
            metadata, refused = {}, e
        backend_for(path).check_target(path)  # a directory in the way, a bucket: before any request
    # several processes save their pieces into one directory; a directory checkpoint stays one
    with naming_file(path):  # a leaf's error names the file too
        if jax.process_count() > 1 or _holds_directory(path):
            if appending and refused is None:
                refused = InputError("appending is not supported for directory checkpoints",
                                     file=path, fix="save the whole tree")
            save_directory(ctx, tree, path, alignment=alignment, failure=refused,
                           metadata=_directory_metadata(metadata, ctx.namespace, tree))
            return
        if refused is not None:
            raise refused
        _save_file(ctx, tree, path, appending, alignment, metadata, progress)


@paused
def save_file(ctx: Context, tree: Any, path: PathLike) -> None:
    """`save` of `tree` as one file that this process alone writes, whatever the process count:
    what a writer that runs on one process of several uses (orbax's handler, on process 0).
    Every leaf must be fully addressable from this process."""
    ctx, path = check_context(ctx), checked_path(path)
    backend_for(path).check_target(path)
    with naming_file(path):
        _save_file(ctx, tree, path, False, None, {}, False)


def _save_file(ctx: Context, tree: Any, path: str, appending: bool, alignment: int | None,
               metadata: dict[str, str], progress: bool) -> None:
    if names_folder(path):  # a file's name: not saved without the '/', nor failing late
        raise folder_path_error(path, saving=True)
    items, empty = tree_mod.flatten_with_empty(tree)
    # CPU arrays stay jax.Arrays: a small one's payload is a view of its buffer (no numpy copy of
    # the array object, one buffer export), a larger one becomes numpy in `_source`
    hosts = to_host.host_leaves(items, namespace=ctx.namespace, pieces=True, keep_cpu=True)
    alignment = check_alignment(ctx.alignment if alignment is None else alignment, path)
    old = _appended(path) if appending else None
    metadata = _with_empty_nodes(metadata, old, ctx.namespace, empty, [p for p, _ in items])
    entries, sources = _entries(ctx, [p for p, _ in items], hosts,
                                kept=old.header.tensors if old is not None else (), alignment=alignment)
    if old is not None:  # the namespace saved into: the tree and the entries kept there
        check_one_tree([e for e in entries if e.namespace == ctx.namespace], file=path,
                       fix="save the namespace whole without appending=True, or under "
                           "another namespace")
    header = _header(entries, alignment, old.header if old is not None else Header(), metadata)
    if old is None:
        _publish(ctx, path, header, sources, progress)
    else:
        _publish_appended(ctx, path, header, entries, sources, old, progress)
    staging.remove_abandoned(path)  # a killed mirror's generations of this path (one stat else)


def _appended(path: str) -> Any:
    """The checkpoint at `path` whose entries an appending save keeps (None when nothing is there)."""
    backend = backend_for(path)
    if backend is LOCAL:
        return CheckpointReader(path) if os.path.exists(path) else None
    try:  # in a bucket, the header's GET says whether it is there: no HEAD first
        return backend.open(path)
    except FormatError as e:
        if e.message != MISSING_OBJECT:
            raise
        return None


def _publish_appended(ctx: Context, path: str, header: Header, entries: Sequence[Entry],
                      sources: Sequence[Any], old: Any, progress: bool) -> None:
    """Publish with the kept entries' payloads copied from the very checkpoint whose header was read."""
    if getattr(old, 'remote', False):  # an object: fetched by ranges conditional on the version read
        _publish(ctx, path, header, [ReaderSource(old, e) if s is None else s
                                     for e, s in zip(entries, sources)], progress)
        return
    fd = reopen(old, "opening the checkpoint to append to")
    try:
        sources = [CopySource(fd, old.data_start + e.offset, e.byte_length, e.checksum)
                   if s is None else s for e, s in zip(entries, sources)]
        _publish(ctx, path, header, sources, progress)
    finally:
        os.close(fd)


def _with_empty_nodes(metadata: dict[str, str], old: CheckpointReader | None, namespace: str,
                      empty: Sequence[KeyPath], stored: Sequence[KeyPath]) -> dict[str, str]:
    """`metadata` with the key paths of the tree's nodes without leaves (`EMPTY_NODES_KEY`),
    merged with an appended file's, so that an orbax export can rebuild them."""
    before = old.header.metadata_dict().get(EMPTY_NODES_KEY) if old is not None else None
    text = empty_nodes_text(before, namespace, empty, stored)
    if text is None:
        return metadata
    return {**metadata, EMPTY_NODES_KEY: text}


def _directory_metadata(metadata: dict[str, str], namespace: str, tree: Any) -> dict[str, str]:
    """`_with_empty_nodes` of a directory save, or `metadata` alone where `tree` cannot be
    flattened: `save_directory` meets that error once this process has taken its turn in the
    run's saves and tells the others, where raising it here left them waiting for this save
    and paired this process's next save with it."""
    try:
        empty = tree_mod.flatten_with_empty(tree)[1]
    except InputError:
        return metadata
    return _with_empty_nodes(metadata, None, namespace, empty, ())


def _holds_directory(path: str) -> bool:
    """Whether `path` holds a directory checkpoint (for a URL, an index under its prefix)."""
    index = os.path.join(path, INDEX_NAME)
    backend = backend_for(path)
    if backend is LOCAL:
        return os.path.isfile(index)
    try:
        return backend.exists(index)
    except CheckpointError as e:  # the checkpoint's URL, not its index's
        e.file = path
        raise


#: Whether `_entries` builds the entries of small host leaves in C where the accelerator is built
#: (False: every leaf through `entry_for` in Python, the reference the tests compare it with).
ACCELERATE = True


def _entries(ctx: Context, paths: Sequence[KeyPath], hosts: Sequence[to_host.HostLeaf], *,
             kept: Sequence[Entry] = (), alignment: int) -> tuple[list[Entry], list[Any]]:
    """Entries and payload sources for host leaves saved under `ctx.namespace`.

    `kept` (an appended file's entries) come first, in their order; a leaf
    with the identity of a kept entry replaces it in its place, with its id.
    New leaves follow in tree order, with ids above every id of the namespace
    in `kept` and in `ctx`'s registry. A kept entry not replaced has the
    source `None` (its payload is copied from the old file).
    """
    namespace = ctx.namespace
    next_id = max([ctx.registry.max_id(namespace)]
                  + [e.id for e in kept if e.namespace == namespace]) + 1
    if not kept and ACCELERATE and leaf_entries.accelerator is not None:
        return _new_entries(namespace, list(paths), list(hosts), next_id, alignment)
    slots = {e.identity: i for i, e in enumerate(kept)}
    entries: list[Entry] = list(kept)
    sources: list[Any] = [None] * len(kept)
    cursor = 0  # without kept entries, the offsets lay_out plans: no second pass over 1e5 entries
    for path, host in zip(paths, hosts):
        slot = slots.get((namespace, path)) if slots else None
        if slot is None:
            ident, next_id = next_id, next_id + 1
        else:
            ident = kept[slot].id
        offset = 0 if kept else round_up(cursor, alignment)
        entry, source = _entry(namespace, path, host, ident, offset)
        cursor = offset + entry.byte_length
        if slot is None:
            entries.append(entry)
            sources.append(source)
        else:
            entries[slot] = entry
            sources[slot] = source
    return entries, sources


def _new_entries(namespace: str, paths: list[KeyPath], hosts: list[to_host.HostLeaf], first_id: int,
                 alignment: int) -> tuple[list[Entry], list[Any]]:
    """`_entries` without kept entries: runs of small leaves built in C, each other leaf in Python."""
    entries: list[Entry] = []
    sources: list[Any] = []
    start, cursor = 0, 0
    while True:
        start, cursor = leaf_entries.build(
            namespace, paths, hosts, start=start, first_id=first_id + start, cursor=cursor,
            alignment=alignment, small_limit=SMALL_PAYLOAD, source_type=BytesSource,
            entries=entries, sources=sources)
        if start == len(hosts):
            return entries, sources
        offset = round_up(cursor, alignment)
        entry, source = _entry(namespace, paths[start], hosts[start], first_id + start, offset)
        entries.append(entry)
        sources.append(source)
        cursor = offset + entry.byte_length
        start += 1


def _entry(namespace: str, path: KeyPath, host: to_host.HostLeaf, ident: int,
           offset: int) -> tuple[Entry, Any]:
    """One leaf's entry, at `offset` with id `ident`, and its payload source."""
    source, checksum = _source(host)
    return entry_for(namespace, path, host.dtype, host.shape, id=ident, key_impl=host.key_impl,
                     checksum=checksum, offset=offset), source


def _source(host: to_host.HostLeaf) -> tuple[ArraySource | ShardedSource, tuple[str, str]]:
    """What streams a host leaf's payload (its whole array, or its shards written in place),
    and the checksum its entry starts with (the real one where known already)."""
    if host.array is not None:  # a CPU jax.Array kept by the staging (`keep_cpu`) as numpy
        return array_source(np.asarray(host.array))
    return ShardedSource(host.shape, host.dtype, [(box, functools.partial(transfers.await_host, data))
                                                  for box, data in host.shards]), CHECKSUM_PLACEHOLDER


def _header(entries: Sequence[Entry], alignment: int, old: Header,
            metadata: Mapping[str, str] | None) -> Header:
    """The laid-out header; `metadata` merged over the old file's, whose unknown fields are kept.
    The empty nodes' record is `metadata`'s alone (`_with_empty_nodes` merged the old file's
    into it): an old one left where the save filled every empty node would name nodes that
    now hold leaves."""
    meta = dict(old.metadata)
    meta.update(metadata or {})
    if EMPTY_NODES_KEY not in (metadata or {}):
        meta.pop(EMPTY_NODES_KEY, None)
    return written_header(entries, alignment, metadata=list(meta.items()), extra=old.extra)


def _publish(ctx: Context, path: str, header: Header, sources: Sequence[Any], progress: bool) -> None:
    with progress_mod.bar(f"saving {os.path.basename(path)}",
                          sum(e.byte_length for e in header.tensors), enabled=progress) as bar:
        write_checkpoint(path, header, sources, durable=ctx.durable,
                         on_payload=(lambda e: bar.advance(e.byte_length)) if bar.drawn else None)


__all__ = ['save']
