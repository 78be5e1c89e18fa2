"""The pickle emitter of torch files: what it writes is what Python's own unpickler reads."""

import pickle

import jax
import ml_dtypes
import numpy as np
import pytest

from jckpt.adapters._torch_pickle import DTYPES, STORAGES, Pickler
from jckpt.errors import InputError


def emitted(value):
    p = Pickler('m.pt')
    p.value(value, '')
    return bytes(p.out) + b'.', p


@pytest.mark.parametrize('value', [
    None, True, False, 0, 255, 256, 65535, 65536, -1, 2**31 - 1, -2**31, 2**31, -2**31 - 1,
    2**100, -2**100, 0.5, -1e300, float('inf'), '', 'héllo \U0001F600', [], {}, (), (1,), (1, 2),
    (1, 2, 3), (1, 2, 3, 4, 5), {'a': [1, {'b': (2.5, 'c')}], 7: None}, [[], [[]], {}],
])
def test_plain_values_round_trip_through_pickle(value):
    raw, p = emitted(value)
    assert raw.startswith(b'\x80\x02') and not p.storages
    assert pickle.loads(raw) == value


def test_tensors_are_storages_in_order_and_check_only_describes_them():
    tree = {'w': np.arange(6, dtype=np.float32).reshape(2, 3), 'h': [np.ones(2, ml_dtypes.bfloat16)],
            'k': jax.random.key(1), 'u': np.ones(3, np.uint16)}
    raw, p = emitted(tree)
    assert [a.dtype for a in p.storages] == [np.float32, ml_dtypes.bfloat16, np.uint32, np.uint16]
    assert b'_rebuild_tensor_v2' in raw and b'_rebuild_tensor_v3' in raw  # uint16: untyped
    checked = Pickler('m.pt', fetch=False)
    checked.value(tree, '')
    assert bytes(checked.out) + b'.' == raw and not checked.storages


@pytest.mark.parametrize('value, entry, match', [
    ({'a': {(1, 2): 1}}, 'a', r'dict key \(1, 2\) cannot be saved'),
    ({1.5: 1}, None, 'dict key 1.5'),
    ({'a': [np.ones(1, 'int4')]}, 'a/0', 'int4 has no torch equivalent'),
    ({'a': object()}, 'a', 'leaf of type object is not an array'),
])
@pytest.mark.parametrize('fetch', [True, False])
def test_what_cannot_be_written_is_named(value, entry, match, fetch):
    with pytest.raises(InputError, match=match) as e:
        Pickler('m.pt', fetch=fetch).value(value, '')
    assert e.value.file == 'm.pt' and e.value.entry == entry and e.value.fix


def test_the_vocabulary_covers_each_dtype_once():
    typed = {np.dtype(d) for d in STORAGES.values()}
    assert typed <= {np.dtype(d) for d in DTYPES.values()}
    assert len(typed) == len(STORAGES)


def test_a_leaf_met_twice_shares_one_storage():
    """Tied weights were written twice: two storages, the file twice the size."""
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    tree = {'emb': w, 'head': w, 'view': w.view(), 'row': w[1], 'j': jax.numpy.ones(2)}
    tree['j2'] = tree['j']
    raw, p = emitted(tree)
    assert len(p.storages) == 3  # w (three times), w[1] (a copy), j (twice)
    checked = Pickler('m.pt', fetch=False)
    checked.value(tree, '')
    assert bytes(checked.out) + b'.' == raw



def test_overlapping_views_share_one_span():
    """`w`, `w[1]` and `w.T` were each written as a copy; torch.save keeps them on one storage."""
    from jckpt.adapters._torch_pickle import overlapping_views
    w = np.arange(12, dtype=ml_dtypes.bfloat16).reshape(3, 4)
    arrays = [w, w[1], w.T, w[:, 2]]
    spans, views = overlapping_views(arrays)
    assert len(spans) == 1 and spans[0].dtype == w.dtype and spans[0].tolist() == w.ravel().tolist()
    assert [views[id(a)] for a in arrays] == [(0, 0, (4, 1)), (0, 4, (1,)), (0, 0, (1, 4)),
                                              (0, 2, (4,))]


@pytest.mark.parametrize('case', ['columns', 'reversed', 'dtypes', 'apart', 'single', 'big-endian'])
def test_views_that_cannot_share_are_left_to_copies(case):
    from jckpt.adapters._torch_pickle import overlapping_views
    big, a = np.zeros((64, 64), np.float32), np.ones(4, np.float32)
    arrays = {
        'columns': [big[:, 0], big[:, 1]],  # the span would be the whole matrix, not 2 columns
        'reversed': [a, a[::-1]],  # a negative stride: no tensor views it
        'dtypes': [a, a.view(np.int32)],
        'apart': [a, np.ones(4, np.float32)],
        'single': [a[:2]],
        'big-endian': [b := a.astype('>f4'), b[1:]],
    }[case]
    assert overlapping_views(arrays) == ([], {})
