"""Pytrees <-> (key path, leaf) lists, and namespace prefixing."""

import collections
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jckpt.errors import InputError
from jckpt.format.entries import Header, entry_for
from jckpt.trees import pytree as tree_mod
from jckpt.trees.nested import unflatten


class Pair(NamedTuple):
    a: object
    b: object


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    params: dict
    step: object


def test_flatten_gives_stored_paths_of_every_kind():
    tree = {"d": {"x": 1}, "e": {3: 2}, "l": [4, (5,)], "p": Pair(6, 7), "s": State({"w": 8}, 9)}
    items = tree_mod.flatten(tree)
    paths = [p for p, _ in items]
    assert paths == [
        (("k", "d"), ("k", "x")), (("k", "e"), ("ki", 3)),
        (("k", "l"), ("i", 0)), (("k", "l"), ("i", 1), ("i", 0)),
        (("k", "p"), ("a", "a")), (("k", "p"), ("a", "b")),
        (("k", "s"), ("a", "params"), ("k", "w")), (("k", "s"), ("a", "step"))]
    assert [v for _, v in items] == [1, 2, 4, 5, 6, 7, 8, 9]
    assert tree_mod.flatten(np.ones(2))[0][0] == ()  # a root leaf has the empty path
    spec = jax.ShapeDtypeStruct((2,), np.float32)
    assert tree_mod.flatten({"s": spec}) == [((("k", "s"),), spec)]  # kept whole


def test_flatten_with_treedef_rebuilds_the_structure():
    tree = {"p": Pair(1, [2, 3]), "s": State({"w": 4}, 5)}
    items, treedef = tree_mod.flatten_with_treedef(tree)
    back = jax.tree_util.tree_unflatten(treedef, [v * 10 for _, v in items])
    assert type(back["p"]) is Pair and back["p"].b == [20, 30] and back["s"].params == {"w": 40}


def test_unflatten_builds_dicts_and_lists():
    tree = {"d": {"x": 1}, "e": {3: 2}, "l": [4, [5, 6]], "p": Pair(7, 8)}
    rebuilt = unflatten(tree_mod.flatten(tree))
    assert rebuilt == {"d": {"x": 1}, "e": {3: 2}, "l": [4, [5, 6]], "p": {"a": 7, "b": 8}}
    assert unflatten([((), 9)]) == 9
    assert unflatten([((("i", 2),), "c"), ((("i", 0),), "a")]) == ["a", None, "c"]


def test_keys_that_cannot_be_stored_name_the_leaf():
    with pytest.raises(InputError, match=r"dict key \(1, 2\) of type tuple cannot be stored") as info:
        tree_mod.flatten({"ok": 1, "bad": {(1, 2): 3}})
    assert "bad" in info.value.entry
    with pytest.raises(InputError, match="key path element"):
        tree_mod.key_to_component(object())


def test_leaf_name():
    assert tree_mod.leaf_name("jckpt", (("k", "a"), ("i", 0), ("ki", 3))) == "jckpt/a/0/3"
    assert tree_mod.leaf_name("ns", ()) == "ns/<root>"


def test_prefix_namespace_of_trees_and_headers():
    header = Header(tensors=(entry_for("jckpt", (("k", "w"),), np.float32, (1,), id=4),))
    pre = tree_mod.prefix_namespace(header, "m1")
    assert [(e.namespace, e.id) for e in pre.tensors] == [("m1__jckpt", 4)]
    assert header.tensors[0].namespace == "jckpt"  # pure: the argument is unchanged
    assert tree_mod.prefix_namespace(header, None) is header
    assert tree_mod.prefix_namespace(header, "") is header
    assert tree_mod.prefix_namespace({"a": 1, "b": 2}, "p") == {"p__a": 1, "p__b": 2}
    assert tree_mod.prefixed("ns", "p") == "p__ns" and tree_mod.prefixed("ns", None) == "ns"


@pytest.mark.parametrize("prefix", ["1bad", "no-dash", "a b", "é"])
def test_prefix_namespace_refuses_invalid_prefixes(prefix):
    with pytest.raises(InputError, match="invalid namespace prefix"):
        tree_mod.prefix_namespace({"a": 1}, prefix)
    with pytest.raises(InputError, match="invalid namespace prefix"):
        tree_mod.check_prefix(prefix)


def test_prefix_namespace_refuses_other_values():
    with pytest.raises(InputError, match="takes a loaded tree"):
        tree_mod.prefix_namespace([1, 2], "p")


def test_prefix_that_is_not_a_string_is_refused():
    with pytest.raises(InputError, match="a namespace prefix must be a string or None"):
        tree_mod.check_prefix(3)
    tree_mod.check_prefix(None)
    tree_mod.check_prefix("")


class _Empty(NamedTuple):
    pass


def test_flatten_with_empty_finds_the_outermost_nodes_without_leaves():
    tree = {'w': np.ones(2), 'opt': (np.zeros(1), _Empty(), None), 'cache': {'a': [], 'b': {}}}
    items, empty = tree_mod.flatten_with_empty(tree)
    assert [p for p, _ in items] == [p for p, _ in tree_mod.flatten(tree)]
    assert empty == [(('k', 'cache'), ('k', 'a')), (('k', 'cache'), ('k', 'b')),
                     (('k', 'opt'), ('i', 1)), (('k', 'opt'), ('i', 2))]
    assert tree_mod.flatten_with_empty({'only': None}) == ([], [(('k', 'only'),)])
    # a tree that is itself one empty node: the root's path, so its namespace is not lost
    assert tree_mod.flatten_with_empty(None) == ([], [()])
    assert tree_mod.empty_paths(_Empty()) == tree_mod.empty_paths({}) == [()]
    # integer keys, alone or beside string keys (a flat .pt file's dict, which JAX cannot sort)
    assert tree_mod.empty_paths({'a': 1, 2: (), 'b': {3: None, 4: [1, {}]}}) == [
        (('k', 'b'), ('ki', 3)), (('k', 'b'), ('ki', 4), ('i', 1)), (('ki', 2),)]


