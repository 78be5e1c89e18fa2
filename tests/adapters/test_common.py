"""What the format adapters share (jckpt.adapters._common): the tree form, flat names, files."""

import os
import warnings
from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jckpt
from jckpt.adapters._common import (
    DEFAULT_NAMESPACE,
    array_view,
    check_member_name,
    check_namespaced,
    flat_name,
    flat_names,
    host_items,
    map_file,
    nest_dotted,
    paths_json,
    published,
    record_covers,
    single_content,
    tree_from_names,
)
from jckpt.errors import FormatError, InputError, StorageError
from tests.properties import PROPERTY

W = (('k', 'w'),)


# --- the tree form -----------------------------------------------------------------------------

def test_the_default_namespace_is_the_contexts():
    import jckpt

    assert DEFAULT_NAMESPACE == jckpt.Context().namespace == 'jckpt'


def test_check_namespaced_passes_a_tree_of_namespaces():
    tree = {'model': {'w': 1}, '_opt2': [2]}
    assert check_namespaced(tree, 'f') is tree
    assert check_namespaced({}, 'f') == {}


@pytest.mark.parametrize('tree', [[np.ones(1)], np.ones(1), {'not valid!': 1}, {'': 1}, {1: 2},
                                  {'ok': 1, '2bad': 2}])
def test_check_namespaced_refuses_anything_else(tree):
    with pytest.raises(InputError, match='adapters write a tree of the form jckpt.load returns') as e:
        check_namespaced(tree, 'out.npz')
    assert e.value.file == 'out.npz' and "{'jckpt': tree}" in e.value.fix


def test_host_items_brings_every_leaf_to_host_in_order():
    x = jax.numpy.arange(3.0)
    key = jax.random.key(2)
    items = host_items({'a': {'w': np.ones(2), 'l': [x]}, 'b': {'k': key, 'n': 3}}, 'f')
    assert [(ns, p) for ns, p, _ in items] == [('a', (('k', 'l'), ('i', 0))), ('a', W),
                                               ('b', (('k', 'k'),)), ('b', (('k', 'n'),))]
    assert all(isinstance(a, np.ndarray) for _, _, a in items)
    np.testing.assert_array_equal(items[0][2], np.arange(3.0))
    np.testing.assert_array_equal(items[2][2], np.asarray(jax.random.key_data(key)))  # key data
    assert items[3][2].shape == () and int(items[3][2]) == 3


def test_host_items_refuses_a_leaf_naming_the_file_and_the_leaf():
    with pytest.raises(InputError, match='leaf of type str is not an array') as e:
        host_items({'a': {'w': np.ones(1), 's': 'text'}}, 'out.safetensors')
    assert (e.value.file, e.value.entry) == ('out.safetensors', 'a/s')
    with pytest.raises(InputError, match='adapters write a tree'):
        host_items([np.ones(1)], 'out.safetensors')


# --- flat names --------------------------------------------------------------------------------

def test_flat_name():
    path = (('k', 'layers'), ('i', 0), ('a', 'kernel'))
    assert flat_name('model', path, False) == 'layers.0.kernel'
    assert flat_name('model', path, True) == 'model.layers.0.kernel'
    assert flat_name('model', path, True, sep='/') == 'model/layers/0/kernel'
    assert flat_name('model', (), False) == ''


def test_flat_names_prefix_the_namespace_only_when_there_are_several():
    one = [('a', W, None), ('a', (('k', 'b'),), None)]
    assert flat_names(one, 'f') == ['w', 'b']
    several = [('a', W, None), ('b', W, None)]
    assert flat_names(several, 'f') == ['a.w', 'b.w']
    assert flat_names(several, 'f', sep='/') == ['a/w', 'b/w']


def test_flat_names_refuse_two_leaves_with_one_name():
    items = [('a', (('k', 'x'), ('k', 'y')), None), ('a', (('k', 'x.y'),), None)]
    with pytest.raises(InputError, match="two leaves would both be stored as 'x.y'") as e:
        flat_names(items, 'out.npz')
    assert (e.value.file, e.value.entry) == ('out.npz', 'a/x.y') and 'a/x/y' in e.value.fix
    assert flat_names(items, 'out.npz', sep='/') == ['x/y', 'x.y']  # distinct with another separator


