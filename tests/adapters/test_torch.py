"""The torch adapter: torch.save fixtures read without torch, files torch.load accepts, refusals."""

import io
import json
import os
import pickle
import struct
import subprocess
import sys
import warnings
import zipfile

import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.adapters import torch as pt
from jckpt.errors import FormatError, InputError

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'fixtures')
STATE = os.path.join(FIXTURES, 'torch_state.pt')
MODEL = os.path.join(FIXTURES, 'torch_model_state_dict.pth')


def expected_state():
    """What make_torch_fixtures.py saved, rebuilt with numpy alone."""
    base = np.arange(12, dtype=np.float32).reshape(3, 4) / 4
    return {
        'float32': base, 'float64': base.astype(np.float64), 'float16': base.astype(np.float16),
        'bfloat16': base.astype(ml_dtypes.bfloat16), 'int64': np.arange(-3, 3, dtype=np.int64),
        'int32': np.arange(4, dtype=np.int32) * 1000, 'int16': np.array([-7, 7], np.int16),
        'int8': np.array([-128, 127], np.int8), 'uint8': np.array([0, 255], np.uint8),
        'uint16': np.array([1, 65535], np.uint16), 'bool': np.array([True, False, True]),
        'complex64': np.array([1 + 2j, -0.5j], np.complex64),
        'float8_e4m3fn': np.array([0.5, -2.0, 448.0], np.float32).astype(ml_dtypes.float8_e4m3fn),
        'float8_e5m2': np.array([0.25, -3.0], np.float32).astype(ml_dtypes.float8_e5m2),
        'scalar': np.array(2.5, np.float32), 'empty': np.zeros((0, 3), np.float32),
        'transposed': base.T, 'row': base[1], 'param': np.ones((2, 2), np.float32),
    }


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def test_reads_torch_save_fixture_without_torch():
    assert jckpt.detect_format(STATE) == 'torch'
    tree = jckpt.adapters.read(STATE)['jckpt']
    for name, array in expected_state().items():
        assert same_bits(tree[name], array), name
    assert same_bits(tree['nested']['list'][0], np.array([1.0], np.float32))
    assert tree['nested']['list'][1] == 3 and tree['nested']['tuple'][1] == 'x'
    assert (tree['epoch'], tree['lr'], tree['name']) == (7, 0.125, 'tiny')
    # 'row' is a view of the storage 'float32' uses, as in torch: no copy, shared bytes
    assert np.shares_memory(tree['row'], tree['float32'])


def test_model_state_dict_converts_to_jckpt(tmp_path):
    out = tmp_path / 'model.jckpt'
    assert jckpt.convert(MODEL, out) == ('torch', 'jckpt')
    _, tree = jckpt.load(jckpt.Context(host=True), out)
    sd = tree['jckpt']
    assert same_bits(sd['0.weight'], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert same_bits(sd['2.bias'], np.array([3.0], np.float32))


def test_jckpt_tree_round_trips_through_torch_file(tmp_path):
    arrays = {k: v for k, v in expected_state().items()}
    tree = {'jckpt': {'params': arrays, 'step': 5, 'layers': [np.ones(2, np.float32)]}}
    path = tmp_path / 'x.pt'
    jckpt.adapters.write(tree, path)
    back = pt.read(path)['jckpt']
    for name, array in arrays.items():
        assert same_bits(back['params'][name], array), name
    assert back['step'] == 5 and same_bits(back['layers'][0], np.ones(2, np.float32))


def test_torch_load_weights_only_accepts_what_jckpt_writes(tmp_path):
    torch = pytest.importorskip('torch')
    tree = jckpt.adapters.read(STATE)
    path = tmp_path / 'again.pt'
    pt.write(tree, path)
    loaded = torch.load(path, weights_only=True)
    for name, array in expected_state().items():
        t = loaded[name]
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b''
        assert raw == np.ascontiguousarray(array).tobytes(), name
        assert list(t.shape) == list(array.shape), name
    assert loaded['epoch'] == 7 and loaded['name'] == 'tiny'
    assert loaded['nested.tuple.0'].tolist() == [2]  # a flat state_dict by default
    mapped = torch.load(path, weights_only=True, mmap=True)  # needs the 64-byte alignment
    assert torch.equal(mapped['float32'], loaded['float32'])
    pt.write(tree, path, flat=False)
    assert torch.load(path, weights_only=True)['nested']['tuple'][0].tolist() == [2]


def test_live_torch_save_round_trip(tmp_path):
    torch = pytest.importorskip('torch')
    model = torch.nn.Linear(4, 3)
    sd = model.state_dict()
    path = tmp_path / 'live.pth'
    torch.save(sd, path)
    back = pt.read(path)['jckpt']
    for name, t in sd.items():
        assert same_bits(back[name], t.numpy()), name
    out = tmp_path / 'back.pth'
    pt.write({'jckpt': back}, out)
    model.load_state_dict(torch.load(out, weights_only=True))


def zip_with(pickled: bytes, extra: dict | None = None, byteorder: str = 'little') -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, 'w', zipfile.ZIP_STORED) as zf:
        zf.writestr('archive/data.pkl', pickled)
        zf.writestr('archive/byteorder', byteorder)
        for name, data in (extra or {}).items():
            zf.writestr(name, data)
    return buf.getvalue()


