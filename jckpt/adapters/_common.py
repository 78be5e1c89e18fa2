"""Helpers shared by the format adapters: the tree form, names, files, archives.

Every adapter reads to and writes from the form `jckpt.load` returns,
`{namespace: subtree}` with host numpy arrays as leaves. Formats without
namespaces put what they hold under `DEFAULT_NAMESPACE`, and write a
tree of one namespace as its subtree alone (several namespaces become the
top level of what is written).
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
import math
import os
import warnings
from collections.abc import Collection, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from jckpt.errors import FormatError, InputError
from jckpt.format._gc import paused
from jckpt.format.header import NAMESPACE_RE, KeyPath, path_name
from jckpt.format.limits import MAX_PATH_LENGTH, json_loads
from jckpt.storage.backend import Buffer, backend_for
from jckpt.storage.publish import storage_error

#: The namespace foreign files are read into (``jckpt.Context()``'s default).
DEFAULT_NAMESPACE = 'jckpt'


def check_namespaced(tree: Any, file: str) -> dict[str, Any]:
    """`tree` as `{namespace: subtree}`, refusing anything else before a byte is written."""
    if not isinstance(tree, dict) or not all(isinstance(k, str) and NAMESPACE_RE.match(k)
                                             for k in tree):
        raise InputError("adapters write a tree of the form jckpt.load returns: "
                         "{namespace: subtree}", file=file,
                         fix="wrap the tree as {'jckpt': tree}")
    return tree


def host_items(tree: Any, file: str) -> list[tuple[str, KeyPath, np.ndarray]]:
    """`[(namespace, path, host array)]` for every leaf of `{namespace: subtree}`.

    Leaves come to host through `jckpt.trees.to_host.host_leaves`
    (every transfer started before any is awaited; a typed PRNG key as its
    key data); one that cannot be stored raises
    `InputError` naming `file` and the leaf, before
    anything is written.
    """
    return [(ns, path, array) for ns, path, array, _ in host_items_with_keys(tree, file)]


def host_items_with_keys(tree: Any, file: str) -> list[tuple[str, KeyPath, np.ndarray, str | None]]:
    """`host_items`, with each leaf's PRNG implementation (`None` but for typed keys),
    for formats that record it."""
    from jckpt.trees import pytree as tree_mod
    from jckpt.trees import to_host  # JAX: imported only when a tree is written

    items = [(ns, path, leaf) for ns, sub in check_namespaced(tree, file).items()
             for path, leaf in tree_mod.flatten(sub)]
    try:
        hosts = to_host.host_leaves([(tree_mod.leaf_name(ns, p), leaf) for ns, p, leaf in items])
    except InputError as e:
        raise InputError(e.message, file=file, entry=e.entry, fix=e.fix) from None
    return [(ns, path, host.array, host.key_impl) for (ns, path, _), host in zip(items, hosts)]


def warn_empty_namespaces(tree: dict[str, Any], kept: Collection[str], file: str,
                          format_name: str) -> None:
    """Warn, naming them, of the namespaces of `tree` not in `kept` (those the file holds
    arrays of): a namespace without arrays (`optax.sgd`'s state of two `EmptyState`s, a
    bare `EmptyState()`, `None`) has nothing a `format_name` file (one array, no record of
    the tree: `.npy`) can hold, so it is left out, as the orbax writer leaves one out, and
    not silently. Formats with a paths record keep it in their `empty_record`.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter('always')
    ...     warn_empty_namespaces({'model': 1, 'opt': ()}, ['model'], 'm.npy', 'npy')
    >>> print(caught[0].message)  # doctest: +ELLIPSIS
    m.npy: namespaces ['opt'] hold no arrays (an empty optimizer state) and are left out: ...
    """
    empty = [ns for ns in tree if ns not in kept]
    if empty:
        warnings.warn(f"{file}: namespaces {empty} hold no arrays (an empty optimizer state) and "
                      f"are left out: {format_name} files hold arrays only, so this one reads "
                      f"back without them; a restore with a target takes them from it (to keep "
                      f"them, write a .jckpt, .safetensors or .npz file)", stacklevel=4)


def warn_key_data(tree: dict[str, Any], file: str, format_name: str) -> None:
    """Warn, naming them, of the typed PRNG keys of `{namespace: subtree}`: a `format_name`
    file has no key dtype, so each is written as its key data (`uint32`, one more axis),
    which reads back as a plain array, not silently. Only orbax and jckpt files keep keys.

    >>> import jax, warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter('always')
    ...     warn_key_data({'jckpt': {'rng': jax.random.key(0)}}, 'm.npz', 'npz')
    >>> print(caught[0].message)  # doctest: +ELLIPSIS
    m.npz: typed PRNG keys jckpt/rng (threefry2x32) are written as their uint32 key data: ...
    """
    from jckpt.trees.pytree import flatten, leaf_name
    from jckpt.trees.to_host import is_key_dtype

    keys = {leaf_name(ns, p): leaf for ns, sub in tree.items() for p, leaf in flatten(sub)
            if getattr(leaf, 'dtype', None) is not None and is_key_dtype(leaf.dtype)}
    if keys:
        import jax

        named = [f"{name} ({jax.random.key_impl(k)})" for name, k in keys.items()]
        warnings.warn(f"{file}: typed PRNG keys {', '.join(named[:5])}"
                      f"{' ...' if len(named) > 5 else ''} are written as their uint32 key data: "
                      f"{format_name} "
                      "files have no key dtype, so they read back as plain arrays "
                      "(jax.random.wrap_key_data(data, impl=...) makes keys of them again; a "
                      ".jckpt file or an orbax directory keeps them keys)", stacklevel=4)


def refuse_dtypes(leaves: list[tuple[str, np.dtype]], file: str, format_name: str) -> None:
    """Refuse, naming every one, the `(name, dtype)` leaves a `format_name` file cannot hold
    (the caller passes only those): a tree with an int4 and a uint4 leaf was told of the first,
    cast it, and was refused again for the second. Writers call this before any warning, so a
    tree that cannot be written is told so first.

    >>> refuse_dtypes([('q', np.dtype('int4')), ('p', np.dtype('uint4'))], 'm.pt', 'torch')
    Traceback (most recent call last):
    ...
    jckpt.errors.InputError: m.pt: entry q: dtypes int4, uint4 have no torch equivalent: ...
    """
    if not leaves:
        return
    dtypes = list(dict.fromkeys(str(dt) for _, dt in leaves))
    named = [f"{name} ({dt})" for name, dt in leaves[:10]] + (['...'] if len(leaves) > 10 else [])
    what = f"dtype {dtypes[0]} has" if len(dtypes) == 1 else f"dtypes {', '.join(dtypes)} have"
    raise InputError(f"{what} no {format_name} equivalent"
                     + (f": leaves {', '.join(named)} ({len(leaves)} in all)" if len(leaves) > 1
                        else ""), file=file, entry=leaves[0][0],
                     fix="cast them, or write a jckpt or npz file instead" if len(leaves) > 1
                     else "cast it, or write a jckpt or npz file instead")


def empty_record(tree: dict[str, Any]) -> str | None:
    """The record of the nodes without arrays of `{namespace: subtree}` (optax's `EmptyState`,
    `None`, empty tuples, lists and dicts), as a jckpt file records them under
    `jckpt.format.names.EMPTY_NODES_KEY`; `None` when there are none. Formats that hold
    arrays only carry it beside the paths record, so `tree_from_names` puts them back.

    >>> empty_record({'jckpt': {'w': 1.0, 'opt': (2.0, ())}, 'sgd': ()})
    '{"jckpt": [[["k", "opt"], ["i", 1]]], "sgd": [[]]}'
    """
    from jckpt.trees.pytree import empty_nodes_record  # JAX: imported only when a tree is written

    return empty_nodes_record(tree)


def abstract_items(tree: Any, file: str) -> list[tuple[str, KeyPath, Any]]:
    """`[(namespace, path, spec)]` for every leaf of `{namespace: subtree}`: `spec` has the
    `shape` and `dtype` the leaf is written with (a typed PRNG key's: its key data's), and
    nothing is read or moved: what a format's `check` looks at."""
    import jax

    from jckpt.trees.pytree import flatten
    from jckpt.trees.to_host import is_key_dtype
    out = []
    for ns, sub in check_namespaced(tree, file).items():
        for path, leaf in flatten(sub):
            dtype = getattr(leaf, 'dtype', None)
            if dtype is None:
                leaf = np.asarray(leaf)  # a Python number
            elif is_key_dtype(dtype):
                leaf = jax.eval_shape(jax.random.key_data, leaf)
            out.append((ns, path, leaf))
    return out


