"""``jckpt.storage.reader``: one open, the header and extents checked before any payload is touched."""

import os
import struct
from pathlib import Path

import numpy as np
import pytest

from jckpt.errors import ChecksumError, FormatError
from jckpt.format import payload as payload_mod
from jckpt.format.entries import entry_for
from jckpt.format.header import Header
from jckpt.format.layout import lay_out
from jckpt.storage.reader import COUNTS, CheckpointReader, IngestionCounts
from jckpt.storage.writer import ArraySource, write_checkpoint
from tests.helpers import entry_text, header_text, raw_file

A = np.arange(6, dtype=np.float32).reshape(2, 3)
B = np.array([7, -8], dtype=np.int16)


def write(path, arrays=None):
    """A checkpoint file of ``{name: array}`` (default: ``a`` and ``b``), written by the writer."""
    arrays = {'a': A, 'b': B} if arrays is None else arrays
    entries = tuple(entry_for('jckpt', (('k', n),), x.dtype, x.shape, id=i)
                    for i, (n, x) in enumerate(arrays.items()))
    write_checkpoint(path, lay_out(Header(tensors=entries, alignment=32)),
                     [ArraySource(x) for x in arrays.values()], durable=False)
    return str(path)


def damage(path, at):
    data = bytearray(Path(path).read_bytes())
    data[at] ^= 0x01
    Path(path).write_bytes(bytes(data))


def test_reads_the_header_and_each_payload(tmp_path):
    path = write(tmp_path / 'm.jckpt')
    r = CheckpointReader(tmp_path / 'm.jckpt')
    assert r.path == path and r.size == os.path.getsize(path)
    st = os.stat(path)
    assert r.file_id == (st.st_dev, st.st_ino)
    assert [e.name for e in r.header.tensors] == ['jckpt/a', 'jckpt/b']
    (hlen,) = struct.unpack('>I', Path(path).read_bytes()[:4])
    assert r.data_start == 4 + hlen and r.data_start % 32 == 0
    a, b = r.header.tensors
    np.testing.assert_array_equal(r.decode(a), A)
    np.testing.assert_array_equal(r.decode(b), B)
    assert bytes(r.payload_bytes(b)) == B.tobytes() and len(r.buffer) == r.size
    assert r.verify() == []


def test_decode_maps_or_copies_and_counts_which(tmp_path):
    r = CheckpointReader(write(tmp_path / 'm.jckpt'))
    a = r.header.tensors[0]
    before = COUNTS.snapshot()
    mapped = r.decode(a)
    copied = r.decode(a, mmap=False)
    r.decode(a, count=False)
    after = COUNTS.snapshot()
    assert (after['mapped'] - before['mapped'], after['decoded'] - before['decoded']) == (1, 1)
    assert np.shares_memory(mapped, np.frombuffer(r.buffer, np.uint8))
    assert not np.shares_memory(copied, np.frombuffer(r.buffer, np.uint8))
    np.testing.assert_array_equal(copied, mapped)


def test_an_unaligned_payload_is_copied_even_when_mapping_is_allowed(tmp_path):
    text = header_text(entry_text(prec='Single_prec', dims='(2)', length=8))
    text += ' ' * ((1 - (4 + len(text))) % 4)  # data starts at 1 mod 4: no float32 view there
    path = tmp_path / 'odd.jckpt'
    path.write_bytes(raw_file(text, np.array([1.5, 2.5], np.float32).tobytes()))
    r = CheckpointReader(path)
    assert r.data_start % 4 == 1
    before = COUNTS.snapshot()['decoded']
    assert r.decode(r.header.tensors[0]).tolist() == [1.5, 2.5]
    assert COUNTS.snapshot()['decoded'] == before + 1


