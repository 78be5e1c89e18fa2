"""`load`, `restore` and `describe`: checkpoints back to pytrees.

`load` rebuilds `{namespace: subtree}` from the stored paths; `restore`
fills a target's structure, matching each leaf by `(namespace, path)` and
checking it (shape, dtype, padding, sharding) before anything is placed.
Both read only the namespaces asked for, and place every array they read
through one `jckpt.trees.placement.place_all` call (one batched
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

import functools
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jckpt.api import matching, targets
from jckpt.api import progress as progress_mod
from jckpt.api.agreement import jointly
from jckpt.api.context import Context, check_context
from jckpt.errors import ClashError, InputError, MissingEntryError, naming_file
from jckpt.format._gc import paused
from jckpt.format.entries import Entry, Header, KeyPath
from jckpt.storage import open_checkpoint
from jckpt.storage.backend import LOCAL, backend_for, checked_path
from jckpt.storage.reader import COUNTS
from jckpt.trees import placement, sharding
from jckpt.trees import pytree as tree_mod
from jckpt.trees.nested import entry_path, unflatten

PathLike = str | os.PathLike
#: What `namespaces=` takes: one namespace, or several.
Namespaces = str | Collection[str]


# --- load --------------------------------------------------------------------------------

@paused
def load(ctx: Context, path: PathLike, *, prefix_namespace: str | None = None,
         mmap: bool | None = None, verify: bool | None = None, progress: bool = False,
         namespaces: Namespaces | None = None) -> tuple[Context, dict[str, Any]]:
    """Read the entries of `path` as `{namespace: subtree}`; return it with a new context.

    Subtrees are rebuilt from the stored paths (dicts and lists); path-less
    (OCANNL) entries appear as `n<id>` in their namespace. With mapping on
    (the default), payloads that allow it are zero-copy, copy-on-write views
    of the file that stay valid after the call and after the file is replaced.

    Args:
      ctx: the context; the returned one also registers what was loaded.
      path: a checkpoint file or directory, or an orbax item or step directory (as it is).
      prefix_namespace: rename every namespace `ns` to `prefix + "__" + ns`.
      mmap: map payloads (default `ctx.mmap`).
      verify: check payload checksums (default: when copying or reading a URL, not when mapping).
      progress: draw a progress bar on stderr while reading (only when stderr is a terminal).
      namespaces: read only these namespaces (a name, or a collection of names, as
        stored: before `prefix_namespace` renames them); default every namespace.

    Raises:
        ClashError: before loading anything, if an entry is already registered in `ctx`.
        MissingEntryError: if a namespace asked for is not in the file.

    Example:
        ```python
        ctx, tree = jckpt.load(jckpt.Context(), "ckpt.jckpt")
        params = tree["jckpt"]["params"]
        _, model = jckpt.load(jckpt.Context(), "ckpt.jckpt", namespaces="model")  # no optimizer
        ```
    """
    ctx = check_context(ctx, mmap=mmap, verify=verify, progress=progress)  # first: names a tree given as ctx
    path = checked_path(path)
    tree_mod.check_prefix(prefix_namespace)
    reader = open_checkpoint(path)  # a file, or a multi-process directory
    stored = reader.header.tensors
    if namespaces is not None:
        names = namespace_names(namespaces, path)
        _check_present(reader.header, names, path)
        wanted = set(names)
        stored = tuple(e for e in stored if e.namespace in wanted)
    entries = tree_mod.prefix_namespace(Header(tensors=stored), prefix_namespace).tensors
    _check_clash(ctx, entries, path)
    mmap = ctx.mmap if mmap is None else mmap
    verify = _verify_default(reader, mmap) if verify is None else verify
    groups: dict[str, list[tuple[KeyPath, int]]] = {}
    requests: list[tuple[Any, Any, str, str | None]] = []
    with progress_mod.bar(f"loading {os.path.basename(path)}",
                          sum(e.byte_length for e in entries), enabled=progress) as bar:
        boxes = [sharding.needed_boxes(None, e, host=ctx.host, device=ctx.device) for e in stored]
        for e, array in zip(entries, _decoded(reader, stored, mmap, verify, bar, boxes)):
            requests.append((array, None, e.name, e.key_impl))
            groups.setdefault(e.namespace, []).append((entry_path(e), len(requests) - 1))
    values = placement.place_all(requests, host=ctx.host, device=ctx.device, file=path)
    out = {ns: unflatten([(k, values[i]) for k, i in items], file=path)
           for ns, items in groups.items()}
    return ctx.replace(registry=ctx.registry.add(entries)), out


def _decoded(reader: Any, entries: Sequence[Entry], mmap: bool, verify: bool, bar: Any, boxes: list) -> Any:
    """Each entry's array, in order, a local reader told first what placing them reads (`boxes`):
    a local file's all at once (mapped views made in one C call), else one by one, advancing
    a drawn progress bar (if any) as each is read."""
    if hasattr(reader, 'advise'):
        reader.advise(list(zip(entries, boxes)), verify=verify, mmap=mmap)
    if (bar is not None and bar.drawn) or not hasattr(reader, 'decode_all'):
        for e in entries:
            yield reader.decode(e, mmap=mmap, verify=verify)
            if bar is not None:
                bar.advance(e.byte_length)
        return
    yield from reader.decode_all(entries, mmap=mmap, verify=verify)


def _verify_default(reader: Any, mmap: bool) -> bool:
    """Check checksums when copying, and always for an object read from a store (never mapped)."""
    return not mmap or getattr(reader, 'remote', False)


def _check_clash(ctx: Context, entries: tuple[Entry, ...], path: str) -> None:
    for e in entries:
        if e.identity in ctx.registry:
            raise ClashError("already loaded into this context", file=path, entry=e.name,
                             fix="load with prefix_namespace=... or use a fresh Context")


def namespace_names(namespaces: Namespaces, path: str) -> tuple[str, ...]:
    """`namespaces` as distinct names in order; refuses anything but a str or strs."""
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

def restore(ctx: Context, target: Any, path: PathLike, *, mmap: bool | None = None,
            cast: bool = False, namespace: str | None = None,
            verify: bool | None = None, namespaces: Namespaces | None = None) -> Any:
    """Fill `target`'s structure from `path`: a tree of exactly `target`'s type.

    `target` may be partial (only its leaves are read). Leaves come back where it
    says: a `jax.Array`'s or a `ShapeDtypeStruct`'s sharding (none: replicated over
    the `jax.set_mesh` mesh), numpy for numpy leaves, and `ctx`'s placement otherwise.

    Args:
      ctx: the context (namespace, placement).
      target: any pytree of arrays, `ShapeDtypeStruct`s or numbers; with
        `namespaces`, `{namespace: subtree}` for exactly those namespaces.
      path: a checkpoint file or directory, or an orbax item or step directory (as it is).
      mmap: map payloads (default `ctx.mmap`).
      cast: convert to the target's dtype instead of refusing a dtype mismatch.
      namespace: read this namespace instead of `ctx.namespace`.
      verify: check checksums of the leaves read (default: when copying or reading a URL).
      namespaces: read several namespaces at once (a name or names): `{namespace: subtree}`,
        each of its target's type, every leaf placed together; one whose target holds no
        leaves (optax.sgd's state) need not be in the file.

    How each leaf is matched (examples in docs/concepts.md):

    * By `(namespace, path)`; else the one entry whose path differs only in
      key kinds: dict key or attribute of one name; index, flattened index, integer
      dict key or its digits as a string key (`"0"`) of one number (as orbax stores them).
    * Typed PRNG keys: keys into a key target of their implementation, raw data otherwise.
    * Another dtype is a `MismatchError` unless `cast=True`; but a weakly typed
      target (`jax.eval_shape` of a Python number, stored 64-bit) of the stored
      value's kind takes it as JAX takes the number: an integer if it fits
      exactly, a float rounded unless it overflows.
    * A `NamedSharding` on an `AbstractMesh` (`nnx.eval_shape` under
      `jax.set_mesh`) goes to the mesh in context with those axes, else to
      `jax.make_mesh` of them when they span all devices; else `InputError`.

    With several processes, a restore onto arrays sharded across processes is made by all
    together, as `save` is (each may name its own path): they meet once (`agreement.jointly`),
    then return together or all raise the error one met, naming it; onto host values or this
    process's devices only, it is this process's own.

    Raises:
        MissingEntryError: naming a target leaf the checkpoint does not hold.
        MismatchError: naming a leaf whose shape or dtype the target refuses.
        InputError: for a target that does not match `namespaces`.

    Example:
        ```python
        state = jckpt.restore(jckpt.Context(), abstract_state, "ckpt.jckpt")
        both = jckpt.restore(jckpt.Context(), {"model": abstract_params, "opt": abstract_opt},
                             "ckpt.jckpt", namespaces=["model", "opt"])
        ```
    """
    read = functools.partial(restore_alone, ctx, target, path, mmap=mmap, cast=cast,
                             namespace=namespace, verify=verify, namespaces=namespaces)
    processes = jax.process_count()
    if processes == 1 or not spans_processes(ctx, target):
        return read()
    return jointly("restoring the checkpoint", _where(path), read, process=jax.process_index(),
                   processes=processes, same_path=False)


def spans_processes(ctx: Any, target: Any) -> bool:
    """Whether `target` holds a leaf placed on other processes' devices too (a global array), so
    that the processes restore it together; True where that cannot be told (a `ctx` or target
    `restore_alone` refuses: refused in every process together); a file-step manager asks it too."""
    try:
        return any(placement.beyond_this_process(leaf, host=ctx.host, device=ctx.device)
                   for leaf in jax.tree_util.tree_leaves(target))
    except Exception:
        return True


def _where(path: Any) -> str:
    """How the errors of a restore that meets the other processes name `path`."""
    try:
        return os.path.abspath(os.fspath(path)) if backend_for(path) is LOCAL else os.fspath(path)
    except Exception:  # not a path: `restore_alone` says so, in every process
        return repr(path)


@paused
def restore_alone(ctx: Context, target: Any, path: PathLike, *, mmap: bool | None = None,
                  cast: bool = False, namespace: str | None = None,
                  verify: bool | None = None, namespaces: Namespaces | None = None) -> Any:
    """`restore` in this process alone, meeting no other: what a caller that meets the other
    processes itself reads with (a multi-process manager's `restore`: once per step).

    >>> import numpy as np, tempfile, os
    >>> from jckpt.api.saving import save
    >>> path = os.path.join(tempfile.mkdtemp(), 'one.jckpt')
    >>> save(Context(), {'w': np.ones(2)}, path)
    >>> restore_alone(Context(), {'w': np.zeros(2)}, path)
    {'w': array([1., 1.])}
    """
    ctx = check_context(ctx, mmap=mmap, cast=cast, verify=verify)  # first: names a tree given as ctx
    path = checked_path(path)
    with naming_file(path):  # a target JAX cannot flatten names the file too, as save's does
        parts = _target_parts(ctx, target, path, namespace, namespaces)
    if not any(items for _, items, _ in parts):
        return target
    reader = open_checkpoint(path)  # a file, or a multi-process directory
    if namespaces is not None:  # one whose target holds no leaves (optax.sgd's state) reads nothing
        _check_present(reader.header, [ns for ns, items, _ in parts if items], path)
    requests = _requests(ctx, reader, parts, path, cast=cast, mmap=mmap, verify=verify)
    values = placement.place_all(requests, host=ctx.host, device=ctx.device, file=path)
    return jax.tree_util.tree_unflatten(parts[0][2], values) if namespaces is None \
        else _rebuild(parts, values)


def _requests(ctx: Context, reader: Any, parts: Sequence[tuple[str, list, Any]], path: str, *,
              cast: bool, mmap: bool | None,
              verify: bool | None) -> list[tuple[Any, Any, str, str | None]]:
    """`(array, target leaf, name, key_impl)` for each target leaf: matched and checked, then
    every payload read (a local file's mapped in one call), then each cast as the target asks."""
    mmap = ctx.mmap if mmap is None else mmap
    verify = _verify_default(reader, mmap) if verify is None else verify
    index = matching.index_entries(reader.header, {ns for ns, _, _ in parts})
    checked = []
    meshes: dict[Any, Any] = {}  # abstract meshes of the target, resolved once each
    known: dict[tuple, tuple[Any, Any]] = {}  # a plain leaf's kind -> (its dtype, its boxes)
    stored, boxes = [], []  # what each leaf's placement reads: the plan of the reads
    for entry, leaf, where in matching.match_all(index, parts, path):
        stored.append(entry)
        kind = _plain_kind(entry, leaf)
        try:
            hit = known.get(kind) if kind is not None else None
        except TypeError:  # a sharding that cannot be hashed: checked on its own
            kind = hit = None
        if hit is None:
            taken, target, want_dtype, needed = _checked(ctx, entry, leaf, path, where, meshes)
            hit = (want_dtype, needed)
            if kind is not None and taken is entry and target is leaf:
                known[kind] = hit
            entry, leaf = taken, target
        checked.append((entry, leaf, where, hit[0]))
        boxes.append(hit[1])
    arrays = _decoded(reader, stored, mmap, verify, None, boxes)
    return [(targets.as_stored_for(array, entry, leaf, want_dtype, path, where, cast=cast), leaf,
             where, entry.key_impl) for (entry, leaf, where, want_dtype), array in zip(checked, arrays)]


def _checked(ctx: Context, entry: Entry, leaf: Any, path: str, where: str,
             meshes: dict[Any, Any]) -> tuple[Entry, Any, Any, Any]:
    """`(entry, leaf, dtype, boxes)`: the entry as the target leaf takes it, the leaf (its
    abstract mesh made concrete), the dtype it wants and the boxes its placement reads."""
    if type(leaf) is jax.ShapeDtypeStruct and leaf.sharding is not None:
        leaf = sharding.with_concrete_mesh(leaf, meshes, file=path, where=where)
    entry = targets.as_target_takes(entry, leaf, path, where)
    want_dtype = targets.check_leaf(ctx, entry, leaf, path, where)
    return entry, leaf, want_dtype, sharding.needed_boxes(leaf, entry, host=ctx.host,
                                                          device=ctx.device)


def _plain_kind(entry: Entry, leaf: Any) -> tuple | None:
    """What `_checked` reads of a plain array target and its entry (no keys, no padding), for
    leaves of one kind to be checked once (a model's 100,000 leaves are of a few kinds); None
    for any other leaf, checked on its own."""
    if entry.key_impl is not None or entry.padding is not None or not (
            type(leaf) is jax.ShapeDtypeStruct or type(leaf) is np.ndarray or
            isinstance(leaf, jax.Array)):
        return None
    return (type(leaf), leaf.shape, leaf.dtype, getattr(leaf, 'sharding', None),
            getattr(leaf, 'weak_type', False), entry.prec, entry.dims)


def _rebuild(parts: Sequence[tuple[str, list, Any]], values: Sequence[Any]) -> dict[str, Any]:
    """`{namespace: subtree}`, each subtree of its target's structure, from the placed leaves."""
    out, start = {}, 0
    for ns, items, treedef in parts:
        out[ns] = jax.tree_util.tree_unflatten(treedef, values[start:start + len(items)])
        start += len(items)
    return out


def _target_parts(ctx: Context, target: Any, path: str, namespace: str | None,
                  namespaces: Namespaces | None) -> list[tuple[str, list[tuple[KeyPath, Any]], Any]]:
    """`[(namespace, [(path, leaf)], treedef)]`: one part, or one per namespace asked for."""
    if namespaces is None:
        return [(ctx.namespace if namespace is None else namespace,
                 *tree_mod.flatten_with_treedef(target))]
    if namespace is not None:
        raise InputError("give namespace= or namespaces=, not both", file=path,
                         fix="name the one namespace in namespaces=")
    names = namespace_names(namespaces, path)
    if not isinstance(target, Mapping) or set(target) != set(names):
        keys = sorted(map(str, target))[:5] if isinstance(target, Mapping) else type(target).__name__
        raise InputError(f"with namespaces, the target must be {{namespace: subtree}} for exactly "
                         f"those namespaces, {list(names)}; its keys are {keys}", file=path,
                         fix=f"pass target={{{names[0]!r}: subtree, ...}}, or drop namespaces= "
                             f"and pass namespace={names[0]!r} for one")
    return [(ns, *tree_mod.flatten_with_treedef(target[ns])) for ns in names]


# --- the header and the counters ---------------------------------------------------------

def ingestion_counts() -> dict[str, int]:
    """Process-wide counts of loaded payloads: `{'mapped': M, 'decoded': D}`.

    Mapped payloads are zero-copy views of a file; decoded ones were copied
    (misaligned, padded, or mapping off). What placing an array on a device
    copies afterwards is not counted (docs/concepts.md, "Mapping"). Thread-safe.

    >>> sorted(ingestion_counts())
    ['decoded', 'mapped']
    """
    return COUNTS.snapshot()


def describe(path: PathLike) -> Header:
    """The validated header of `path` without reading (or mapping) any payload."""
    return open_checkpoint(path, mapped=False).header


__all__ = ['describe', 'ingestion_counts', 'load', 'restore', 'restore_alone', 'spans_processes']
