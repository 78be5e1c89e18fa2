"""``jckpt.storage.writer``: the header, then payloads streamed and hashed, then checksums patched in."""

import dataclasses
import errno
import itertools
import os
from pathlib import Path

import numpy as np
import pytest

from jckpt.errors import CheckpointError, InputError, StorageError
from jckpt.format import payload as payload_mod
from jckpt.format.entries import entry_for
from jckpt.format.header import Header, decode_header, encode_header
from jckpt.format.layout import lay_out
from jckpt.storage import writer
from jckpt.storage.reader import CheckpointReader
from jckpt.storage.writer import (
    SMALL_PAYLOAD,
    ArraySource,
    CopySource,
    Sink,
    _evolve,
    pad_for_aliasing,
    with_placeholders,
    write_checkpoint,
)

PLACEHOLDER = payload_mod.CHECKSUM_PLACEHOLDER


def header_of(arrays, alignment=32):
    return lay_out(Header(tensors=tuple(
        entry_for('jckpt', (('k', name),), x.dtype, x.shape, id=i)
        for i, (name, x) in enumerate(arrays.items())), alignment=alignment))


def write(path, arrays, **kwargs):
    return write_checkpoint(path, header_of(arrays), [ArraySource(x) for x in arrays.values()],
                            durable=False, **kwargs)


@pytest.fixture
def fd(tmp_path):
    fd = os.open(tmp_path / 'out', os.O_RDWR | os.O_CREAT)
    yield fd
    os.close(fd)


def on_disk(fd):
    return os.pread(fd, 1 << 24, 0)


# --- Sink -----------------------------------------------------------------------------------------

def test_sink_gathers_small_writes_until_flushed(fd):
    sink = Sink(fd)
    sink.write(b'abc')
    sink.write(np.arange(3, dtype=np.uint8))
    assert sink.position == 6 and on_disk(fd) == b''  # gathered, not written yet
    sink.flush()
    assert on_disk(fd) == b'abc\0\1\2'
    sink.flush()  # nothing gathered: nothing to do
    assert on_disk(fd) == b'abc\0\1\2'


def test_reading_the_descriptor_flushes_first(fd):
    sink = Sink(fd)
    sink.write(b'head')
    os.write(sink.fd, b'+direct')  # code writing to the descriptor finds earlier bytes in place
    assert on_disk(fd) == b'head+direct'


def test_a_large_write_goes_straight_after_what_was_gathered(fd):
    sink = Sink(fd, position=100)  # the position is a count; the descriptor's offset is used
    big = np.full(Sink.SMALL_WRITE, 7, np.uint8)
    sink.write(b'xy')
    sink.write(big)
    assert sink.position == 102 + big.nbytes
    assert on_disk(fd) == b'xy' + big.tobytes()


def test_the_gathered_buffer_is_written_when_full(fd):
    sink = Sink(fd)
    chunk = b'z' * (Sink.SMALL_WRITE - 1)
    n = Sink.BUFFER_BYTES // len(chunk) + 1
    for _ in range(n):
        sink.write(chunk)
    assert len(on_disk(fd)) == n * len(chunk) == sink.position  # written without a flush


def test_pad_to_writes_zeros_forward_only(fd):
    sink = Sink(fd)
    sink.write(b'a')
    sink.pad_to(4)
    sink.pad_to(2)  # behind the position: nothing
    sink.flush()
    assert sink.position == 4 and on_disk(fd) == b'a\0\0\0'



def test_put_small_pads_and_gathers_by_reference_in_writev_batches(fd, monkeypatch):
    calls = []
    real = os.writev
    monkeypatch.setattr(os, 'writev', lambda f, bufs: (calls.append(len(bufs)), real(f, bufs))[1])
    sink = Sink(fd)
    payloads = [np.full(3, i % 200, np.uint8) for i in range(Sink.IOV_MAX)]
    for i, data in enumerate(payloads):
        sink.put_small(4 * i, data)  # one zero byte of padding before each but the first
    payloads[-1][:] = 9  # gathered by reference: what is written is the buffer at flush time
    sink.flush()
    assert calls == [Sink.IOV_MAX, Sink.IOV_MAX - 1]  # never more buffers than one call takes
    expected = b''.join(bytes([i % 200] * 3) + b'\0' for i in range(Sink.IOV_MAX - 1)) + b'\t' * 3
    assert on_disk(fd) == expected and sink.position == len(expected)