# --- the paths record --------------------------------------------------------------------------

def items_and_names():
    items = [('model', (('k', 'layers'), ('i', 0), ('k', 'w')), np.ones(2)),
             ('model', (('k', 'step'),), np.int32(1)),
             ('opt', (('a', 'mu'), ('ki', 3)), np.zeros(1))]
    return items, flat_names(items, 'f')


def test_paths_json_round_trips_the_tree():
    items, names = items_and_names()
    record = paths_json(items, names)
    arrays = {n: a for n, (_, _, a) in zip(names, items)}
    tree = tree_from_names(arrays, record)
    assert sorted(tree) == ['model', 'opt']
    assert tree['model']['layers'][0]['w'] is arrays['model.layers.0.w']
    assert tree['model']['step'] is arrays['model.step']
    assert list(jax.tree_util.tree_leaves(tree['opt'])) == [arrays['opt.mu.3']]


@pytest.mark.parametrize('record', [None, '', 'not json', '[]', '{"x": 1}',
                                    '{"a": ["bad ns!", [["k", "a"]]]}',
                                    '{"a": ["m", [["zz", "a"]]]}',
                                    '{"a": ["m", [["i", "0"]]]}',
                                    '{"a": ["m", [["i", true]]]}',
                                    '{"a": ["m", [["k", "a", "b"]]]}',
                                    '{"a": ["m", "ka"]}', '{"a": ["m", [["k", ["a"]]]]}',
                                    '{"a": [["m"], [["k", "a"]]]}', '[' * 100_000,
                                    '{"a": ["m", [["k", %s]]]}' % ('[' * 900 + ']' * 900),
                                    '{"a": ["m", [["k", "a"], "ka"]]}', '{"a": "mk"}'])
def test_a_record_that_does_not_fit_gives_flat_names(record):
    arrays = {'a': np.ones(1)}
    assert tree_from_names(arrays, record) == {DEFAULT_NAMESPACE: arrays}
    assert tree_from_names(arrays, record, namespace='other') == {'other': arrays}


def test_a_record_must_cover_exactly_the_names_and_distinct_paths():
    items, names = items_and_names()
    arrays = {n: a for n, (_, _, a) in zip(names, items)}
    record = paths_json(items, names)
    fewer = dict(list(arrays.items())[:2])
    assert tree_from_names(fewer, record) == {DEFAULT_NAMESPACE: fewer}
    twice = paths_json([items[0], items[0]], ['x', 'y'])  # two names, one path
    pair = {'x': np.ones(1), 'y': np.ones(1)}
    assert tree_from_names(pair, twice) == {DEFAULT_NAMESPACE: pair}


def test_a_tree_read_back_keeps_the_order_it_was_written_in():
    """The record lists the tree in its own order; the file's tensors (largest element first)
    are in another. The tree is rebuilt in the record's."""
    items = [('jckpt', (('k', 'a'),), np.float32(1)), ('jckpt', (('k', 'b'),), np.float64(2)),
             ('jckpt', (('k', 'c'), ('i', 0)), np.int8(3))]
    names = flat_names(items, 'f')
    arrays = {'c.0': items[2][2], 'b': items[1][2], 'a': items[0][2]}  # the file's order
    assert list(tree_from_names(arrays, paths_json(items, names))['jckpt']) == ['a', 'b', 'c']


def test_a_tree_of_lists_of_lists_is_rebuilt_from_its_record():
    items = [('m', (('k', 'l'), ('i', i), ('i', j), ('k', 'w')), np.full(1, 10 * i + j))
             for i in range(3) for j in range(2)] + [('o', (('ki', 7),), np.zeros(1))]
    names = flat_names(items, 'f')
    tree = tree_from_names({n: a for n, (_, _, a) in zip(names, items)}, paths_json(items, names))
    assert [[w['w'].item() for w in row] for row in tree['m']['l']] == [[0, 1], [10, 11], [20, 21]]
    assert list(tree['o']) == [7]


def _with_empty_namespaces():
    """A model, `optax.sgd`'s state (two `EmptyState`s) and `optax.identity()`'s (one)."""
    return {'model': {'w': np.ones(2, np.float32)}, 'opt': ((), ()), 'ident': ()}


