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

import dataclasses
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jckpt.api import progress as progress_mod
from jckpt.api.context import Context, check_context
from jckpt.errors import ClashError, InputError, MismatchError, MissingEntryError
from jckpt.format import precs
from jckpt.format._gc import paused
from jckpt.format.entries import Entry, Header, KeyPath, path_name
from jckpt.format.payload import stored_dtype
from jckpt.storage import open_checkpoint
from jckpt.storage.backend import checked_path
from jckpt.storage.reader import COUNTS
from jckpt.trees import placement, sharding, to_host
from jckpt.trees import pytree as tree_mod

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
    path, ctx = checked_path(path), check_context(ctx, mmap=mmap, verify=verify, progress=progress)
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
    verify = _verify_default(reader, mmap) if verify is None else verify
    groups: dict[str, list[tuple[KeyPath, int]]] = {}
    requests: list[tuple[Any, Any, str, str | None]] = []
    with progress_mod.bar(f"loading {os.path.basename(path)}",
                          sum(e.byte_length for e in entries), enabled=progress) as bar:
        for e, array in zip(entries, _decoded(reader, stored, mmap, verify, bar)):
            requests.append((array, None, e.name, e.key_impl))
            groups.setdefault(e.namespace, []).append((_stored_path(e), len(requests) - 1))
    values = placement.place_all(requests, host=ctx.host, device=ctx.device, file=path)
    out = {ns: tree_mod.unflatten([(k, values[i]) for k, i in items], file=path)
           for ns, items in groups.items()}
    return ctx.replace(registry=ctx.registry.add(entries)), out


def _decoded(reader: Any, entries: Sequence[Entry], mmap: bool, verify: bool, bar: Any) -> Any:
    """Each entry's array, in order: a local file's all at once (mapped views made in one C
    call), else one by one, advancing a drawn progress bar (if any) as each is read."""
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


def _stored_path(e: Entry) -> KeyPath:
    """Where the entry sits in its namespace's tree: its path, or `n<id>` for path-less ones."""
    return e.path if e.path is not None else (('k', f"n{e.id}"),)


def _check_clash(ctx: Context, entries: tuple[Entry, ...], path: str) -> None:
    for e in entries:
        if e.identity in ctx.registry:
            raise ClashError("already loaded into this context", file=path, entry=e.name,
                             fix="load with prefix_namespace=... or use a fresh Context")


def _namespace_names(namespaces: Namespaces, path: str) -> tuple[str, ...]:
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