def test_a_short_writev_writes_the_rest(fd, monkeypatch):
    real = os.writev
    monkeypatch.setattr(os, 'writev', lambda f, bufs: real(f, [b''.join(map(bytes, bufs))[:5]]))
    sink = Sink(fd)
    sink.write(b'abc')
    sink.put_small(7, b'defgh')
    sink.put_small(12, np.frombuffer(b'ij', np.uint8))
    sink.flush()
    assert on_disk(fd) == b'abc\0\0\0\0defghij' and sink.position == 14


def test_code_writing_through_the_descriptor_moves_the_position_on(fd):
    sink = Sink(fd)
    sink.write(b'ab')
    os.write(sink.fd, b'cd')  # as a sharded payload writes its pieces in place
    sink.position += 2
    sink.write(b'e')
    sink.flush()
    assert on_disk(fd) == b'abcde' and sink.position == 5


def mixed_payloads():
    """Small payloads (their sources made as a save makes them) between larger and odd ones."""
    rng = np.random.default_rng(0)
    arrays = {f's{i}': rng.random(i % 7 + 1, dtype=np.float32) for i in range(40)}
    arrays['big'] = rng.random(SMALL_PAYLOAD, dtype=np.float32)
    arrays['be'] = np.arange(6, dtype='>i4')  # converted on the way: not a ready byte view
    arrays |= {f't{i}': rng.integers(0, 9, i + 1, dtype=np.int8) for i in range(40)}
    return arrays


@pytest.mark.parametrize('batch', [(3, 64), (7, 1 << 20), (1024, 1 << 20)])
@pytest.mark.skipif(writer.accelerator is None, reason='the C accelerator is not built')
def test_payloads_gathered_in_c_make_the_same_file(tmp_path, monkeypatch, batch):
    """Runs of small payloads gathered by C, in batches of at most IOV_MAX buffers and
    BUFFER_BYTES bytes, write exactly the file the Python path writes."""
    arrays = mixed_payloads()
    header = header_of(arrays, alignment=16)
    sources = [writer.array_source(x)[0] for x in arrays.values()]
    monkeypatch.setattr(Sink, 'IOV_MAX', batch[0])
    monkeypatch.setattr(Sink, 'BUFFER_BYTES', batch[1])
    calls = []
    real = writer.accelerator.gather_payloads
    monkeypatch.setattr(writer.accelerator, 'gather_payloads', lambda *a: calls.append(1) or real(*a))
    fast = write_checkpoint(tmp_path / 'c.jckpt', header, sources, durable=False)
    assert calls
    monkeypatch.setattr(writer, 'accelerator', None)
    slow = write_checkpoint(tmp_path / 'py.jckpt', header, sources, durable=False)
    assert fast == slow
    assert (tmp_path / 'c.jckpt').read_bytes() == (tmp_path / 'py.jckpt').read_bytes()
    reader = CheckpointReader(tmp_path / 'c.jckpt')
    assert reader.verify() == []
    assert all(np.array_equal(reader.decode(e), x) for e, x in zip(fast.tensors, arrays.values()))

# --- sources --------------------------------------------------------------------------------------

@pytest.mark.parametrize('array', [
    np.arange(5, dtype=np.float32),                                   # small, stored form
    np.arange(SMALL_PAYLOAD, dtype=np.int32),                         # large, streamed in chunks
    np.arange(12, dtype='>i4').reshape(3, 4),                         # big-endian: converted
    np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),  # not C order: converted
    np.float64(2.5),                                                  # a scalar
], ids=['small', 'large', 'big-endian', 'fortran', 'scalar'])
def test_array_source_writes_the_stored_bytes_and_their_checksum(fd, array):
    sink = Sink(fd)
    checksum = ArraySource(array).write(sink)
    sink.flush()
    expected = np.ascontiguousarray(array).astype(array.dtype.newbyteorder('<')).tobytes()
    assert on_disk(fd) == expected and sink.position == len(expected)
    assert checksum == payload_mod.checksum(expected)


