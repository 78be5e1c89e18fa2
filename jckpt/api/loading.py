"""``load``, ``restore`` and ``describe``: checkpoints back to pytrees.

``load`` rebuilds ``{namespace: subtree}`` from the stored paths; ``restore``
fills a target's structure, matching each leaf by ``(namespace, path)`` and
checking it (shape, dtype, padding, sharding) before anything is placed.
Both read only the namespaces asked for, and place every array they read
through one :func:`jckpt.trees.placement.place_all` call (one batched
transfer per device).

>>> import numpy as np, tempfile, os
>>> from jckpt.api.saving import save
>>> path = os.path.join(tempfile.mkdtemp(), 'model.jckpt')
>>> save(Context(namespace='model'), {'w': np.ones((2, 3))}, path)
>>> save(Context(namespace='opt'), {'mu': np.zeros(3)}, path, appending=True)
>>> ctx, tree = load(Context(host=True), path, namespaces='model')
>>> list(tree), tree['model']['w'].shape
(['model'], (2, 3))
>>> restore(Context(host=True), {'opt': {'mu': np.ones(3)}}, path, namespaces=['opt'])
{'opt': {'mu': array([0., 0., 0.])}}
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jckpt.api import progress as progress_mod
from jckpt.api.context import Context
from jckpt.errors import ClashError, InputError, MismatchError, MissingEntryError
from jckpt.format._gc import paused
from jckpt.format.entries import Entry, Header, KeyPath, path_name
from jckpt.format.payload import stored_dtype
from jckpt.storage import open_checkpoint
from jckpt.storage.reader import COUNTS
from jckpt.trees import placement, sharding
from jckpt.trees import pytree as tree_mod

PathLike = str | os.PathLike
#: What ``namespaces=`` takes: one namespace, or several.
Namespaces = str | Collection[str]


# --- load --------------------------------------------------------------------------------

@paused
def load(ctx: Context, path: PathLike, *, prefix_namespace: str | None = None,
         mmap: bool | None = None, verify: bool | None = None, progress: bool = False,
         namespaces: Namespaces | None = None) -> tuple[Context, dict[str, Any]]:
    """Read the entries of ``path`` as ``{namespace: subtree}``; return it with a new context.

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
      namespaces: read only these namespaces (a name, or a collection of names, as
        stored: before ``prefix_namespace`` renames them); default every namespace.

    Raises :class:`~jckpt.errors.ClashError`, before loading anything, if an
    entry is already registered in ``ctx``, and
    :class:`~jckpt.errors.MissingEntryError` if a namespace asked for is not
    in the file.

    Example::

        ctx, tree = jckpt.load(jckpt.Context(), "ckpt.jckpt")
        params = tree["jckpt"]["params"]
        _, model = jckpt.load(jckpt.Context(), "ckpt.jckpt", namespaces="model")  # no optimizer
    """
    path = os.fspath(path)
    tree_mod.check_prefix(prefix_namespace)
    reader = open_checkpoint(path)  # a file, or a multi-process directory
    stored = reader.header.tensors
    if namespaces is not None:
        names = _namespace_names(namespaces, path)
        _check_present(reader.header, names, path)
        wanted = set(names)
        stored = tuple(e for e in stored if e.namespace in wanted)
    entries = tree_mod.prefix_namespace(Header(tensors=stored), prefix_namespace).tensors
    _check_clash(ctx, entries, path)
    mmap = ctx.mmap if mmap is None else mmap
    verify = (not mmap) if verify is None else verify
    groups: dict[str, list[tuple[KeyPath, int]]] = {}
    requests: list[tuple[Any, Any, str, str | None]] = []
    with progress_mod.bar(f"loading {os.path.basename(path)}",
                          sum(e.byte_length for e in entries), enabled=progress) as bar:
        for s, e in zip(stored, entries):
            requests.append((reader.decode(s, mmap=mmap, verify=verify), None, e.name, e.key_impl))
            groups.setdefault(e.namespace, []).append((_stored_path(e), len(requests) - 1))
            bar.advance(s.byte_length)
    values = placement.place_all(requests, host=ctx.host, device=ctx.device, file=path)
    out = {ns: tree_mod.unflatten([(k, values[i]) for k, i in items], file=path)
           for ns, items in groups.items()}
    return ctx.replace(registry=ctx.registry.add(entries)), out


def _stored_path(e: Entry) -> KeyPath:
    """Where the entry sits in its namespace's tree: its path, or ``n<id>`` for path-less ones."""
    return e.path if e.path is not None else (('k', f"n{e.id}"),)