@paused
def restore(ctx: Context, target: Any, path: PathLike, *, mmap: bool | None = None,
            cast: bool = False, namespace: str | None = None,
            verify: bool | None = None, namespaces: Namespaces | None = None) -> Any:
    """Fill `target`'s structure from `path`: a tree of exactly `target`'s type.

    `target` may be partial (only its leaves are read). Leaves come back where it
    says: a `jax.Array`'s or a `ShapeDtypeStruct`'s sharding, numpy for numpy
    leaves, and `ctx`'s placement otherwise.

    Args:
      ctx: the context (namespace, placement).
      target: any pytree of arrays, `ShapeDtypeStruct`s or numbers; with
        `namespaces`, `{namespace: subtree}` for exactly those namespaces.
      path: a checkpoint file or directory, or an orbax item or step directory (as it is).
      mmap: map payloads (default `ctx.mmap`).
      cast: convert to the target's dtype instead of refusing a dtype mismatch.
      namespace: read this namespace instead of `ctx.namespace`.
      verify: check checksums of the leaves read (default: when copying or reading a URL).
      namespaces: read several namespaces at once (a name or a collection of
        names); the result is `{namespace: subtree}`, each subtree of its
        target's type, and every leaf of every namespace is placed together.

    How each leaf is matched (examples in docs/concepts.md):

    * By `(namespace, path)`; else the one entry whose path differs only in
      key kinds: dict key or attribute of one name; index, flattened index or
      integer dict key of one number (orbax stores NamedTuple fields as dict keys).
    * Typed PRNG keys: keys into a key target of their implementation, raw data otherwise.
    * Another dtype is a `MismatchError` unless `cast=True`; but a weakly typed
      target (`jax.eval_shape` of a Python number, stored 64-bit) of the stored
      value's kind takes it as JAX takes the number: an integer if it fits
      exactly, a float rounded unless it overflows.
    * A `NamedSharding` on an `AbstractMesh` (`nnx.eval_shape` under
      `jax.set_mesh`) goes to the mesh in context with those axes, else to
      `jax.make_mesh` of them when they span all devices; else `InputError`.

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
    path, ctx = checked_path(path), check_context(ctx, mmap=mmap, cast=cast, verify=verify)
    parts = _target_parts(ctx, target, path, namespace, namespaces)
    if not any(items for _, items, _ in parts):
        return target
    reader = open_checkpoint(path)  # a file, or a multi-process directory
    if namespaces is not None:
        _check_present(reader.header, [ns for ns, _, _ in parts], path)
    requests = _requests(ctx, reader, parts, path, cast=cast, mmap=mmap, verify=verify)
    values = placement.place_all(requests, host=ctx.host, device=ctx.device, file=path)
    if namespaces is None:
        return jax.tree_util.tree_unflatten(parts[0][2], values)
    return _rebuild(parts, values)


def _requests(ctx: Context, reader: Any, parts: Sequence[tuple[str, list, Any]], path: str, *,
              cast: bool, mmap: bool | None,
              verify: bool | None) -> list[tuple[Any, Any, str, str | None]]:
    """`(array, target leaf, name, key_impl)` for each target leaf: matched and checked, then
    every payload read (a local file's mapped in one call), then each cast as the target asks."""
    mmap = ctx.mmap if mmap is None else mmap
    verify = _verify_default(reader, mmap) if verify is None else verify
    index = _index(reader.header, {ns for ns, _, _ in parts})
    checked = []
    meshes: dict[Any, Any] = {}  # abstract meshes of the target, resolved once each
    stored = []
    for ns, items, _ in parts:
        for p, leaf in items:
            where = tree_mod.leaf_name(ns, p)
            entry = _match(index[ns], ns, p, path, where)
            stored.append(entry)
            if type(leaf) is jax.ShapeDtypeStruct and leaf.sharding is not None:
                leaf = sharding.with_concrete_mesh(leaf, meshes, file=path, where=where)
            if entry.key_impl is not None:
                entry = _as_key_target_takes(entry, leaf, path, where)
            want_dtype = _check_leaf(ctx, entry, leaf, path, where)
            checked.append((entry, leaf, where, want_dtype))
    arrays = _decoded(reader, stored, mmap, verify, None)
    return [(_as_stored_for(array, entry, leaf, want_dtype, path, where, cast=cast), leaf, where,
             entry.key_impl) for (entry, leaf, where, want_dtype), array in zip(checked, arrays)]


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
    names = _namespace_names(namespaces, path)
    if not isinstance(target, Mapping) or set(target) != set(names):
        raise InputError("with namespaces, the target must be {namespace: subtree} for "
                         "exactly those namespaces", file=path)
    return [(ns, *tree_mod.flatten_with_treedef(target[ns])) for ns in names]


class _Stored:
    """One namespace's entries by stored path, and by path less key kinds (built on first need)."""

    def __init__(self) -> None:
        self.by_path: dict[KeyPath, Entry] = {}
        self._loose: dict[KeyPath, list[Entry]] | None = None

    def loose(self) -> dict[KeyPath, list[Entry]]:
        if self._loose is None:
            self._loose = {}
            for q, e in self.by_path.items():
                self._loose.setdefault(tree_mod.loose_path(q), []).append(e)
        return self._loose


def _index(header: Header, names: Collection[str]) -> dict[str, _Stored]:
    """The entries of the namespaces in `names`, by namespace."""
    out: dict[str, _Stored] = {ns: _Stored() for ns in names}
    for e in header.tensors:
        found = out.get(e.namespace)
        if found is not None:
            found.by_path[_stored_path(e)] = e
    return out


def _match(stored: _Stored, namespace: str, p: KeyPath, path: str, where: str) -> Entry:
    """The entry stored at `p`, or at the one path that differs from `p` only in key kinds.

    A dict key and an attribute of the same name match, and so do a sequence
    index, a flattened index and an integer dict key of the same number:
    orbax, for one, records a NamedTuple's fields as dict keys.
    """
    entry = stored.by_path.get(p)
    if entry is not None:
        return entry
    found = stored.loose().get(tree_mod.loose_path(p), ())
    if len(found) == 1:
        return found[0]
    raise _missing(stored, namespace, p, found, path, where)


def _missing(stored: _Stored, namespace: str, p: KeyPath, found: Sequence[Entry], path: str,
             where: str) -> MissingEntryError:
    """The error for a target leaf no stored entry matches, never listing its own name as present."""
    show = tree_mod.path_repr
    if found:
        return MissingEntryError(
            f"ambiguous: the target's {show(p)} differs only in key kinds from "
            f"{', '.join(show(_stored_path(e)) for e in found)} in the file", file=path, entry=where,
            fix="load the file and pick the entry, or restore into a target whose key kinds "
                "(dict key, attribute, index) match one of them exactly")
    name = path_name(p)
    same = [q for q in stored.by_path if path_name(q) == name]
    if same:
        return MissingEntryError(
            f"not in the checkpoint: the file's {show(same[0])} has the same name but another "
            f"nesting than the target's {show(p)}", file=path, entry=where,
            fix="restore into a target of the stored structure (jckpt.load shows it)")
    near = [path_name(q) for q in stored.by_path][:5]
    return MissingEntryError("not in the checkpoint", file=path, entry=where,
                             fix=f"check the namespace and the tree; the file's {namespace!r} "
                                 f"entries include {near}" if near else
                             f"the file has no entries in namespace {namespace!r}")


def _as_key_target_takes(entry: Entry, leaf: Any, path: str, where: str) -> Entry:
    """A typed PRNG key's entry as the target `leaf` takes it: keys of the stored implementation
    for a typed-key target (another implementation refused), else the raw key data as stored
    (`jax.random.key_data` of the keys: an old-style `PRNGKey`'s form)."""
    if not _is_key_target(leaf):
        return dataclasses.replace(entry, key_impl=None)
    want = _key_impl_of(leaf)
    if want is not None and want != entry.key_impl:
        raise MismatchError(
            f"PRNG key implementation mismatch: file has {entry.key_impl} keys, target has "
            f"{want} keys", file=path, entry=where,
            fix=f"restore into keys of {entry.key_impl!r} (jax.random.key(0, impl="
                f"{entry.key_impl!r})), or into jax.ShapeDtypeStruct({tuple(entry.shape)}, "
                f"jnp.{entry.dtype}) for the raw key data")
    return entry


def _key_impl_of(leaf: Any) -> str | None:
    """The name of a typed-key target's implementation (`jax.random.key_impl`'s), if it says."""
    try:
        if isinstance(leaf, jax.Array):
            return str(jax.random.key_impl(leaf))
        return str(leaf.dtype._impl.name)  # a ShapeDtypeStruct's key dtype knows its impl
    except Exception:  # a JAX that keeps it elsewhere: the stored impl is taken as it is
        return None


def _check_leaf(ctx: Context, entry: Entry, leaf: Any, path: str, where: str) -> Any:
    """Check `entry` against the target `leaf` before anything is read; the dtype it wants."""
    want_shape, want_dtype = _target_spec(leaf)
    if want_dtype is None and entry.key_impl is None and _is_key_target(leaf):
        raise _raw_key_data(entry, want_shape, path, where)
    _check_shape(entry, want_shape, path, where)
    target_sharding = getattr(leaf, 'sharding', None) or (
        ctx.device if not ctx.host and not isinstance(leaf, (np.ndarray, np.generic)) else None)
    sharding.check_fits(want_shape if want_shape is not None else entry.shape, target_sharding,
                        file=path, where=where)
    return want_dtype


def _as_stored_for(array: Any, entry: Entry, leaf: Any, want_dtype: Any, path: str, where: str, *,
                   cast: bool) -> Any:
    """The array read for `entry`, in the dtype the target wants (lazily for sharded targets)."""
    if want_dtype is not None and entry.key_impl is None and stored_dtype(want_dtype) != array.dtype:
        if cast:
            return sharding.as_lazy(array).astype(want_dtype)  # cast per shard, as read
        if getattr(leaf, 'weak_type', False) and _kind(array.dtype) == _kind(want_dtype):
            return _exactly(array, np.dtype(want_dtype), path, where)
        raise MismatchError(f"dtype mismatch: file has {array.dtype}, target has "
                            f"{np.dtype(want_dtype)}", file=path, entry=where,
                            fix="pass cast=True to convert, or fix the target's dtype")
    return array


_KINDS = (('bool', np.bool_), ('integer', np.integer), ('floating', np.floating),
          ('complex', np.complexfloating))


def _kind(dtype: Any) -> str | None:
    """Which of bool, integer (signed or not), floating and complex `dtype` is."""
    return next((name for name, t in _KINDS if jax.dtypes.issubdtype(dtype, t)), None)


def _exactly(array: Any, dtype: np.dtype, path: str, where: str) -> np.ndarray:
    """`array` as `dtype` for a weakly typed target: only if every value converts as JAX
    would convert the Python number itself.

    A weakly typed target stands for a Python number (`jax.eval_shape` of a
    tree holding `step=0` or `lr=0.1`), which jckpt stored as 64-bit. An
    integer (or bool) is accepted when the target's dtype holds it exactly; a
    float or complex number is rounded to the target's precision, as JAX
    rounds the Python number 0.1 to float32, unless it overflows. Never
    narrowed silently otherwise.
    """
    values = np.asarray(array)
    with np.errstate(all='ignore'):
        out = values.astype(dtype)
        if _kind(values.dtype) in ('floating', 'complex'):
            same = np.isfinite(out) | ~np.isfinite(values)  # rounded, but never overflowed
        else:
            same = out.astype(values.dtype) == values
    if not np.all(same):
        bad = values[~same].flat[0].item()
        raise MismatchError(f"dtype mismatch: the file's {values.dtype} value {bad!r} does not fit "
                            f"the target's weakly typed {dtype}", file=path, entry=where,
                            fix=f"restore into a target of dtype {values.dtype} (64-bit needs "
                                f"jax_enable_x64), or pass cast=True to convert anyway (the value "
                                f"changes)")
    return out


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


def _is_key_target(leaf: Any) -> bool:
    return to_host.is_prng_key(leaf) or (isinstance(leaf, jax.ShapeDtypeStruct) and
                                            jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))


