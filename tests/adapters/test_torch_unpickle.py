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