class _System:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def test_malicious_pickle_is_refused_without_side_effect(tmp_path):
    marker = tmp_path / 'pwned'
    payload = pickle.dumps({'w': _System(f'touch {marker}')}, protocol=2)
    # the payload is live: plain pickle runs it (in a child process)
    live = tmp_path / 'live.pkl'
    live.write_bytes(payload)
    subprocess.run([sys.executable, '-c', 'import pickle, sys; pickle.load(open(sys.argv[1], "rb"))',
                    str(live)], timeout=60, check=True)
    assert marker.exists()
    marker.unlink()
    path = tmp_path / 'evil.pt'
    path.write_bytes(zip_with(payload))
    assert jckpt.detect_format(path) == 'torch'
    with pytest.raises(FormatError, match=r'refusing to unpickle global (posix|os)\.system') as info:
        pt.read(path)
    assert str(path) in str(info.value)
    assert not marker.exists()
    with pytest.raises(FormatError):
        jckpt.convert(path, tmp_path / 'evil.jckpt')
    assert not marker.exists() and not (tmp_path / 'evil.jckpt').exists()


def test_unknown_class_and_bad_member_names_are_refused(tmp_path):
    path = tmp_path / 'm.pt'
    path.write_bytes(zip_with(b'\x80\x02ctorch.nn.modules.linear\nLinear\n)R.'))
    with pytest.raises(FormatError, match='torch.nn.modules.linear.Linear'):
        pt.read(path)
    path.write_bytes(zip_with(pickle.dumps({}, protocol=2), {'archive/../../escape': b'x'}))
    with pytest.raises(FormatError, match='unsafe'):
        pt.read(path)
    path.write_bytes(zip_with(pickle.dumps({}, protocol=2), {'/abs/data/0': b'x'}))
    with pytest.raises(FormatError, match='unsafe'):
        pt.read(path)


def test_storage_reference_out_of_range_is_refused(tmp_path):
    raw = bytearray(open(STATE, 'rb').read())
    src = zipfile.ZipFile(io.BytesIO(bytes(raw)))
    root = src.namelist()[0].split('/')[0]
    pickled = src.read(f'{root}/data.pkl')
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, 'w') as zf:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == f'{root}/data/0':
                data = data[:8]  # a storage shorter than its tensors need
            zf.writestr(info.filename, pickled if info.filename.endswith('data.pkl') else data)
    path = tmp_path / 'short.pt'
    path.write_bytes(buf.getvalue())
    with pytest.raises(FormatError, match='not a valid torch pickle'):
        pt.read(path)


@pytest.mark.parametrize('cut', [100, 2000, -30])
def test_truncated_file_is_refused(tmp_path, cut):
    raw = open(STATE, 'rb').read()
    path = tmp_path / 't.pt'
    path.write_bytes(raw[:cut])
    with pytest.raises(FormatError) as info:
        pt.read(path)
    assert str(path) in str(info.value)


def test_corrupt_pickle_and_a_bare_pickle_are_refused(tmp_path):
    path = tmp_path / 'c.pt'
    path.write_bytes(zip_with(b'\x80\x02}q\x00(X\x01\x00'))
    with pytest.raises(FormatError, match='not a valid torch pickle'):
        pt.read(path)
    path.write_bytes(pickle.dumps({'a': 1}, protocol=2))
    with pytest.raises(FormatError, match='not a readable zip archive'):
        pt.read(path)


def test_unrepresentable_dtype_is_refused_before_writing(tmp_path):
    path = tmp_path / 'x.pt'
    with pytest.raises(InputError, match='no torch equivalent'):
        pt.write({'jckpt': {'q': np.zeros(2, ml_dtypes.int4)}}, path)
    assert not path.exists()


def test_numpy_scalars_are_written_as_tensors_python_numbers_as_themselves(tmp_path):
    """np.float64 is a Python float: it was pickled as one, np.float32 as a tensor."""
    path = tmp_path / 'm.pt'
    pt.write({'jckpt': {'f64': np.float64(1.5), 'f32': np.float32(1.5), 'py': 1.5}}, path)
    back = pt.read(path)['jckpt']
    assert isinstance(back['f64'], np.ndarray) and back['f64'].dtype == np.float64
    assert isinstance(back['f32'], np.ndarray) and back['py'] == 1.5 and type(back['py']) is float