def _raw_key_data(entry: Entry, want_shape: Any, path: str, where: str) -> MismatchError:
    """The error for a typed-key target whose entry holds plain integers (an old-style
    `jax.random.PRNGKey`, or key data saved with `jax.random.key_data`)."""
    dtype = precs.dtype_of(entry.prec)
    return MismatchError(
        f"the file holds plain {dtype}{list(entry.shape)} key data (an old-style "
        f"jax.random.PRNGKey), not a typed PRNG key as the target (shape {tuple(want_shape)})",
        file=path, entry=where,
        fix=f"restore into jax.ShapeDtypeStruct({tuple(entry.shape)}, jnp.{dtype}) and wrap the "
            f"result with jax.random.wrap_key_data(data); to store typed keys, save "
            f"jax.random.key(...) (jax.random.key_data(key) unwraps one)")


def _target_spec(leaf: Any) -> tuple[tuple[int, ...] | None, Any]:
    """`(shape, dtype)` a target leaf asks for (None where it does not say)."""
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        if to_host.is_key_dtype(leaf.dtype):
            return tuple(leaf.shape), None
        return tuple(leaf.shape), leaf.dtype
    if isinstance(leaf, (bool, int, float, complex)):
        return (), None
    raise InputError(f"target leaf of type {type(leaf).__name__} is not an array or a spec",
                     fix="use arrays, jax.ShapeDtypeStruct or numbers as target leaves")


# --- the header and the counters ---------------------------------------------------------

def ingestion_counts() -> dict[str, int]:
    """Process-wide counts of loaded payloads: `{'mapped': M, 'decoded': D}`.

    Mapped payloads are zero-copy views of a file; decoded ones were copied
    (misaligned, padded, or mapping off). Thread-safe.
    """
    return COUNTS.snapshot()


def describe(path: PathLike) -> Header:
    """The validated header of `path` without reading any payload."""
    return open_checkpoint(path).header


__all__ = ['describe', 'ingestion_counts', 'load', 'restore']
