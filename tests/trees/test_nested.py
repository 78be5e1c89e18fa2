"""Nested dicts and lists from stored key paths (jckpt.trees.nested), built without JAX."""

import subprocess
import sys

import pytest

from jckpt.errors import FormatError
from jckpt.trees.nested import unflatten, with_recorded_empty_nodes


def test_dicts_lists_and_holes():
    assert unflatten([((("k", "w"),), 1), ((("k", "l"), ("i", 1)), 2)]) == {"w": 1, "l": [None, 2]}
    assert unflatten([((("ki", 3), ("a", "x")), 5)]) == {3: {"x": 5}}
    assert unflatten([((), 9)]) == 9


@pytest.mark.parametrize("items,message", [
    ([((("k", "a"),), 2), ((), 1)], "root leaf conflicts"),
    ([((), 1), ((("k", "a"),), 2)], "root leaf conflicts"),  # first: the rest were dropped
    ([((), 1), ((), 2)], "root leaf conflicts"),
    ([((("k", "a"),), 1), ((("k", "a"),), 2)], "two entries claim the same place"),
    ([((("k", "a"),), 1), ((("k", "a"), ("k", "b")), 2)], "inside another entry's leaf"),
    ([((("i", -1),), 1)], "negative or leaves too many empty slots"),
    ([((("i", 10**9),), 1)], "negative or leaves too many empty slots"),
    ([((("k", "a"), ("i", 0)), 1), ((("k", "a"), ("k", "b")), 2)], "mixes integer and string"),
    ([((("k", "a"), ("ki", 0)), 1), ((("k", "a"), ("k", "x")), 2)], "mixes integer and string"),
])
def test_unflatten_refuses_inconsistent_paths(items, message):
    with pytest.raises(FormatError, match=message) as e:
        unflatten(items, file="f.jckpt")
    assert e.value.fix


def test_lists_inside_lists_are_made_inside_out_and_name_where_a_mix_is():
    items = [((("i", i), ("k", "l"), ("i", j)), 10 * i + j) for i in (2, 0) for j in (1, 0)]
    assert unflatten(items) == [{"l": [0, 1]}, None, {"l": [20, 21]}]
    with pytest.raises(FormatError) as e:
        unflatten([((("k", "a"), ("i", 0), ("i", 0)), 1), ((("k", "a"), ("i", 0), ("k", "x")), 2)])
    assert e.value.entry == "a/0"


def test_building_a_tree_imports_no_jax():
    """The adapters' readers build their trees here: reading an npz or safetensors file, or
    verifying a manager's steps, imported JAX through the tree layer."""
    code = ("import sys; from jckpt.trees.nested import unflatten\n"
            "unflatten([((('k', 'a'),), 1)])\n"
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_check_one_tree_refuses_what_unflatten_cannot_rebuild():
    import numpy as np

    from jckpt.errors import InputError
    from jckpt.format.entries import entry_for
    from jckpt.trees.nested import check_one_tree, entry_path

    def entry(ns, path, i):
        return entry_for(ns, path, np.dtype('f4'), (), id=i)

    path_less = entry('ocannl', None, 0)
    assert entry_path(path_less) == (('k', 'n0'),)
    check_one_tree([path_less, entry('ocannl', (('k', 'w'),), 1), entry('jckpt', (), 0)],
                   file='m', fix='f')  # a root leaf alone in its namespace
    with pytest.raises(InputError, match="namespace 'ocannl' would not form one tree: two") as e:
        check_one_tree([path_less, entry('ocannl', (('k', 'n0'),), 1)], file='m', fix='f')
    assert (e.value.file, e.value.entry, e.value.fix) == ('m', 'ocannl/n0', 'f')
    with pytest.raises(InputError, match="an entry sits inside another entry's leaf"):
        check_one_tree([entry('j', (('k', 'a'),), 0), entry('j', (('k', 'a'), ('i', 0)), 1)],
                       file='m', fix='f')


def test_flatten_plain_orders_keys_as_jax_does_whatever_kinds_they_mix():
    """Keys of one kind sort as they are; mixed ones put ints first, as JAX does."""
    import jax
    import numpy as np

    from jckpt.trees.nested import flatten_plain
    for tree in ({'b': 1, 'a': 2, 'a.b': 3}, {3: 1, 1: 2, 2: 3},
                 {'x': [{'z': 1, 'y': 2}, (3, None)], 'y': {}}):
        tree = jax.tree.map(np.int64, tree)
        assert [leaf for _, leaf in flatten_plain(tree)] == jax.tree.leaves(tree), tree
    mixed = flatten_plain({'b': 1, 2: 2, 'a': 3, 1: 4})  # a torch file's state may mix them
    assert [p for p, _ in mixed] == [(('ki', 1),), (('ki', 2),), (('k', 'a'),), (('k', 'b'),)]


def test_recorded_empty_nodes_are_put_back_and_a_namespace_of_them_alone_added():
    recorded = ('{"jckpt": [[["k", "opt"], ["i", 1]]], "sgd": [[["i", 0]], [["i", 1]]], '
                '"ident": [[]], "bad name": [[]], "w": [[["k", "x"]]]}')
    tree = {'jckpt': {'opt': [1]}, 'w': 2}
    out = with_recorded_empty_nodes(tree, recorded)
    assert out == {'jckpt': {'opt': [1, None]}, 'w': 2, 'sgd': [None, None], 'ident': None}
    assert with_recorded_empty_nodes(tree, None) is tree  # nothing recorded: as it was
    assert with_recorded_empty_nodes(tree, 'not json') == tree


@pytest.mark.parametrize("path", [[["zz", "a"]], [["i", "0"]], [["i", True]], [["k", 1]],
                                  [["k", "a", "b"]], ["ka"], [["k", ["a"]]], [[["k"], "a"]],
                                  "ka", [None]])
def test_checked_paths_are_lists_of_pairs_of_a_known_kind_and_a_key_of_its_type(path):
    """What a paths record's JSON holds is checked as the leaf is placed: a component of
    two characters (`"ka"`) is no pair, a bool no index."""
    assert unflatten([([["k", "l"], ["i", 0]], 1)], check=True) == {"l": [1]}
    with pytest.raises(FormatError, match="is not a list of \\[kind, key\\] pairs"):
        unflatten([([["k", "w"]], 0), (path, 1)], check=True)
