"""The jckpt format as an adapter (jckpt.adapters.native): sniff, read, write, build_header."""

import os
import struct

import jax
import numpy as np
import pytest

import jckpt
from jckpt import adapters
from jckpt.adapters import native
from jckpt.errors import FormatError, InputError
from jckpt.format.names import INDEX_NAME
from jckpt.storage import CheckpointReader
from jckpt.tools.verify import verify
from jckpt.version import __version__
from tests.helpers import entry_text, header_text, raw_file, write_arrays, write_directory


def head_of(path, n=64):
    with open(path, 'rb') as f:
        return f.read(n)


# --- sniff -------------------------------------------------------------------------------------

def test_sniff_knows_jckpt_and_ocannl_files(tmp_path):
    path = write_arrays(tmp_path / 'a.jckpt', {'w': np.ones(2)})
    assert native.sniff(path, head_of(path))
    legacy = tmp_path / 'o.ckpt'  # an OCANNL file written by hand
    legacy.write_bytes(raw_file(header_text(entry_text()), np.ones(1, np.float32).tobytes()))
    assert native.sniff(str(legacy), head_of(legacy))


@pytest.mark.parametrize('head', [
    b'', b'\x00\x00\x00\x20((vers', b'\x00\x00\x00\x05((version 1))',    # too short; too small
    b'\x00\x00\x00\x40((format 1))     ', b'PK\x03\x04\x14\x00\x00\x00\x08\x00\x00\x00',
    b'\x93NUMPY((version'])
def test_sniff_refuses_other_bytes(tmp_path, head):
    assert not native.sniff(str(tmp_path / 'x'), head)


def test_sniff_allows_whitespace_before_the_header():
    body = b'  \n((version 1) (tensors ()))'
    assert native.sniff('x', struct.pack('>I', len(body)) + body)


def test_sniff_of_a_directory_looks_for_the_index(tmp_path):
    d = write_directory(tmp_path / 'ckpt', {'w': np.arange(4.0)})
    assert native.sniff(d, None)
    os.unlink(os.path.join(d, INDEX_NAME))
    assert not native.sniff(d, None)
    assert not native.sniff(str(tmp_path / 'missing'), None)


# --- read --------------------------------------------------------------------------------------

def test_read_gives_every_namespace_as_host_arrays(tmp_path):
    path = tmp_path / 'two.jckpt'
    jckpt.save(jckpt.Context(namespace='model'), {'w': np.arange(6.0).reshape(2, 3), 'l': [np.int8(3)]},
               path)
    jckpt.save(jckpt.Context(namespace='opt'), {'m': np.zeros(2, np.float32)}, path, appending=True)
    tree = native.read(str(path))
    assert sorted(tree) == ['model', 'opt']
    np.testing.assert_array_equal(tree['opt']['m'], np.zeros(2, np.float32))
    w = tree['model']['w']
    assert isinstance(w, np.ndarray) and not isinstance(w, jax.Array)
    np.testing.assert_array_equal(w, np.arange(6.0).reshape(2, 3))
    assert int(tree['model']['l'][0]) == 3


def test_read_of_a_directory_checkpoint(tmp_path):
    arrays = {'w': np.arange(12, dtype=np.float32).reshape(6, 2), 'b': np.arange(3.0)}
    d = write_directory(tmp_path / 'ckpt', arrays, processes=3)
    tree = native.read(d)
    assert sorted(tree['jckpt']) == ['b', 'w']
    for k, v in arrays.items():
        np.testing.assert_array_equal(np.asarray(tree['jckpt'][k]), v)


def test_read_refuses_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FormatError):
        native.read(str(tmp_path / 'missing.jckpt'))
    bad = tmp_path / 'bad.jckpt'
    bad.write_bytes(b'\x00\x00\x00\x05((((')
    with pytest.raises(FormatError) as e:
        native.read(str(bad))
    assert e.value.file == str(bad)


# --- build_header, write_items, write ----------------------------------------------------------

def test_build_header_counts_ids_per_namespace_and_lays_out():
    items = [('a', (('k', 'w'),), np.ones((2, 3), np.float32)), ('b', (('k', 'w'),), np.ones(3, np.int8)),
             ('a', (('k', 'v'),), np.ones(5, np.float64))]
    header = native.build_header(items, metadata=[('note', 'x')])
    assert [(e.namespace, e.id, e.name) for e in header.tensors] == [
        ('a', 0, 'a/w'), ('b', 0, 'b/w'), ('a', 1, 'a/v')]
    assert [e.dims for e in header.tensors] == [(2, 3), (3,), (5,)]
    assert [e.byte_length for e in header.tensors] == [24, 3, 40]
    assert header.alignment == 32 and header.writer == f'jckpt {__version__}'
    assert header.metadata == (('note', 'x'),)
    offsets = [e.offset for e in header.tensors]
    assert offsets[0] == 0 and all(o % 32 == 0 for o in offsets) and len(set(offsets)) == 3
    assert native.build_header(items, alignment=4096).tensors[1].offset == 4096


