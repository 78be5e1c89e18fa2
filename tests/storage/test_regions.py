"""``jckpt.storage.regions``: payloads written piece by piece into place, and hashed as written."""

import itertools
import os
from pathlib import Path

import numpy as np
import pytest

from jckpt.errors import StorageError
from jckpt.format import payload as payload_mod
from jckpt.format.boxes import box_slices
from jckpt.storage import regions
from jckpt.storage.regions import ShardedSource, hash_region, stored_bytes
from jckpt.storage.writer import Sink


def data(shape, dtype=np.float32):
    return np.arange(int(np.prod(shape))).reshape(shape).astype(dtype)


def grid_boxes(shape, box_grid):
    """The boxes of ``shape`` cut into ``box_grid`` blocks per dimension."""
    cuts = [np.linspace(0, d, g + 1).astype(int) for d, g in zip(shape, box_grid)]
    return [tuple((int(c[i]), int(c[i + 1])) for c, i in zip(cuts, idx))
            for idx in itertools.product(*[range(g) for g in box_grid])]


def write_source(path, source, head=b'head'):
    """Write ``source`` after ``head`` in a new file; return its checksum, the sink, the payload."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, head)
        sink = Sink(fd, len(head))
        checksum = source.write(sink)
        end = os.lseek(sink.fd, 0, os.SEEK_CUR)
        sink.flush()
        raw = Path(path).read_bytes()[len(head):]
    finally:
        os.close(fd)
    assert end == sink.position  # the next payload goes right after this one
    return checksum, sink, raw


@pytest.mark.parametrize("shape,box_grid", [
    ((64, 32), (1, 8)),        # short runs: assembled in bands of rows
    ((4, 40000), (1, 4)),      # few long runs: one pwrite each
    ((40, 30000), (2, 2)),     # many runs
    ((6, 5, 4), (3, 1, 2)),    # three dims
    ((6, 20, 4), (3, 2, 2)),   # three dims, short runs below a split first dim
    ((9,), (3,)),
    ((0, 4), (1, 2)),
])
@pytest.mark.parametrize("assemble", [0, regions.ASSEMBLE_BYTES])
def test_sharded_source_writes_every_layout(tmp_path, shape, box_grid, assemble, monkeypatch):
    monkeypatch.setattr(regions, "ASSEMBLE_BYTES", assemble)  # 0: always write in place
    x = data(shape)
    pieces = [(b, lambda b=b: np.ascontiguousarray(x[box_slices(b)]))
              for b in grid_boxes(shape, box_grid)]
    checksum, sink, raw = write_source(tmp_path / "raw", ShardedSource(shape, x.dtype, pieces[::-1]))
    assert sink.position == 4 + x.nbytes
    assert raw == x.tobytes()
    assert checksum == payload_mod.checksum(x.tobytes())


@pytest.mark.parametrize("shape,box_grid", [((64, 32), (1, 8)), ((6, 20, 4), (3, 2, 2)),
                                            ((40, 300), (2, 3))])
@pytest.mark.parametrize("direct_run_bytes", [0, 1 << 40])  # every run by pwrite / all scattered
def test_direct_and_scattered_runs_write_the_same_bytes(tmp_path, shape, box_grid,
                                                        direct_run_bytes, monkeypatch):
    monkeypatch.setattr(regions, "ASSEMBLE_BYTES", 0)
    monkeypatch.setattr(regions, "DIRECT_RUN_BYTES", direct_run_bytes)
    x = data(shape, np.int16)
    pieces = [(b, lambda b=b: x[box_slices(b)]) for b in grid_boxes(shape, box_grid)]
    checksum, _, raw = write_source(tmp_path / "raw", ShardedSource(shape, x.dtype, pieces))
    assert raw == x.tobytes() and checksum == payload_mod.checksum(x.tobytes())


@pytest.mark.parametrize("band_bytes", [1, 5 * 32 * 2, 1 << 20])  # a row, 5 rows, all rows
@pytest.mark.parametrize("box_grid", [(1, 8), (3, 4), (7, 2)])
def test_short_runs_are_written_in_bands_whatever_their_rows(tmp_path, band_bytes, box_grid,
                                                             monkeypatch):
    """Bands of rows that pieces cross, partly or whole, give the payload and its checksum."""
    monkeypatch.setattr(regions, "ASSEMBLE_BYTES", 0)
    monkeypatch.setattr(regions, "BAND_BYTES", band_bytes)
    x = data((61, 32), np.int16)
    pieces = [(b, lambda b=b: x[box_slices(b)]) for b in grid_boxes(x.shape, box_grid)]
    checksum, sink, raw = write_source(tmp_path / "raw", ShardedSource(x.shape, x.dtype, pieces))
    assert raw == x.tobytes() and checksum == payload_mod.checksum(x.tobytes())
    assert sink.position == 4 + x.nbytes


@pytest.mark.parametrize("box_grid,most", [((4, 4), 4), ((4, 1), 1)])
def test_pieces_are_fetched_when_needed_and_let_go_after(tmp_path, box_grid, most, monkeypatch):
    """Every piece of a payload was fetched to the host before any was written, so saving a
    sharded array held it whole on the host: one piece at a time is enough for long rows, the
    pieces of the band's rows for short ones."""
    import weakref

    monkeypatch.setattr(regions, "ASSEMBLE_BYTES", 0)
    x = data((128, 64), np.float32)
    monkeypatch.setattr(regions, "BAND_BYTES", 32 * x.shape[1] * x.itemsize)  # a row of pieces
    alive, peak = [0], [0]

    def fetch(box):
        piece = x[box_slices(box)].copy()
        alive[0] += 1
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(piece, lambda: alive.__setitem__(0, alive[0] - 1))
        return piece

    pieces = [(b, lambda b=b: fetch(b)) for b in grid_boxes(x.shape, box_grid)]
    checksum, _, raw = write_source(tmp_path / "raw", ShardedSource(x.shape, x.dtype, pieces))
    assert raw == x.tobytes() and checksum == payload_mod.checksum(x.tobytes())
    assert peak[0] <= most