def _check_clash(ctx: Context, entries: tuple[Entry, ...], path: str) -> None:
    for e in entries:
        if e.identity in ctx.registry:
            raise ClashError("already loaded into this context", file=path, entry=e.name,
                             fix="load with prefix_namespace=... or use a fresh Context")


def _namespace_names(namespaces: Namespaces, path: str) -> tuple[str, ...]:
    """``namespaces`` as distinct names in order; refuses anything but a str or strs."""
    try:
        names = (namespaces,) if isinstance(namespaces, str) else tuple(namespaces)
    except TypeError:
        names = (namespaces,)
    if not all(isinstance(n, str) for n in names):
        raise InputError(f"namespaces must be a namespace or a collection of them, not "
                         f"{namespaces!r}", file=path, fix="pass e.g. namespaces=['model']")
    return tuple(dict.fromkeys(names))


def _check_present(header: Header, names: Sequence[str], path: str) -> None:
    present = {e.namespace for e in header.tensors}
    missing = [ns for ns in names if ns not in present]
    if missing:
        raise MissingEntryError(f"no namespace {missing[0]!r} in the checkpoint", file=path,
                                fix=f"the file holds {sorted(present)}")


# --- restore -----------------------------------------------------------------------------

@paused
def restore(ctx: Context, target: Any, path: PathLike, *, mmap: bool | None = None,
            cast: bool = False, namespace: str | None = None,
            verify: bool | None = None, namespaces: Namespaces | None = None) -> Any:
    """Fill ``target``'s structure from ``path``: a tree of exactly ``target``'s type.

    Each leaf is matched by ``(namespace, path)``; ``target`` may be a partial
    tree (only its leaves are read). Leaves come back where the target says:
    a ``jax.Array``'s sharding, a ``jax.ShapeDtypeStruct``'s sharding, numpy
    for numpy leaves, and ``ctx``'s placement otherwise.

    Args:
      ctx: the context (namespace, placement).
      target: any pytree of arrays, ``ShapeDtypeStruct``s or numbers; with
        ``namespaces``, ``{namespace: subtree}`` for exactly those namespaces.
      path: the checkpoint file, or a directory checkpoint.
      mmap: map payloads (default ``ctx.mmap``).
      cast: convert to the target's dtype instead of refusing a dtype mismatch.
      namespace: read this namespace instead of ``ctx.namespace``.
      verify: check checksums of the leaves read (default: when copying).
      namespaces: read several namespaces at once (a name or a collection of
        names); the result is ``{namespace: subtree}``, each subtree of its
        target's type, and every leaf of every namespace is placed together.

    Raises :class:`~jckpt.errors.MissingEntryError` or
    :class:`~jckpt.errors.MismatchError` naming the leaf, and
    :class:`~jckpt.errors.InputError` for a target that does not match
    ``namespaces``; the file is never modified. An empty target returns at
    once without opening the file.

    Example::

        state = jckpt.restore(jckpt.Context(), abstract_state, "ckpt.jckpt")
        both = jckpt.restore(jckpt.Context(), {"model": abstract_params, "opt": abstract_opt},
                             "ckpt.jckpt", namespaces=["model", "opt"])
    """
    path = os.fspath(path)
    parts = _target_parts(ctx, target, path, namespace, namespaces)
    if not any(items for _, items, _ in parts):
        return target
    reader = open_checkpoint(path)  # a file, or a multi-process directory
    if namespaces is not None:
        _check_present(reader.header, [ns for ns, _, _ in parts], path)
    mmap = ctx.mmap if mmap is None else mmap
    verify = (not mmap) if verify is None else verify
    index = _index(reader.header, {ns for ns, _, _ in parts})
    requests = []
    for ns, items, _ in parts:
        for p, leaf in items:
            where = tree_mod.leaf_name(ns, p)
            entry = _match(index[ns], ns, p, path, where)
            array = _read_leaf(ctx, reader, entry, leaf, path, where, cast=cast, mmap=mmap,
                               verify=verify)
            requests.append((array, leaf, where, entry.key_impl))
    values = placement.place_all(requests, host=ctx.host, device=ctx.device, file=path)
    if namespaces is None:
        return jax.tree_util.tree_unflatten(parts[0][2], values)
    return _rebuild(parts, values)


