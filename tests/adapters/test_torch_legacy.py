"""Legacy torch.save files (`_use_new_zipfile_serialization=False`): read without torch or code."""

import pickle

import numpy as np
import pytest

import jckpt
from jckpt.adapters import _torch_legacy as legacy
from jckpt.adapters import torch as pt
from jckpt.errors import FormatError


def legacy_file(obj_pickle: bytes, keys: list, data: bytes) -> bytes:
    """A legacy file by hand: the header pickles, the object, the keys, then the storages."""
    head = b''.join(pickle.dumps(x, protocol=2) for x in (1001, {'little_endian': True}))
    return legacy.LEGACY_MAGIC + head + obj_pickle + pickle.dumps(keys, protocol=2) + data


# a float tensor of 2 elements on storage '7'
TENSOR = (b'\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage'
          b'ctorch\nFloatStorage\nX\x01\x00\x00\x007X\x03\x00\x00\x00cpuK\x02NtQK\x00'
          b'K\x02\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR.')


def test_a_hand_made_legacy_file_reads():
    data = (2).to_bytes(8, 'little') + np.array([1.5, -2], '<f4').tobytes()
    got = legacy.read(legacy_file(TENSOR, ['7'], data), 'old.pt')
    assert got.dtype == np.float32 and got.tolist() == [1.5, -2.0]


@pytest.mark.parametrize('keys, data, match', [
    (['7'], (2).to_bytes(8, 'little') + b'\0' * 4, 'extends past the end'),
    (['7'], (3).to_bytes(8, 'little') + b'\0' * 12, 'holds 3 elements, not the 2'),
    (['7', '8'], (2).to_bytes(8, 'little') + b'\0' * 8, 'does not name each storage once'),
    ('7', b'', 'does not name each storage once'),
])
def test_damaged_storages_are_refused(keys, data, match):
    with pytest.raises(FormatError, match=match) as e:
        legacy.read(legacy_file(TENSOR, keys, data), 'old.pt')
    assert e.value.file == 'old.pt'


def test_a_wrong_protocol_and_code_are_refused(tmp_path):
    raw = legacy.LEGACY_MAGIC + pickle.dumps(7, protocol=2) + pickle.dumps({}, protocol=2)
    with pytest.raises(FormatError, match='protocol 7'):
        legacy.read(raw, 'old.pt')
    from tests.adapters.test_torch_unpickle import _doubling
    from tests.helpers import peak_bytes
    crafted = legacy.LEGACY_MAGIC + b'\x80\x02' + _doubling(20) + b'.' + pickle.dumps({})
    with pytest.raises(FormatError, match=r'protocol \[\[\['):  # its whole repr was written
        legacy.read(crafted, 'old.pt')
    assert peak_bytes(lambda: legacy.read(crafted, 'old.pt')) < 1 << 20
    evil = legacy_file(b'\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueq\x00\x85R.', [], b'')
    with pytest.raises(FormatError, match='refusing to unpickle global os.system'):
        legacy.read(evil, 'old.pt')


def test_a_storage_larger_than_the_file_is_refused_without_allocating():
    huge = TENSOR.replace(b'K\x02NtQ', b'\x8a\x06\x00\x00\x00\x00\x00\x01NtQ')  # 2**40 elements
    with pytest.raises(FormatError, match='larger than the file'):
        legacy.read(legacy_file(huge, ['7'], b''), 'old.pt')


def test_torch_legacy_files_read_as_torch_loads_them(tmp_path):
    """Refused before ("load it with torch.load and save it again"); read now, views shared."""
    torch = pytest.importorskip('torch')
    base = torch.arange(12.).reshape(3, 4)
    bn = torch.nn.BatchNorm1d(3)
    state = {'w': base, 'row': base[1], 't': base.T, 'bf16': base.to(torch.bfloat16),
             'u16': torch.arange(3).to(torch.uint16), 'scalar': torch.tensor(2.5),
             'empty': torch.zeros(0, 2), 'bn': bn.state_dict(), 'epoch': 3}
    path = tmp_path / 'old.pt'
    torch.save(state, path, _use_new_zipfile_serialization=False)
    assert jckpt.detect_format(path) == 'torch'
    got = pt.read(path)['jckpt']
    for name in ('w', 'row', 't', 'bf16', 'u16', 'scalar', 'empty'):
        want = state[name]
        assert list(got[name].shape) == list(want.shape), name
        raw = want.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert np.ascontiguousarray(got[name]).tobytes() == raw, name
    assert got['bn']['num_batches_tracked'].dtype == np.int64 and got['epoch'] == 3
    assert np.shares_memory(got['w'], got['row'])
    out = tmp_path / 'new.pt'
    assert jckpt.convert(path, out) == ('torch', 'torch')
    again = torch.load(out, weights_only=True)
    assert torch.equal(again['t'], base.T) and torch.equal(again['bn']['running_var'], bn.running_var)
