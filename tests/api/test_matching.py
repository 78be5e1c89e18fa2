"""Matching target leaves to stored entries, and the errors for leaves the file lacks."""

import numpy as np
import pytest

from jckpt.api.matching import index_entries, match_all
from jckpt.errors import InputError, MissingEntryError
from jckpt.format.entries import Entry, Header


def _header(*paths, namespace='model'):
    return Header(tensors=tuple(
        Entry(id=i, namespace=namespace, prec='Single_prec', dims=(2,), offset=8 * i,
              byte_length=8, path=p) for i, p in enumerate(paths)))


ARRAY = np.zeros(2, np.float32)


def _match(header, *paths, namespace='model', leaf=ARRAY):
    index = index_entries(header, {namespace})
    return match_all(index, [(namespace, [(p, leaf) for p in paths], None)], 'f.jckpt')


W, B = (('k', 'w'),), (('k', 'b'),)


def test_each_leaf_pairs_with_the_entry_at_its_path_in_target_order():
    found = _match(_header(W, B), B, W)
    assert [(e.path, where) for e, _, where in found] == [(B, 'model/b'), (W, 'model/w')]


def test_an_attribute_matches_a_dict_key_of_its_name_and_an_index_its_number_written_out():
    header = _header((('k', 'layers'), ('k', '0'), ('k', 'count')))
    (entry, _, _), = _match(header, (('a', 'layers'), ('i', 0), ('a', 'count')))
    assert entry.id == 0


def test_a_leaf_matching_two_entries_by_key_kinds_alone_is_ambiguous():
    header = _header((('k', '1'),), (('ki', 1),))
    with pytest.raises(MissingEntryError, match="ambiguous"):
        _match(header, (('i', 1),))


def test_a_renamed_leaf_is_told_the_entries_nearest_its_name():
    header = _header((('k', 'dense'), ('k', 'kernel')), (('k', 'dense'), ('k', 'bias')),
                     *[(('k', f'other{i}'),) for i in range(8)])
    with pytest.raises(MissingEntryError) as e:
        _match(header, (('k', 'dense'), ('k', 'kernal')))
    assert 'kernel' in e.value.fix and 'other7' not in e.value.fix


def test_a_tree_saved_whole_and_restored_in_part_is_told_where_the_file_has_it():
    header = _header((('k', 'params'), ('k', 'w')))
    with pytest.raises(MissingEntryError, match="under") as e:
        _match(header, W)
    assert 'params' in e.value.message


def test_an_nnx_state_against_its_pure_dict_is_told_which_to_restore_into():
    header = _header((('k', 'w'), ('a', 'value')))
    with pytest.raises(MissingEntryError) as e:
        _match(header, W)
    assert 'nnx.state' in e.value.fix


def test_a_namespace_the_file_lacks_names_the_ones_it_has():
    header = _header(W, namespace='opt')
    index = index_entries(header, {'model'})
    with pytest.raises(MissingEntryError, match="no namespace 'model'") as e:
        match_all(index, [('model', [(W, np.zeros(2))], None)], 'f.jckpt')
    assert "['opt']" in e.value.fix


def test_every_missing_leaf_is_counted_in_the_one_error():
    with pytest.raises(MissingEntryError, match="2 other target leaves are missing too"):
        _match(_header(W), W, (('k', 'x'),), (('k', 'y'),), (('k', 'z'),))


def test_a_leaf_that_is_no_target_is_named_for_what_it_is():
    with pytest.raises(InputError):
        _match(_header(W), (('k', 'act'),), leaf=print)


def test_a_subtree_the_file_lacks_whole_is_named_with_how_to_keep_its_initial_value():
    params = [(('k', 'params'), ('k', n)) for n in ('w', 'b')]
    stats = [(('k', 'batch_stats'), ('k', n)) for n in ('mean', 'var')]
    with pytest.raises(MissingEntryError) as e:
        _match(_header(*params), *stats, *params, (('k', 'params'), ('k', 'new')))
    assert "nothing under the target's ['batch_stats'] (2 leaves)" in e.value.message
    assert "1 other target leaf is missing too: model/params/new" in e.value.message
    assert "without it (e.g. restore only its ['params'])" in e.value.fix
    assert e.value.entry == 'model/batch_stats/mean'


def test_a_tree_nested_otherwise_is_told_so_when_its_first_leaf_is_a_subtree_the_file_lacks():
    stats = [(('k', 'batch_stats'), ('k', 'mean'))]
    with pytest.raises(MissingEntryError, match="without the target's \\['params'\\]") as e:
        _match(_header(W, B), *stats, (('k', 'params'), *W), (('k', 'params'), *B))
    assert 'params' in e.value.fix and e.value.entry == 'model/params/w'