def test_storages_are_64_byte_aligned_and_mapped(tmp_path):
    path = tmp_path / 'a.pt'
    pt.write({'jckpt': {'a': np.arange(5, dtype=np.float64), 'b': np.arange(3, dtype=np.int8)}}, path)
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            at = info.header_offset
            n, m = struct.unpack_from('<HH', raw, at + 26)
            assert (at + 30 + n + m) % 64 == 0, info.filename
    tree = pt.read(path)['jckpt']
    assert not tree['a'].flags.owndata and tree['a'].tolist() == [0, 1, 2, 3, 4]


def test_build_on_anything_but_a_state_dict_is_refused(tmp_path):
    path = tmp_path / 'b.pt'
    path.write_bytes(zip_with(b'\x80\x02ctorch\nSize\n)R}b.'))
    with pytest.raises(FormatError, match='BUILD on a tuple is not allowed'):
        pt.read(path)


def test_view_far_larger_than_its_storage_is_refused(tmp_path):
    pickled = (b'\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage'
               b'ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x01tQK\x00'
               b'J\x00\x00\x00\x40\x85K\x00\x85\x89ccollections\nOrderedDict\n)RtR.')
    path = tmp_path / 'v.pt'
    path.write_bytes(zip_with(pickled, {'archive/data/0': b'\0\0\x80\x3f'}))
    with pytest.raises(FormatError, match='implausibly'):
        pt.read(path)
    # the same pickle with an honest size reads
    path.write_bytes(zip_with(pickled.replace(b'J\x00\x00\x00\x40', b'J\x03\x00\x00\x00'),
                              {'archive/data/0': b'\0\0\x80\x3f'}))
    assert pt.read(path)['jckpt'].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize('glob', [b'ctorch\nSize\n', b'ccollections\nOrderedDict\n'])
def test_a_tensor_is_never_iterated_by_an_allowed_class(tmp_path, glob):
    """`torch.Size(view)` or `OrderedDict(view)` of a stride-0 view of a 1-byte storage, 400
    times over in 3 KB: 4 GB of memory, or a minute, before; refused at once now."""
    pickled = (b'\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage'
               b'ctorch\nByteStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x01tQK\x00'
               b'J\x40\x00\x10\x00\x85K\x00\x85\x89ccollections\nOrderedDict\n)RtRq\x01' + glob
               + b'q\x02' + b'h\x02h\x01\x85R' * 400 + b'h\x01.')
    path = tmp_path / 'bomb.pt'
    path.write_bytes(zip_with(pickled, {'archive/data/0': b'\x07'}))
    with pytest.raises(FormatError, match='is allowed only'):
        pt.read(path)


def test_big_endian_archive(tmp_path):
    pickled = (b'\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage'
               b'ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02tQK\x00'
               b'K\x02\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR.')
    path = tmp_path / 'be.pt'
    data = np.array([1.5, -2.0], '>f4').tobytes()
    path.write_bytes(zip_with(pickled, {'archive/data/0': data}, byteorder='big'))
    got = pt.read(path)['jckpt']
    assert got.tolist() == [1.5, -2.0]
    out = tmp_path / 'be.jckpt'
    jckpt.convert(path, out)
    _, tree = jckpt.load(jckpt.Context(host=True), out)
    assert tree['jckpt'].dtype == np.dtype('<f4') and tree['jckpt'].tolist() == [1.5, -2.0]


def test_reading_never_imports_torch():
    root = os.path.dirname(FIXTURES.rstrip('/')).rsplit('/tests', 1)[0]
    code = ("import sys, jckpt; from jckpt.adapters import torch as pt; "
            "t = pt.read(sys.argv[1])['jckpt']; jckpt.convert(sys.argv[2], sys.argv[3]); "
            "print(t['epoch'], 'torch' in sys.modules)")
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, '-c', code, STATE, MODEL, os.path.join(d, 'x.jckpt')],
                             capture_output=True, text=True, timeout=120, cwd=root,
                             env={**os.environ, 'PYTHONPATH': root})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ['7', 'False']


def test_converting_a_string_leaf_names_it(tmp_path):
    with pytest.raises(InputError, match='entry jckpt/name: leaf of type str') as info:
        jckpt.convert(STATE, tmp_path / 'x.jckpt')
    assert str(tmp_path / 'x.jckpt') in str(info.value)
    assert not (tmp_path / 'x.jckpt').exists()


def test_a_key_with_a_lone_surrogate_is_refused(tmp_path):
    """BINUNICODE bytes of a lone surrogate became a dict key that no writer could write."""
    key = b'\xed\xa0\x80'
    pickled = b'\x80\x02}X' + len(key).to_bytes(4, 'little') + key + b'K\x01s.'
    path = tmp_path / 'k.pt'
    path.write_bytes(zip_with(pickled))
    with pytest.raises(FormatError, match='surrogate'):
        pt.read(path)