def flat_name(ns: str, path: KeyPath, several: bool, sep: str = '.') -> str:
    """The flat tensor name of a leaf: its path joined by `sep`, prefixed by the
    namespace when the tree has several."""
    parts = [str(v) for _, v in path]
    if several:
        parts.insert(0, ns)
    return sep.join(parts)


def flat_names(items: list[tuple[str, KeyPath, np.ndarray]], file: str,
               sep: str = '.') -> list[str]:
    """Distinct flat names for `items`; refuses two leaves that would share one."""
    several = len({ns for ns, _, _ in items}) > 1
    names = [flat_name(ns, p, several, sep) for ns, p, _ in items]
    seen: dict[str, str] = {}
    for (ns, p, _), name in zip(items, names):
        if name in seen:
            raise InputError(f"two leaves would both be stored as {name!r}", file=file,
                             entry=f"{ns}/{path_name(p)}",
                             fix=f"rename one of them (also {seen[name]})")
        seen[name] = f"{ns}/{path_name(p)}"
    _check_text(items, names, file)
    return names


def _check_text(items: list, names: list[str], file: str) -> None:
    """Refuse a name no UTF-8 text holds (a lone surrogate, `os.fsdecode`'s of a bad byte)."""
    try:
        '\n'.join(names).encode('utf-8')  # one pass; the leaf is looked for only on failure
    except UnicodeEncodeError:
        for (ns, p, _), name in zip(items, names):
            try:
                name.encode('utf-8')
            except UnicodeEncodeError:
                raise InputError(f"the name {name!r} holds a lone surrogate, which no UTF-8 text "
                                 "can hold", file=file,
                                 entry=f"{ns}/{path_name(p)}".encode('utf-8', 'backslashreplace')
                                 .decode(), fix="rename the leaf in plain text") from None


