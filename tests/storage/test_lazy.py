"""``jckpt.storage.lazy``: arrays read box by box, and the log of what each read took."""

import os
import threading

import ml_dtypes
import numpy as np
import pytest

from jckpt.format.boxes import box_slices
from jckpt.format.entries import entry_for
from jckpt.format.header import Header
from jckpt.format.layout import lay_out
from jckpt.format.names import DIRECTORY_LOCK_NAME, piece_name
from jckpt.storage import directory
from jckpt.storage.checkpoint import open_checkpoint
from jckpt.storage.lazy import LazyArray, note_read, record_reads
from jckpt.storage.writer import ArraySource, write_checkpoint

X = np.arange(24, dtype=np.float32).reshape(4, 6)


class Recording:
    """A ``read`` function over ``X`` that remembers the boxes asked of it."""

    def __init__(self, array=X):
        self.array = array
        self.boxes = []

    def __call__(self, box):
        self.boxes.append(box)
        return self.array[box_slices(box)].copy()


def test_shape_dtype_and_sizes_without_reading():
    read = Recording()
    a = LazyArray([4, 6], 'float32', read)
    assert (a.shape, a.dtype, a.ndim, a.size, a.nbytes) == ((4, 6), np.dtype(np.float32), 2, 24, 96)
    assert repr(a) == 'LazyArray(shape=(4, 6), dtype=float32)'
    assert read.boxes == []


def test_indexing_reads_only_the_box_asked_for():
    read = Recording()
    a = LazyArray(X.shape, X.dtype, read)
    np.testing.assert_array_equal(a[1:3, 2:5], X[1:3, 2:5])
    np.testing.assert_array_equal(a[2:], X[2:])  # one index: the other dims are whole
    np.testing.assert_array_equal(a[1], X[1:2])  # an integer reads its row (as a box)
    assert read.boxes == [((1, 3), (2, 5)), ((2, 4), (0, 6)), ((1, 2), (0, 6))]
    assert a.read(((0, 1), (0, 1))).tolist() == [[0.0]]


def test_a_strided_index_is_refused_before_reading():
    read = Recording()
    with pytest.raises(ValueError, match='not a box'):
        LazyArray(X.shape, X.dtype, read)[::2]
    assert read.boxes == []


def test_asarray_reads_the_whole_array_once():
    read = Recording()
    a = LazyArray(X.shape, X.dtype, read)
    np.testing.assert_array_equal(np.asarray(a), X)
    assert np.asarray(a, dtype=np.int64).dtype == np.int64
    assert read.boxes == [((0, 4), (0, 6))] * 2


def test_astype_converts_each_read_and_reads_nothing_itself():
    read = Recording()
    a = LazyArray(X.shape, X.dtype, read)
    b = a.astype(ml_dtypes.bfloat16)
    assert read.boxes == [] and b.dtype == np.dtype(ml_dtypes.bfloat16) and b.shape == a.shape
    part = b[0:2, 0:3]
    assert part.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(part, X[0:2, 0:3].astype(ml_dtypes.bfloat16))
    c = b.astype(np.int32)  # conversions chain
    assert c[3:4, 5:6].tolist() == [[23]] and c[3:4, 5:6].dtype == np.int32
    assert read.boxes == [((0, 2), (0, 3)), ((3, 4), (5, 6)), ((3, 4), (5, 6))]


def test_astype_to_the_same_dtype():
    a = LazyArray(X.shape, X.dtype, Recording())
    assert a.astype(np.float32, copy=False) is a
    same = a.astype(np.float32)
    assert same is not a and same.dtype == a.dtype
    np.testing.assert_array_equal(np.asarray(same), X)


# --- record_reads -----------------------------------------------------------------------------------

def test_record_reads_collects_only_while_active():
    note_read(((0, 1),), 4)  # nobody listening: nothing to do, no error
    with record_reads() as log:
        note_read(((0, 2), (2, 4)), 32)
        with record_reads() as inner:
            note_read(((5, 6),), 8)
    note_read(((7, 8),), 8)
    assert log == [(((0, 2), (2, 4)), 32), (((5, 6),), 8)]
    assert inner == [(((5, 6),), 8)]


def test_record_reads_stops_when_the_block_raises():
    with pytest.raises(RuntimeError):
        with record_reads() as log:
            raise RuntimeError
    note_read(((0, 1),), 4)
    assert log == []


def test_record_reads_sees_every_thread():
    with record_reads() as log:
        threads = [threading.Thread(target=lambda i=i: [note_read(((i, i + 1),), 1)
                                                        for _ in range(200)])
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(log) == 800 and {b for b, _ in log} == {((i, i + 1),) for i in range(4)}


# --- on a directory checkpoint (real files) ---------------------------------------------------------

@pytest.fixture
def stored(tmp_path):
    """A directory checkpoint of ``X`` in two pieces of two rows, and its lazy array."""
    path = str(tmp_path / 'ckpt')
    stage, lock = directory.make_stage(path)
    try:
        for p in range(2):
            rows = ((2 * p, 2 * p + 2), (0, 6))
            part = X[box_slices(rows)]
            entry = entry_for('jckpt', (('k', 'x'),), X.dtype, part.shape, id=0, slice=rows,
                              global_dims=X.shape)
            write_checkpoint(os.path.join(stage, piece_name(p)), lay_out(Header(tensors=(entry,))),
                             [ArraySource(part)], durable=False)
        directory.write_index(stage, 2, 32, {}, durable=False)
        directory.publish_directory(stage, path, durable=False)
        os.unlink(os.path.join(path, DIRECTORY_LOCK_NAME))
    finally:
        os.close(lock)
    reader = open_checkpoint(path)
    return reader, reader.decode(reader.header.tensors[0])


def test_a_stored_array_reads_and_logs_only_the_boxes_asked_for(stored):
    reader, lazy = stored
    assert isinstance(lazy, LazyArray) and reader._readers == {}
    with record_reads() as log:
        np.testing.assert_array_equal(lazy[0:1, 1:3], X[0:1, 1:3])
        assert sorted(reader._readers) == [0]  # the second piece file is not opened
        np.testing.assert_array_equal(lazy[1:3], X[1:3])  # spans both pieces
    assert log == [(((0, 1), (1, 3)), 2 * 4), (((1, 3), (0, 6)), 12 * 4)]


def test_a_stored_array_converts_per_read(stored):
    _, lazy = stored
    with record_reads() as log:
        part = lazy.astype(np.float64)[3:4, 0:2]
    assert part.dtype == np.float64 and part.tolist() == [[18.0, 19.0]]
    assert log == [(((3, 4), (0, 2)), 2 * 4)]  # bytes as stored (float32), not as converted


def test_a_negative_integer_reads_the_last_row(stored):
    _, lazy = stored
    with record_reads() as log:
        lazy[-1]
    assert log == [(((3, 4), (0, 6)), 6 * 4)]


def test_a_fetch_cache_counts_a_key_fetched_twice_once():
    """Two threads missing one key both fetched it; the second replaced the first without its
    bytes leaving the count, so the cache held less than its budget said."""
    import threading

    from jckpt.storage.lazy import FetchCache
    cache = FetchCache(budget=1 << 20)
    barrier = threading.Barrier(2)

    def fetch():
        barrier.wait(10)
        return np.zeros(100, np.uint8)
    threads = [threading.Thread(target=cache.get, args=('k', fetch)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache._bytes == 100 and len(cache._kept) == 1