def test_write_items_publishes_a_file_that_verifies(tmp_path):
    items = [('m', (('k', 'w'),), np.arange(4, dtype=np.float32)),
             ('m', (('k', 's'),), np.array(7, np.int32))]
    path = str(tmp_path / 'i.jckpt')
    header = native.write_items(items, path, alignment=64, metadata=[('k', 'v')])
    reader = CheckpointReader(path)
    assert reader.header.alignment == 64 and dict(reader.header.metadata) == {'k': 'v'}
    assert [e.checksum for e in reader.header.tensors] == [e.checksum for e in header.tensors]
    assert all(e.checksum is not None for e in header.tensors)
    assert verify(path).ok
    np.testing.assert_array_equal(reader.decode(reader.header.tensors[0]), np.arange(4))


def test_write_puts_every_namespace_in_one_file(tmp_path):
    path = tmp_path / 'two.jckpt'
    key = jax.random.key(5)
    native.write({'model': {'w': np.ones(2), 'k': key}, 'opt': {'m': jax.numpy.zeros(2)}}, path)
    assert os.listdir(tmp_path) == ['two.jckpt']
    tree = native.read(str(path))
    assert sorted(tree) == ['model', 'opt']
    np.testing.assert_array_equal(tree['model']['w'], np.ones(2))
    np.testing.assert_array_equal(jax.random.key_data(tree['model']['k']),  # a key comes back a key
                                  jax.random.key_data(key))
    assert jckpt.describe(path).tensors[0].name == 'model/k'
    assert jckpt.describe(path).tensors[0].key_impl is not None


def test_write_refuses_a_bad_tree_before_touching_the_file(tmp_path):
    path = write_arrays(tmp_path / 'a.jckpt', {'old': np.ones(1)})
    with pytest.raises(InputError, match='adapters write a tree'):
        native.write([np.ones(1)], path)
    with pytest.raises(InputError, match='not an array') as e:
        native.write({'jckpt': {'w': np.ones(1), 's': 'text'}}, path)
    assert (e.value.file, e.value.entry) == (path, 'jckpt/s')
    assert [x.name for x in jckpt.describe(path).tensors] == ['jckpt/old']
    assert os.listdir(tmp_path) == ['a.jckpt']


def test_the_format_is_registered_under_its_name():
    fmt = adapters.get_format('jckpt')
    assert fmt.read is native.read and fmt.write is native.write and fmt.sniff is native.sniff
    assert '.jckpt' in fmt.extensions


def test_converting_out_of_jckpt_says_which_metadata_is_left_behind(tmp_path):
    """The user's metadata (and orbax's JSON items) went without a word into npz or orbax;
    what jckpt records of the tree itself is not the user's and is not named."""
    import warnings

    import jckpt
    jckpt.save(jckpt.Context(), {"w": np.ones(2), "opt": ()}, tmp_path / "meta.jckpt",
               metadata={"run": "abc"})
    with pytest.warns(UserWarning, match=r"\['run'\] .* is not kept in 'npz'; the .jckpt file keeps"):
        jckpt.convert(tmp_path / "meta.jckpt", tmp_path / "m.npz")
    jckpt.save(jckpt.Context(), {"w": np.ones(2), "opt": ()}, tmp_path / "plain.jckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jckpt.convert(tmp_path / "plain.jckpt", tmp_path / "p.npz")
    jckpt.convert(tmp_path / "meta.jckpt", tmp_path / "again.jckpt")
    assert jckpt.describe(tmp_path / "again.jckpt").metadata_dict()["run"] == "abc"


@pytest.mark.parametrize('dst', ['out.jckpt', 'out.safetensors', 'out.npz'])
def test_a_damaged_payload_is_not_converted(tmp_path, dst):
    """convert copied a corrupt payload into a new file under a fresh checksum (verify then
    said the copy was fine)."""
    import jckpt
    from jckpt.errors import ChecksumError
    src = tmp_path / 'm.jckpt'
    jckpt.save(jckpt.Context(), {'w': np.arange(8, dtype=np.float32)}, src)
    raw = bytearray(src.read_bytes())
    raw[-1] ^= 1
    src.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match='checksum mismatch') as e:
        jckpt.convert(src, tmp_path / dst)
    assert e.value.entry == 'jckpt/w' and not (tmp_path / dst).exists()


def test_convert_reads_the_header_once(tmp_path, monkeypatch):
    """The header was read and checked three times (the tree, its empty nodes, its metadata)."""
    src = tmp_path / 'a.jckpt'
    native.write({'m': {'w': np.ones(3, np.float32)}}, src, metadata={'source': 'run 7'})
    reads = []
    real = CheckpointReader._read_head
    monkeypatch.setattr(CheckpointReader, '_read_head',
                        lambda self, fd: reads.append(self.path) or real(self, fd))
    jckpt.convert(src, tmp_path / 'a.safetensors')
    assert reads == [str(src)]
    tree, meta = adapters.read_with_metadata(src)
    assert meta == {'source': 'run 7'} and tree['m']['w'].tolist() == [1, 1, 1]
