"""``jckpt.adapters.tree_reader``: a checkpoint in another format opened with a jckpt
reader's surface (``header``, ``decode``), as ``jckpt.info`` and ``jckpt.diff`` read it."""

import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.adapters import write as write_format
from jckpt.adapters.tree_reader import TreeReader, open_foreign
from jckpt.trees import pytree


def _tree():
    return {'jckpt': {'layers': [{'w': np.arange(6, dtype=np.float32).reshape(2, 3)},
                                 {'w': np.ones((2, 3), ml_dtypes.bfloat16)}],
                      'epoch': 3, 'name': 'run-7', 'none': None}}


def test_entries_have_the_identity_a_jckpt_save_gives_the_same_tree(tmp_path):
    path = tmp_path / 'm.pt'
    write_format(_tree(), path)
    reader = open_foreign(path, 'torch')
    assert isinstance(reader, TreeReader) and reader.header.writer == 'torch'
    saved = [p for p, _ in pytree.flatten({k: v for k, v in _tree()['jckpt'].items()
                                           if k not in ('name', 'none')})]
    assert [e.path for e in reader.header.tensors] == saved  # strings and None hold no array
    by_name = {e.name: e for e in reader.header.tensors}
    assert by_name['jckpt/epoch'].dims == () and by_name['jckpt/epoch'].dtype == np.int64
    w = reader.decode(by_name['jckpt/layers/1/w'])
    assert w.dtype == ml_dtypes.bfloat16 and w.shape == (2, 3)
    assert [e.id for e in reader.header.tensors] == [0, 1, 2]


def test_specs_describe_the_arrays_without_making_the_header(tmp_path):
    """A listing needs each array's description only: the entries are made when asked for."""
    path = tmp_path / 'm.pt'
    write_format(_tree(), path)
    reader = TreeReader(path, 'torch')
    specs = list(reader.specs())
    assert 'header' not in vars(reader)  # not made yet
    assert specs == [(e.namespace, e.path, e.dtype, e.shape, e.byte_length)
                     for e in reader.header.tensors]
    assert reader.metadata == reader.header.metadata


def test_the_files_own_metadata_is_the_headers(tmp_path):
    from jckpt.adapters.safetensors import write
    path = tmp_path / 'm.safetensors'
    write({'jckpt': {'w': np.ones(2)}}, path, metadata={'source': 'hub'})
    assert open_foreign(path, 'safetensors').header.metadata_dict() == {'format': 'pt',
                                                                        'source': 'hub'}


def test_a_directory_with_a_registered_reader_opens_through_it(tmp_path):
    pytest.importorskip('orbax.checkpoint')
    jckpt.adapters.write({'jckpt': {'w': np.arange(3.0)}}, tmp_path / 'o', format='orbax')
    reader = open_foreign(tmp_path / 'o', 'orbax')
    assert not isinstance(reader, TreeReader)  # the orbax reader: metadata, then data on demand
    (entry,) = reader.header.tensors
    assert entry.name == 'jckpt/w' and reader.decode(entry).tolist() == [0, 1, 2]
    assert list(reader.specs()) == [('jckpt', (('k', 'w'),), entry.dtype, (3,), 24)]
    assert reader.metadata == reader.header.metadata


def test_a_damaged_file_is_the_formats_error(tmp_path):
    path = tmp_path / 'm.npz'
    path.write_bytes(b'PK\x03\x04' + b'\x00' * 40)
    with pytest.raises(jckpt.FormatError) as e:
        open_foreign(path, 'npz')
    assert e.value.file == str(path)


def test_the_first_array_of_a_dtype_jckpt_lacks_is_named(tmp_path):
    """Dtypes are now checked once each: the error must still name the first such array."""
    path = tmp_path / 'u.npz'
    np.savez(path, a=np.ones(2), s=np.array(['x']), t=np.array(['yy']), z=np.ones(1, bool))
    with pytest.raises(jckpt.FormatError, match='dtype <U1 has no jckpt element type') as e:
        TreeReader(path, 'npz')
    assert e.value.entry == 'jckpt/s' and e.value.file == str(path)
