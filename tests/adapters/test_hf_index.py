"""Every reader of a Hugging Face sharded index reads it one way: capped, from a regular file."""

import json
import os

import numpy as np
import pytest

import jckpt
from jckpt.adapters import hf_index
from jckpt.adapters import safetensors as st
from jckpt.adapters import torch as pt
from jckpt.errors import FormatError
from jckpt.format.limits import MAX_RECORD_BYTES
from tests.helpers import peak_bytes


def index(tmp_path, name='model.safetensors.index.json', pad=0, shard='model-1.safetensors'):
    path = tmp_path / name
    path.write_text(json.dumps({'weight_map': {'w': shard}, 'pad': 'x' * pad}))
    return str(path)


def test_the_weight_map_of_an_index(tmp_path):
    assert hf_index.weight_map(index(tmp_path)) == {'w': 'model-1.safetensors'}
    for text, why in [('[1]', 'no weight_map'), ('{"weight_map": {"w": 1}}', 'no weight_map'),
                      ('{', 'cannot be read'), ('[' * 100_000, 'cannot be read')]:
        (tmp_path / 'bad.index.json').write_text(text)
        with pytest.raises(FormatError, match=why) as e:
            hf_index.weight_map(str(tmp_path / 'bad.index.json'))
        assert e.value.file == str(tmp_path / 'bad.index.json') and e.value.fix
    with pytest.raises(FormatError, match='no such file'):
        hf_index.weight_map(str(tmp_path / 'missing.index.json'))


def test_a_fifo_named_as_an_index_is_refused_never_waited_on(tmp_path):
    fifo = tmp_path / 'model.safetensors.index.json'
    os.mkfifo(fifo)
    with pytest.raises(FormatError, match='not a regular file'):
        hf_index.weight_map(str(fifo))
    with pytest.raises(FormatError, match='not a regular file'):
        st.read_sharded(str(fifo))


@pytest.mark.parametrize('caller', ['safetensors', 'torch', 'listing'])
def test_each_reader_of_an_index_stops_at_the_cap(tmp_path, monkeypatch, caller):
    """An index over `MAX_RECORD_BYTES` (here made small) is refused by the safetensors
    reader, and is no index to the torch reader and the listing of a path's files."""
    monkeypatch.setattr(hf_index, 'MAX_RECORD_BYTES', 1000)
    shard = 'model-1.safetensors' if caller != 'torch' else 'pytorch_model-1.bin'
    name = 'pytorch_model.bin.index.json' if caller == 'torch' else 'model.safetensors.index.json'
    small, large = index(tmp_path, name, 0, shard), None
    st.write({'jckpt': {'w': np.ones(2, np.float32)}}, str(tmp_path / 'model-1.safetensors'))
    if caller == 'safetensors':
        assert st.read_sharded(small)[0]['w'].tolist() == [1, 1]
        large = index(tmp_path, name, 1000, shard)
        with pytest.raises(FormatError, match='over 1000 bytes') as e:
            st.read_sharded(large)
        assert e.value.file == large
    elif caller == 'torch':
        assert pt._shard_names(small) == {'w': shard}  # its shard missing: the index names it
        assert pt._shard_names(index(tmp_path, name, 1000, shard)) is None
    else:
        assert hf_index.index_shards(small) == [str(tmp_path / 'model-1.safetensors')]
        assert hf_index.index_shards(index(tmp_path, name, 1000, shard)) == []


def test_a_huge_index_given_to_inspect_is_not_read_whole(tmp_path):
    """The listing of what a path's files are opened an index with plain `open()` and read it
    whole: a crafted index of 80 MB took three times that to be read and parsed."""
    path = index(tmp_path, pad=MAX_RECORD_BYTES + (16 << 20))
    size = os.path.getsize(path)
    assert hf_index.index_shards(path) == []
    assert peak_bytes(lambda: hf_index.index_shards(path)) < size
    with pytest.raises(FormatError, match=f'over {MAX_RECORD_BYTES} bytes') as e:
        jckpt.adapters.safetensors.read_sharded(path)
    assert e.value.file == path
