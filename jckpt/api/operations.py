"""The public operations: ``save``, ``load``, ``restore``.

>>> import jax.numpy as jnp, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), 'model.jckpt')
>>> ctx = Context()
>>> save(ctx, {'w': jnp.ones((2, 3)), 'step': 7}, path)
>>> ctx, tree = load(ctx, path)
>>> tree['jckpt']['w'].shape, int(tree['jckpt']['step'])
((2, 3), 7)
>>> restore(Context(), {'w': jnp.zeros((2, 3))}, path)['w'].sum()
Array(6., dtype=float32)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jckpt.api import progress as progress_mod
from jckpt.api.context import Context
from jckpt.api.multiprocess import save_directory
from jckpt.errors import (
    ClashError,
    InputError,
    InUseError,
    MismatchError,
    MissingEntryError,
)
from jckpt.format import precs
from jckpt.format._gc import paused
from jckpt.format.header import Entry, Header, KeyPath, path_name, round_up
from jckpt.format.layout import lay_out
from jckpt.format.payload import CHECKSUM_PLACEHOLDER, stored_dtype
from jckpt.storage.checkpoint import open_checkpoint
from jckpt.storage.publish import storage_error
from jckpt.storage.reader import COUNTS, CheckpointReader
from jckpt.storage.writer import CopySource, write_checkpoint
from jckpt.trees import placement, sharding
from jckpt.trees import pytree as tree_mod
from jckpt.version import __version__

PathLike = str | os.PathLike


def _label(path: KeyPath) -> tuple[str, ...]:
    return tuple([v if type(v) is str else str(v) for _, v in path])


def _keystr(path: KeyPath) -> str:
    """``path_name(path)`` (list-built: it runs once per leaf of every save and restore)."""
    return '/'.join([v if type(v) is str else str(v) for _, v in path]) or '<root>'


@paused
def save(ctx: Context, tree: Any, path: PathLike, *, appending: bool = False,
         alignment: int | None = None, metadata: Mapping[str, str] | None = None,
         progress: bool = False) -> None:
    """Write ``tree`` to ``path`` under ``ctx.namespace``, atomically and (by default) durably.

    Payloads stream to a staging file next to ``path`` (never the whole file in
    memory), each hashed as it goes; the file is fsynced and renamed over
    ``path``, so a reader sees the old file or the new one, never a mix.

    Args:
      ctx: the context (namespace, alignment, durability).
      tree: a pytree of arrays (``jax.Array``, numpy, Python numbers, typed PRNG keys).
      path: the checkpoint file; a directory checkpoint when several processes
        save together (``jax.process_count() > 1``: call ``save`` from every one)
        or when ``path`` already holds one.
      appending: keep every entry of an existing file at ``path`` that ``tree``
        does not replace (matched by namespace and path), with its id.
      alignment: payload alignment for this file (default ``ctx.alignment``).
      metadata: string pairs stored in the header (merged over an appended file's).
      progress: draw a progress bar on stderr while writing (only when stderr is a terminal).

    Raises :class:`~jckpt.errors.InputError` before touching the file when a
    leaf cannot be stored, and :class:`~jckpt.errors.StorageError` if the disk
    fails, in which case the previous file at ``path`` is left intact.

    Example::

        jckpt.save(jckpt.Context(), {"params": params, "step": 100}, "ckpt.jckpt")
    """
    path = os.fspath(path)
    namespace = ctx.namespace
    items = tree_mod.flatten(tree)
    # several processes save their pieces into one directory; a directory checkpoint stays one
    if jax.process_count() > 1 or os.path.isfile(os.path.join(path, 'index.jckpt')):
        if appending:
            raise InputError("appending is not supported for directory checkpoints",
                             file=path, fix="save the whole tree")
        save_directory(ctx, tree, path, alignment=alignment, metadata=metadata)
        return
    # every transfer to host (each distinct shard of sharded arrays) starts before any is awaited
    hosts = [(p, h, h.key_impl) for (p, _), h in zip(items, sharding.prepare_leaves(
        items, namespace, _keystr))]
    alignment = ctx.alignment if alignment is None else alignment
    if not isinstance(alignment, int) or alignment < 1:
        raise InputError(f"alignment must be a positive integer, not {alignment!r}", file=path)

    old: CheckpointReader | None = None
    kept: list[Entry] = []
    if appending and os.path.exists(path):
        old = CheckpointReader(path)
        kept = list(old.header.tensors)
    old_header = old.header if old is not None else Header()
    by_identity = {e.identity: i for i, e in enumerate(kept)}
    next_id = max([ctx.registry.max_id(namespace)]
                  + [e.id for e in kept if e.namespace == namespace]) + 1

    entries: list[Entry | None] = list(kept)
    sources: list[Any] = [None] * len(kept)
    cursor = 0  # without kept entries, the offsets lay_out plans: no second pass over 1e5 entries
    for p, array, key_impl in hosts:  # array: a sharding.HostLeaf
        prec = precs.prec_of(array.dtype)
        slot = by_identity.get((namespace, p))
        ident = kept[slot].id if slot is not None else None
        if ident is None:
            ident, next_id = next_id, next_id + 1
        offset = 0 if kept else round_up(cursor, alignment)
        cursor = offset + array.nbytes
        entry = Entry(id=ident, namespace=namespace, prec=prec, dims=tuple(array.shape),
                      offset=offset, byte_length=array.nbytes, label=_label(p), path=p,
                      key_impl=key_impl, checksum=CHECKSUM_PLACEHOLDER)
        if slot is None:
            entries.append(entry)
            sources.append(array.source)
        else:
            entries[slot] = entry
            sources[slot] = array.source
    if old is not None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise storage_error(e, "opening the checkpoint to append to", path) from e
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != old.file_id:  # kept payloads must come from the file read
            os.close(fd)
            raise InUseError("the file was replaced while this appending save read it",
                             file=path, fix="save again; let one writer at a time append to a "
                                            "path (a jckpt.Mirror holds a lease for that)")
    try:
        for i, e in enumerate(kept):
            if sources[i] is None:
                sources[i] = CopySource(fd, old.data_start + e.offset, e.byte_length, e.checksum)
        meta = dict(old_header.metadata)
        meta.update(metadata or {})
        header = lay_out(Header(tensors=tuple(entries), alignment=alignment,
                                writer=f"jckpt {__version__}", metadata=tuple(meta.items()),
                                extra=old_header.extra))
        with progress_mod.bar(f"saving {os.path.basename(path)}",
                              sum(e.byte_length for e in header.tensors), enabled=progress) as bar:
            write_checkpoint(path, header, sources, durable=ctx.durable,
                             on_payload=lambda e: bar.advance(e.byte_length))
    finally:
        if old is not None:
            os.close(fd)


def _check_clash(ctx: Context, entries: tuple[Entry, ...], path: str) -> None:
    for e in entries:
        if e.identity in ctx.registry:
            raise ClashError("already loaded into this context", file=path, entry=e.name,
                             fix="load with prefix_namespace=... or use a fresh Context")


@paused
def load(ctx: Context, path: PathLike, *, prefix_namespace: str | None = None,
         mmap: bool | None = None, verify: bool | None = None,
         progress: bool = False) -> tuple[Context, dict[str, Any]]:
    """Read every entry of ``path`` as ``{namespace: subtree}``; return it with a new context.

    Subtrees are rebuilt from the stored paths (dicts and lists); path-less
    (OCANNL) entries appear as ``n<id>`` in their namespace. With mapping on
    (the default), payloads that allow it are zero-copy, copy-on-write views
    of the file that stay valid after the call and after the file is replaced.

    Args:
      ctx: the context; the returned one also registers what was loaded.
      path: the checkpoint file, or a directory checkpoint.
      prefix_namespace: rename every namespace ``ns`` to ``prefix + "__" + ns``.
      mmap: map payloads (default ``ctx.mmap``).
      verify: check payload checksums (default: when copying, not when mapping).
      progress: draw a progress bar on stderr while reading (only when stderr is a terminal).

    Raises :class:`~jckpt.errors.ClashError`, before loading anything, if an
    entry is already registered in ``ctx``.

    Example::

        ctx, tree = jckpt.load(jckpt.Context(), "ckpt.jckpt")
        params = tree["jckpt"]["params"]
    """
    path = os.fspath(path)
    tree_mod.check_prefix(prefix_namespace)
    reader = open_checkpoint(path)  # a file, or a multi-process directory
    header = tree_mod.prefix_namespace(reader.header, prefix_namespace)
    _check_clash(ctx, header.tensors, path)
    mmap = ctx.mmap if mmap is None else mmap
    verify = (not mmap) if verify is None else verify
    groups: dict[str, list[tuple[KeyPath, int]]] = {}
    requests: list[tuple[Any, Any, str, str | None]] = []
    with progress_mod.bar(f"loading {os.path.basename(path)}",
                          sum(e.byte_length for e in header.tensors), enabled=progress) as bar:
        for stored, e in zip(reader.header.tensors, header.tensors):
            array = reader.decode(stored, mmap=mmap, verify=verify)
            requests.append((array, None, e.name, e.key_impl))
            key = e.path if e.path is not None else (('k', f"n{e.id}"),)
            groups.setdefault(e.namespace, []).append((key, len(requests) - 1))
            bar.advance(stored.byte_length)
    values = placement.place_all(requests, host=ctx.host, device=ctx.device, file=path)
    out = {ns: tree_mod.unflatten([(k, values[i]) for k, i in items], file=path)
           for ns, items in groups.items()}
    return ctx.replace(registry=ctx.registry.add(header.tensors)), out


@paused
def restore(ctx: Context, target: Any, path: PathLike, *, mmap: bool | None = None,
            cast: bool = False, namespace: str | None = None,
            verify: bool | None = None) -> Any:
    """Fill ``target``'s structure from ``path``: a tree of exactly ``target``'s type.

    Each leaf is matched by ``(namespace, path)``; ``target`` may be a partial
    tree (only its leaves are read). Leaves come back where the target says:
    a ``jax.Array``'s sharding, a ``jax.ShapeDtypeStruct``'s sharding, numpy
    for numpy leaves, and ``ctx``'s placement otherwise.

    Args:
      ctx: the context (namespace, placement).
      target: any pytree of arrays, ``ShapeDtypeStruct``s or numbers.
      path: the checkpoint file, or a directory checkpoint.
      mmap: map payloads (default ``ctx.mmap``).
      cast: convert to the target's dtype instead of refusing a dtype mismatch.
      namespace: read this namespace instead of ``ctx.namespace``.
      verify: check checksums of the leaves read (default: when copying).

    Raises :class:`~jckpt.errors.MissingEntryError` or
    :class:`~jckpt.errors.MismatchError` naming the leaf; the file is never
    modified. An empty target returns at once without opening the file.

    Example::

        state = jckpt.restore(jckpt.Context(), abstract_state, "ckpt.jckpt")
    """
    path = os.fspath(path)
    items, treedef = tree_mod.flatten_with_treedef(target)
    if not items:
        return target
    namespace = ctx.namespace if namespace is None else namespace
    reader = open_checkpoint(path)  # a file, or a multi-process directory
    index = {e.path if e.path is not None else (('k', f"n{e.id}"),): e
             for e in reader.header.tensors if e.namespace == namespace}
    mmap = ctx.mmap if mmap is None else mmap
    verify = (not mmap) if verify is None else verify
    leaves = []
    for p, leaf in items:
        where = f"{namespace}/{_keystr(p)}"
        entry = index.get(p)
        if entry is None:
            near = [path_name(q) for q in index][:5]
            raise MissingEntryError("not in the checkpoint", file=path, entry=where,
                                    fix=f"check the namespace and the tree; the file's "
                                        f"{namespace!r} entries include {near}" if near else
                                    f"the file has no entries in namespace {namespace!r}")
        want_shape, want_dtype = _target_spec(leaf)
        if entry.padding is not None and want_shape is not None and \
                tuple(want_shape) == entry.logical_dims and entry.logical_dims != entry.dims:
            raise MismatchError(f"padding mismatch: the stored entry is padded {entry.padding.pairs} "
                                f"to dims {entry.dims}; the target has the unpadded shape "
                                f"{tuple(want_shape)}", file=path, entry=where,
                                fix="give the target the padded shape")
        stored_shape = entry.shape
        if entry.key_impl is not None:
            stored_shape = stored_shape[:-1] if stored_shape else stored_shape
        if want_shape is not None and tuple(want_shape) != tuple(stored_shape) and not (
                entry.key_impl is not None and tuple(want_shape) == entry.shape[:len(want_shape)]):
            raise MismatchError(f"shape mismatch: file has {entry.shape}, target has "
                                f"{tuple(want_shape)}", file=path, entry=where,
                                fix="restore into a target of the stored shape")
        target_sharding = getattr(leaf, 'sharding', None) or (
            ctx.device if not ctx.host and not isinstance(leaf, (np.ndarray, np.generic)) else None)
        sharding.check_fits(want_shape if want_shape is not None else entry.shape, target_sharding,
                            file=path, where=where)
        array = reader.decode(entry, mmap=mmap, verify=verify)
        if want_dtype is not None and entry.key_impl is None and stored_dtype(want_dtype) != array.dtype:
            if not cast:
                raise MismatchError(f"dtype mismatch: file has {array.dtype}, target has "
                                    f"{np.dtype(want_dtype)}", file=path, entry=where,
                                    fix="pass cast=True to convert, or fix the target's dtype")
            array = sharding.as_lazy(array).astype(want_dtype)  # cast per shard, as read
        leaves.append((array, leaf, where, entry.key_impl))
    leaves = placement.place_all(leaves, host=ctx.host, device=ctx.device, file=path)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _target_spec(leaf: Any) -> tuple[tuple[int, ...] | None, Any]:
    """``(shape, dtype)`` a target leaf asks for (None where it does not say)."""
    if placement.is_prng_key(leaf):
        return tuple(leaf.shape), None
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        if isinstance(leaf, jax.ShapeDtypeStruct) and jax.dtypes.issubdtype(
                leaf.dtype, jax.dtypes.prng_key):
            return tuple(leaf.shape), None
        return tuple(leaf.shape), leaf.dtype
    if isinstance(leaf, (bool, int, float, complex)):
        return (), None
    raise InputError(f"target leaf of type {type(leaf).__name__} is not an array or a spec",
                     fix="use arrays, jax.ShapeDtypeStruct or numbers as target leaves")


def ingestion_counts() -> dict[str, int]:
    """Process-wide counts of loaded payloads: ``{'mapped': M, 'decoded': D}``.

    Mapped payloads are zero-copy views of a file; decoded ones were copied
    (misaligned, padded, or mapping off). Thread-safe.
    """
    return COUNTS.snapshot()


def describe(path: PathLike) -> Header:
    """The validated header of ``path`` without reading any payload."""
    return open_checkpoint(path).header


__all__ = ['describe', 'ingestion_counts', 'load', 'restore', 'save']
