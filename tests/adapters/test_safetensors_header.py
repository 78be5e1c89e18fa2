"""The safetensors header: read and checked as the safetensors reader checks it, crafted
headers refused before they are built, encoded for a writer."""

import json
import os
import struct

import numpy as np
import pytest

from jckpt.adapters import safetensors as st
from jckpt.adapters import safetensors_header as sh
from jckpt.errors import FormatError


def test_a_header_encoded_reads_back_with_its_end_and_metadata():
    entries = [('b', np.dtype(np.int16), (3,), 6), ('a', np.dtype(np.float32), (2, 2), 16)]
    raw = sh.encode_header(entries, {'format': 'pt'})
    assert len(raw) % 8 == 0 and sh.header_end(raw) == len(raw)
    layout, metadata, start = sh.read_header(raw + bytes(22), 'm.safetensors')
    assert (layout.names, layout.shapes, layout.begins) == (['b', 'a'], [(3,), (2, 2)], [0, 6])
    assert metadata == {'format': 'pt'} and start == len(raw)
    with pytest.raises(FormatError, match='trailing bytes') as info:
        sh.read_header(raw + bytes(23), 'm.safetensors')
    assert 'm.safetensors' in str(info.value)
    assert sh.header_end(b'PK\x03\x04' + bytes(12)) is None


def test_overlap_and_packed_dtype_refused(tmp_path):
    header = {'a': {'dtype': 'U8', 'shape': [2], 'data_offsets': [0, 2]},
              'b': {'dtype': 'U8', 'shape': [2], 'data_offsets': [1, 3]}}
    text = json.dumps(header).encode()
    path = tmp_path / 'o.safetensors'
    path.write_bytes(struct.pack('<Q', len(text)) + text + b'abc')
    with pytest.raises(FormatError, match='overlaps'):
        st.read(path)
    text = json.dumps({'a': {'dtype': 'F4', 'shape': [2], 'data_offsets': [0, 1]}}).encode()
    path.write_bytes(struct.pack('<Q', len(text)) + text + b'a')
    with pytest.raises(FormatError, match='packed'):
        st.read(path)


@pytest.mark.parametrize('header', [
    b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],'
    b'"data_offsets":[0,4]}}',
    b'{"w":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}'])
def test_a_key_twice_in_the_header_is_refused(tmp_path, header):
    """JSON keeps the last of two equal keys: a tensor named twice would silently be one."""
    path = tmp_path / 'dup.safetensors'
    path.write_bytes(struct.pack('<Q', len(header)) + header + b'\0' * 4)
    with pytest.raises(FormatError, match="key 'w' appears twice|key 'dtype' appears twice"):
        st.read(path)


def test_a_header_of_deep_lists_repeated_is_refused_before_they_are_built(tmp_path):
    """A 40-deep list repeated as a tensor's data_offsets (the hostile fuzzer, seed 48): the
    JSON reader built every list before the offsets were checked, about 40 times the
    header's size in memory (over a GiB for a 32 MB header, a `MemoryError` under a cap)."""
    from tests.helpers import peak_bytes

    deep = "[" * 40 + "]" * 40
    header = ('{"w":{"dtype":"F32","shape":[1],"data_offsets":[' + ", ".join([deep] * 25_000)
              + ']}}').encode()
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(FormatError, match="nests 43 deep") as info:
        st.read(str(path))
    assert str(path) in str(info.value)
    assert peak_bytes(lambda: st.read(str(path))) < 8 * len(header)


def _crafted(tmp_path, items: list[str]) -> str:
    header = ('{' + ','.join(items) + '}').encode()
    path = tmp_path / "crafted.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return str(path)


def test_a_header_of_more_entries_than_its_size_holds_is_refused_before_they_are_built(
        tmp_path):
    """Millions of short keys (`"k1":[]`, a few bytes each) made `json.loads` build every
    key and value, twice (the per-entry check parsed again while the first parse was held):
    about 35 times the header's size before the first entry was refused. A tensor's entry
    takes 50 bytes at least, so the keys are counted first, on the text."""
    from tests.helpers import peak_bytes

    path = _crafted(tmp_path, [f'"{i:x}":[]' for i in range(1_000_000)])
    assert peak_bytes(lambda: st.read(path)) < 4 * os.path.getsize(path)
    with pytest.raises(FormatError, match=r"holds 1000000 entries; a tensor's entry takes 50 "
                                          r"bytes at least, so no more than \d+ fit") as info:
        st.read(path)
    assert path in str(info.value)


def test_a_refused_header_is_not_held_twice_while_its_fault_is_named(tmp_path):
    """The per-entry check parses the header again (to refuse duplicate keys), while the
    first parse was still held: twice the memory of one. The first is let go first."""
    from tests.helpers import peak_bytes

    path = _crafted(tmp_path, [f'"{i:040x}":{{"data_offsets":[0,0]}}' for i in range(50_000)])
    with pytest.raises(FormatError, match="must have exactly dtype, shape and data_offsets"):
        st.read(path)
    one = peak_bytes(lambda: json.loads(open(path, 'rb').read()[8:]))
    assert peak_bytes(lambda: st.read(path)) < 1.5 * one


GAP_KEYS = {  # 13 to 50 bytes an entry: too few colons to look crafted, too many entries
    'escaped keys': lambda i: f'"k\\u00e9\\u00e9{i:07d}":[]',
    'empty objects': lambda i: f'"k\\u00e9\\u00e9{i:07d}":{{}}',
    'one key repeated': lambda i: '"data_offsets":[]',
    'longer keys': lambda i: f'"k{i:010d}":[]',
}


@pytest.mark.parametrize('entry', GAP_KEYS.values(), ids=list(GAP_KEYS))
def test_a_header_of_too_many_entries_with_few_colons_is_refused_before_they_are_built(
        tmp_path, entry):
    """Keys of 13 to 50 bytes (escapes in them, or a key repeated) left the header's colons
    too few to count its keys, so `json.loads` built every key and value, and the per-entry
    check parsed it again: 7.7 to 21 times its size before the refusal (an escape anywhere
    also sent the count through a copy of the text without its strings, 8 times). Colons
    that are not four an object, as a tensor's entry's are, are counted now, strings skipped
    in place."""
    from tests.helpers import peak_bytes

    path = _crafted(tmp_path, [entry(i) for i in range(200_000)])
    assert peak_bytes(lambda: st.read(path)) < 2.5 * os.path.getsize(path)
    with pytest.raises(FormatError, match=r"holds 200000 entries; a tensor's entry takes 50"):
        st.read(path)


def test_a_header_with_metadata_and_names_with_colons_is_read():
    """Colons beyond four an object (metadata pairs, a name with a colon) are only counted."""
    entries = [(f'block:{i}', np.dtype(np.float32), (2,), 8) for i in range(100)]
    raw = sh.encode_header(entries, {f'k{i}': 'v:{x}' for i in range(100)}) + bytes(800)
    layout, metadata, _ = sh.read_header(raw, 'm.safetensors')
    assert layout.names[:2] == ['block:0', 'block:1'] and len(metadata) == 100