# --- flat state_dicts: what a torch model loads ---------------------------------------------------

def flax_tree():
    return {'params': {'dense': {'kernel': np.arange(6, dtype=np.float32).reshape(3, 2),
                                 'bias': np.zeros(2, np.float32)},
                       'layers': [{'w': np.ones(2, np.float32)}, {'w': np.full(2, 2, np.float32)}]},
            'step': 7}


def test_a_nested_tree_is_written_as_a_flat_state_dict_torch_loads(tmp_path):
    """A flax-style tree was pickled as nested dicts, which no nn.Module loads."""
    torch = pytest.importorskip('torch')
    path = tmp_path / 'm.pt'
    pt.write({'jckpt': flax_tree()}, path)
    loaded = torch.load(path, weights_only=True)
    assert sorted(loaded) == ['params.dense.bias', 'params.dense.kernel', 'params.layers.0.w',
                              'params.layers.1.w', 'step']
    assert loaded['params.layers.1.w'].tolist() == [2.0, 2.0] and loaded['step'] == 7

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = torch.nn.Linear(3, 2)

    model = Model()
    flat = {'jckpt': {'dense': {'weight': np.ones((2, 3), np.float32), 'bias': np.ones(2, np.float32)}}}
    pt.write(flat, path)
    model.load_state_dict(torch.load(path, weights_only=True))
    assert model.dense.weight.sum().item() == 6.0


def test_a_flat_file_reads_back_as_the_tree_it_was_written_from(tmp_path):
    path = tmp_path / 'm.pt'
    tree = {'params': {'w': np.ones(2, np.float32)}, 'opt': {'mu': [np.zeros(2, np.float32)]}}
    pt.write(tree, path)  # two namespaces: names prefixed by the namespace
    with zipfile.ZipFile(path) as zf:
        assert 'archive/' + pt.PATHS_MEMBER in zf.namelist()
    back = pt.read(path)
    assert sorted(back) == ['opt', 'params']
    assert back['params']['w'].tolist() == [1, 1] and back['opt']['mu'][0].tolist() == [0, 0]
    back = jckpt.adapters.read(path)
    assert back['opt']['mu'][0].tolist() == [0, 0]


def test_a_state_dict_reads_nested_when_asked_and_writes_back_flat(tmp_path):
    torch = pytest.importorskip('torch')
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    path = tmp_path / 'sd.pt'
    torch.save(model.state_dict(), path)
    assert sorted(pt.read(path)['jckpt']) == ['0.bias', '0.weight', '2.bias', '2.weight']
    nested = pt.read(path, nest=True)['jckpt']
    assert sorted(nested) == ['0', '2'] and sorted(nested['2']) == ['bias', 'weight']
    out = tmp_path / 'back.pt'
    pt.write({'jckpt': nested}, out)
    again = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    again.load_state_dict(torch.load(out, weights_only=True))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  again.state_dict().values()))
    assert list(torch.load(out, weights_only=True)) == list(model.state_dict())  # its order


def test_a_state_dict_that_cannot_nest_says_so(tmp_path):
    path = tmp_path / 'c.pt'
    pt.write({'jckpt': {'a': np.ones(1, np.float32), 'a.b': np.ones(1, np.float32)}}, path,
             flat=False)
    with pytest.raises(FormatError, match="key 'a.b' cannot be nested: 'a' is an entry") as e:
        pt.read(path, nest=True)
    assert str(path) in str(e.value) and 'without nesting' in e.value.fix
    assert sorted(pt.read(path)['jckpt']) == ['a', 'a.b']


def test_leaves_whose_flat_names_collide_are_refused_before_writing(tmp_path):
    path = tmp_path / 'x.pt'
    tree = {'jckpt': {'a.b': np.ones(1, np.float32), 'a': {'b': np.ones(1, np.float32)}}}
    with pytest.raises(InputError, match="two leaves would both be stored as 'a.b'"):
        pt.write(tree, path)
    with pytest.raises(InputError, match="'a.b'"):
        pt.check(tree, path)
    assert not path.exists()
    pt.write(tree, path, flat=False)  # as it is, they do not collide
    assert sorted(pt.read(path)['jckpt']) == ['a', 'a.b']


def test_a_flax_state_with_dataclass_nodes_is_written_flat(tmp_path):
    """Nodes that are not dicts or lists (a flax struct, a NamedTuple) go through JAX."""
    import collections
    state = collections.namedtuple('State', 'mu nu')(np.ones(2, np.float32), np.zeros(2, np.float32))
    path = tmp_path / 's.pt'
    pt.write({'jckpt': {'opt': state}}, path)
    back = pt.read(path)['jckpt']
    assert back['opt']['mu'].tolist() == [1, 1] and back['opt']['nu'].tolist() == [0, 0]