@pytest.mark.parametrize('ext', ['safetensors', 'npz', 'pt'])
def test_a_namespace_without_arrays_is_kept_as_a_jckpt_file_keeps_it(tmp_path, ext, recwarn):
    """These formats hold arrays only: such a namespace was left out (with a warning). The file
    records it now, as it records the paths, so it reads back as the jckpt file reads."""
    from jckpt import adapters
    from jckpt.adapters import native

    native.write(_with_empty_namespaces(), tmp_path / 's.jckpt')
    adapters.convert(tmp_path / 's.jckpt', tmp_path / f'o.{ext}')
    back = adapters.read(tmp_path / f'o.{ext}')
    assert jax.tree.structure(back) == jax.tree.structure(native.read(tmp_path / 's.jckpt'))
    assert back['opt'] == [None, None] and back['ident'] is None
    assert not [w for w in recwarn if 'hold no arrays' in str(w.message)]


def test_adamw_state_reads_back_with_its_empty_states_from_every_array_format(tmp_path):
    """adamw's state is (ScaleByAdamState, EmptyState, EmptyState): the EmptyStates were
    dropped by a write to safetensors, npz or a flat .pt and the read gave one node where
    the state has three, with nothing said."""
    import optax

    from jckpt import adapters

    state = optax.adamw(1e-3).init({'w': np.ones(3, np.float32)})
    for name in ('s.safetensors', 's.npz', 's.pt', 'i.safetensors.index.json'):
        adapters.write({'jckpt': {'opt': state, 'step': np.int32(3)}}, tmp_path / name)
        back = adapters.read(tmp_path / name)['jckpt']
        assert len(back['opt']) == 3 and back['opt'][1:] == [None, None], name
        np.testing.assert_array_equal(back['opt'][0]['mu']['w'], np.zeros(3, np.float32))
    # the record is jckpt's own: not the file's metadata that convert and inspect show
    assert adapters.read_with_metadata(tmp_path / 's.safetensors')[1] == {'format': 'pt'}
    assert adapters.read_with_metadata(tmp_path / 's.pt')[1] == {}


class _State(NamedTuple):
    count: Any
    mu: Any


class _Empty(NamedTuple):
    """optax's `EmptyState`: a NamedTuple without fields."""


def _plain(tree):
    """`tree` as a reader of these formats rebuilds it: dicts (a NamedTuple's fields as keys),
    lists, and `None` for each node without arrays."""
    if tree is None or (isinstance(tree, (tuple, list, dict)) and not tree):
        return None
    if isinstance(tree, _State):
        return {'count': _plain(tree.count), 'mu': _plain(tree.mu)}
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_plain(v) for v in tree]
    return tree


def _containers(children):
    return st.one_of(st.dictionaries(st.sampled_from(['a', 'b', 'w']), children, max_size=3),
                     st.dictionaries(st.integers(0, 3), children, max_size=2),
                     st.lists(children, max_size=3), st.lists(children, max_size=3).map(tuple),
                     st.builds(_State, children, children))


_nodes = st.recursive(
    st.one_of(st.integers(0, 3).map(lambda n: np.arange(n, dtype=np.float32)),
              st.sampled_from([None, (), [], {}, _Empty()])), _containers, max_leaves=10)


@PROPERTY
@given(tree=st.dictionaries(st.sampled_from(['jckpt', 'opt']), _nodes, min_size=1, max_size=2),
       name=st.sampled_from(['t.safetensors', 't.npz', 't.pt', 't.safetensors.index.json']))
def test_trees_with_empty_nodes_at_any_depth_read_back_with_their_structure(tmp_path_factory,
                                                                          tree, name):
    """Every node without arrays, at any depth (a whole namespace too), comes back as `None`
    where the tree had it, as jckpt's own reader gives it: the same treedef and leaves."""
    from jckpt import adapters

    path = tmp_path_factory.mktemp('empty') / name
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # nothing is left out, so nothing is to be said
        adapters.write(tree, path)
    back = adapters.read(path)
    expected = {ns: _plain(sub) for ns, sub in tree.items()}
    assert jax.tree.structure(back) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)


