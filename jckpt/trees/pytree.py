"""Pytrees <-> flat `(key path, leaf)` lists, and namespace prefixing.

Key paths are stored as `path` components: `('k', str)` dict key,
`('ki', int)` integer dict key, `('i', int)` sequence index, `('a', str)`
attribute (dataclasses, NamedTuples, flax structs), `('f', int)` flattened
index. Without a target, `jckpt.trees.nested.unflatten` rebuilds nested dicts
(for `k`, `ki` and `a`) and lists (for `i` and `f`).

>>> items = flatten({'params': {'w': 1.0}, 'opt': [2, 3]})
>>> [p for p, _ in items]
[(('k', 'opt'), ('i', 0)), (('k', 'opt'), ('i', 1)), (('k', 'params'), ('k', 'w'))]
>>> from jckpt.trees.nested import unflatten
>>> unflatten(items)
{'opt': [2, 3], 'params': {'w': 1.0}}
>>> prefix_namespace({'jckpt': 1}, 'student')
{'student__jckpt': 1}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import jax

from jckpt.errors import InputError
from jckpt.format.entries import check_prefix, prefixed
from jckpt.format.entries import loose_path as loose_path  # its home is the codec: the tools match by it
from jckpt.format.header import Header, KeyPath, path_name
from jckpt.format.limits import MAX_INT_DIGITS, MAX_PATH_LENGTH
from jckpt.format.metadata import empty_nodes_text, prefix_header
from jckpt.trees.nested import is_empty_node as is_empty_node  # plain Python: readers use them
from jckpt.trees.nested import unflatten as unflatten  # its home before trees.nested
from jckpt.trees.nested import with_empty_nodes as with_empty_nodes

T = TypeVar('T')


def key_to_component(key: Any, where: str = '') -> tuple[str, str | int]:
    """One JAX key-path element as a stored `path` component."""
    tu = jax.tree_util
    if isinstance(key, tu.DictKey):
        k = key.key
        if isinstance(k, str):
            return ('k', k)
        if isinstance(k, int) and not isinstance(k, bool):
            if abs(k) >= 10 ** MAX_INT_DIGITS:  # a reader would refuse it as a damaged header
                raise InputError(f"integer dict key has more than {MAX_INT_DIGITS} digits",
                                 entry=where or None, fix="use keys that fit in 64 bits, or strings")
            return ('ki', int(k))
        raise InputError(f"dict key {k!r} of type {type(k).__name__} cannot be stored",
                         entry=where or None, fix="use str or int dict keys")
    if isinstance(key, tu.SequenceKey):
        return ('i', key.idx)
    if isinstance(key, tu.GetAttrKey):
        return ('a', key.name)
    if isinstance(key, tu.FlattenedIndexKey):
        return ('f', key.key)
    raise InputError(f"key path element {key!r} cannot be stored", entry=where or None,
                     fix="register the node type with a key path that uses dict keys, "
                         "indices or attributes")


def _component(key: Any) -> tuple[str, str | int]:
    """`key_to_component` with the common cases first (the save and restore hot loop)."""
    kind = type(key)
    if kind is _DictKey and type(key.key) is str:
        return ('k', key.key)
    if kind is _SequenceKey:
        return ('i', key.idx)
    if kind is _GetAttrKey:
        return ('a', key.name)
    return key_to_component(key)


_DictKey = jax.tree_util.DictKey
_SequenceKey = jax.tree_util.SequenceKey
_GetAttrKey = jax.tree_util.GetAttrKey


def to_path(keypath: Iterable[Any]) -> KeyPath:
    """A JAX key path as a stored path."""
    keypath = tuple(keypath)
    try:
        return tuple([_component(k) for k in keypath])
    except InputError:  # again, naming the leaf (formatted only when needed)
        return tuple(key_to_component(k, _keystr(keypath)) for k in keypath)


def _keystr(keypath: tuple[Any, ...]) -> str:
    """`jax.tree_util.keystr`, or a placeholder where a key is an integer too long to print."""
    try:
        return jax.tree_util.keystr(keypath)
    except ValueError:  # Python refuses str() of an integer over 4300 digits
        return '<a path with an integer key too long to print>'


def leaf_name(namespace: str, path: KeyPath) -> str:
    """`namespace/a/b/0`: how messages name the leaf at `path` (`namespace/<root>` for the root).

    >>> leaf_name('jckpt', (('k', 'params'), ('i', 0)))
    'jckpt/params/0'
    """
    # list-built: this runs once per leaf of every save and restore
    return f"{namespace}/{'/'.join([v if type(v) is str else str(v) for _, v in path]) or '<root>'}"


_REPR = {'k': '[{!r}]', 'ki': '[{!r}]', 'i': '[{}]', 'a': '.{}', 'f': '[<flat index {}>]'}


def path_repr(path: KeyPath) -> str:
    """`path` written as JAX writes key paths, so that its key kinds show.

    >>> path_repr((('i', 0), ('a', 'count'))), path_repr((('i', 0), ('k', 'count')))
    ('[0].count', "[0]['count']")
    """
    return ''.join(_REPR.get(kind, '[{!r}]').format(key) for kind, key in path) or '<root>'


def is_leaf(x: Any) -> bool:
    """Leaves that JAX would otherwise flatten further, kept whole (ShapeDtypeStruct)."""
    return isinstance(x, jax.ShapeDtypeStruct)


def flatten(tree: Any) -> list[tuple[KeyPath, Any]]:
    """`[(path, leaf), ...]` in JAX's leaf order."""
    return flatten_with_treedef(tree)[0]