def test_the_mapping_is_private_and_outlives_the_file(tmp_path):
    path = write(tmp_path / 'm.jckpt')
    original = Path(path).read_bytes()
    r = CheckpointReader(path)
    view = r.decode(r.header.tensors[0])
    view[0, 0] = 99.0  # copy-on-write: the file does not change
    assert Path(path).read_bytes() == original
    write(path, {'a': np.zeros((2, 3), np.float32)})  # replaced by another file
    os.unlink(path)
    del r
    assert view.tolist() == [[99.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


# --- refusals before any payload ---------------------------------------------------------------

def test_extents_are_checked_when_opening(tmp_path):
    path = tmp_path / 'short.jckpt'
    path.write_bytes(raw_file(header_text(entry_text(length=8, dims='(2)')), b'\0' * 4))
    with pytest.raises(FormatError, match=r'payload \[0, 8\) extends past the end of the file '
                                          r'\(4 data bytes\)') as info:
        CheckpointReader(path)
    assert info.value.entry == 'jckpt/n0' and info.value.file == str(path)


def test_overlapping_payloads_are_refused(tmp_path):
    path = tmp_path / 'overlap.jckpt'
    path.write_bytes(raw_file(header_text(entry_text(id=0, length=8, dims='(2)'),
                                          entry_text(id=1, offset=4, length=4)), b'\0' * 8))
    with pytest.raises(FormatError, match='payload overlaps the payload of'):
        CheckpointReader(path)


@pytest.mark.parametrize('keep,message', [
    (0, 'file is 0 bytes, shorter than the 4-byte header length'),
    (3, 'file is 3 bytes, shorter than the 4-byte header length'),
    (20, 'header length .* extends past the end of the file'),
    (-1, r'payload \[.*\) extends past the end of the file'),
])
def test_a_truncated_file_is_a_format_error(tmp_path, keep, message):
    path = write(tmp_path / 'm.jckpt')
    size = os.path.getsize(path)
    os.truncate(path, keep % size)
    with pytest.raises(FormatError, match=message) as info:
        CheckpointReader(path)
    assert type(info.value) is FormatError and info.value.file == path


def test_a_missing_file_is_a_format_error(tmp_path):
    with pytest.raises(FormatError, match='no such checkpoint file') as info:
        CheckpointReader(tmp_path / 'nope.jckpt')
    assert info.value.file == str(tmp_path / 'nope.jckpt')


def test_a_directory_is_a_format_error(tmp_path):
    with pytest.raises(FormatError, match='is a directory, not a checkpoint file'):
        CheckpointReader(tmp_path)


@pytest.mark.timeout(20)
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / 'pipe.jckpt'
    os.mkfifo(fifo)  # opening it for reading without O_NONBLOCK would block forever
    with pytest.raises(FormatError, match='not a regular file') as e:
        CheckpointReader(fifo)
    assert e.value.file == str(fifo)


def test_the_reader_can_refuse_symlinks(tmp_path):
    """What a reader of names from a file uses: ``CheckpointReader(..., follow_symlinks=False)``."""
    real = write(tmp_path / 'real.jckpt')
    link = tmp_path / 'link.jckpt'
    os.symlink(real, link)
    assert CheckpointReader(link).header.tensors  # a user's own path may be a link
    with pytest.raises(FormatError, match='symbolic link'):
        CheckpointReader(link, follow_symlinks=False)
    assert CheckpointReader(real, follow_symlinks=False).header.tensors


# --- checksums ----------------------------------------------------------------------------------

def test_a_damaged_payload_is_named(tmp_path):
    path = write(tmp_path / 'm.jckpt')
    r = CheckpointReader(path)
    a, b = r.header.tensors
    damage(path, r.data_start + b.offset + 1)
    r = CheckpointReader(path)  # opening reads no payload: the damage is not seen yet
    r.verify_entry(a)
    with pytest.raises(ChecksumError, match=f'checksum mismatch: stored {b.checksum[1]}') as info:
        r.verify_entry(b)
    assert info.value.entry == 'jckpt/b' and info.value.file == path
    with pytest.raises(ChecksumError):
        r.decode(b, verify=True)
    assert r.decode(b).tolist() != B.tolist()  # without verify the damaged bytes are returned
    bad = r.verify()
    assert len(bad) == 1 and bad[0].entry == 'jckpt/b'
    assert r.verify([a]) == []


def test_entries_without_a_known_checksum_are_not_compared(tmp_path):
    unknown = entry_text(id=1, offset=4, extra=' (checksum (md5 00112233445566778899aabbccddeeff))')
    path = tmp_path / 'plain.jckpt'
    path.write_bytes(raw_file(header_text(entry_text(id=0), unknown), b'\1\2\3\4\5\6\7\x08'))
    r = CheckpointReader(path)
    assert r.header.tensors[0].checksum is None and r.header.tensors[1].checksum[0] == 'md5'
    assert r.verify() == []


def test_a_checksum_in_capitals_matches(tmp_path):
    data = np.float32(3.0).tobytes()
    digest = payload_mod.checksum(data)[1].upper()
    path = tmp_path / 'upper.jckpt'
    path.write_bytes(raw_file(header_text(entry_text(extra=f' (checksum (xxh3_64 {digest}))')),
                              data))
    assert CheckpointReader(path).verify() == []


def test_ingestion_counts_add_up():
    counts = IngestionCounts()
    counts.add(2, 0)
    counts.add(1, 3)
    assert counts.snapshot() == {'mapped': 3, 'decoded': 3}


def every_kind_of_entry(path, alignment):
    """A file of entries of every shape a payload decodes to: mapped, copied and padded."""
    import dataclasses

    import ml_dtypes

    from jckpt.format.entries import Padding
    arrays = {'f32': A, 'i16': B, 'scalar': np.array(2.5), 'bf16': np.ones((2, 2), ml_dtypes.bfloat16),
              'bool': np.array([True, False, True]), 'c64': np.arange(3, dtype=np.complex64),
              'f64': np.arange(5.0), 'empty': np.zeros((0, 3), np.float32),
              'keys': np.arange(8, dtype=np.uint32).reshape(2, 4), 'pad': A}
    entries = []
    for i, (name, x) in enumerate(arrays.items()):
        e = entry_for('jckpt', (('k', name),), x.dtype, x.shape, id=i)
        if name == 'keys':  # 2 keys of 4 uint32 words
            e = dataclasses.replace(e, prec='Uint4x32_prec', dims=(2,), byte_length=32)
        if name == 'pad':  # a (2, 3) region inside (4, 4)
            e = dataclasses.replace(e, dims=(4, 4), padding=Padding(((1, 1), (0, 1)), -1.0))
        entries.append(e)
    header = lay_out(Header(tensors=tuple(entries), alignment=alignment))
    write_checkpoint(path, header, [ArraySource(x) for x in arrays.values()], durable=False)
    return str(path)


@pytest.mark.parametrize('mmap', [True, False])
@pytest.mark.parametrize('alignment', [1, 64])  # 1: most payloads misaligned, so copied
def test_decode_all_gives_what_decode_gives_each_entry(tmp_path, monkeypatch, mmap, alignment):
    from jckpt.storage import reader as reader_mod
    reader = CheckpointReader(every_kind_of_entry(tmp_path / 'k.jckpt', alignment))
    in_c = []
    if reader_mod.accelerator is not None:
        real = reader_mod.accelerator
        monkeypatch.setattr(reader_mod, 'accelerator', type('Spy', (), {'map_payloads': staticmethod(
            lambda *a: in_c.append(real.map_payloads(*a)) or in_c[-1])}))
    before = COUNTS.snapshot()
    together = reader.decode_all(reader.header.tensors, mmap=mmap, verify=True)
    middle = COUNTS.snapshot()
    one_by_one = [reader.decode(e, mmap=mmap, verify=True) for e in reader.header.tensors]
    after = COUNTS.snapshot()
    for e, x, y in zip(reader.header.tensors, together, one_by_one):
        assert (x.dtype, x.shape) == (y.dtype, y.shape) and np.array_equal(x, y), e.name
        assert x.flags.writeable == y.flags.writeable and x.flags.owndata == y.flags.owndata, e.name
    counted = {k: middle[k] - before[k] for k in before}
    assert counted == {k: after[k] - middle[k] for k in before}  # the same payloads mapped
    assert sum(counted.values()) == 10
    assert counted['mapped'] == (9 if mmap and alignment == 64 else 1 if mmap else 0)
    if reader_mod.accelerator is not None and mmap:  # C mapped all but the padded, empty and key ones
        assert in_c == [7 if alignment == 64 else 1]  # 1: the booleans, 1-byte elements


def test_a_partial_read_asks_the_kernel_for_exactly_its_payloads(tmp_path, monkeypatch):
    """A plan of some entries advises `MADV_WILLNEED` on their pages alone, in chunks the
    kernel reads whole, so its read-around does not read the neighbours; one of the whole
    file advises nothing and keeps the kernel's read-ahead."""
    from jckpt.storage import reader as reader_mod
    big = {n: np.full(300_000, i, np.float32) for i, n in enumerate('abcd')}  # 1.2 MB each
    r = CheckpointReader(write(tmp_path / 'x.jckpt', big))
    advised = []
    monkeypatch.setattr(reader_mod, '_advise', lambda m, start, n: advised.append((start, n)))
    a, c = r.header.tensors[0], r.header.tensors[2]
    r.advise([(c, None), (a, None)])
    out = r.decode_all([c, a])
    assert [x[0] for x in out] == [2, 0]
    page = reader_mod.mmap_mod.PAGESIZE
    for e in (a, c):
        lo = (r.data_start + e.offset) // page * page
        hi = -(-(r.data_start + e.offset + e.byte_length) // page) * page
        got = [(s, n) for s, n in advised if lo <= s < hi]
        assert got[0][0] == lo and sum(n for _, n in got) == hi - lo, (e, advised)
        assert all(n <= reader_mod.ADVISE_BYTES for _, n in got)
    assert sum(n for _, n in advised) < 2 * big['a'].nbytes + 4 * page  # b and d not advised
    advised.clear()
    r.advise([(e, None) for e in r.header.tensors])
    assert advised == []


def test_the_advice_stops_at_its_budget_the_first_ranges_first(monkeypatch):
    """Pages read ahead of their use must still be cached when they are touched: a restore
    of more than a quarter of the free memory is advised up to that much, the rest read as
    it is touched (advised whole, the first pages would be evicted before their use)."""
    from jckpt.storage import reader as reader_mod
    advised = []
    monkeypatch.setattr(reader_mod, '_advise', lambda m, start, n: advised.append((start, n)))
    monkeypatch.setattr(reader_mod, 'advice_budget', lambda: 5 << 20)
    reader_mod.advise_needed(None, [(0, 3 << 20), (8 << 20, 4 << 20), (16 << 20, 1 << 20)])
    assert advised == [(0, 2 << 20), (2 << 20, 1 << 20), (8 << 20, 2 << 20)]
    assert sum(n for _, n in advised) == 5 << 20


def test_a_plan_of_boxes_of_a_file_asks_for_their_rows_alone(tmp_path, monkeypatch):
    """A single file restored onto a mesh takes the directory's plan: the left half of every
    row of an array (rows of 256 KiB) is a range per row; a verified or copied read, whose
    payloads are read whole, plans them whole."""
    from jckpt.storage import reader as reader_mod
    big = {n: np.ones((16, 65536), np.float32) for n in 'ab'}
    r = CheckpointReader(write(tmp_path / 'x.jckpt', big))
    advised = []
    monkeypatch.setattr(reader_mod, '_advise', lambda m, start, n: advised.append((start, n)))
    a = r.header.tensors[0]
    r.advise([(a, [((0, 16), (0, 32768))])])
    page = reader_mod.mmap_mod.PAGESIZE
    start = r.data_start + a.offset
    assert advised == [((start + row * 262144) // page * page, 131072 + page * bool(start % page))
                       for row in range(16)]
    for how in ({'verify': True}, {'mmap': False}):
        advised.clear()
        r.advise([(a, [((0, 16), (0, 32768))])], **how)
        assert sum(n for _, n in advised) == pytest.approx(a.byte_length, abs=2 * page), how