def test_tied_weights_stay_tied_through_a_torch_file(tmp_path):
    torch = pytest.importorskip('torch')

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(100, 64)
            self.head = torch.nn.Linear(64, 100, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    path, out = tmp_path / 'tied.pt', tmp_path / 'back.pt'
    torch.save(model.state_dict(), path)
    tree = pt.read(path)
    assert np.shares_memory(tree['jckpt']['emb.weight'], tree['jckpt']['head.weight'])
    pt.write(tree, out)
    loaded = torch.load(out, weights_only=True)
    assert loaded['emb.weight'].data_ptr() == loaded['head.weight'].data_ptr()
    assert os.path.getsize(out) < 1.2 * 100 * 64 * 4
    again = Tied()
    again.load_state_dict(loaded)
    assert torch.equal(again.head.weight, model.emb.weight)


def optimizer_and_model(torch):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


def test_a_checkpoint_dict_keeps_its_structure_through_convert(tmp_path):
    """torch -> jckpt -> torch, and a legacy file -> a zip one: the tree came back flattened
    ('optimizer.param_groups.0.lr'), which optimizer.load_state_dict cannot take."""
    torch = pytest.importorskip('torch')
    model, opt = optimizer_and_model(torch)
    src, mid, out = tmp_path / 'ckpt.pt', tmp_path / 'ckpt.jckpt', tmp_path / 'again.pt'
    torch.save({'model': model.state_dict(), 'optimizer': opt.state_dict(), 'epoch': 3}, src,
               _use_new_zipfile_serialization=False)
    assert jckpt.convert(src, mid) == ('torch', 'jckpt')
    assert jckpt.describe(mid).metadata_dict()[pt.LAYOUT_KEY] == 'nested'
    assert jckpt.convert(mid, out) == ('jckpt', 'torch')
    loaded = torch.load(out, weights_only=True)
    assert sorted(loaded) == ['epoch', 'model', 'optimizer'] and loaded['epoch'] == 3
    again, opt2 = optimizer_and_model(torch)
    again.load_state_dict(loaded['model'])
    opt2.load_state_dict(loaded['optimizer'])
    assert opt2.state_dict()['param_groups'][0]['lr'] == 1e-3
    assert torch.equal(opt2.state_dict()['state'][0]['exp_avg'], opt.state_dict()['state'][0]['exp_avg'])
    assert torch.equal(again[1].num_batches_tracked, model[1].num_batches_tracked)
    direct = tmp_path / 'direct.pt'
    assert jckpt.convert(src, direct) == ('torch', 'torch')  # legacy to zip: the same object
    assert sorted(torch.load(direct, weights_only=True)) == ['epoch', 'model', 'optimizer']


def test_a_state_dict_and_a_jckpt_tree_convert_flat_and_keep_metadata(tmp_path):
    torch = pytest.importorskip('torch')
    model, _ = optimizer_and_model(torch)
    src, mid, out = tmp_path / 'sd.pt', tmp_path / 'sd.jckpt', tmp_path / 'again.pt'
    torch.save(model.state_dict(), src)
    jckpt.convert(src, mid)
    assert pt.LAYOUT_KEY not in jckpt.describe(mid).metadata_dict()
    jckpt.convert(mid, out)
    model.load_state_dict(torch.load(out, weights_only=True))
    state = {'params': {'dense': {'kernel': np.ones((2, 2), np.float32)}}}
    jckpt.save(jckpt.Context(), state, tmp_path / 'state.jckpt', metadata={'run': 'r1'})
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # the metadata is kept, not dropped with a warning
        jckpt.convert(tmp_path / 'state.jckpt', out)
    assert list(torch.load(out, weights_only=True)) == ['params.dense.kernel']
    jckpt.convert(out, tmp_path / 'back.jckpt')
    back = jckpt.describe(tmp_path / 'back.jckpt')
    assert back.metadata_dict()['run'] == 'r1'
    _, tree = jckpt.load(jckpt.Context(host=True), tmp_path / 'back.jckpt')
    assert tree['jckpt']['params']['dense']['kernel'].shape == (2, 2)


def test_a_lone_tensor_is_written_as_itself(tmp_path):
    torch = pytest.importorskip('torch')
    path = tmp_path / 't.pt'
    pt.write({'jckpt': np.arange(3, dtype=np.float32)}, path)
    assert torch.load(path, weights_only=True).tolist() == [0.0, 1.0, 2.0]


def test_metadata_must_be_strings(tmp_path):
    with pytest.raises(InputError, match='strings to strings'):
        pt.write({'jckpt': {}}, tmp_path / 'm.pt', metadata={'a': 1})


def test_a_file_torch_wrote_without_crc32s_reads(tmp_path):
    """torch.serialization.set_crc32_options(False) writes every CRC-32 as 0: the file was
    refused as damaged. One CRC-32 damaged among others is still refused."""
    torch = pytest.importorskip('torch')
    path = tmp_path / 'nocrc.pt'
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({'w': torch.arange(3.0)}, path)
    finally:
        torch.serialization.set_crc32_options(True)
    assert pt.read(path)['jckpt']['w'].tolist() == [0.0, 1.0, 2.0]
    raw = bytearray(open(STATE, 'rb').read())
    with zipfile.ZipFile(STATE) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith('data.pkl'))
    at = raw.index(struct.pack('<I', info.CRC), raw.index(b'PK\x01\x02'))  # the central entry
    raw[at:at + 4] = b'\0\0\0\0'
    (tmp_path / 'bad.pt').write_bytes(bytes(raw))
    with pytest.raises(FormatError, match='CRC-32'):
        pt.read(tmp_path / 'bad.pt')