def test_a_torch_file_of_the_tree_as_it_is_keeps_them_and_says_nothing(tmp_path, recwarn):
    from jckpt import adapters
    from jckpt.adapters import torch as pt

    pt.write(_with_empty_namespaces(), tmp_path / 'n.pt', flat=False)
    adapters.write({'model': {'w': np.ones(2)}}, tmp_path / 'm.safetensors')
    assert not [w for w in recwarn if 'hold no arrays' in str(w.message)]
    back = adapters.read(tmp_path / 'n.pt')['jckpt']
    assert back['opt'] == ((), ()) and back['ident'] == ()  # pickled as they were


def test_single_content():
    assert single_content({'jckpt': {'w': 1}}) == {'w': 1}
    both = {'a': 1, 'b': 2}
    assert single_content(both) is both
    assert single_content({}) == {}


# --- archive member names ----------------------------------------------------------------------

@pytest.mark.parametrize('name', ['weights.bin', 'archive/data/0', 'a/./b', 'dot..dot', 'a/..b'])
def test_safe_member_names_pass(name):
    check_member_name(name, 'a.zip')


@pytest.mark.parametrize('name', ['..a', '...', '..hidden/w'])
def test_a_name_starting_with_two_dots_does_not_escape(name):
    check_member_name(name, 'a.zip')


@pytest.mark.parametrize('name', ['../x', 'a/../../x', '/etc/passwd', '\\\\server\\share',
                                  'C:evil', 'c:/x', 'a\\..\\x', 'a/..', 'nul\0byte', ''])
def test_unsafe_member_names_are_refused(name):
    with pytest.raises(FormatError, match='archive member name .* is unsafe|escapes the archive') as e:
        check_member_name(name, 'a.zip')
    assert e.value.file == 'a.zip' and 'malicious or damaged' in e.value.fix


# --- files -------------------------------------------------------------------------------------

def test_map_file_is_a_private_mapping(tmp_path):
    path = tmp_path / 'data'
    path.write_bytes(b'abcdef')
    m = map_file(str(path))
    assert bytes(m[:]) == b'abcdef' and len(m) == 6
    m[0:1] = b'X'  # copy on write: the file is not changed
    assert path.read_bytes() == b'abcdef'
    (tmp_path / 'empty').write_bytes(b'')
    assert map_file(str(tmp_path / 'empty')) == b''


def test_map_file_refuses_what_is_not_a_file(tmp_path):
    with pytest.raises(FormatError, match='no such file') as e:
        map_file(str(tmp_path / 'missing'))
    assert e.value.file == str(tmp_path / 'missing')
    with pytest.raises(FormatError, match='is a directory, not a file'):
        map_file(str(tmp_path))


def test_array_view_is_zero_copy_when_aligned():
    raw = np.arange(8, dtype=np.float32)
    buffer = raw.tobytes()
    view = array_view(buffer, np.dtype(np.float32), (2, 3), 8, 'f', 'e')
    np.testing.assert_array_equal(view, np.arange(2, 8, dtype=np.float32).reshape(2, 3))
    assert np.shares_memory(view, np.frombuffer(buffer, np.uint8))


def test_array_view_copies_a_misaligned_payload_into_aligned_memory():
    buffer = b'\0' + np.arange(3, dtype=np.float64).tobytes()
    view = array_view(buffer, np.dtype(np.float64), (3,), 1, 'f', 'e')
    np.testing.assert_array_equal(view, np.arange(3.0))
    assert not np.shares_memory(view, np.frombuffer(buffer, np.uint8))
    assert view.ctypes.data % 8 == 0 and view.flags.writeable
    bytes_view = array_view(buffer, np.dtype(np.uint8), (2,), 1, 'f', 'e')  # 1-byte elements: a view
    assert np.shares_memory(bytes_view, np.frombuffer(buffer, np.uint8))


@pytest.mark.parametrize('offset,shape', [(0, (5,)), (4, (4,)), (17, ()), (-4, (1,))])
def test_array_view_refuses_data_past_the_end(offset, shape):
    buffer = np.zeros(4, np.float32).tobytes()
    with pytest.raises(FormatError, match='tensor data extends past the end of the file') as e:
        array_view(buffer, np.dtype(np.float32), shape, offset, 'm.npz', 'w')
    assert (e.value.file, e.value.entry) == ('m.npz', 'w')


