"""``jckpt.storage.checkpoint.open_checkpoint``: one way to open a file or a directory checkpoint."""

import os

import numpy as np
import pytest

from jckpt.errors import FormatError, InputError
from jckpt.format.entries import entry_for
from jckpt.format.header import Header
from jckpt.format.layout import lay_out
from jckpt.format.names import DIRECTORY_LOCK_NAME, INDEX_NAME, piece_name
from jckpt.storage import directory
from jckpt.storage.checkpoint import open_checkpoint
from jckpt.storage.directory import DirectoryReader
from jckpt.storage.reader import CheckpointReader
from jckpt.storage.writer import ArraySource, write_checkpoint

W = np.arange(12, dtype=np.float32).reshape(4, 3)


def write_file(path, array=W, *, box=None):
    """A checkpoint file holding ``array`` as ``w`` (a piece of ``W`` when ``box`` is given)."""
    entry = entry_for('jckpt', (('k', 'w'),), array.dtype, array.shape, id=0, slice=box,
                      global_dims=None if box is None else W.shape)
    write_checkpoint(path, lay_out(Header(tensors=(entry,))), [ArraySource(array)], durable=False)


def write_directory(path):
    """A directory checkpoint of two processes, each holding two rows of ``W``."""
    stage, lock = directory.make_stage(str(path))
    try:
        for p in range(2):
            write_file(os.path.join(stage, piece_name(p)), W[2 * p:2 * p + 2],
                       box=((2 * p, 2 * p + 2), (0, 3)))
        directory.write_index(stage, 2, 32, {}, durable=False)
        directory.publish_directory(stage, str(path), durable=False)
        os.unlink(os.path.join(path, DIRECTORY_LOCK_NAME))
    finally:
        os.close(lock)


def test_a_file_opens_as_a_checkpoint_reader(tmp_path):
    path = tmp_path / 'm.jckpt'
    write_file(path)
    reader = open_checkpoint(path)  # a PathLike is accepted
    assert type(reader) is CheckpointReader and reader.path == str(path)
    (entry,) = reader.header.tensors
    assert entry.name == 'jckpt/w' and entry.dims == (4, 3)
    np.testing.assert_array_equal(reader.decode(entry), W)


def test_a_file_opened_for_its_header_alone_is_not_mapped(tmp_path, monkeypatch):
    """`describe` (a manager reads every step's header as it opens) mapped each file, and
    the mapping and its removal were a tenth of reading a small step's header."""
    import jckpt
    from jckpt.storage import reader as reader_mod
    path = tmp_path / 'm.jckpt'
    write_file(path)
    mapped = open_checkpoint(path).header
    monkeypatch.setattr(reader_mod.mmap_mod, 'mmap', lambda *a, **k: pytest.fail('mapped'))
    assert open_checkpoint(path, mapped=False).header == mapped == jckpt.describe(path)
    with open(path, 'r+b') as f:
        f.truncate(os.path.getsize(path) - 1)  # the header's checks all the same
    with pytest.raises(FormatError, match="truncated"):
        jckpt.describe(path)


def test_a_directory_opens_as_a_directory_reader(tmp_path):
    path = tmp_path / 'ckpt'
    write_directory(path)
    reader = open_checkpoint(str(path))
    assert type(reader) is DirectoryReader
    (entry,) = reader.header.tensors
    assert entry.dims == (4, 3)  # the global array, not a piece
    assert reader._readers == {}  # opening read only the index, no piece yet
    np.testing.assert_array_equal(np.asarray(reader.decode(entry)), W)
    assert type(open_checkpoint(path / piece_name(1))) is CheckpointReader  # a piece is a file


def test_a_missing_path_is_a_format_error(tmp_path):
    path = tmp_path / 'nope.jckpt'
    with pytest.raises(FormatError, match='no such checkpoint file') as info:
        open_checkpoint(path)
    assert info.value.file == str(path) and info.value.fix


def test_a_directory_without_index_is_not_a_checkpoint(tmp_path):
    (tmp_path / 'half').mkdir()
    write_file(tmp_path / 'half' / piece_name(0))  # pieces, but the save never wrote the index
    with pytest.raises(FormatError, match=f'directory has no {INDEX_NAME}') as info:
        open_checkpoint(tmp_path / 'half')
    assert info.value.file == str(tmp_path / 'half')


def test_a_file_that_is_not_a_checkpoint_is_a_format_error(tmp_path):
    path = tmp_path / 'notes.txt'
    path.write_bytes(b'\x00\x00\x00\x05hello')
    with pytest.raises(FormatError) as info:
        open_checkpoint(path)
    assert info.value.file == str(path)


def test_a_url_no_backend_serves_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match='no storage backend'):
        open_checkpoint('nosuch://bucket/m.jckpt')


@pytest.fixture
def fake_format():
    """A directory format that claims directories holding a file named FAKE."""
    from jckpt.storage import checkpoint

    opened = []

    def claims(path):
        if os.path.exists(os.path.join(path, 'BROKEN')):
            raise RuntimeError('a claim that fails does not claim')
        return os.path.exists(os.path.join(path, 'FAKE'))

    fmt = checkpoint.register_directory_reader('fake', claims=claims,
                                               open=lambda path: opened.append(path) or 'reader')
    yield fmt, opened
    with checkpoint._LOCK:
        checkpoint._DIRECTORY_FORMATS.pop('fake')


def test_a_registered_directory_format_opens_its_directories(tmp_path, fake_format):
    _, opened = fake_format
    (tmp_path / 'foreign').mkdir()
    (tmp_path / 'foreign' / 'FAKE').write_text('')
    assert open_checkpoint(tmp_path / 'foreign') == 'reader'
    assert opened == [str(tmp_path / 'foreign')]


def test_a_directory_checkpoint_is_never_offered_to_another_format(tmp_path, fake_format):
    write_directory(tmp_path / 'ckpt')
    (tmp_path / 'ckpt' / 'FAKE').write_text('')
    assert isinstance(open_checkpoint(tmp_path / 'ckpt'), DirectoryReader)
    (tmp_path / 'other').mkdir()
    (tmp_path / 'other' / 'BROKEN').write_text('')
    with pytest.raises(FormatError, match=f"no {INDEX_NAME}"):  # a failing claim claims nothing
        open_checkpoint(tmp_path / 'other')


def test_a_prefix_in_an_object_store_is_offered_to_the_registered_formats():
    """A prefix with no index.jckpt goes to the directory readers too (which list it themselves)."""
    pytest.importorskip('obstore')
    from jckpt.storage import backend_for, checkpoint

    store = backend_for('memory://x')
    opened = []
    checkpoint.register_directory_reader(
        'fake-url', claims=lambda path: 'FAKE' in store.list(path),
        open=lambda path: opened.append(path) or 'reader')
    try:
        store.stream('memory://prefixes/foreign/FAKE', iter([b'x']), 1)
        assert open_checkpoint('memory://prefixes/foreign') == 'reader'
        assert opened == ['memory://prefixes/foreign']
        store.stream('memory://prefixes/other/x', iter([b'x']), 1)
        with pytest.raises(FormatError, match=f"no {INDEX_NAME}"):  # claimed by none
            open_checkpoint('memory://prefixes/other')
    finally:
        with checkpoint._LOCK:
            checkpoint._DIRECTORY_FORMATS.pop('fake-url')