def test_plain_values_torch_accepts_round_trip(tmp_path):
    """bytes were refused as a leaf that is not an array, complex numbers became tensors."""
    torch = pytest.importorskip('torch')
    path = tmp_path / 'v.pt'
    values = {'by': b'\x00\xffraw', 'c': 1 + 2j, 'big': -2**70, 'ik': {0: {'lr': 0.5}},
              't': (1, None, 'x')}
    pt.write({'jckpt': values}, path, flat=False)
    assert torch.load(path, weights_only=True) == values
    assert pt.read(path)['jckpt'] == values


def test_a_tree_without_arrays_reads_back_with_its_empty_nodes(tmp_path):
    path = tmp_path / 'e.pt'
    pt.write({'jckpt': {'nothing': None, 'empty': {}}}, path)  # an empty state_dict for torch
    assert pt.read(path) == {'jckpt': {'nothing': None, 'empty': None}}
    pt.write({'jckpt': {}}, path)  # the namespace is itself one empty node, as a jckpt file reads
    assert pt.read(path) == {'jckpt': None}


def test_a_torchscript_archive_is_named(tmp_path):
    torch = pytest.importorskip('torch')
    path = tmp_path / 'ts.pt'
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    with pytest.raises(FormatError, match=r'a TorchScript archive \(torch.jit.save\)') as e:
        pt.read(path)
    assert 'torch.jit.load' in e.value.fix


