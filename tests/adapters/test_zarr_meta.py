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


def test_memory_is_what_an_address_space_limit_leaves(monkeypatch):
    unlimited = zarr_meta.memory_bytes()
    assert unlimited > 0
    monkeypatch.setattr(resource, 'getrlimit', lambda what: (1 << 62, resource.RLIM_INFINITY))
    assert zarr_meta.memory_bytes() == unlimited  # the machine's memory is the smaller
    with open('/proc/self/statm') as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    monkeypatch.setattr(resource, 'getrlimit', lambda what: (used + (1 << 30), resource.RLIM_INFINITY))
    assert (1 << 30) - (64 << 20) < zarr_meta.memory_bytes() <= 1 << 30