@pytest.mark.parametrize("assemble", [0, regions.ASSEMBLE_BYTES])
def test_pieces_are_stored_little_endian(tmp_path, assemble, monkeypatch):
    monkeypatch.setattr(regions, "ASSEMBLE_BYTES", assemble)
    x = data((4, 3)).astype('>f4')
    pieces = [(b, lambda b=b: x[box_slices(b)]) for b in grid_boxes(x.shape, (2, 1))]
    checksum, _, raw = write_source(tmp_path / "raw", ShardedSource(x.shape, x.dtype, pieces))
    little = x.astype('<f4').tobytes()
    assert raw == little and checksum == payload_mod.checksum(little)


@pytest.mark.parametrize("assemble", [0, regions.ASSEMBLE_BYTES])
def test_empty_pieces_are_not_fetched(tmp_path, assemble, monkeypatch):
    monkeypatch.setattr(regions, "ASSEMBLE_BYTES", assemble)
    x = data((4, 2))

    def never():
        raise AssertionError("an empty piece was fetched")

    pieces = [(((0, 4), (0, 2)), lambda: x), (((4, 4), (0, 2)), never)]
    _, _, raw = write_source(tmp_path / "raw", ShardedSource(x.shape, x.dtype, pieces))
    assert raw == x.tobytes()


def test_a_piece_of_the_wrong_shape_is_refused_in_place(tmp_path, monkeypatch):
    monkeypatch.setattr(regions, "ASSEMBLE_BYTES", 0)
    x = data((2, 3))
    source = ShardedSource(x.shape, x.dtype, [(((0, 2), (0, 3)), lambda: x[:1])])
    with pytest.raises(StorageError, match=r"piece \(\(0, 2\), \(0, 3\)\) has shape \(1, 3\), "
                                           r"expected \(2, 3\)"):
        write_source(tmp_path / "raw", source)


def test_a_piece_of_the_wrong_shape_is_refused_when_assembled(tmp_path):
    x = data((2, 3))
    source = ShardedSource(x.shape, x.dtype, [(((0, 2), (0, 3)), lambda: x[:1])])
    with pytest.raises(StorageError, match="has shape"):
        write_source(tmp_path / "raw", source)


# --- hashing and stored bytes ---------------------------------------------------------------------

@pytest.mark.parametrize("offset", [0, 1, 4095, 4096, 4097, 70_001])
@pytest.mark.parametrize("length", [0, 1, 100, 9_000])
def test_hash_region_is_the_checksum_of_the_same_bytes(tmp_path, offset, length):
    content = np.random.default_rng(offset + length).bytes(offset + length + 50)
    path = tmp_path / "f"
    path.write_bytes(content)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert hash_region(fd, offset, length) == payload_mod.checksum(content[offset:offset + length])
    finally:
        os.close(fd)


def test_hash_region_hashes_chunk_by_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(payload_mod, "CHUNK_BYTES", 1000)
    content = np.random.default_rng(0).bytes(10_500)
    (tmp_path / "f").write_bytes(content)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert hash_region(fd, 123, 10_000) == payload_mod.checksum(content[123:10_123])
    finally:
        os.close(fd)


def test_stored_bytes_are_c_ordered_little_endian():
    x = np.asfortranarray(data((3, 4)).astype('>i4'))
    flat = stored_bytes(x)
    assert flat.dtype == np.uint8 and flat.ndim == 1
    assert flat.tobytes() == np.ascontiguousarray(x).astype('<i4').tobytes()
    y = data((2, 2))
    assert np.shares_memory(stored_bytes(y), y)  # already in stored form: no copy