def sharded_checkpoint(torch, directory):
    """What transformers' save_pretrained(safe_serialization=False) writes for a large model."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    sd = model.state_dict()
    shards = {'pytorch_model-00001-of-00002.bin': ['0.weight', '0.bias'],
              'pytorch_model-00002-of-00002.bin': ['1.weight', '1.bias']}
    for shard, names in shards.items():
        torch.save({n: sd[n] for n in names}, directory / shard)
    index = directory / 'pytorch_model.bin.index.json'
    index.write_text(json.dumps({'metadata': {'total_size': 68}, 'weight_map': {
        n: shard for shard, names in shards.items() for n in names}}))
    return model, index


def test_a_sharded_torch_checkpoint_reads_from_its_index(tmp_path):
    """pytorch_model.bin.index.json was taken for a safetensors index and failed on the
    first .bin shard."""
    torch = pytest.importorskip('torch')
    model, index = sharded_checkpoint(torch, tmp_path)
    assert jckpt.detect_format(index) == 'torch'
    tree = jckpt.adapters.read(index)['jckpt']
    assert sorted(tree) == ['0.bias', '0.weight', '1.bias', '1.weight']
    assert same_bits(tree['1.weight'], model[1].weight.detach().numpy())
    out = tmp_path / 'model.jckpt'
    assert jckpt.convert(index, out, nest=True) == ('torch', 'jckpt')
    _, got = jckpt.load(jckpt.Context(host=True), out)
    assert got['jckpt']['0']['bias'].shape == (3,)
    index.write_text(json.dumps({'weight_map': {'0.weight': 'pytorch_model-00001-of-00002.bin',
                                                'extra': 'pytorch_model-00002-of-00002.bin'}}))
    with pytest.raises(FormatError, match="places 'extra' in pytorch_model-00002"):
        pt.read(index)
    index.write_text(json.dumps({'weight_map': {'w': '../pytorch_model-00001-of-00002.bin'}}))
    with pytest.raises(FormatError):
        pt.read(index)


def test_loading_a_torch_file_as_a_checkpoint_says_what_it_is(tmp_path):
    """jckpt.load('model.pt') said "header length 1347093252 ... truncated or not a checkpoint"."""
    path = tmp_path / 'm.pt'
    pt.write({'jckpt': {'w': np.ones(2, np.float32)}}, path)
    with pytest.raises(FormatError, match='it is a zip archive .a PyTorch .pt/.pth') as e:
        jckpt.load(jckpt.Context(host=True), path)
    assert 'jckpt.convert' in e.value.fix and str(path) in str(e.value)


def test_one_namespace_of_a_training_checkpoint_exports_with_bare_names(tmp_path):
    torch = pytest.importorskip('torch')
    src = tmp_path / 'train.jckpt'
    params = {'dense': {'weight': np.ones((2, 3), np.float32), 'bias': np.zeros(2, np.float32)}}
    jckpt.save(jckpt.Context(namespace='params'), params, src)
    jckpt.save(jckpt.Context(namespace='opt'), {'mu': np.zeros(3, np.float32)}, src, appending=True)
    both, only = tmp_path / 'both.pt', tmp_path / 'params.pt'
    jckpt.convert(src, both)
    assert sorted(torch.load(both, weights_only=True)) == [
        'opt.mu', 'params.dense.bias', 'params.dense.weight']
    assert sorted(pt.read(both)) == ['opt', 'params']
    jckpt.convert(src, only, namespaces='params')
    model = torch.nn.Module()
    model.dense = torch.nn.Linear(3, 2)
    model.load_state_dict(torch.load(only, weights_only=True))
    assert model.dense.weight.sum().item() == 6.0


def test_an_optimizers_numbers_stay_numbers_through_jckpt(tmp_path):
    """lr, betas and the params ids came back as 0-d tensors: load_state_dict matched no
    state to the parameters, and training resumed with fresh Adam moments, silently."""
    torch = pytest.importorskip('torch')
    model, opt = optimizer_and_model(torch)
    src, mid, out = tmp_path / 'opt.pt', tmp_path / 'opt.jckpt', tmp_path / 'again.pt'
    torch.save({'optimizer': opt.state_dict(), 'epoch': 3}, src)
    jckpt.convert(src, mid)
    jckpt.convert(mid, out)
    loaded = torch.load(out, weights_only=True)
    group = loaded['optimizer']['param_groups'][0]
    assert group['params'] == [0, 1, 2, 3] and type(group['lr']) is float
    assert type(group['amsgrad']) is bool and loaded['epoch'] == 3 and type(loaded['epoch']) is int
    assert torch.is_tensor(loaded['optimizer']['state'][0]['step'])  # a tensor stays a tensor
    opt2 = torch.optim.AdamW(model.parameters())
    opt2.load_state_dict(loaded['optimizer'])
    assert all(torch.equal(opt2.state[p]['exp_avg'], opt.state[p]['exp_avg'])
               for p in model.parameters())


def test_a_real_model_goes_to_a_nested_jckpt_file_and_back(tmp_path):
    """Conv2d, BatchNorm (an int64 num_batches_tracked), Embedding, LayerNorm: nested for JAX,
    then flat again, and the model computes the same."""
    torch = pytest.importorskip('torch')

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
            self.emb = torch.nn.Embedding(5, 4)
            self.norm = torch.nn.LayerNorm(4)

        def forward(self, x, i):
            return self.norm(self.conv(x).mean((2, 3)) + self.emb(i))

    net = Net()
    net.train()
    net(torch.randn(2, 3, 5, 5), torch.tensor([1, 2]))  # running stats and a batch count
    net.eval()
    src, mid, out = tmp_path / 'net.pt', tmp_path / 'net.jckpt', tmp_path / 'back.pt'
    torch.save(net.state_dict(), src)
    jckpt.convert(src, mid, nest=True)
    _, tree = jckpt.load(jckpt.Context(host=True), mid)
    assert tree['jckpt']['conv']['1']['num_batches_tracked'].dtype == np.int64
    jckpt.convert(mid, out)
    again = Net().eval()
    again.load_state_dict(torch.load(out, weights_only=True, mmap=True))
    x, i = torch.randn(2, 3, 5, 5), torch.tensor([0, 4])
    assert torch.equal(again(x, i), net(x, i))


@pytest.mark.parametrize('action', ['convert', 'inspect'])
def test_convert_and_inspect_read_the_file_once(tmp_path, monkeypatch, action):
    """The file was read twice, once for its tree and once for its metadata: a 1 GB
    checkpoint was mapped, checked and unpickled twice."""
    src = tmp_path / 'ckpt.pt'
    pt.write({'jckpt': {'model': {'w': np.ones(3, np.float32)}, 'epoch': 3}}, src, flat=False)
    reads = []
    real = pt._read_file
    monkeypatch.setattr(pt, '_read_file', lambda path: reads.append(path) or real(path))
    if action == 'convert':
        jckpt.convert(src, tmp_path / 'ckpt.jckpt')
        assert jckpt.describe(tmp_path / 'ckpt.jckpt').metadata_dict()['torch.layout'] == 'nested'
    else:
        summary = jckpt.info(src)
        assert dict(summary.metadata)['torch.layout'] == 'nested'
    assert reads == [str(src)]


def test_an_adam_state_dict_keeps_its_tuples_through_jckpt(tmp_path):
    """torch -> jckpt -> torch gave param_groups' betas back as a list: torch takes it, but
    the state_dict was not the one saved."""
    torch = pytest.importorskip('torch')
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    src, mid, out = tmp_path / 'opt.pt', tmp_path / 'opt.jckpt', tmp_path / 'back.pt'
    torch.save(opt.state_dict(), src)
    jckpt.convert(src, mid)
    jckpt.convert(mid, out)
    back = torch.load(out, weights_only=True)
    groups = opt.state_dict()['param_groups']
    assert back['param_groups'] == groups
    assert [{k: type(v) for k, v in g.items()} for g in back['param_groups']] == \
        [{k: type(v) for k, v in g.items()} for g in groups]
    again = torch.optim.Adam(torch.nn.Linear(3, 2).parameters())
    again.load_state_dict(back)
    assert again.param_groups[0]['betas'] == (0.8, 0.9)
    assert type(again.param_groups[0]['betas']) is tuple
    assert torch.equal(again.state_dict()['state'][0]['exp_avg'], opt.state_dict()['state'][0]['exp_avg'])


def test_views_of_one_storage_stay_views_through_a_torch_file(tmp_path):
    """A state_dict holding `w`, `w[1]` and `w.t()` of one storage was written as copies
    (torch.save keeps one storage, and an in-place update of one shows in the others)."""
    torch = pytest.importorskip('torch')
    w = torch.arange(12.0).reshape(3, 4)
    sd = {'w': w, 'row': w[1], 't': w.t(), 'col': w[:, 2]}
    path, out = tmp_path / 'views.pt', tmp_path / 'back.pt'
    torch.save(sd, path)
    pt.write(pt.read(path), out)
    back = torch.load(out, weights_only=True)
    assert {k: torch.equal(v, sd[k]) for k, v in back.items()} == dict.fromkeys(sd, True)
    assert len({v.untyped_storage().data_ptr() for v in back.values()}) == 1
    assert [(back[k].storage_offset(), back[k].stride()) for k in sd] == \
        [(v.storage_offset(), v.stride()) for v in sd.values()]
    back['w'][1, 0] = 100.0
    assert back['row'][0] == back['t'][0, 1] == 100.0
    a = np.arange(6, dtype=np.float32).reshape(2, 3)  # a numpy tree: views of one array too
    pt.write({'jckpt': {'a': a, 'c': a[:, 1], 'r': a[::-1]}}, out)
    back = torch.load(out, weights_only=True)
    assert back['c'].untyped_storage().data_ptr() == back['a'].untyped_storage().data_ptr()
    assert back['r'].tolist() == a[::-1].tolist()  # a negative stride: a copy


def test_damaged_metadata_fails_its_reading_not_the_tensors(tmp_path):
    """The tree and the metadata are read in one pass; a damaged metadata member is still
    refused where the metadata is asked for, and only there."""
    good, bad = tmp_path / 'good.pt', tmp_path / 'bad.pt'
    pt.write({'jckpt': {'w': np.ones(2, np.float32)}}, good, metadata={'run': 'a'})
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, 'w') as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, b'[1]' if info.filename.endswith(pt.METADATA_MEMBER) else data)
    assert pt.read(bad)['jckpt']['w'].tolist() == [1.0, 1.0]
    with pytest.raises(FormatError, match='not a JSON object of strings'):
        pt.read_metadata(bad)
    with pytest.raises(FormatError, match='not a JSON object of strings'):
        jckpt.convert(bad, tmp_path / 'bad.jckpt')


def test_an_empty_tuple_comes_back_through_jckpt(tmp_path):
    """A jckpt file keeps `()` as an empty node, read as None: torch -> jckpt -> torch gave
    None where the file held an empty tuple."""
    src, mid, out = tmp_path / 't.pt', tmp_path / 't.jckpt', tmp_path / 'back.pt'
    pt.write({'jckpt': {'w': np.ones(2, np.float32), 'e': (), 'n': [(), 1], 'z': None}}, src,
             flat=False)
    jckpt.convert(src, mid)
    jckpt.convert(mid, out)
    back = jckpt.adapters.read(out)['jckpt']
    assert back['e'] == () and back['n'] == [(), 1] and back['z'] is None


def test_a_missing_torch_shard_names_the_index_and_the_shard(tmp_path):
    """Its first shard missing, a torch index was no format at all; a later one, "no such file"."""
    torch = pytest.importorskip('torch')
    _, index = sharded_checkpoint(torch, tmp_path)
    for shard in ('pytorch_model-00002-of-00002.bin', 'pytorch_model-00001-of-00002.bin'):
        (tmp_path / shard).unlink()
        with pytest.raises(FormatError, match=f"names shard '{shard}'") as e:
            jckpt.convert(index, tmp_path / 'out.jckpt')
        assert e.value.file == str(index) and 'weight_map' in e.value.fix