def test_array_view_of_nothing():
    assert array_view(b'', np.dtype(np.float32), (0, 3), 0, 'f', 'e').shape == (0, 3)


def test_published_writes_the_target_whole_on_success(tmp_path):
    target = tmp_path / 'out.bin'
    target.write_bytes(b'old')
    with published(str(target), durable=False) as f:
        f.write(b'new ')
        f.write(b'content')
        assert target.read_bytes() == b'old'  # not yet in place
    assert target.read_bytes() == b'new content'
    assert os.listdir(tmp_path) == ['out.bin']


def test_published_leaves_the_target_alone_on_failure(tmp_path):
    target = tmp_path / 'out.bin'
    target.write_bytes(b'old')
    with pytest.raises(RuntimeError, match='converter failed'):
        with published(str(target)) as f:
            f.write(b'half')
            raise RuntimeError('converter failed')
    assert target.read_bytes() == b'old' and os.listdir(tmp_path) == ['out.bin']


def test_published_reports_an_os_error_as_a_storage_error(tmp_path):
    target = tmp_path / 'out.bin'
    with pytest.raises(StorageError) as e:
        with published(str(target)) as f:
            f.write(b'x')
            raise OSError(28, 'No space left on device')
    assert e.value.file == str(target) and e.value.errno == 28
    assert os.listdir(tmp_path) == []


def test_published_into_a_missing_directory_is_a_storage_error(tmp_path):
    with pytest.raises(StorageError):
        with published(str(tmp_path / 'no' / 'out.bin')):
            pass


# --- nesting flat names ----------------------------------------------------------------------

def test_dotted_keys_nest_at_every_depth_and_keep_order():
    flat = {'b.x': 1, 'a.y.z': 2, 'a.w': 3, 7: {'c.d': [{'e.f': 4}]}}
    assert nest_dotted(flat, 'm.pt') == {'b': {'x': 1}, 'a': {'y': {'z': 2}, 'w': 3},
                                         7: {'c': {'d': [{'e': {'f': 4}}]}}}
    assert list(nest_dotted(flat, 'm.pt')) == ['b', 'a', 7]


@pytest.mark.parametrize('flat, match', [
    ({'a': 1, 'a.b': 2}, "'a.b' cannot be nested: 'a' is an entry"),
    ({'a.b': 2, 'a': 1}, "'a' cannot be nested: other keys start with it"),
    ({'a': {'b': 1}, 'a.c': 2}, "'a.c' cannot be nested: 'a' is an entry"),
    ({'a..b': 1}, 'empty part'),
    ({'.a': 1}, 'empty part'),
])
def test_keys_that_cannot_nest_are_named(flat, match):
    with pytest.raises(FormatError, match=match) as e:
        nest_dotted(flat, 'm.pt')
    assert e.value.file == 'm.pt' and e.value.entry and 'without nesting' in e.value.fix


def test_a_record_covers_exactly_its_names():
    items = [('jckpt', W, np.ones(1))]
    record = paths_json(items, ['w'])
    assert record_covers(record, ['w']) and not record_covers(record, ['w', 'v'])
    assert not record_covers(None, ['w']) and not record_covers('{not json', ['w'])


def test_a_held_file_is_detected_and_read_from_its_bytes_without_the_storage(tmp_path):
    """Detecting a model file's format and reading it each read it again: from an object store,
    one GET each (four for an npz, whose sniffers read the zip's directory)."""
    pytest.importorskip("obstore")
    import jckpt.adapters as adapters
    from jckpt.adapters._common import holding

    src, path = tmp_path / "a.npz", "memory://jckpt-held/gone.npz"  # no object is there
    adapters.write({"jckpt": {"w": np.arange(3.0)}}, str(src))
    with holding(path, src.read_bytes()):  # nothing is at `path`: every read uses the bytes held
        assert bytes(map_file(path)) == src.read_bytes()
        assert adapters.detect_format(path) == "npz"
        np.testing.assert_array_equal(adapters.read(path)["jckpt"]["w"], np.arange(3.0))
    with pytest.raises(FormatError, match="no such object"):
        map_file(path)