def paths_json(items: list[tuple[str, KeyPath, np.ndarray]], names: list[str],
               file: str | None = None) -> str:
    """A JSON record of each stored name's namespace and exact key path; `InputError`
    naming `file` and the leaf for a path deeper than `MAX_PATH_LENGTH`, which readers
    refuse (the file read back with flat names, its tree silently lost)."""
    for ns, p, _ in items:
        if len(p) > MAX_PATH_LENGTH:
            raise InputError(f"key path of {len(p)} components is deeper than {MAX_PATH_LENGTH}, "
                             "more than readers accept", file=file,
                             entry=f"{ns}/{path_name(p[:8])}/...", fix="store the tree flatter")
    return json.dumps({name: [ns, [list(c) for c in p]] for (ns, p, _), name in zip(items, names)},
                      separators=(',', ':'))


@paused  # the record's JSON is a list or two per name, and no cycle: 200,000 names made the
# collector walk millions of objects again and again
def tree_from_names(arrays: dict[str, np.ndarray], record: str | None,
                    namespace: str = DEFAULT_NAMESPACE, empty: str | None = None
                    ) -> dict[str, Any]:
    """Rebuild `{namespace: subtree}` from named arrays and, when it is present
    and covers exactly these names, the paths record written by `paths_json`
    (in the record's order: the tree's, as it was written), with `None` at the nodes
    without arrays that `empty` (written by `empty_record`) names.

    The tree is built by `jckpt.trees.nested.unflatten`, as `jckpt.load` builds one,
    from leaves paired with their paths in C (one namespace, the common case) or
    grouped by namespace. Without a paths record the names stay flat, and `empty`,
    whose paths name no flat name, is not used.
    """
    from jckpt.trees.nested import unflatten, with_recorded_empty_nodes  # reading needs no JAX

    found = _parse_record(record, arrays.keys())
    if found is None:
        return {namespace: dict(arrays)}
    names, distinct, namespaces, paths = found
    leaves = map(arrays.__getitem__, names)
    groups: dict[str, list] = {}
    if len(distinct) == 1:
        groups[namespaces[0]] = list(zip(paths, leaves))
    else:
        for ns, p, leaf in zip(namespaces, paths, leaves):
            groups.setdefault(ns, []).append((p, leaf))
    try:
        tree = {ns: unflatten(items, check=True) for ns, items in groups.items()}
    except FormatError:  # a component not as `paths_json` writes it, two names of one path
        return {namespace: dict(arrays)}
    return with_recorded_empty_nodes(tree, empty)


