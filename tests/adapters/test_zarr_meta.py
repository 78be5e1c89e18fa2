"""A zarr array's `.zarray` is checked before tensorstore, which aborts the process on a failed
allocation, sizes memory by it."""

import json
import resource

import pytest

from jckpt.adapters import zarr_meta
from jckpt.errors import FormatError


def zarray(tmp_path, **fields):
    meta = {'zarr_format': 2, 'shape': [3, 4], 'chunks': [3, 4], 'dtype': '<f4',
            'compressor': None, 'fill_value': None, 'filters': None, 'order': 'C', **fields}
    path = tmp_path / '.zarray'
    path.write_text(json.dumps(meta))
    return str(path)


def test_the_claim_is_the_array_or_one_chunk_where_larger(tmp_path):
    assert zarr_meta.zarray_claim(zarray(tmp_path)) == 48
    assert zarr_meta.zarray_claim(zarray(tmp_path, chunks=[1, 4])) == 48
    assert zarr_meta.zarray_claim(zarray(tmp_path, shape=[0, 4], chunks=[1, 4])) == 0
    # a chunk past its array's edge, as a writer of small arrays may make one
    assert zarr_meta.zarray_claim(zarray(tmp_path, shape=[3], chunks=[1000])) == 4000


@pytest.mark.parametrize('fields, why', [
    ({'chunks': [1 << 40, 4]}, 'larger than its array'),  # tensorstore: std::bad_alloc, SIGABRT
    ({'chunks': [1 << 26, 1]}, 'larger than its array'),
    ({'chunks': [0, 4]}, 'chunks'),
    ({'chunks': [3]}, 'chunks'),
    ({'shape': [1] * 33, 'chunks': [1] * 33}, 'shape'),
    ({'shape': [3.5, 4]}, 'shape'),
    ({'zarr_format': 3}, 'not zarr version 2'),
])
def test_metadata_tensorstore_would_abort_on_is_refused_naming_the_file(tmp_path, fields, why):
    path = zarray(tmp_path, **fields)
    with pytest.raises(FormatError, match=f'zarr metadata cannot be read: .*{why}') as e:
        zarr_meta.zarray_claim(path)
    assert e.value.file == path and e.value.fix


def zarr_json(tmp_path, shape=(3, 4), grid=(3, 4), inner=(3, 4), **fields):
    meta = {'zarr_format': 3, 'node_type': 'array', 'shape': list(shape), 'data_type': 'bfloat16',
            'chunk_grid': {'name': 'regular', 'configuration': {'chunk_shape': list(grid)}},
            'codecs': [{'name': 'sharding_indexed', 'configuration': {
                'chunk_shape': list(inner), 'codecs': [{'name': 'bytes'}]}}], **fields}
    path = tmp_path / 'zarr.json'
    path.write_text(json.dumps(meta))
    return str(path)


def test_zarr_version_3_metadata_as_orbax_writes_it_with_use_zarr3(tmp_path):
    assert zarr_meta.zarray_claim(zarr_json(tmp_path)) == 24  # bfloat16: 2 bytes
    assert zarr_meta.zarray_claim(zarr_json(tmp_path, node_type='group')) == 0
    for fields, why in [({'inner': (1 << 40, 4)}, 'larger than its array'),  # tensorstore:
                        ({'grid': (1 << 26, 1)}, 'larger than its array'),   # SIGABRT
                        ({'grid': (3,)}, 'chunks'), ({'zarr_format': 2}, 'not zarr version 3'),
                        ({'chunk_grid': None}, 'not subscriptable')]:
        path = zarr_json(tmp_path, **fields)
        with pytest.raises(FormatError, match=f'zarr metadata cannot be read: .*{why}') as e:
            zarr_meta.zarray_claim(path)
        assert e.value.file == path


def test_memory_is_what_an_address_space_limit_leaves(monkeypatch):
    unlimited = zarr_meta.memory_bytes()
    assert unlimited > 0
    monkeypatch.setattr(resource, 'getrlimit', lambda what: (1 << 62, resource.RLIM_INFINITY))
    assert zarr_meta.memory_bytes() == unlimited  # the machine's memory is the smaller
    with open('/proc/self/statm') as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    monkeypatch.setattr(resource, 'getrlimit', lambda what: (used + (1 << 30), resource.RLIM_INFINITY))
    assert (1 << 30) - (64 << 20) < zarr_meta.memory_bytes() <= 1 << 30
