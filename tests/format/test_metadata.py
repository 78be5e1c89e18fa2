"""User metadata: string pairs, checked before anything is written."""

import json

import pytest

from jckpt.errors import InputError
from jckpt.format.entries import Header
from jckpt.format.metadata import (
    check_metadata,
    empty_node_namespaces,
    empty_nodes,
    empty_nodes_table,
    empty_nodes_text,
    merged_empty_nodes,
    prefix_header,
)
from jckpt.format.names import LINEAGE_KEY


def test_strings_pass_as_a_new_dict():
    source = {'run': 'a', 'step': '3'}
    out = check_metadata(source, 'f.jckpt')
    assert out == source and out is not source
    assert check_metadata(None) == {}


@pytest.mark.parametrize('bad, named', [({'n': 3}, "'n'"), ({'n': None}, "'n'"), ({3: 'x'}, '3'),
                                        ({'n': b'x'}, "'n'")])
def test_what_is_not_a_string_is_refused_naming_the_key(bad, named):
    with pytest.raises(InputError, match='metadata maps strings to strings') as e:
        check_metadata(bad, 'f.jckpt')
    assert named in e.value.message and e.value.file == 'f.jckpt' and e.value.fix


def test_a_mapping_is_required():
    with pytest.raises(InputError, match='must be a mapping'):
        check_metadata([('a', 'b')], 'f.jckpt')


def test_reserved_keys_are_refused():
    with pytest.raises(InputError, match='is reserved') as e:
        check_metadata({LINEAGE_KEY: 'x'}, 'f.jckpt')
    assert e.value.file == 'f.jckpt' and 'jckpt.' in e.value.fix


def test_empty_nodes_round_trip_and_merge_on_append():
    text = empty_nodes_text(None, 'opt', [(('i', 1),), (('i', 2), ('a', 'x'))])
    assert empty_nodes(text, 'opt') == [(('i', 1),), (('i', 2), ('a', 'x'))]
    assert empty_nodes(text, 'model') == []
    # an append of another namespace keeps these; one of the same namespace drops the empty
    # nodes its leaves now fill, and keeps the others
    both = empty_nodes_text(text, 'model', [(('k', 'cache'),)])
    assert empty_nodes(both, 'opt') == empty_nodes(text, 'opt')
    again = empty_nodes_text(both, 'opt', [], stored=[(('i', 1), ('k', 'mu'))])
    assert empty_nodes(again, 'opt') == [(('i', 2), ('a', 'x'))]
    assert empty_nodes_text(None, 'opt', []) is None
    # a node under an empty one (the root, `()`) fills it as a leaf would
    below = empty_nodes_text(empty_nodes_text(None, 'opt', [()]), 'opt', [(('k', 'z'),)])
    assert empty_nodes(below, 'opt') == [(('k', 'z'),)]
    # and a namespace saved empty whole (`optax.EmptyState()`) holds none of the old nodes
    assert empty_nodes(empty_nodes_text(below, 'opt', [()]), 'opt') == [()]


@pytest.mark.parametrize('text', ['', 'not json', '[1]', '{"opt": 3}', '{"opt": [[["z", 1]]]}',
                                  '{"opt": [[["i", -1]]]}', '{"opt": [[["k", 1]]]}',
                                  '{"opt": [[["i", true]]]}', '{"opt": [[3]]}', '[' * 5000])
def test_empty_nodes_that_are_not_as_written_are_ignored(text):
    assert empty_nodes(text, 'opt') == []


def test_metrics_past_floats_range_are_infinite_never_an_error():
    """`{"loss": 10**400}` written out raised a bare OverflowError from the manager, info
    and the command line; parse_metrics never raises."""
    import math

    from jckpt.format.metadata import parse_metrics
    big = '1' + '0' * 400
    assert parse_metrics(f'{{"loss": {big}, "acc": -{big}, "x": 0.5}}') == {
        'loss': math.inf, 'acc': -math.inf, 'x': 0.5}


def test_empty_node_namespaces_lists_the_recorded_ones_and_ignores_damage():
    text = empty_nodes_text(None, 'opt', [(('i', 0),), (('i', 1),)])
    assert empty_node_namespaces(text) == ['opt']
    assert empty_node_namespaces('{"opt": "bad"}') == empty_node_namespaces('[') == []
    both = empty_nodes_text(text, 'sgd', [()])
    assert empty_nodes_table(both) == {'opt': [(('i', 0),), (('i', 1),)], 'sgd': [()]}
    assert empty_nodes_table('{"opt": "bad"}') == empty_nodes_table(None) == {}


def test_the_roots_empty_path_is_recorded_and_read():
    """A namespace that is itself one empty node (a bare optax `EmptyState()`) had no path
    to record, so the namespace was lost; its path is the root's, `[]` (which earlier
    readers skip as a path that is not one)."""
    text = empty_nodes_text(None, 'opt', [()])
    assert text == '{"opt": [[]]}'
    assert empty_nodes(text, 'opt') == [()] and empty_node_namespaces(text) == ['opt']
    assert empty_nodes_text(text, 'opt', [], stored=[(('k', 'mu'),)]) is None  # filled: dropped


def test_prefix_header_moves_the_recorded_empty_nodes_with_their_namespace():
    header = Header(metadata=(('run', 'a'), ('jckpt.empty_nodes', '{"jckpt": [[["k", "opt"]]]}')))
    assert prefix_header(header, 'ema').metadata_dict() == {
        'run': 'a', 'jckpt.empty_nodes': '{"ema__jckpt": [[["k", "opt"]]]}'}
    assert prefix_header(header, None) is header


def test_many_recorded_empty_nodes_merge_in_one_pass():
    # a node is found above another by a set of prefixes: comparing every pair took 40 s for
    # two files recording 20,000 empty nodes each (a merge of a crafted file, or a big one)
    text = json.dumps({"a": [[["i", i]] for i in range(20_000)] + [[["k", "x"]]]})
    other = json.dumps({"a": [[["k", "x"], ["k", "y"]]]})
    merged = json.loads(merged_empty_nodes([text, other]))
    assert len(merged["a"]) == 20_001 and [["k", "x"]] not in merged["a"]


@pytest.mark.parametrize('metadata, what', [({'run': 'a\udcff'}, 'value'), ({'r\udcffn': 'a'}, 'key')])
def test_a_lone_surrogate_in_metadata_is_refused_naming_the_key(metadata, what):
    # what os.fsdecode makes of a file name's undecodable byte: no header can hold it
    with pytest.raises(InputError, match=f"the {what} of metadata key 'r") as e:
        check_metadata(metadata, 'a.jckpt')
    assert e.value.file == 'a.jckpt' and 'surrogateescape' in e.value.fix