def _is_leaf_or_empty(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or is_empty_node(x)


def flatten_with_empty(tree: Any) -> tuple[list[tuple[KeyPath, Any]], list[KeyPath]]:
    """`flatten`, with the paths of the outermost empty nodes (`is_empty_node`; see `empty_paths`).

    A save records them (`jckpt.format.names.EMPTY_NODES_KEY`) so that an
    export to a format that keeps such nodes (orbax) can put them back.

    >>> items, empty = flatten_with_empty({'w': 1.0, 'opt': [2.0, (), None]})
    >>> len(items), empty
    (2, [(('k', 'opt'), ('i', 1)), (('k', 'opt'), ('i', 2))])
    """
    return flatten(tree), empty_paths(tree)


def empty_paths(tree: Any) -> list[KeyPath]:
    """The paths of `tree`'s outermost empty nodes below the root, in path order; `[()]`
    (the root's empty path) when `tree` is itself one (`optax.identity().init(params)`,
    a bare `EmptyState()`), so a namespace holding only that is not lost.

    >>> empty_paths({'opt': [1.0, (), {}]}), empty_paths(())
    ([(('k', 'opt'), ('i', 1)), (('k', 'opt'), ('i', 2))], [()])
    """
    if is_empty_node(tree):
        return [()]
    empty: list[KeyPath] = []
    _empties(tree, (), empty)
    return sorted(empty)  # in path order, whatever order dicts were built in


def empty_nodes_record(trees: Mapping[str, Any]) -> str | None:
    """The value of `jckpt.format.names.EMPTY_NODES_KEY` recording the key paths of the
    empty nodes (`empty_paths`) of every namespace of `{namespace: tree}`, as `save` records
    them; `None` when there are none.

    >>> empty_nodes_record({'opt': [{'count': 1}, (), None], 'w': {'a': 1}})
    '{"opt": [[["i", 1]], [["i", 2]]]}'
    """
    text = None
    for namespace, tree in trees.items():
        text = empty_nodes_text(text, namespace, empty_paths(tree)) or text
    return text


def _empties(node: Any, prefix: KeyPath, out: list[KeyPath]) -> None:
    """Append the path of each outermost node without leaves below `node` (at `prefix`).

    Plain dicts, lists and tuples are walked here, their leaves skipped by type
    (a save of many leaves stays cheap); other nodes go through JAX's key paths. A dict
    of integer keys, or of integer and string keys (which JAX cannot sort, but a flat
    `.pt` file holds), is walked here too, each integer key an `('ki', key)` step.
    """
    kind = type(node)
    if kind is dict and all(type(k) is str for k in node):
        children: Iterable[tuple[str, Any]] = node.items()
        step = 'k'
    elif kind is list or kind is tuple:
        children, step = enumerate(node), 'i'
    elif node is None or _is_plain_leaf(node):
        return
    elif kind is dict and all(type(k) is str or type(k) is int for k in node):
        for key, child in node.items():
            if type(child) not in _LEAF_TYPES:
                _empty_child(child, (*prefix, ('k' if type(key) is str else 'ki', key)), out)
        return
    else:  # NamedTuples, dataclasses, modules: JAX's key paths, with empty nodes as leaves
        for kp, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=_is_leaf_or_empty)[0]:
            if kp and is_empty_node(leaf):
                out.append(prefix + to_path(kp))
        return
    leaf_types = _LEAF_TYPES
    for key, child in children:
        if type(child) not in leaf_types:
            _empty_child(child, (*prefix, (step, key)), out)