@pytest.fixture
def source_file(tmp_path):
    path = tmp_path / 'source'
    path.write_bytes(b'0123456789' * 10)
    fd = os.open(path, os.O_RDONLY)
    yield fd
    os.close(fd)


def test_copy_source_keeps_the_payload_and_its_checksum(fd, source_file):
    sink = Sink(fd)
    sink.write(b'hd')  # gathered: the copy must land after it
    kept = ('xxh3_64', 'feedfacefeedface')
    assert CopySource(source_file, 15, 30, kept).write(sink) == kept  # not recomputed
    sink.write(b'!')
    sink.flush()
    assert on_disk(fd) == b'hd' + (b'0123456789' * 10)[15:45] + b'!'
    assert sink.position == 33


def test_copy_source_without_a_checksum_computes_one(fd, source_file):
    sink = Sink(fd)
    checksum = CopySource(source_file, 3, 50, None).write(sink)
    sink.flush()
    assert on_disk(fd) == (b'0123456789' * 10)[3:53]
    assert checksum == payload_mod.checksum((b'0123456789' * 10)[3:53])


@pytest.mark.parametrize('checksum', [None, ('xxh3_64', '0123456789abcdef')])
def test_copy_source_past_the_end_of_its_file_is_a_storage_error(fd, source_file, checksum):
    with pytest.raises(StorageError, match='source file ended early while copying a kept payload'):
        CopySource(source_file, 90, 20, checksum).write(Sink(fd))


# --- the header -----------------------------------------------------------------------------------

def test_with_placeholders_fills_only_missing_checksums():
    header = header_of({'a': np.ones(2, np.float32), 'b': np.ones(3, np.int8)})
    kept = ('xxh3_64', 'aaaaaaaaaaaaaaaa')
    header = dataclasses.replace(header, tensors=(header.tensors[0],
                                                  _evolve(header.tensors[1], checksum=kept)))
    a, b = with_placeholders(header).tensors
    assert a.checksum == PLACEHOLDER and b.checksum == kept
    assert dataclasses.replace(a, checksum=None) == header.tensors[0]


def test_evolve_is_dataclasses_replace():
    e = entry_for('jckpt', (('k', 'w'),), np.dtype(np.float32), (2, 3), id=4)
    assert _evolve(e, offset=64, checksum=PLACEHOLDER) == dataclasses.replace(
        e, offset=64, checksum=PLACEHOLDER)
    assert e.offset == 0 and e.checksum is None  # the original is untouched


def test_pad_for_aliasing_puts_the_largest_payload_on_64_bytes():
    arrays = {'big': np.zeros(1000, np.float32), 'small': np.zeros(3, np.int8)}
    for name in ('', 'x' * 16, 'y' * 32):  # headers of various lengths
        header = with_placeholders(header_of({f'big{name}': arrays['big'],
                                              'small': arrays['small']}))
        raw = encode_header(header)
        padded = pad_for_aliasing(raw, header)
        assert len(padded) % 32 == 0 and len(padded) - len(raw) in (0, 32)
        assert (len(padded) + header.tensors[0].offset) % 64 == 0
        assert decode_header(padded) == decode_header(raw)  # the same header, with spaces


def test_pad_for_aliasing_leaves_other_alignments_alone():
    for alignment in (1, 8, 64, 4096):
        header = with_placeholders(header_of({'w': np.zeros(4, np.float32)}, alignment=alignment))
        raw = encode_header(header)
        assert pad_for_aliasing(raw, header) is raw
    empty = Header(tensors=(), alignment=32)
    assert pad_for_aliasing(encode_header(empty), empty) == encode_header(empty)


# --- write_checkpoint ---------------------------------------------------------------------------------

