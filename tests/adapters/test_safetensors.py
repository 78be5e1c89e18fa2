"""The safetensors adapter: round trips, the safetensors package both ways, sharded layout, refusals."""

import json
import os
import struct
import subprocess
import sys
import warnings

import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.adapters import safetensors as st
from jckpt.errors import FormatError, InputError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def every_dtype():
    rng = np.random.default_rng(0)
    out = {}
    for name, dtype in st.DTYPES.items():
        raw = rng.integers(0, 256, size=(3, 5) if name != 'BOOL' else (2, 2), dtype=np.uint8)
        if name == 'BOOL':
            out[name] = raw.astype(bool)
        else:
            out[name] = np.frombuffer(rng.integers(0, 256, 15 * dtype.itemsize, dtype=np.uint8)
                                      .tobytes(), dtype=dtype).reshape(3, 5)
    return out


def test_round_trip_every_dtype_and_structure(tmp_path):
    tree = {'jckpt': {'params': {'dense': every_dtype()}, 'opt': [np.float32(3.5), np.zeros((0, 4))],
                      'step': np.int64(7)}}
    path = tmp_path / 'm.safetensors'
    jckpt.adapters.write(tree, path)
    assert jckpt.detect_format(path) == 'safetensors'
    back = jckpt.adapters.read(path)
    for name, array in tree['jckpt']['params']['dense'].items():
        assert same_bits(back['jckpt']['params']['dense'][name], array), name
    assert same_bits(back['jckpt']['opt'][0], np.float32(3.5))
    assert back['jckpt']['opt'][1].shape == (0, 4) and int(back['jckpt']['step']) == 7


def test_several_namespaces_round_trip(tmp_path):
    tree = {'model': {'w': np.ones(2, np.float32)}, 'opt': {'w': np.zeros(2, np.float32)}}
    path = tmp_path / 'm.safetensors'
    st.write(tree, path)
    safetensors_numpy = pytest.importorskip('safetensors.numpy')
    assert sorted(safetensors_numpy.load_file(path)) == ['model.w', 'opt.w']
    back = st.read(path)
    assert set(back) == {'model', 'opt'} and same_bits(back['opt']['w'], tree['opt']['w'])


def test_non_contiguous_and_fortran_arrays_are_written_by_value(tmp_path):
    """The safetensors package's numpy save_file writes memory order for these; jckpt writes values."""
    safetensors_numpy = pytest.importorskip('safetensors.numpy')
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    arrays = {'fortran': np.asfortranarray(base), 'strided': base[::2, 1::2],
              'transposed': base.T, 'big_endian': base.astype('>f4')}
    path = tmp_path / 'v.safetensors'
    st.write({'jckpt': arrays}, path)
    theirs = safetensors_numpy.load_file(path)
    ours = st.read(path)['jckpt']
    for name, array in arrays.items():
        assert np.array_equal(theirs[name], array), name
        assert np.array_equal(ours[name], array), name
        assert ours[name].dtype.byteorder in '=<|'


def test_bfloat16_in_a_fresh_process(tmp_path):
    path = tmp_path / 'bf.safetensors'
    values = np.array([1.5, -2.0, 3.140625, 0.0], dtype=ml_dtypes.bfloat16)
    st.write({'jckpt': {'x': values}}, path)
    code = ("import sys; from jckpt.adapters import safetensors as st; "
            "x = st.read(sys.argv[1])['jckpt']['x']; print(x.dtype, x.astype('float32').tolist())")
    out = subprocess.run([sys.executable, '-c', code, str(path)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, 'PYTHONPATH': ROOT})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == 'bfloat16 [1.5, -2.0, 3.140625, 0.0]'