def record_covers(record: str | None, names: Collection[str]) -> bool:
    """Whether `record` (written by `paths_json`) is well formed and names exactly `names`,
    so `tree_from_names` rebuilds the structure from it (the components of its paths are
    checked as it does: one that is damaged gives the flat names there)."""
    return _parse_record(record, set(names)) is not None


def nest_dotted(tree: Any, file: str, sep: str = '.') -> Any:
    """`tree` with every dict's `sep`-joined str keys split into nested dicts, all the way down.

    A flat `state_dict` becomes the nested tree a JAX model holds; index-like parts stay
    str keys (`'layers.0.w'` gives `{'layers': {'0': {'w': ...}}}`). Refuses with
    `FormatError` a key that cannot be nested: an empty part (`'a..b'`), or a name that
    is both an entry and the prefix of others (`'a'` and `'a.b'`).

    >>> nest_dotted({'params.dense.kernel': 1, 'params.dense.bias': 2, 'step': 3}, 'm.pt')
    {'params': {'dense': {'kernel': 1, 'bias': 2}}, 'step': 3}
    """
    if isinstance(tree, dict):
        out: dict = {}
        made: set[int] = {id(out)}
        for key, value in tree.items():
            parts = key.split(sep) if isinstance(key, str) and sep in key else [key]
            if '' in parts or len(parts) > MAX_PATH_LENGTH:
                raise FormatError(f"key {key!r} has an empty part or too many parts to nest",
                                  file=file, entry=str(key), fix="read it without nesting")
            _place(out, parts, nest_dotted(value, file, sep), made, str(key), file)
        return out
    if isinstance(tree, (list, tuple)):
        items = [nest_dotted(v, file, sep) for v in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def _place(out: dict, parts: list, value: Any, made: set[int], key: str, file: str) -> None:
    """Put `value` at `parts` under `out`, through dicts made here only (`made`)."""
    node = out
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict) or (id(child) not in made and child):
            raise FormatError(f"key {key!r} cannot be nested: {part!r} is an entry of its own",
                              file=file, entry=key, fix="read it without nesting (keys stay flat)")
        made.add(id(child))
        node = child
    if parts[-1] in node:
        raise FormatError(f"key {key!r} cannot be nested: other keys start with it", file=file,
                          entry=key, fix="read it without nesting (keys stay flat)")
    node[parts[-1]] = value


def _parse_record(record: str | None, names: AbstractSet[str]
                  ) -> tuple[list[str], set[str], tuple[str, ...], tuple[list, ...]] | None:
    """`(names, distinct namespaces, namespaces, paths)`, in the record's order, of a record
    `paths_json` wrote for exactly `names`; None for anything else. Checked column by column
    (the names, then each name's `[namespace, path]` pair and the namespaces, each in a C
    pass), not name by name. The paths are left as JSON gives them (lists of `[kind, key]`
    lists): `unflatten(..., check=True)` checks each as it places its leaf, one pass over
    the 600,000 components of 200,000 names where checking them here walked them twice more
    (each a cache miss), and refuses two names of one path."""
    if not record:
        return None
    try:  # shallow: every part's type is checked, so nothing nests deeper than the layout
        raw = json_loads(record, shallow=True)
        if type(raw) is not dict or raw.keys() != names:
            return None
        if not raw:
            return [], set(), (), ()
        # a ValueError but for pairs; a pair that is no list (`"ab"`) has a path that is none
        namespaces, paths = zip(*raw.values(), strict=True)
        distinct = set(namespaces)
        if not all(map(NAMESPACE_RE.match, distinct)):  # what is no str: a TypeError
            return None
    except (ValueError, TypeError, RecursionError):
        return None
    return list(raw), distinct, namespaces, paths