def test_write_checkpoint_patches_the_checksums_into_the_header(tmp_path):
    arrays = {'a': np.arange(6, dtype=np.float32).reshape(2, 3), 'b': np.array([1, 2], np.int16)}
    path = str(tmp_path / 'm.jckpt')
    written = write(path, arrays)
    raw = Path(path).read_bytes()
    assert PLACEHOLDER[1].encode() not in raw
    r = CheckpointReader(path)
    assert r.header.tensors == written.tensors
    for e, x in zip(r.header.tensors, arrays.values()):
        assert e.checksum == payload_mod.checksum(x.tobytes())
        assert bytes(r.payload_bytes(e)) == x.tobytes()
    assert r.data_start % 32 == 0
    assert r.verify() == []


def test_kept_checksums_are_written_as_given(tmp_path):
    x = np.arange(4, dtype=np.int32)
    src = tmp_path / 'src.jckpt'
    write(src, {'x': x})
    old = CheckpointReader(src)
    e = old.header.tensors[0]
    fd = os.open(src, os.O_RDONLY)
    try:
        header = lay_out(Header(tensors=(e,), alignment=128))
        written = write_checkpoint(tmp_path / 'copy.jckpt', header,
                                   [CopySource(fd, old.data_start + e.offset, e.byte_length,
                                               e.checksum)], durable=False)
    finally:
        os.close(fd)
    assert written.tensors[0].checksum == e.checksum
    r = CheckpointReader(tmp_path / 'copy.jckpt')
    assert r.header.alignment == 128 and r.decode(r.header.tensors[0]).tolist() == [0, 1, 2, 3]
    assert r.verify() == []


def test_write_checkpoint_publishes_atomically(tmp_path):
    path = str(tmp_path / 'm.jckpt')
    write(path, {'w': np.zeros(3, np.float32)})
    old = Path(path).read_bytes()
    seen = []

    def during(entry):
        seen.append((entry.name, Path(path).read_bytes() == old, len(os.listdir(tmp_path))))

    write(path, {'w': np.ones(3, np.float32), 'v': np.ones(2, np.int8)}, on_payload=during)
    assert seen == [('jckpt/w', True, 2), ('jckpt/v', True, 2)]  # the old file, and a staging file
    assert os.listdir(tmp_path) == ['m.jckpt']
    r = CheckpointReader(path)
    assert r.decode(r.header.tensors[0]).tolist() == [1.0, 1.0, 1.0]


def test_a_source_writing_the_wrong_byte_count_publishes_nothing(tmp_path):
    path = str(tmp_path / 'm.jckpt')
    header = header_of({'w': np.zeros(4, np.float32)})
    with pytest.raises(StorageError, match='wrote 12 bytes for an entry of 16') as info:
        write_checkpoint(path, header, [ArraySource(np.zeros(3, np.float32))], durable=False)
    assert info.value.file == path and info.value.entry == 'jckpt/w'
    assert os.listdir(tmp_path) == []
    write(path, {'w': np.zeros(4, np.float32)})
    before = Path(path).read_bytes()
    with pytest.raises(StorageError):
        write_checkpoint(path, header, [ArraySource(np.zeros(5, np.float32))], durable=False)
    assert Path(path).read_bytes() == before and os.listdir(tmp_path) == ['m.jckpt']


def test_fewer_sources_than_entries_is_refused(tmp_path):
    path = tmp_path / 'm.jckpt'
    header = header_of({'a': np.zeros(4, np.float32), 'b': np.zeros(4, np.float32)})
    with pytest.raises(CheckpointError):
        write_checkpoint(path, header, [ArraySource(np.zeros(4, np.float32))], durable=False)
    assert not path.exists()


@pytest.mark.parametrize('namespace', ['ns.2', '9lives', '', 'a b'])
def test_a_namespace_readers_refuse_is_refused_before_any_write(tmp_path, namespace):
    """The writer published `ns.2`, which every reader then refused; it checks the namespace
    as `save`'s `Context` does, and writes nothing."""
    path = tmp_path / 'm.jckpt'
    good = entry_for('ok', (('k', 'a'),), np.float32, (1,), id=0)
    bad = entry_for('ok', (('k', 'b'),), np.float32, (1,), id=1)
    header = lay_out(Header(tensors=(good, dataclasses.replace(bad, namespace=namespace))))
    with pytest.raises(InputError, match=f"invalid namespace '{namespace}'") as e:
        write_checkpoint(path, header, [ArraySource(np.ones(1, np.float32))] * 2, durable=False)
    assert (e.value.file, e.value.entry) == (str(path), f'{namespace}/b')
    assert 'letters, digits and underscores' in e.value.fix and os.listdir(tmp_path) == []