def test_float8_both_ways_with_the_package():
    torch = pytest.importorskip('torch')
    safetensors_torch = pytest.importorskip('safetensors.torch')
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        values = np.array([0.5, -1.0, 2.0, 448.0], dtype=np.float32)
        ours = os.path.join(d, 'ours.safetensors')
        st.write({'jckpt': {'e4m3': values.astype(ml_dtypes.float8_e4m3fn),
                            'e5m2': values.astype(ml_dtypes.float8_e5m2),
                            'bf16': values.astype(ml_dtypes.bfloat16)}}, ours)
        loaded = safetensors_torch.load_file(ours)
        assert loaded['e4m3'].dtype == torch.float8_e4m3fn
        assert loaded['e4m3'].float().tolist() == values.tolist()
        assert loaded['e5m2'].dtype == torch.float8_e5m2 and loaded['bf16'].dtype == torch.bfloat16
        theirs = os.path.join(d, 'theirs.safetensors')
        safetensors_torch.save_file({'e4m3': torch.tensor(values).to(torch.float8_e4m3fn),
                                     'bf16': torch.tensor(values).to(torch.bfloat16)}, theirs)
        back = st.read(theirs)['jckpt']
        assert back['e4m3'].dtype == ml_dtypes.float8_e4m3fn
        assert back['e4m3'].astype(np.float32).tolist() == values.tolist()
        assert back['bf16'].dtype == ml_dtypes.bfloat16


def test_reads_what_the_package_writes(tmp_path):
    safetensors_numpy = pytest.importorskip('safetensors.numpy')
    arrays = {'model.layers.0.weight': np.arange(12, dtype=np.float16).reshape(3, 4),
              'model.embed': np.arange(5, dtype=np.int64), 'flag': np.array([True, False])}
    path = tmp_path / 'theirs.safetensors'
    safetensors_numpy.save_file(arrays, path, metadata={'format': 'np'})
    back = jckpt.adapters.read(path)
    assert set(back) == {'jckpt'} and set(back['jckpt']) == set(arrays)
    for name, array in arrays.items():
        assert same_bits(back['jckpt'][name], array)


def test_convert_keeps_the_files_own_metadata_but_not_jckpts(tmp_path):
    safetensors_numpy = pytest.importorskip('safetensors.numpy')
    path = tmp_path / 'theirs.safetensors'
    safetensors_numpy.save_file({'w': np.ones(2, np.float32)}, path,
                                metadata={'format': 'np', 'source': 'hub'})
    jckpt.convert(path, tmp_path / 'c.jckpt')
    assert jckpt.describe(tmp_path / 'c.jckpt').metadata_dict() == {'format': 'np', 'source': 'hub'}
    ours = tmp_path / 'ours.safetensors'
    st.write({'jckpt': {'a': {'b': np.ones(1)}}}, ours, metadata={'run': '7'})
    assert 'jckpt.paths' in st.read_arrays(str(ours))[1]  # how jckpt records structure there
    assert st.read_metadata(str(ours)) == {'format': 'pt', 'run': '7'}  # is not the file's own


def test_converting_a_jckpt_file_keeps_its_metadata_in_the_files_own(tmp_path):
    src = tmp_path / 'm.jckpt'
    jckpt.save(jckpt.Context(), {'w': np.ones(2, np.float32)}, src, metadata={'run': '7'})
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # nothing is left behind, so nothing is warned of
        jckpt.convert(src, tmp_path / 'm.safetensors')
    assert st.read_metadata(str(tmp_path / 'm.safetensors')) == {'format': 'pt', 'run': '7'}
    jckpt.convert(tmp_path / 'm.safetensors', tmp_path / 'back.jckpt')
    assert jckpt.describe(tmp_path / 'back.jckpt').metadata_dict() == {'format': 'pt', 'run': '7'}


def test_loading_is_zero_copy_where_aligned(tmp_path):
    path = tmp_path / 'z.safetensors'
    st.write({'jckpt': {'a': np.ones(5, np.float64), 'b': np.ones(3, np.float16),
                        'c': np.ones(7, np.uint8)}}, path)
    for name, array in st.read(path)['jckpt'].items():
        assert not array.flags.owndata, name


def test_misaligned_foreign_tensor_is_copied_correctly(tmp_path):
    header = {'a': {'dtype': 'U8', 'shape': [1], 'data_offsets': [0, 1]},
              'b': {'dtype': 'F32', 'shape': [2], 'data_offsets': [1, 9]}}
    text = json.dumps(header).encode()
    text += b' ' * (-len(text) % 8)
    data = b'\x07' + np.array([1.25, -3.5], '<f4').tobytes()
    path = tmp_path / 'm.safetensors'
    path.write_bytes(struct.pack('<Q', len(text)) + text + data)
    back = st.read(path)['jckpt']
    assert back['a'].tolist() == [7] and back['b'].tolist() == [1.25, -3.5]


