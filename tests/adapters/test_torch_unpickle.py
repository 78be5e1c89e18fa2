"""The allow-list unpickler of torch files: tensors rebuilt from storages, nothing else built."""

import io
import pickle

import ml_dtypes
import numpy as np
import pytest

from jckpt.adapters import _torch_unpickle as up
from jckpt.errors import FormatError


def test_plain_values_unpickle_as_themselves():
    raw = pickle.dumps({'epoch': 3, 'lr': [0.5, None, (True, 'x')]}, protocol=2)
    assert up.unpickle(io.BytesIO(raw), None, 'm.pt') == {'epoch': 3, 'lr': [0.5, None, (True, 'x')]}


def test_a_storage_reference_without_storages_is_refused():
    raw = (b'\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage'
           b'ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x01tQK\x00'
           b'K\x01\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR.')
    with pytest.raises(FormatError, match='unknown persistent reference') as e:
        up.unpickle(io.BytesIO(raw), None, 'm.pt')
    assert e.value.file == 'm.pt'
    got = up.unpickle(io.BytesIO(raw), lambda kind, key, n: np.ones(n, kind.dtype), 'm.pt')
    assert got.tolist() == [1.0]


@pytest.mark.parametrize('dtype', [ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fn,
                                   ml_dtypes.bfloat16, np.complex128])
def test_a_strided_view_of_any_dtype_is_rebuilt(dtype):
    """A transposed float8_e5m2 tensor was refused as a damaged pickle: numpy's array
    interface, which as_strided goes through, cannot name that dtype."""
    storage = np.arange(6).astype(dtype)
    view = up._rebuild(storage, 0, (3, 2), (1, 3))
    want = np.ascontiguousarray(storage.reshape(2, 3).T)
    assert view.dtype == dtype and np.ascontiguousarray(view).tobytes() == want.tobytes()




def saved(torch, obj, tmp_path):
    from jckpt.adapters import torch as pt
    path = tmp_path / 'x.pt'
    torch.save(obj, path)
    return pt.read(path)['jckpt'], path


def test_values_torch_loads_with_weights_only_read_as_plain_values(tmp_path):
    """A dtype or device in a checkpoint's config, a complex number, a tensor with Python
    attributes (an nn.Buffer): a dtype came back as an internal object, the rest refused
    as code."""
    torch = pytest.importorskip('torch')
    obj = {'dtype': torch.bfloat16, 'device': torch.device('cuda', 1), 'cpu': torch.device('cpu'),
           'c': 1 + 2j, 'buf': torch.nn.Buffer(torch.ones(2)), 'shape': torch.Size([2, 3])}
    got, _ = saved(torch, obj, tmp_path)
    assert got == {'dtype': 'torch.bfloat16', 'device': 'cuda:1', 'cpu': 'cpu', 'c': 1 + 2j,
                   'buf': got['buf'], 'shape': (2, 3)}
    assert type(got['device']) is str and got['buf'].tolist() == [1.0, 1.0]


@pytest.mark.parametrize('make, what, fix', [
    (lambda t: t.ones(2, dtype=t.complex32), 'dtype torch.complex32', 'torch.complex64'),
    (lambda t: t.quantize_per_tensor(t.ones(2), 0.1, 0, t.qint8), 'a quantized tensor',
     'dequantize'),
    (lambda t: t.eye(2).to_sparse(), 'a sparse tensor', 'to_dense'),
    (lambda t: t.empty(2, device='meta'), 'meta device', 'holds data'),
    (lambda t: t.zeros(2, dtype=t.float4_e2m1fn_x2), 'dtype torch.float4_e2m1fn_x2', 'view'),
])
def test_tensors_numpy_cannot_hold_are_named_not_called_code(tmp_path, make, what, fix):
    torch = pytest.importorskip('torch')
    with pytest.raises(FormatError, match=f'holds .*{what}.*which jckpt cannot read') as e:
        saved(torch, {'w': make(torch)}, tmp_path)
    assert fix in e.value.fix and str(tmp_path / 'x.pt') in str(e.value)


def test_numpy_objects_are_named_not_called_code(tmp_path):
    """np.random.get_state() in a checkpoint (a trainer's RNG state)."""
    torch = pytest.importorskip('torch')
    with pytest.raises(FormatError, match=r'a numpy object \(numpy\S*_reconstruct') as e:
        saved(torch, {'rng': np.random.get_state()}, tmp_path)
    assert 'torch.from_numpy' in e.value.fix


@pytest.mark.parametrize('glob, what, fix', [
    (b'torch.distributed._shard.sharded_tensor.api\nShardedTensor', 'a distributed', 'FULL_STATE_DICT'),
    (b'torch._utils\n_rebuild_wrapper_subclass', 'tensor subclass without storage', 'full_tensor'),
])
def test_distributed_tensors_say_how_to_gather_them(glob, what, fix):
    with pytest.raises(FormatError, match=what) as e:
        up.unpickle(io.BytesIO(b'\x80\x02c' + glob + b'\n)R.'), None, 'm.pt')
    assert fix in e.value.fix


def _doubling(depth: int) -> bytes:
    """Protocol-2 opcodes leaving on the stack a list holding the one before it twice, `depth`
    times over: a few bytes a level, 2**depth items when written out."""
    out = b']K\x01aq\x00'  # [1], memo 0
    for n in range(depth):
        out += b'](h' + bytes([n]) + b'h' + bytes([n]) + b'eq' + bytes([n + 1])
    return out


def test_a_crafted_persistent_reference_is_named_in_bounded_time_and_memory():
    """Its name was the whole repr of the reference, cut after: a list of itself twice, 43
    deep (a 1.3 KB torch file found by fuzzing), never finished; 20 deep wrote megabytes."""
    from tests.helpers import peak_bytes

    raw = b'\x80\x02' + _doubling(20) + b'Q.'
    with pytest.raises(FormatError, match=r'unknown persistent reference \[\[\[\[\[\[') as e:
        up.unpickle(io.BytesIO(raw), None, 'm.pt')
    assert e.value.file == 'm.pt' and len(str(e.value)) < 300
    assert peak_bytes(lambda: up.unpickle(io.BytesIO(raw), None, 'm.pt')) < 1 << 20