def test_with_empty_nodes_puts_none_at_each_path_and_builds_parents_without_leaves():
    loaded = {'opt': [np.zeros(1)], 'w': np.ones(2)}
    out = tree_mod.with_empty_nodes(loaded, [(('k', 'opt'), ('i', 2)), (('k', 'cache'),),
                                             (('k', 'gone'), ('k', 'x')), (('k', 'w'), ('i', 0)),
                                             (('k', 'opt'), ('i', 10**12)),
                                             (('k', 'opt'), ('k', 'x'))])
    assert out['opt'][1:] == [None, None] and out['cache'] is None
    assert out['gone'] == {'x': None}  # a parent without leaves is built
    assert len(out['opt']) == 3  # an index far beyond the list adds nothing, nor a key in a list
    np.testing.assert_array_equal(out['w'], np.ones(2))  # a path into a leaf is left out
    # a list's hole (an index no entry filled) whose node holds only empty nodes: built
    holes = tree_mod.with_empty_nodes({'opt': [None, {'count': 1}]},
                                      [(('k', 'opt'), ('i', 0), ('a', 'inner_state')),
                                       (('k', 'skip'), ('i', 1), ('i', 0))])
    assert holes == {'opt': [{'inner_state': None}, {'count': 1}], 'skip': [None, [None]]}
    # the root's path: the tree is one empty node, unless entries filled it
    assert tree_mod.with_empty_nodes({}, [()]) is None
    assert tree_mod.with_empty_nodes({'mu': 1}, [()]) == {'mu': 1}


class _Pair(NamedTuple):
    left: Any
    right: Any


@dataclasses.dataclass
class _Node:
    w: Any
    b: Any


jax.tree_util.register_dataclass(_Node, data_fields=['w', 'b'], meta_fields=[])


@pytest.mark.parametrize("tree", [
    {"b": [1, (2.0, None, np.float32(3))], "a": {"z": np.ones(2), "y": []}},
    {"opt": _Pair(left={"mu": np.zeros(3)}, right=(None, jnp.ones(1))), "i": {1: 2, 0: [3]}},
    [_Node(w=np.ones(1), b={"k": _Pair(1, 2)}), collections.OrderedDict(z=1, a=2), 7],
    {"key": jax.random.key(0), "sds": jax.ShapeDtypeStruct((2,), jnp.float32), "n": None},
    np.arange(3),
    (),
])
def test_flatten_gives_jax_order_and_key_paths(tree):
    """The fast path for plain containers agrees with JAX's own key paths, leaf for leaf."""
    expected, treedef = jax.tree_util.tree_flatten_with_path(tree)
    items, got_treedef = tree_mod.flatten_with_treedef(tree)
    assert [p for p, _ in items] == [tree_mod.to_path(kp) for kp, _ in expected]
    assert all(a is b for (_, a), (_, b) in zip(items, expected))
    assert got_treedef == treedef


def test_a_tree_jax_cannot_flatten_is_an_input_error():
    with pytest.raises(InputError, match="JAX cannot flatten the tree") as e:
        tree_mod.flatten({1: np.ones(1), "1": np.ones(1)})
    assert "keys of one type" in e.value.fix


@pytest.mark.parametrize("key", [10 ** 20, -10 ** 20, 2 ** 70, 10 ** 5000],
                         ids=["1e20", "-1e20", "2**70", "1e5000"])
def test_an_integer_key_too_long_to_read_back_is_refused_at_save(tmp_path, key):
    import jckpt

    path = tmp_path / "big.jckpt"
    with pytest.raises(InputError, match="more than 20 digits") as err:
        jckpt.save(jckpt.Context(), {key: np.ones(1)}, path)
    assert err.value.file == str(path) and not path.exists()
    with pytest.raises(InputError, match="more than 20 digits"):
        tree_mod.key_to_component(jax.tree_util.DictKey(key))


def test_the_longest_integer_keys_round_trip(tmp_path):
    import jckpt

    tree = {10 ** 20 - 1: np.ones(1), -(10 ** 20 - 1): np.zeros(1), 2 ** 64 - 1: np.ones(2)}
    jckpt.save(jckpt.Context(), tree, tmp_path / "k.jckpt")
    _, back = jckpt.load(jckpt.Context(host=True), tmp_path / "k.jckpt")
    assert sorted(back["jckpt"]) == sorted(tree)


def test_a_tree_nested_past_the_path_limit_is_refused_not_a_recursion_error(tmp_path):
    """Looking for empty nodes descended two Python frames a level: 500 levels overflowed
    the stack (RecursionError) before the paths' check could name the leaf."""
    import jckpt
    tree = np.ones(2, np.float32)
    for i in range(500):
        tree = {f"k{i}": tree}
    assert tree_mod.empty_paths(tree) == []
    with pytest.raises(InputError, match='key path of 500 components is deeper than 256') as e:
        jckpt.save(jckpt.Context(), tree, tmp_path / 'deep.jckpt')
    # named as every other entry is, with its namespace (it was 'k499/k498/...', alone so)
    assert e.value.entry.startswith('jckpt/k499/k498/') and e.value.entry.endswith('/...')
