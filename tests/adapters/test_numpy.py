"""The numpy adapters: .npy and .npz round trips, numpy reading them, refusals."""

import io
import warnings
import zipfile

import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.adapters import numpy as npa
from jckpt.errors import FormatError, InputError


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def sample():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    return {'params': {'w': base, 'wt': base.T, 'strided': base[::2, ::3],
                       'bf16': base.astype(ml_dtypes.bfloat16),
                       'f8': base.astype(ml_dtypes.float8_e4m3fn),
                       'i4': np.arange(-8, 8).astype(ml_dtypes.int4),
                       'be': base.astype('>f8'), 'c': np.array([1 + 1j], np.complex128)},
            'opt': [np.int64(3), np.zeros((0, 2), np.uint16), np.array([True, False])]}


def test_npz_round_trip_and_numpy_reads_it(tmp_path):
    tree = {'jckpt': sample()}
    path = tmp_path / 'a.npz'
    jckpt.adapters.write(tree, path)
    assert jckpt.detect_format(path) == 'npz'
    back = jckpt.adapters.read(path)['jckpt']
    for name, array in tree['jckpt']['params'].items():
        assert same_bits(back['params'][name], np.asarray(array).astype(array.dtype.newbyteorder('<'))
                         ), name
    assert back['params']['be'].dtype == np.dtype('<f8')
    assert same_bits(back['opt'][0], np.int64(3)) and back['opt'][1].shape == (0, 2)
    with np.load(path) as z:  # numpy itself (ml_dtypes is imported) reads every member
        assert same_bits(z['params.bf16'], tree['jckpt']['params']['bf16'])
        assert np.array_equal(z['params.wt'], tree['jckpt']['params']['wt'])
        assert sorted(z.files)[:3] == ['opt.0', 'opt.1', 'opt.2']


def test_npz_written_by_numpy_reads_flat(tmp_path):
    path = tmp_path / 'np.npz'
    arrays = {'a': np.arange(5, dtype=np.int16), 'b/c': np.ones((2, 2)),
              'f': np.asfortranarray(np.arange(6.0).reshape(2, 3))}
    np.savez(path, **arrays)
    back = jckpt.adapters.read(path)['jckpt']
    assert set(back) == set(arrays) and all(np.array_equal(back[k], v) for k, v in arrays.items())
    np.savez_compressed(path, **arrays)
    back = jckpt.adapters.read(path)['jckpt']
    assert all(np.array_equal(back[k], v) for k, v in arrays.items())


def test_npz_members_are_mapped(tmp_path):
    path = tmp_path / 'a.npz'
    npa.write_npz({'jckpt': {'a': np.arange(10.0), 'b': np.arange(3, dtype=np.int8)}}, path)
    back = npa.read_npz(path)['jckpt']
    assert not back['a'].flags.owndata and not back['b'].flags.owndata


def test_several_namespaces_round_trip_in_npz(tmp_path):
    tree = {'model': {'w': np.ones(2, np.float32)}, 'opt': {'w': np.zeros(2, np.float32)}}
    path = tmp_path / 'a.npz'
    npa.write_npz(tree, path)
    back = npa.read_npz(path)
    assert set(back) == {'model', 'opt'} and same_bits(back['opt']['w'], tree['opt']['w'])
    with np.load(path) as z:
        assert sorted(z.files) == ['model.w', 'opt.w']


def test_npy_round_trip_and_numpy_reads_it(tmp_path):
    path = tmp_path / 'a.npy'
    array = np.arange(12, dtype=np.float64).reshape(3, 4).T
    npa.write_npy({'jckpt': array}, path)
    assert jckpt.detect_format(path) == 'npy'
    assert np.array_equal(np.load(path), array)
    back = npa.read_npy(path)['jckpt']
    assert same_bits(back, array) and not back.flags.owndata
    np.save(path, np.asfortranarray(array))  # numpy's Fortran-order file
    assert np.array_equal(npa.read_npy(path)['jckpt'], array)
    bf = np.array([1.5, -2], ml_dtypes.bfloat16)
    npa.write_npy({'jckpt': bf}, path)
    assert same_bits(npa.read_npy(path)['jckpt'], bf) and same_bits(np.load(path), bf)
    out = tmp_path / 'a.jckpt'
    jckpt.convert(path, out)
    _, tree = jckpt.load(jckpt.Context(host=True), out)
    assert same_bits(tree['jckpt'], bf)