def test_an_empty_checkpoint(tmp_path):
    path = tmp_path / 'empty.jckpt'
    written = write_checkpoint(path, Header(tensors=()), [], durable=True)
    assert written.tensors == () and CheckpointReader(path).header.tensors == ()


def test_a_url_is_refused_before_any_work(tmp_path):
    with pytest.raises(InputError, match='no storage backend'):
        write_checkpoint('nosuch://bucket/m.jckpt', Header(), [])


def test_a_missing_directory_is_a_storage_error(tmp_path):
    path = str(tmp_path / 'missing' / 'm.jckpt')
    with pytest.raises(StorageError) as info:
        write(path, {'w': np.zeros(2, np.float32)})
    assert info.value.errno == errno.ENOENT and info.value.file == path


@pytest.mark.parametrize('small', [True, False])
def test_a_header_whose_checksums_are_all_known_is_written_once(tmp_path, monkeypatch, small):
    arrays = {'a': np.arange(4, dtype=np.float32), 'b': np.ones((2, 3), np.int16)}
    sources = [writer.array_source(x)[0] if small else ArraySource(x) for x in arrays.values()]
    header = header_of(arrays)
    if small:  # a save's small payloads: hashed, and their entries carry the checksum
        header = dataclasses.replace(header, tensors=tuple(
            _evolve(e, checksum=s.checksum) for e, s in zip(header.tensors, sources)))
    patches = []
    real = os.pwrite
    monkeypatch.setattr(os, 'pwrite', lambda fd, data, at: patches.append(at) or real(fd, data, at))
    written = write_checkpoint(tmp_path / 'o.jckpt', header, sources, durable=False)
    assert patches == ([] if small else [0])  # checksums known before: no patch afterwards
    reader = CheckpointReader(tmp_path / 'o.jckpt')
    assert reader.header.tensors == written.tensors and reader.verify() == []
    assert all(e.checksum is not None for e in written.tensors)


@pytest.mark.parametrize('durable', [True, False])
def test_a_durable_write_starts_the_disk_behind_each_mib(tmp_path, monkeypatch, durable):
    kicks = []
    monkeypatch.setattr(writer, 'start_writeback', lambda fd, at, n: kicks.append((at, n)))
    arrays = {f's{i}': np.full(1000, i, np.float32) for i in range(600)}  # 2.4 MB, gathered
    arrays['big'] = np.arange(1 << 19, dtype=np.float32)  # 2 MiB, written straight
    header = header_of(arrays)
    sources = [writer.array_source(x)[0] for x in arrays.values()]
    write_checkpoint(tmp_path / 'w.jckpt', header, sources, durable=durable)
    if not durable:
        assert kicks == []
        return
    assert len(kicks) >= 3 and kicks[0][0] == 0 and all(n >= Sink.BUFFER_BYTES for _, n in kicks)
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(kicks))  # back to back, in order
    assert kicks[-1][0] + kicks[-1][1] <= (tmp_path / 'w.jckpt').stat().st_size
    assert CheckpointReader(tmp_path / 'w.jckpt').verify() == []


def test_a_file_laid_out_at_an_odd_alignment_still_reads(tmp_path):
    # writers refuse alignment=3 (check_alignment), but the format allows it: OCANNL may write it
    arrays = {'a': np.arange(5, dtype=np.uint8), 'b': np.arange(3.0)}
    path = str(tmp_path / 'odd.jckpt')
    header = header_of(arrays, alignment=3)
    assert [e.offset for e in header.tensors] == [0, 6]
    write_checkpoint(path, header, [ArraySource(x) for x in arrays.values()], durable=False)
    reader = CheckpointReader(path)
    assert reader.header.alignment == 3 and reader.verify() == []
    assert all(np.array_equal(reader.decode(e), x) for e, x in zip(reader.header.tensors, arrays.values()))