def _empty_child(child: Any, path: KeyPath, out: list[KeyPath]) -> None:
    """Append `path` if `child` (at `path`) is an empty node, else its own empty nodes'.
    Past `MAX_PATH_LENGTH` components it stops: such a tree is refused, naming the leaf, by
    the check of its paths, where descending further overflowed Python's stack."""
    if is_empty_node(child):
        out.append(path)
    elif len(path) <= MAX_PATH_LENGTH:
        _empties(child, path, out)


def flatten_with_treedef(tree: Any) -> tuple[list[tuple[KeyPath, Any]], Any]:
    """Like `flatten`, also returning the treedef to rebuild `tree`'s structure.

    The leaves and the treedef come from JAX's own `tree_flatten`; the paths of
    plain dicts (string keys), lists, tuples and `None` are built here, about
    ten times faster than `tree_flatten_with_path` (which builds a key object
    per step of every path), and only other nodes (dataclasses, NamedTuples,
    flax and equinox modules, ...) go through JAX's key paths. Checkpoints of
    100,000 leaves are common: this runs once per save and restore.
    """
    try:
        leaves, treedef = jax.tree_util.tree_flatten(tree)  # a ShapeDtypeStruct is a leaf
    except (TypeError, ValueError) as e:  # e.g. dict keys JAX cannot sort: {1: x, '1': y}
        raise InputError(f"JAX cannot flatten the tree: {e}",
                         fix="give each dict keys of one type (all strings, or all integers); "
                             "a custom pytree node's flatten function must not fail") from None
    paths: list[KeyPath] = []
    _paths(tree, (), paths)
    if len(paths) != len(leaves):  # cannot happen for the nodes above; JAX decides if it does
        pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
        return [(to_path(kp), leaf) for kp, leaf in pairs], treedef
    return list(zip(paths, leaves)), treedef


#: Leaf types met in checkpoints, known without asking JAX's registry.
_LEAF_TYPES = {int, float, bool, complex, jax.ShapeDtypeStruct}


def _is_plain_leaf(node: Any) -> bool:
    kind = type(node)
    if kind in _LEAF_TYPES:
        return True
    if isinstance(node, jax.Array) or kind.__module__ == 'numpy':  # ndarray, numpy scalars
        _LEAF_TYPES.add(kind)
        return True
    return False


def _paths(node: Any, prefix: KeyPath, out: list[KeyPath]) -> None:
    """Append the path of every leaf under `node` (at `prefix`), in JAX's order."""
    kind = type(node)
    if kind is dict and all(type(k) is str for k in node):
        keys = sorted(node)
        steps = [(('k', key),) for key in keys]
        children = [node[key] for key in keys]
    elif kind is list or kind is tuple:
        steps = [(('i', i),) for i in range(len(node))]
        children = node
    elif node is None:
        return
    elif _is_plain_leaf(node):
        out.append(prefix)
        return
    else:  # any other node, or a leaf of another type: JAX's key paths
        out.extend(prefix + p for p in _jax_paths(node, prefix))
        return
    for step, child in zip(steps, children):
        if type(child) in _LEAF_TYPES:  # most children are leaves: no call for them
            out.append(prefix + step)
        else:
            _paths(child, prefix + step, out)


def _jax_paths(node: Any, prefix: KeyPath) -> list[KeyPath]:
    """The paths of the leaves under `node` by JAX's key paths; errors name the whole path."""
    pairs = jax.tree_util.tree_flatten_with_path(node, is_leaf=is_leaf)[0]
    try:
        return [to_path(kp) for kp, _ in pairs]
    except InputError as e:
        raise InputError(e.message, entry=f"{path_name(prefix)}/{e.entry}" if prefix else e.entry,
                         fix=e.fix) from None


def prefix_namespace(tree_or_header: T, prefix: str | None) -> T:
    """Prefix every namespace of a loaded tree `{ns: subtree}` or of a `Header`.

    `ns` becomes `prefix + "__" + ns`; ids are unchanged. A pure function:
    the argument is not modified.
    """
    check_prefix(prefix)
    if isinstance(tree_or_header, Header):
        return prefix_header(tree_or_header, prefix)  # type: ignore[return-value]
    if not prefix:
        return tree_or_header
    if isinstance(tree_or_header, dict):
        return {prefixed(ns, prefix): sub for ns, sub in tree_or_header.items()}
    raise InputError(f"prefix_namespace takes a loaded tree {{namespace: subtree}} or a Header, "
                     f"not {type(tree_or_header).__name__}")
