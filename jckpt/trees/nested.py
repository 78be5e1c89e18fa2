"""Nested dicts and lists from stored key paths: the tree a checkpoint read without a target
becomes. Plain Python, no JAX: the adapters and the tools build trees this way too.

>>> unflatten([((('k', 'w'),), 1), ((('k', 'l'), ('i', 1)), 2)])
{'w': 1, 'l': [None, 2]}
>>> flatten_plain({'w': 1, 'l': [None, 2]})
[((('k', 'l'), ('i', 1)), 2), ((('k', 'w'),), 1)]
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable
from typing import Any

from jckpt.errors import FormatError, InputError
from jckpt.format.entries import INT_KINDS, PATH_KINDS
from jckpt.format.header import NAMESPACE_RE, Entry, KeyPath, path_name
from jckpt.format.limits import MAX_PATH_LENGTH
from jckpt.format.metadata import empty_nodes_table


def unflatten(items: Iterable[tuple[KeyPath, Any]], *, file: str | None = None,
              check: bool = False) -> Any:
    """Nested dicts and lists from `(path, leaf)` pairs (the inverse of `flatten`
    for trees of dicts and lists).

    One pass places every leaf, noting the few nodes given an integer key on the way;
    only those are looked at again (made lists, or refused for mixing key kinds). Every
    load of a file builds its tree here: 200,000 leaves take about what nesting 200,000
    dotted names takes.

    `check=True` takes paths as JSON gives them (lists of `[kind, key]` lists, as a paths
    record stores them) and checks each component as its leaf is placed, refusing with
    `FormatError` one that is not a pair of a known kind and a key of its type (a bool is
    no int): one pass over them, where checking first would walk every component twice.

    >>> unflatten([([['k', 'l'], ['i', 0]], 1)], check=True)
    {'l': [1]}
    """
    items = items if isinstance(items, list) else list(items)
    root: dict = {}
    numbered: dict[int, list] = {}  # id -> [node, a path through it, its depth, sequence?]
    for path, leaf in items:
        if check:
            _check_path(path, file)
        if not path:
            if len(items) > 1:  # whichever comes first: the others would be dropped
                raise FormatError(f"a root leaf conflicts with {len(items) - 1} other entries",
                                  file=file, fix="the file is damaged or crafted: a tree whose "
                                                 "root is a leaf holds nothing else")
            return leaf
        node = root
        for kind, key in path[:-1]:
            if kind not in _NAMED_KINDS:
                _number(numbered, root, node, path, kind)
            child = node.get(key, _MISSING)
            if child is _MISSING:
                child = node[key] = {}
            elif not isinstance(child, dict):
                raise FormatError("an entry sits inside another entry's leaf", file=file,
                                  entry=path_name(path), fix="the file is damaged or crafted")
            node = child
        kind, key = path[-1]
        if kind not in _NAMED_KINDS:
            _number(numbered, root, node, path, kind)
        if key in node:
            raise FormatError("two entries claim the same place", file=file,
                              entry=path_name(path), fix="the file is damaged or crafted")
        node[key] = leaf
    # Holes (indices no entry fills) become None; a hostile index must not allocate a huge list.
    return _sequences(root, numbered, _MAX_HOLES + 16 * len(items), file) if numbered else root


#: The type of the key of each path kind (`type(key)`: a bool is no int).
_KEY_TYPES = {kind: int if kind in INT_KINDS else str for kind in PATH_KINDS}
_PAIRS = (list, tuple)


def _check_path(path: Any, file: str | None) -> None:
    """Refuse a path that is not a sequence of at most `MAX_PATH_LENGTH` `[kind, key]` pairs of
    a known kind and a key of its type (what `unflatten(..., check=True)` is given from a
    file's JSON)."""
    try:
        if type(path) in _PAIRS and len(path) <= MAX_PATH_LENGTH:
            for c in path:  # a loop, not all(): this runs for every leaf of a large file
                if type(c) not in _PAIRS or len(c) != 2 or _KEY_TYPES.get(c[0]) is not type(c[1]):
                    break
            else:
                return
    except TypeError:  # a kind that cannot be looked up: a list
        pass
    raise FormatError(f"key path {reprlib.repr(path)} is not a list of [kind, key] pairs jckpt "
                      "writes", file=file, fix="the file is damaged or crafted")  # reprlib: bounded


def entry_path(e: Entry) -> KeyPath:
    """Where an entry sits in its namespace's tree: its path, or `n<id>` for a path-less
    (OCANNL) one."""
    return e.path if e.path is not None else (('k', f"n{e.id}"),)


def check_one_tree(entries: Iterable[Entry], *, file: str, fix: str) -> None:
    """Refuse, before a file is written, entries that `load` could not rebuild into one tree
    per namespace: a leaf where others hold a node, a root leaf beside other leaves, a
    field and a dict key of one name, an index and an integer key of one number.

    >>> import numpy as np
    >>> from jckpt.format.entries import entry_for
    >>> root, w = (entry_for('jckpt', p, np.dtype('f4'), (), id=i) for i, p in
    ...            enumerate([(), (('k', 'w'),)]))
    >>> check_one_tree([root, w], file='m.jckpt', fix='save it whole')
    Traceback (most recent call last):
    jckpt.errors.InputError: m.jckpt: namespace 'jckpt' would not form one tree: ...
    """
    groups: dict[str, list[tuple[KeyPath, None]]] = {}
    for e in entries:
        groups.setdefault(e.namespace, []).append((entry_path(e), None))
    for namespace, items in groups.items():
        try:
            unflatten(items)
        except FormatError as err:
            raise InputError(f"namespace {namespace!r} would not form one tree: {err.message}",
                             file=file, entry=err.entry and f"{namespace}/{err.entry}",
                             fix=fix) from None


def flatten_plain(tree: Any) -> list[tuple[KeyPath, Any]]:
    """`(path, leaf)` pairs of a tree of dicts, lists and tuples, in JAX's order (a dict's
    keys sorted) and with its path kinds (`k`, `ki` for an integer key, `i`), without JAX:
    None and empty containers hold no leaf. What a format's reader gives is flattened so."""
    out: list[tuple[KeyPath, Any]] = []
    stack: list[tuple[KeyPath, Any]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            keys = _sorted_keys(node)
            stack.extend(((*path, ('ki' if isinstance(k, int) else 'k', k)), node[k])
                         for k in reversed(keys))
        elif isinstance(node, (list, tuple)):
            stack.extend(((*path, ('i', i)), v) for i, v in reversed(list(enumerate(node))))
        elif node is not None:
            out.append((path, node))
    return out


def _sorted_keys(node: dict) -> list:
    """A dict's keys in JAX's order: ints first, then strings, each sorted. Keys of one kind
    sort as they are (no Python call per key); mixed ones by kind, then value."""
    try:
        return sorted(node)
    except TypeError:
        return sorted(node, key=lambda k: (isinstance(k, str), k))


def is_empty_node(x: Any) -> bool:
    """Whether `x` is a node that holds no leaves and that exports must keep: `None`, and
    empty tuples (optax's `EmptyState` and other NamedTuples without fields), lists and dicts.

    >>> is_empty_node(None), is_empty_node(()), is_empty_node({'a': None}), is_empty_node(0)
    (True, True, False, False)
    """
    return x is None or (isinstance(x, (tuple, list, dict)) and len(x) == 0)


def with_empty_nodes(tree: Any, paths: Iterable[KeyPath]) -> Any:
    """`tree` (nested dicts and lists, as `unflatten` builds) with `None` at each of `paths`.

    A parent that holds no leaves (optax's `MaskedState(inner_state=EmptyState())`, whose
    only empty node is its field) is missing from `tree`, or a `None` hole of a list:
    it is built, a list where the path's next step is an index, else a dict. A path that
    runs into a leaf, or a key of the wrong kind, is left out (the paths only help exports).

    >>> with_empty_nodes([{'count': 1}], [(('i', 1),), (('i', 2),), (('k', 'x'), ('k', 'y'))])
    [{'count': 1}, None, None]
    >>> with_empty_nodes([None, {'count': 1}], [(('i', 0), ('a', 'inner_state'))])
    [{'inner_state': None}, {'count': 1}]
    >>> print(with_empty_nodes({}, [()]))  # the root's path: the tree is one empty node
    None
    """
    paths = list(paths)
    if () in paths:
        return None if is_empty_node(tree) else tree
    for p in paths:
        node = tree
        for n, (_, key) in enumerate(p[:-1]):
            node = _child_node(node, key, [] if p[n + 1][0] == 'i' else {}, len(paths))
            if node is None:
                break
        else:
            _child_node(node, p[-1][1], None, len(paths))
    return tree


def with_recorded_empty_nodes(tree: dict[str, Any], recorded: str | None) -> dict[str, Any]:
    """`{namespace: subtree}` with `None` at each node without leaves that `recorded` (the
    value of `jckpt.format.names.EMPTY_NODES_KEY`, by namespace) names (`with_empty_nodes`),
    and a namespace of such nodes alone (`optax.sgd`'s state) added: the structure a jckpt
    file, or a file jckpt wrote in another format, records of the tree it was written from.

    A namespace that is not a valid name is left out, as every path that does not fit the
    tree (the record only describes structure; a damaged one changes no leaf).

    >>> with_recorded_empty_nodes({'jckpt': {'w': 1}}, '{"jckpt": [[["k", "e"]]], "opt": [[]]}')
    {'jckpt': {'w': 1, 'e': None}, 'opt': None}
    """
    table = empty_nodes_table(recorded)  # parsed once: a crafted record may name many
    if not table:
        return tree
    out = dict(tree)
    for ns, paths in table.items():  # a namespace of empty nodes alone has no leaf
        if ns not in out and NAMESPACE_RE.match(ns):
            first = paths[0]  # `()`: the namespace is itself an empty node
            out[ns] = [] if first and first[0][0] == 'i' else {}
    return {ns: with_empty_nodes(sub, table.get(ns, ())) for ns, sub in out.items()}


def _child_node(node: Any, key: Any, made: Any, slack: int) -> Any:
    """`node[key]`, with `made` put there first in place of nothing or of a `None` hole; the
    child if it is a dict or a list, else None. None too where `key` cannot be in `node`: a
    leaf, a list's key that is not an index or lies beyond `slack` slots past its end."""
    if isinstance(node, dict):
        if node.get(key) is None:
            node[key] = made
        child = node[key]
    elif isinstance(node, list) and type(key) is int and 0 <= key <= len(node) + slack:
        node.extend([None] * (key + 1 - len(node)))  # a bounded extension: holes are None
        if node[key] is None:
            node[key] = made
        child = node[key]
    else:
        return None
    return child if isinstance(child, (dict, list)) else None


#: Sequence slots without an entry that ``unflatten`` fills with None, beyond 16 per entry.
_MAX_HOLES = 1 << 16
#: Path kinds whose key is a name: every other kind's key is an integer.
_NAMED_KINDS = frozenset({'k', 'a'})
#: Path kinds of a sequence's slots (`ki` is an integer key of a dict).
_SEQUENCE_KINDS = frozenset({'i', 'f'})
_MISSING = object()


def _number(numbered: dict[int, list], root: dict, node: dict, path: KeyPath, kind: str) -> None:
    """Note that `node` (on `path`) is given an integer key of `kind`."""
    found = numbered.get(id(node))
    if found is None:
        depth = 0
        walk = root
        while walk is not node:  # on the path: it was just walked to
            walk = walk[path[depth][1]]
            depth += 1
        numbered[id(node)] = [node, path, depth, kind in _SEQUENCE_KINDS]
    elif kind in _SEQUENCE_KINDS:
        found[3] = True


def _sequences(root: dict, numbered: dict[int, list], holes: int, file: str | None) -> Any:
    """`root` with each noted node whose slots are all indices made a list (deepest first, so a
    list of lists is made inside out); a node mixing integer and string keys refused."""
    for node, path, depth, sequence in sorted(numbered.values(), key=lambda n: -n[2]):
        where = path_name(path[:depth]) or '<root>'
        if not all(isinstance(k, int) for k in node):  # JAX sorts a dict's keys: it could not
            raise FormatError("a node mixes integer and string keys, which no tree can order",
                              file=file, entry=where, fix="the header's paths are damaged")
        if not sequence:
            continue
        size = max(node, default=-1) + 1
        holes -= size - len(node)
        if holes < 0 or min(node, default=0) < 0:
            raise FormatError(f"sequence index {min(node) if min(node) < 0 else max(node)} is "
                              "negative or leaves too many empty slots", file=file, entry=where,
                              fix="the header's paths are damaged")
        made = [node.get(i) for i in range(size)]
        if depth == 0:
            root = made  # type: ignore[assignment]
            continue
        parent = root
        for _, key in path[:depth - 1]:
            parent = parent[key]
        parent[path[depth - 1][1]] = made
    return root


__all__ = ['check_one_tree', 'entry_path', 'flatten_plain', 'is_empty_node', 'unflatten',
           'with_empty_nodes', 'with_recorded_empty_nodes']