def _rebuild(parts: Sequence[tuple[str, list, Any]], values: Sequence[Any]) -> dict[str, Any]:
    """``{namespace: subtree}``, each subtree of its target's structure, from the placed leaves."""
    out, start = {}, 0
    for ns, items, treedef in parts:
        out[ns] = jax.tree_util.tree_unflatten(treedef, values[start:start + len(items)])
        start += len(items)
    return out


def _target_parts(ctx: Context, target: Any, path: str, namespace: str | None,
                  namespaces: Namespaces | None) -> list[tuple[str, list[tuple[KeyPath, Any]], Any]]:
    """``[(namespace, [(path, leaf)], treedef)]``: one part, or one per namespace asked for."""
    if namespaces is None:
        return [(ctx.namespace if namespace is None else namespace,
                 *tree_mod.flatten_with_treedef(target))]
    if namespace is not None:
        raise InputError("give namespace= or namespaces=, not both", file=path,
                         fix="name the one namespace in namespaces=")
    names = _namespace_names(namespaces, path)
    if not isinstance(target, Mapping) or set(target) != set(names):
        raise InputError("with namespaces, the target must be {namespace: subtree} for "
                         "exactly those namespaces", file=path)
    return [(ns, *tree_mod.flatten_with_treedef(target[ns])) for ns in names]


def _index(header: Header, names: Collection[str]) -> dict[str, dict[KeyPath, Entry]]:
    """``{namespace: {stored path: entry}}`` for the namespaces in ``names``."""
    out: dict[str, dict[KeyPath, Entry]] = {ns: {} for ns in names}
    for e in header.tensors:
        found = out.get(e.namespace)
        if found is not None:
            found[_stored_path(e)] = e
    return out


def _match(index: Mapping[KeyPath, Entry], namespace: str, p: KeyPath, path: str,
           where: str) -> Entry:
    """The entry stored at ``p``; refuses a leaf the file does not hold, naming some it does."""
    entry = index.get(p)
    if entry is None:
        near = [path_name(q) for q in index][:5]
        raise MissingEntryError("not in the checkpoint", file=path, entry=where,
                                fix=f"check the namespace and the tree; the file's "
                                    f"{namespace!r} entries include {near}" if near else
                                f"the file has no entries in namespace {namespace!r}")
    return entry


def _read_leaf(ctx: Context, reader: Any, entry: Entry, leaf: Any, path: str, where: str, *,
               cast: bool, mmap: bool, verify: bool) -> Any:
    """Check ``entry`` against the target ``leaf``, then read it (lazily for sharded targets)."""
    want_shape, want_dtype = _target_spec(leaf)
    _check_shape(entry, want_shape, path, where)
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
    return array


def _check_shape(entry: Entry, want_shape: Sequence[int] | None, path: str, where: str) -> None:
    """Refuse a target shape other than the stored one (a PRNG key's: less its trailing dim)."""
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


# --- the header and the counters ---------------------------------------------------------

def ingestion_counts() -> dict[str, int]:
    """Process-wide counts of loaded payloads: ``{'mapped': M, 'decoded': D}``.

    Mapped payloads are zero-copy views of a file; decoded ones were copied
    (misaligned, padded, or mapping off). Thread-safe.
    """
    return COUNTS.snapshot()


def describe(path: PathLike) -> Header:
    """The validated header of ``path`` without reading any payload."""
    return open_checkpoint(path).header


__all__ = ['describe', 'ingestion_counts', 'load', 'restore']