@pytest.mark.parametrize('tree', [{'jckpt': {'x': np.ones(2)}}, {'params': np.ones(2)}])
def test_a_name_an_npy_file_cannot_hold_is_named_in_a_warning(tmp_path, tree):
    """The leaf's name was dropped silently: it reads back as {'jckpt': array}."""
    with pytest.warns(UserWarning, match=r"a.npy: entry (jckpt/x|params/<root>): an .npy file holds "
                                         r"one array and no name.*write an .npz file"):
        npa.write_npy(tree, tmp_path / 'a.npy')
    assert list(npa.read_npy(tmp_path / 'a.npy')) == ['jckpt']
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        npa.write_npy({'jckpt': np.ones(2)}, tmp_path / 'b.npy')  # what read_npy gives: no warning


def test_npy_refusals(tmp_path):
    path = tmp_path / 'a.npy'
    with pytest.raises(InputError, match='exactly one array'):
        npa.write_npy({'jckpt': {'a': np.ones(1), 'b': np.ones(1)}}, path)
    np.save(path, np.array([{'a': 1}], dtype=object), allow_pickle=True)
    with pytest.raises(FormatError, match='pickles'):
        npa.read_npy(path)
    np.save(path, np.zeros(2, ml_dtypes.bfloat16))  # numpy writes it as raw '<V2'
    with pytest.raises(FormatError, match='raw bytes dtype'):
        npa.read_npy(path)
    np.save(path, np.arange(100.0))
    raw = path.read_bytes()
    for damaged, message in [(raw[:-8], 'past the end'), (raw[:7], 'magic'),
                             (raw[:10] + b"{'descr': '<f8', 'shape': (100,)}".ljust(118) + raw[128:],
                              'exactly descr'),
                             (raw.replace(b"'<f8'", b"'<q9'"), 'dtype')]:
        path.write_bytes(damaged)
        with pytest.raises(FormatError, match=message) as info:
            npa.read_npy(path)
        assert str(path) in str(info.value)


def test_an_npy_file_with_more_after_its_array_is_refused_not_read_in_part(tmp_path):
    """equinox's `tree_serialise_leaves` writes one .npy record per leaf, back to back: it was
    detected as .npy, and `convert` wrote its first array alone, the rest dropped silently."""
    path = tmp_path / "model.eqx"
    with open(path, "wb") as f:  # what tree_serialise_leaves writes
        for leaf in (np.ones((8, 4), np.float32), np.zeros(8, np.float32), np.float32(2)):
            np.save(f, leaf)
    with pytest.raises(FormatError, match=r"holds more \.npy arrays after its first") as e:
        jckpt.convert(path, tmp_path / "model.jckpt")
    assert "eqx.tree_deserialise_leaves" in e.value.fix and not (tmp_path / "model.jckpt").exists()
    junk = tmp_path / "junk.npy"
    np.save(junk, np.ones(3))
    junk.write_bytes(junk.read_bytes() + b"xyz")
    with pytest.raises(FormatError, match="3 bytes follow the .npy array"):
        npa.read_npy(junk)
    np.save(tmp_path / "one.npy", np.arange(3))
    assert npa.read_npy(tmp_path / "one.npy")["jckpt"].tolist() == [0, 1, 2]


def test_npz_refusals(tmp_path):
    path = tmp_path / 'a.npz'
    npa.write_npz({'jckpt': {'a': np.arange(100.0)}}, path)
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(FormatError, match='zip') as info:
        npa.read_npz(path)
    assert str(path) in str(info.value)
    for name in ('../evil.npy', '/abs.npy'):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, 'w') as zf:
            zf.writestr(name, raw[:10])
        path.write_bytes(buf.getvalue())
        with pytest.raises(FormatError, match='unsafe'):
            npa.read_npz(path)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, 'w') as zf:
        zf.writestr('a.npy', b'\x93NUMPY\x01\x00\x10\x00{"descr": 1}')
    path.write_bytes(buf.getvalue())
    with pytest.raises(FormatError, match="entry a"):
        npa.read_npz(path)