def sharded(tmp_path):
    safetensors_numpy = pytest.importorskip('safetensors.numpy')
    one = {'a.weight': np.arange(4, dtype=np.float32)}
    two = {'b.weight': np.arange(6, dtype=np.int32).reshape(2, 3), 'b.bias': np.ones(2, np.float32)}
    safetensors_numpy.save_file(one, tmp_path / 'model-00001-of-00002.safetensors')
    safetensors_numpy.save_file(two, tmp_path / 'model-00002-of-00002.safetensors')
    weight_map = {**{k: 'model-00001-of-00002.safetensors' for k in one},
                  **{k: 'model-00002-of-00002.safetensors' for k in two}}
    index = tmp_path / 'model.safetensors.index.json'
    index.write_text(json.dumps({'metadata': {'total_size': 48}, 'weight_map': weight_map}))
    return index, {**one, **two}


def test_sharded_index(tmp_path):
    index, arrays = sharded(tmp_path)
    for where in (index, tmp_path):
        assert jckpt.detect_format(where) == 'safetensors'
        back = jckpt.adapters.read(where)['jckpt']
        assert set(back) == set(arrays)
        assert all(same_bits(back[k], v) for k, v in arrays.items())
    out = tmp_path / 'all.jckpt'
    jckpt.convert(index, out)
    _, tree = jckpt.load(jckpt.Context(host=True), out)
    assert same_bits(tree['jckpt']['b.weight'], arrays['b.weight'])


def test_sharded_index_refusals(tmp_path):
    index, _ = sharded(tmp_path)
    raw = json.loads(index.read_text())
    raw['weight_map']['a.weight'] = '../outside.safetensors'
    index.write_text(json.dumps(raw))
    with pytest.raises(FormatError, match="unsafe"):
        st.read(index)
    raw['weight_map']['a.weight'] = 'model-00002-of-00002.safetensors'
    index.write_text(json.dumps(raw))
    with pytest.raises(FormatError, match="lacks it"):
        st.read(index)


def good_file(tmp_path):
    path = tmp_path / 'g.safetensors'
    st.write({'jckpt': {'a': np.arange(8, dtype=np.float32), 'b': np.arange(3, dtype=np.int16)}}, path)
    return path