@pytest.mark.parametrize('name,fmt', [('k.safetensors', None), ('k.safetensors.index.json', None),
                                      ('k.npz', None), ('k.npy', None), ('k.pt', None),
                                      ('k.ocannl', 'ocannl')])
def test_a_typed_key_written_as_its_data_is_named_in_a_warning(tmp_path, name, fmt):
    """Formats without a key dtype write a key's uint32 data, which reads back as a plain
    array: that was silent, where orbax and jckpt files keep the key."""
    from jckpt import adapters
    keys = {'rng': jax.random.split(jax.random.key(0), 3)}
    with pytest.warns(UserWarning, match=r'typed PRNG keys jckpt/rng \(threefry2x32\) are written '
                                         r'as their uint32 key data: .*wrap_key_data'):
        adapters.write({'jckpt': keys}, tmp_path / name, format=fmt)
    back = adapters.read(tmp_path / name, format=fmt)['jckpt']
    back = back['rng'] if isinstance(back, dict) else back
    assert np.array_equal(back, jax.random.key_data(keys['rng']))
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # plain arrays: no warning
        again = back if name.endswith('.npy') else {'rng': back}  # an .npy file holds no name
        adapters.write({'jckpt': again}, tmp_path / ('again.' + name), format=fmt)


@pytest.mark.parametrize('name', ['d.safetensors', 'd.safetensors.index.json', 'd.npz', 'd.pt'])
def test_a_path_deeper_than_readers_accept_is_refused_before_writing(tmp_path, name):
    """Written with its paths record, which readers refuse past 256 components: the file
    read back with flat dotted names, its tree lost without a word."""
    from jckpt import adapters
    tree = np.ones(2, np.float32)
    for i in range(300):
        tree = {f"k{i}": tree}
    with pytest.raises(InputError, match='key path of 300 components is deeper than 256') as e:
        adapters.write({'jckpt': tree}, tmp_path / name)
    assert e.value.file == str(tmp_path / name) and e.value.entry.startswith('jckpt/k299/k298/')
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize('name', ['m.safetensors', 'm.safetensors.index.json', 'm.pt', 'm.npy',
                                  'm.ocannl.jckpt'])
def test_a_tree_a_format_refuses_is_refused_before_its_keys_are_warned_of(tmp_path, name):
    """A tree with a PRNG key and int4 leaves was warned that its keys would be written as key
    data, then refused for its first int4 leaf alone: cast, and refused again for the next."""
    tree = {'jckpt': {'rng': jax.random.key(0), 'q': np.zeros(4, ml_dtypes.int4),
                      'p': np.zeros(2, ml_dtypes.uint4), 'w': np.ones(3, np.float32)}}
    fmt = 'ocannl' if name.endswith('ocannl.jckpt') else None
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # a warning first would be raised here instead
        with pytest.raises(InputError) as e:
            jckpt.adapters.write(tree, tmp_path / name, format=fmt)
    if name.endswith(('.safetensors', '.json', '.pt')):
        assert 'p (uint4), q (int4)' in e.value.message and e.value.entry == 'p'
    assert not list(tmp_path.iterdir())


def test_a_name_no_text_holds_is_refused_by_every_writer(tmp_path):
    """A key `os.fsdecode` made of a bad byte failed the safetensors and npz writers with a
    bare `UnicodeEncodeError`, and made a `.pt` file jckpt's reader refused as damaged."""
    from jckpt.adapters import torch as pt
    from jckpt.adapters import write

    tree = {'jckpt': {'a': {'w\udcff': np.ones(2, np.float32)}}}
    for name in ('m.safetensors', 'm.npz', 'm.pt'):
        with pytest.raises(jckpt.InputError, match="lone surrogate") as e:
            write(tree, tmp_path / name)
        assert e.value.entry == 'jckpt/a/w\\udcff'
    with pytest.raises(jckpt.InputError, match="lone surrogate"):
        pt.write(tree, tmp_path / 'n.pt', flat=False)
    assert sorted(os.listdir(tmp_path)) == []
