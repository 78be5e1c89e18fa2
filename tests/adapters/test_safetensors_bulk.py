"""The safetensors reader's bulk checks: they accept only what the per-tensor checks accept,
and the views they make hold the same values as one `np.frombuffer` per tensor."""

import json
import struct

import numpy as np
import pytest

from jckpt.adapters import safetensors as st
from jckpt.adapters import safetensors_bulk as bulk
from jckpt.errors import FormatError


def raw_file(tmp_path, header, data, name='t.safetensors'):
    text = json.dumps(header).encode()
    path = tmp_path / name
    path.write_bytes(struct.pack('<Q', len(text)) + text + data)
    return path


def info(dtype, shape, begin, end):
    return {'dtype': dtype, 'shape': shape, 'data_offsets': [begin, end]}


def accepts(header, size, text=None):
    metadata = header.pop('__metadata__', None)
    text = json.dumps({'__metadata__': metadata, **header} if metadata is not None else header
                      ) if text is None else text
    return bulk.layout(header, metadata, text, size, st.DTYPES) is not None


@pytest.mark.parametrize('header,data,message', [
    ({'a': info('U8', [2], 0, 2), 'b': info('U8', [2], 1, 3)}, b'abc', 'overlaps'),
    ({'a': info('U8', [2], 0, 2), 'b': info('U8', [2], 3, 5)}, b'abcde', 'leaves a gap'),
    ({'a': info('U8', [2], 1, 3)}, b'abc', 'leaves a gap'),
    ({'a': info('U8', [4], 0, 4)}, b'abc', 'truncated'),
    ({'a': info('U8', [2], 0, 2)}, b'abc', 'trailing bytes'),
    ({'a': info('U8', [2], 2**63, 2**63 + 2)}, b'ab', 'leaves a gap'),
    ({'a': info('U8', [2], -2, 0)}, b'ab', 'invalid data_offsets'),
    ({'a': info('U8', [2], 2, 0)}, b'ab', 'invalid data_offsets'),
    ({'a': info('U8', [True], 0, 1)}, b'a', 'invalid shape'),
    ({'a': info('U8', [1.0], 0, 1)}, b'a', 'invalid shape'),
    ({'a': info('U8', '', 0, 0)}, b'', 'invalid shape'),
    ({'a': info('U8', [-1], 0, 0)}, b'', 'invalid shape'),
    ({'a': info('U8', [2], 0, 2.0)}, b'ab', 'invalid data_offsets'),
    ({'a': info('U8', [2], 0, 1)}, b'a', 'need 2'),
    ({'a': {**info('U8', [2], 0, 2), 'extra': 1}}, b'ab', 'exactly dtype'),
    ({'a': {'dtype': 'U8', 'shape': [2]}}, b'ab', 'exactly dtype'),
    ({'a': info(['U8'], [2], 0, 2)}, b'ab', 'not a string'),
])
def test_a_damaged_layout_is_refused_naming_the_fault(tmp_path, header, data, message):
    assert not accepts(json.loads(json.dumps(header)), len(data))
    path = raw_file(tmp_path, header, data)
    with pytest.raises(FormatError, match=message) as e:
        st.read(path)
    assert e.value.file == str(path)


@pytest.mark.parametrize('header', [
    b'{"a:b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a:b":{"dtype":"U8","shape":[1],'
    b'"data_offsets":[0,1]}}',
    b'{"a\\u003ab":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a:b":{"dtype":"U8",'
    b'"shape":[1],"data_offsets":[0,1]}}',
    b'{"__metadata__":{"k":"v","k":"w"},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
])
def test_a_key_twice_is_refused_whatever_colons_the_names_hold(tmp_path, header):
    path = tmp_path / 'd.safetensors'
    path.write_bytes(struct.pack('<Q', len(header)) + header + b'\0')
    with pytest.raises(FormatError, match='appears twice'):
        st.read(path)


def test_colons_in_names_and_metadata_take_the_bulk_path(tmp_path):
    header = {'__metadata__': {'k:1': '{"x": 1}'}, 'a:b': info('U8', [1], 0, 1)}
    assert accepts(header, 1)
    path = raw_file(tmp_path, {'__metadata__': {'k:1': '{"x": 1}'},
                               'a:b': info('U8', [1], 0, 1)}, b'\x05')
    assert st.read_arrays(str(path))[0]['a:b'].tolist() == [5]


def test_views_hold_the_values_of_every_shape_dtype_and_alignment(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {'m': rng.standard_normal((3, 4, 2)).astype(np.float32),
              's': np.array(7.5, np.float64), 'e': np.zeros((0, 3), np.float32),
              'b': np.arange(3, dtype=np.int16), 'c': np.ones((2, 2), np.complex64)}
    arrays.update({f'r{i}': rng.standard_normal(5).astype(np.float32) for i in range(4)})
    header, data = {}, b''
    for name, a in arrays.items():  # written in this order: some start misaligned
        header[name] = info(st.dtype_name(a.dtype), list(a.shape), len(data), len(data) + a.nbytes)
        data += a.tobytes()
    back = st.read(raw_file(tmp_path, header, data))['jckpt']
    assert list(back) == list(arrays)
    for name, a in arrays.items():
        assert type(back[name]) is np.ndarray and back[name].dtype == a.dtype, name
        assert back[name].shape == a.shape and np.array_equal(back[name], a), name
    assert not back['m'].flags.owndata and back['m'].flags.c_contiguous


@pytest.mark.parametrize('value', ['0', 'null', '[]', '""', '{}'])
def test_an_empty_metadata_value_of_any_type_reads_as_none(tmp_path, value):
    header = ('{"__metadata__":' + value + ',"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
              ).encode()
    path = tmp_path / 'e.safetensors'
    path.write_bytes(struct.pack('<Q', len(header)) + header + b'\x03')
    arrays, metadata = st.read_arrays(str(path))
    assert metadata == {} and arrays['a'].tolist() == [3]


@pytest.mark.parametrize('shape', ['[' * 150 + ']' * 150, '[' * 5000 + ']' * 5000])
def test_a_deeply_nested_header_is_refused_as_too_deep(tmp_path, shape):
    """The bulk path parses without the nesting scan; what nests deeper is checked again."""
    header = ('{"a":{"dtype":"U8","shape":' + shape + ',"data_offsets":[0,0]}}').encode()
    path = tmp_path / 'n.safetensors'
    path.write_bytes(struct.pack('<Q', len(header)) + header)
    with pytest.raises(FormatError, match='nests'):
        st.read(path)