def single_content(tree: dict[str, Any]) -> Any:
    """What a namespace-less format stores: the only namespace's subtree, or the whole
    `{namespace: subtree}` when there are several (or none)."""
    if len(tree) == 1:
        return next(iter(tree.values()))
    return tree


def unsafe_member_name(name: str) -> bool:
    """Whether an archive member name could escape a directory or names none of its files:
    `..`, absolute, a drive, NUL, or empty (which `zipfile`'s `ZipInfo.is_dir` and `repr`
    fail on with an `IndexError`).

    >>> [unsafe_member_name(n) for n in ('a/b.npy', '', '../x')]
    [False, True, True]
    """
    norm = name.replace('\\', '/')
    return not name or norm.startswith('/') or '..' in norm.split('/') or (len(norm) > 1 and norm[1] == ':') \
        or '\0' in name


def check_member_name(name: str, file: str) -> None:
    """Refuse archive member names that could escape a directory (`..`, absolute, drive) or
    name no file (empty): every archive reader checks each name here first."""
    if unsafe_member_name(name):
        raise FormatError(f"archive member name {name!r} is unsafe (empty, absolute or with '..')",
                          file=file, fix="the archive is malicious or damaged; do not use it")


def inside(directory: str, path: str) -> bool:
    """Whether `path` is no symbolic link and lies inside `directory` (a crafted checkpoint
    directory must not make a reader follow it elsewhere)."""
    return not os.path.islink(path) and os.path.realpath(path).startswith(
        os.path.realpath(directory) + os.sep)


def map_file(path: str) -> Buffer:
    """The whole file `path` from its storage backend (locally a private copy-on-write
    mapping; `b''` when it is empty), or the bytes `holding` holds for it. A URL no backend
    serves is an `InputError`."""
    held = held_bytes(path)
    return held if held is not None else backend_for(path).map(path)


_HELD: contextvars.ContextVar[tuple[str, Buffer] | None] = contextvars.ContextVar(
    'jckpt_held_file', default=None)


@contextlib.contextmanager
def holding(path: str, buffer: Buffer) -> Iterator[Buffer]:
    """Within the block, `map_file(path)` and `detect_format(path)` use `buffer` (the whole
    file, as `map_file` returned it) instead of asking the storage again.

    Detecting a file's format and reading it each read the file, and several sniffers map
    it whole (a zip's directory): from an object store, one GET each. A caller that reads
    one file by its detected format reads it once.

    Example:
        ```python
        with holding(url, map_file(url)):
            tree = adapters.read(url)  # detected and read from the one GET's bytes
        ```
    """
    token = _HELD.set((path, buffer))
    try:
        yield buffer
    finally:
        _HELD.reset(token)


def held_bytes(path: str) -> Buffer | None:
    """The bytes `holding` holds for `path` in this context, or `None`."""
    held = _HELD.get()
    return held[1] if held is not None and held[0] == path else None


def array_view(buffer, dtype: np.dtype, shape: tuple[int, ...], offset: int,
               file: str, entry: str) -> np.ndarray:
    """`shape` elements of `dtype` at `offset` of `buffer`: a zero-copy view
    when the offset is a multiple of the element size, an aligned copy otherwise."""
    count = math.prod(shape)
    if offset < 0 or offset + count * dtype.itemsize > len(buffer):
        raise FormatError("tensor data extends past the end of the file", file=file, entry=entry,
                          fix="the file is truncated or damaged")
    array = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)
    if dtype.itemsize > 1 and offset % dtype.itemsize:
        array = array.copy()
    return array


@contextlib.contextmanager
def published(target: str, durable: bool = True) -> Iterator[io.BufferedWriter]:
    """A binary file object streaming to `target`'s backend, published atomically on success.

    The backend's `create` stages the
    write (locally a locked sibling renamed over `target`); the file object
    wraps a duplicate of its descriptor, so `zipfile` and `struct` writers
    can seek and write. An exception leaves `target` as it was.
    """
    with backend_for(target).create(target, durable=durable) as staging:
        try:
            with os.fdopen(os.dup(staging.fd), 'w+b') as f:
                yield f
                f.flush()
        except OSError as e:
            raise storage_error(e, "writing", target) from e
        staging.publish()