def test_an_npz_member_without_a_name_is_refused_naming_the_file(tmp_path):
    """A zip member whose name length is 0 failed inside zipfile's `is_dir` with an IndexError."""
    path = tmp_path / 'a.npz'
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, 'w') as zf:
        zf.writestr(zipfile.ZipInfo(''), b'\x93NUMPY')
    path.write_bytes(buf.getvalue())
    with pytest.raises(FormatError, match="member name '' is unsafe") as info:
        npa.read_npz(path)
    assert str(path) in str(info.value)


def test_nodes_without_arrays_past_the_comments_limit_are_left_out_naming_the_first(tmp_path):
    """The paths and the nodes without arrays share the archive comment (65,535 bytes at
    most): nodes that do not fit are left out with a warning, the paths still kept."""
    path = tmp_path / 'e.npz'
    tree = {'jckpt': {'w': np.ones(2), 'e': [None] * 10_000}}
    with pytest.warns(UserWarning, match=r"entry jckpt/e/0 and the tree's other nodes without "
                                         r"arrays are left out: .* write a \.safetensors"):
        npa.write_npz(tree, path)
    assert list(npa.read_npz(path)['jckpt']) == ['w']  # nested by its paths, without the nodes
    small = {'jckpt': {'w': np.ones(2), 'e': [None] * 10}}
    npa.write_npz(small, path)
    assert npa.read_npz(path)['jckpt']['e'] == [None] * 10


def test_paths_past_the_comments_limit_warn_and_their_check_refuses_the_tree(tmp_path):
    """A record of the key paths over 65,535 bytes was dropped without a word: the file read
    back with flat names, and a manager's npz step could not be restored into its own tree."""
    tree = {f'layer_{i:04d}': {'kernel_weights': np.ones(1, np.float32)} for i in range(1200)}
    with pytest.warns(UserWarning, match=r"key paths takes [0-9,]+ bytes, .* flat names"):
        npa.write_npz({'jckpt': tree}, tmp_path / 'big.npz')
    assert 'layer_0000.kernel_weights' in npa.read_npz(tmp_path / 'big.npz')['jckpt']
    with pytest.raises(InputError, match="would read back with flat names") as e:
        npa.check_npz({'jckpt': tree}, str(tmp_path / 'm.npz'))
    assert e.value.entry == 'jckpt/layer_0000/kernel_weights' and '.safetensors' in e.value.fix
    flat = {f'model.layers.{i}.mlp.kernel': np.ones(1, np.float32) for i in range(1200)}  # a state_dict
    npa.check_npz({'jckpt': flat}, str(tmp_path / 'f.npz'))  # reads back as it is: no record
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        npa.write_npz({'jckpt': flat}, tmp_path / 'f.npz')
    assert sorted(npa.read_npz(tmp_path / 'f.npz')['jckpt']) == sorted(flat)


def test_a_manager_refuses_an_npz_step_that_would_not_restore_into_its_tree(tmp_path):
    tree = {f'layer_{i:04d}': {'kernel_weights': np.ones(1, np.float32)} for i in range(1200)}
    opts = jckpt.CheckpointOptions(format='npz')
    with jckpt.CheckpointManager(tmp_path / 'run', asynchronous=False, options=opts) as mgr:
        with pytest.raises(InputError, match="cannot be written as npz"):
            mgr.save(1, tree)
        assert mgr.all_steps() == []


def test_a_strided_array_is_written_to_an_npz_a_chunk_at_a_time(tmp_path, monkeypatch):
    """A transposed array's chunks are copies, and the writer listed them all before writing:
    a full extra copy (1 GiB more to write a 1 GiB array's transpose)."""
    import functools

    from jckpt.format import payload
    from tests.helpers import peak_bytes
    monkeypatch.setattr(npa, 'iter_payload_chunks',
                        functools.partial(payload.iter_payload_chunks, chunk_bytes=1 << 20))
    a = np.arange(2048 * 2048, dtype=np.float32).reshape(2048, 2048)  # 16 MiB
    peak = peak_bytes(lambda: npa.write_npz({'jckpt': {'w': a.T}}, tmp_path / 'w.npz'))
    assert peak < 4 << 20, peak
    assert np.array_equal(np.load(tmp_path / 'w.npz')['w'], a.T)