@pytest.mark.parametrize('damage,message', [
    (lambda raw: raw[:-3], 'truncated'),
    (lambda raw: raw + b'xx', 'trailing bytes'),
    (lambda raw: raw[:5], 'shorter than the 8-byte'),
    (lambda raw: struct.pack('<Q', 10**6) + raw[8:], 'past the end'),
    (lambda raw: struct.pack('<Q', 2 * 10**8) + raw[8:], 'limit'),
    (lambda raw: raw[:8] + b'[' + raw[9:], 'JSON'),
    (lambda raw: raw.replace(b'"I16"', b'"Q16"'), 'unknown dtype'),
    (lambda raw: raw.replace(b'[0,32]', b'[0,30]'), 'need 32'),
])
def test_damaged_files_are_refused(tmp_path, damage, message):
    path = good_file(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(FormatError, match=message) as info:
        st.read(path)
    assert str(path) in str(info.value)


def test_unrepresentable_dtype_refused_before_writing(tmp_path):
    path = tmp_path / 'x.safetensors'
    with pytest.raises(InputError, match='no safetensors equivalent'):
        st.write({'jckpt': {'q': np.zeros(2, ml_dtypes.int4)}}, path)
    assert not path.exists()


@pytest.mark.parametrize('name', ['x.safetensors', 'model.safetensors.index.json'])
def test_a_leaf_named_like_the_metadata_key_is_refused_before_writing(tmp_path, name):
    """The header held `__metadata__` twice and every reader refused the file as damaged."""
    path = tmp_path / name
    tree = {'jckpt': {'__metadata__': np.ones(2, np.float32), 'w': np.zeros(1, np.float32)}}
    with pytest.raises(InputError, match="cannot be named '__metadata__'") as e:
        jckpt.adapters.write(tree, path)
    assert e.value.entry == '__metadata__' and not path.exists()
    with pytest.raises(InputError, match="__metadata__"):
        st.check(tree, path)
    st.write({'jckpt': {'a': {'__metadata__': np.ones(2, np.float32)}}}, tmp_path / 'y.safetensors')
    assert sorted(st.read(tmp_path / 'y.safetensors')['jckpt']['a']) == ['__metadata__']


def test_sharded_write(tmp_path):
    safetensors_numpy = pytest.importorskip('safetensors.numpy')
    tree = {'jckpt': {'layers': [{'w': np.full((16, 16), i, np.float32)} for i in range(5)],
                      'emb': np.arange(64, dtype=np.float16), 'step': np.int64(3)}}
    index = tmp_path / 'out' / 'model.safetensors.index.json'
    index.parent.mkdir()
    jckpt.adapters.write(tree, index)  # the index name asks for the sharded layout
    shards = sorted(p.name for p in index.parent.glob('*.safetensors'))
    raw = json.loads(index.read_text())
    assert len(shards) == 1 and raw['metadata']['total_size'] == 5 * 1024 + 128 + 8
    files = st.write_sharded(tree, index, max_shard_bytes=2048)
    assert len(files) >= 3 and files[0] == f'model-00001-of-{len(files):05d}.safetensors'
    raw = json.loads(index.read_text())
    assert set(raw['weight_map'].values()) == set(files)
    assert raw['weight_map']['layers.3.w'] in files
    theirs = {}
    for file in files:  # every shard is a file the safetensors package reads, format "pt"
        theirs.update(safetensors_numpy.load_file(index.parent / file))
        with open(index.parent / file, 'rb') as f:
            n = struct.unpack('<Q', f.read(8))[0]
            assert json.loads(f.read(n))['__metadata__']['format'] == 'pt'
    assert same_bits(theirs['layers.4.w'], tree['jckpt']['layers'][4]['w'])
    back = jckpt.adapters.read(index)['jckpt']  # the structure comes back from the index
    assert same_bits(back['layers'][2]['w'], tree['jckpt']['layers'][2]['w'])
    assert same_bits(back['step'], np.int64(3))
    with pytest.raises(InputError, match='strings'):
        st.write(tree, tmp_path / 'm.safetensors', metadata={'epoch': 3})


def test_a_tensor_name_with_a_lone_surrogate_is_refused(tmp_path):
    """It was read, and every writer then failed with UnicodeEncodeError (not a CheckpointError)."""
    header = b'{"w\\ud800": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
    header += b' ' * (-len(header) % 8)
    path = tmp_path / 's.safetensors'
    path.write_bytes(struct.pack('<Q', len(header)) + header + bytes(8))
    with pytest.raises(FormatError, match='lone surrogate') as e:
        jckpt.adapters.read(path)
    assert e.value.file == str(path)


@pytest.mark.parametrize('action', ['convert', 'inspect'])
def test_convert_and_inspect_parse_the_header_once(tmp_path, monkeypatch, action):
    """The header was parsed twice, once for the arrays and once for `__metadata__`: `jckpt
    inspect` of a file of 200,000 empty tensors took 11.7 s."""
    src = tmp_path / 'm.safetensors'
    st.write({'jckpt': {'w': np.ones(3, np.float32)}}, src, metadata={'source': 'hub'})
    parses = []
    real = st.read_header
    monkeypatch.setattr(st, 'read_header', lambda *a: parses.append(1) or real(*a))
    if action == 'convert':
        jckpt.convert(src, tmp_path / 'm.jckpt')
        assert jckpt.describe(tmp_path / 'm.jckpt').metadata_dict()['source'] == 'hub'
    else:
        assert dict(jckpt.info(src).metadata)['source'] == 'hub'
    assert len(parses) == 1


def test_a_missing_shard_names_the_index_and_the_shard(tmp_path):
    """A download that stopped part way was told "no such file" of the shard alone."""
    index, _ = sharded(tmp_path)
    (tmp_path / 'model-00002-of-00002.safetensors').unlink()
    with pytest.raises(FormatError, match="names shard 'model-00002-of-00002.safetensors'") as e:
        jckpt.convert(index, tmp_path / 'out.jckpt')
    assert e.value.file == str(index) and 'weight_map' in e.value.fix
