"""Zip archives for the adapters (jckpt.adapters._zip): members found in place, aligned writes, refusals."""

import struct
import zipfile

import numpy as np
import pytest

from jckpt.adapters._common import map_file
from jckpt.adapters._zip import (
    ALIGNMENT,
    ZIP_END,
    Budget,
    member_bytes,
    member_head,
    member_span,
    open_zip,
    write_member,
)
from jckpt.errors import FormatError
from jckpt.format.sniff import ZIP_LOCAL, foreign_kind

DATA = bytes(range(256)) * 4

#: Offsets of fields in a local header (PK\3\4) and a central directory entry (PK\1\2).
LOCAL_FLAGS, LOCAL_CRC = 6, 14
CENTRAL_FLAGS, CENTRAL_CRC, CENTRAL_COMPRESSED = 8, 16, 20


def archive(path, members, compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, 'w', compression=compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return str(path)


def test_the_signatures_are_those_zipfile_writes(tmp_path):
    """One spelling of a zip's first bytes serves the codec's and the adapters' sniffers."""
    whole, empty = archive(tmp_path / 'a.zip', {'x': b'1'}), archive(tmp_path / 'e.zip', {})
    assert open(whole, 'rb').read(4) == ZIP_LOCAL and open(empty, 'rb').read(4) == ZIP_END
    assert 'zip archive' in foreign_kind(ZIP_LOCAL)


def patch(path, signature, offset, change):
    """Apply ``change(old bytes) -> new bytes`` to a 4-byte field of the first record ``signature``."""
    data = bytearray(open(path, 'rb').read())
    at = data.find(signature) + offset
    data[at:at + 4] = change(bytes(data[at:at + 4]))
    with open(path, 'wb') as f:
        f.write(data)


def set_flag(path, bit):
    def on(old):
        return bytes([old[0] | bit]) + old[1:]

    patch(path, b'PK\x01\x02', CENTRAL_FLAGS, on)
    patch(path, b'PK\x03\x04', LOCAL_FLAGS, on)


def read_member(path, name='a.bin'):
    zf = open_zip(path)
    return member_bytes(zf, map_file(path), zf.getinfo(name), path)


# --- reading -----------------------------------------------------------------------------------

def test_a_stored_member_is_a_view_of_the_archive(tmp_path):
    path = archive(tmp_path / 's.zip', {'x/first': b'abc', 'a.bin': DATA})
    zf = open_zip(path)
    buffer = map_file(path)
    info = zf.getinfo('a.bin')
    start, length = member_span(buffer, info, path)
    assert length == len(DATA) and bytes(buffer[start:start + length]) == DATA
    view = member_bytes(zf, buffer, info, path)
    assert isinstance(view, memoryview) and bytes(view) == DATA
    assert np.shares_memory(np.frombuffer(view, np.uint8), np.frombuffer(buffer, np.uint8))


@pytest.mark.parametrize('compression', [zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_a_compressed_member_is_decompressed(tmp_path, compression):
    path = archive(tmp_path / 'd.zip', {'a.bin': DATA}, compression)
    out = read_member(path)
    assert isinstance(out, (bytes, bytearray)) and out == DATA  # a copy, not a view


def test_a_compressed_member_with_a_bad_crc_is_refused(tmp_path):
    path = archive(tmp_path / 'd.zip', {'a.bin': DATA}, zipfile.ZIP_DEFLATED)

    def flip(old):
        return bytes(b ^ 0xFF for b in old)

    patch(path, b'PK\x01\x02', CENTRAL_CRC, flip)
    patch(path, b'PK\x03\x04', LOCAL_CRC, flip)
    with pytest.raises(FormatError, match=r"archive member 'a.bin' cannot be read \(Bad CRC") as e:
        read_member(path)
    assert e.value.file == path and 'damaged' in e.value.fix


def test_a_damaged_compressed_stream_is_refused(tmp_path):
    path = archive(tmp_path / 'd.zip', {'a.bin': DATA}, zipfile.ZIP_DEFLATED)
    zf = open_zip(path)
    start, length = member_span(map_file(path), zf.getinfo('a.bin'), path)
    data = bytearray(open(path, 'rb').read())
    data[start:start + length] = b'\xff' * length
    with open(path, 'wb') as f:
        f.write(data)
    with pytest.raises(FormatError, match="archive member 'a.bin' cannot be read"):
        read_member(path)


def test_an_encrypted_compressed_member_is_refused(tmp_path):
    path = archive(tmp_path / 'd.zip', {'a.bin': DATA}, zipfile.ZIP_DEFLATED)
    set_flag(path, 0x01)
    with pytest.raises(FormatError):
        read_member(path)


def test_an_encrypted_stored_member_is_refused(tmp_path):
    path = archive(tmp_path / 's.zip', {'a.bin': DATA})
    set_flag(path, 0x01)
    with pytest.raises(FormatError):
        read_member(path)


def test_a_member_whose_local_header_is_gone_is_refused(tmp_path):
    path = archive(tmp_path / 's.zip', {'a.bin': DATA})
    patch(path, b'PK\x03\x04', 0, lambda old: b'XXXX')
    zf = zipfile.ZipFile(path)  # the central directory still lists it
    with pytest.raises(FormatError, match="archive member 'a.bin' has no local header") as e:
        member_bytes(zf, map_file(path), zf.getinfo('a.bin'), path)
    assert e.value.file == path


def test_a_member_named_otherwise_in_its_local_header_is_refused(tmp_path):
    """No checksum covers names: a damaged directory entry must not rename a member's data."""
    path = archive(tmp_path / 's.npz', {'w.npy': b'w', 's.npy': DATA})
    data = bytearray(open(path, 'rb').read())
    at = data.find(b's.npy', data.find(b'PK\x01\x02'))  # the central directory's copy
    data[at] = ord('t')
    open(path, 'wb').write(data)
    zf = open_zip(path)
    assert read_member(path, 'w.npy').tobytes() == b'w'
    with pytest.raises(FormatError, match="member 't.npy' is named 's.npy' in its local header"):
        member_bytes(zf, map_file(path), zf.getinfo('t.npy'), path)
    import jckpt.adapters
    npz = str(tmp_path / 'arrays.npz')
    np.savez(npz, w=np.ones(3), s=np.arange(4))
    data = bytearray(open(npz, 'rb').read())
    data[data.find(b's.npy', data.find(b'PK\x01\x02'))] = ord('t')
    open(npz, 'wb').write(data)
    with pytest.raises(FormatError, match="'t.npy' is named 's.npy' in its local header"):
        jckpt.adapters.read(npz)


def test_a_member_past_the_end_is_refused(tmp_path):
    path = archive(tmp_path / 's.zip', {'a.bin': DATA})
    zf = open_zip(path)
    info = zf.getinfo('a.bin')
    buffer = map_file(path)
    info.compress_size = len(buffer)
    with pytest.raises(FormatError, match="'a.bin' extends past the end of the file"):
        member_span(buffer, info, path)
    info.header_offset = len(buffer) - 10
    with pytest.raises(FormatError, match="'a.bin' lies past the end of the file"):
        member_span(buffer, info, path)
    info.header_offset = -1
    with pytest.raises(FormatError, match='lies past the end'):
        member_span(buffer, info, path)


# --- opening -----------------------------------------------------------------------------------

@pytest.mark.parametrize('data', [b'', b'not a zip archive at all', b'PK\x05\x06' + b'\0' * 10])
def test_what_is_not_a_zip_archive_is_refused(tmp_path, data):
    path = tmp_path / 'x.zip'
    path.write_bytes(data)
    with pytest.raises(FormatError, match='not a readable zip archive') as e:
        open_zip(str(path))
    assert e.value.file == str(path) and 'truncated or damaged' in e.value.fix


def test_a_truncated_archive_is_refused(tmp_path):
    path = archive(tmp_path / 's.zip', {'a.bin': DATA, 'b.bin': DATA})
    data = open(path, 'rb').read()
    with open(path, 'wb') as f:
        f.write(data[:len(data) - 30])
    with pytest.raises(FormatError, match='not a readable zip archive'):
        open_zip(path)


def test_a_missing_archive_is_refused(tmp_path):
    with pytest.raises(FormatError, match='not a readable zip archive'):
        open_zip(str(tmp_path / 'missing.zip'))


@pytest.mark.parametrize('name', ['../evil', 'a/../../evil', '/abs/path', 'C:/windows', ''])
def test_an_archive_with_an_unsafe_member_name_is_refused(tmp_path, name):
    """An empty name (a crafted name length of 0) passed, then failed inside `zipfile`'s
    `ZipInfo.is_dir` or `repr` with an IndexError in whichever reader met it first."""
    path = tmp_path / 'evil.zip'
    with zipfile.ZipFile(path, 'w') as zf:
        zf.writestr('fine', b'x')
        zf.writestr(zipfile.ZipInfo(name), b'y')
    assert zipfile.ZipFile(path).namelist() == ['fine', name]  # zipfile writes it as given
    with pytest.raises(FormatError, match='unsafe|escapes') as e:
        open_zip(str(path))
    assert e.value.file == str(path)


# --- writing -----------------------------------------------------------------------------------

def test_written_members_are_stored_aligned_and_readable(tmp_path):
    path = tmp_path / 'w.zip'
    parts = {'archive/data/0': [np.arange(10, dtype=np.float32)],
             'archive/version': [b'3\n'],
             'archive/data/1': [np.arange(5, dtype=np.int64), memoryview(b'tail')]}
    with zipfile.ZipFile(path, 'w') as zf:
        for name, chunks in parts.items():
            write_member(zf, name, chunks, sum(memoryview(c).nbytes for c in chunks))
    zf = zipfile.ZipFile(path)
    assert zf.testzip() is None  # every CRC holds
    buffer = map_file(str(path))
    for name, chunks in parts.items():
        info = zf.getinfo(name)
        assert info.compress_type == zipfile.ZIP_STORED and info.date_time == (1980, 1, 1, 0, 0, 0)
        start, length = member_span(buffer, info, str(path))
        assert start % ALIGNMENT == 0
        assert bytes(buffer[start:start + length]) == b''.join(bytes(memoryview(c)) for c in chunks)
        assert zf.read(name) == bytes(buffer[start:start + length])


def test_the_padding_is_torch_saves_record(tmp_path):
    path = tmp_path / 'w.zip'
    with zipfile.ZipFile(path, 'w') as zf:
        write_member(zf, 'x', [b'abc'], 3)
    extra = zipfile.ZipFile(path).getinfo('x').extra
    tag, size = struct.unpack_from('<HH', extra)
    assert tag == 0x4246 and size == len(extra) - 4 and set(extra[4:]) <= {ord('Z')}


def test_a_size_other_than_what_the_chunks_hold_is_refused(tmp_path):
    with zipfile.ZipFile(tmp_path / 'w.zip', 'w') as zf:
        with pytest.raises(FormatError, match="wrote 3 bytes for member 'x' of 5"):
            write_member(zf, 'x', [b'abc'], 5)
        with pytest.raises(FormatError, match="wrote 8 bytes for member 'y' of 4"):
            write_member(zf, 'y', [np.zeros(2, np.float32)], 4)


# --- bounded decompression ---------------------------------------------------------------------

def members_of(path):
    buffer = map_file(path)
    zf = open_zip(path)
    return zf, buffer, {i.filename: i for i in zf.infolist()}


@pytest.mark.parametrize('compression', [zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_a_member_is_decompressed_no_further_than_its_limit(tmp_path, compression):
    path = archive(tmp_path / 'd.zip', {'a.bin': bytes(1 << 20)}, compression)
    zf, buffer, infos = members_of(path)
    assert member_bytes(zf, buffer, infos['a.bin'], path, limit=1 << 20) == bytes(1 << 20)
    with pytest.raises(FormatError, match="decompresses to more than the 1000 bytes it may hold"):
        member_bytes(zf, buffer, infos['a.bin'], path, limit=1000)
    assert bytes(member_head(buffer, infos['a.bin'], path, 10)) == bytes(10)


def test_the_members_of_an_archive_share_one_budget(tmp_path):
    path = archive(tmp_path / 'd.zip', {'a.bin': bytes(3 << 20), 'b.bin': bytes(3 << 20)},
                   zipfile.ZIP_DEFLATED)
    zf, buffer, infos = members_of(path)
    budget = Budget(len(buffer))
    budget.left = 5 << 20  # what about 4.6 KB of archive may hold at 1100 to 1, plus 1 MiB
    member_bytes(zf, buffer, infos['a.bin'], path, budget=budget)
    with pytest.raises(FormatError, match="past what the archive may hold"):
        member_bytes(zf, buffer, infos['b.bin'], path, budget=budget)


def test_an_unknown_compression_method_is_refused(tmp_path):
    path = archive(tmp_path / 'd.zip', {'a.bin': DATA}, zipfile.ZIP_DEFLATED)
    data = bytearray(open(path, 'rb').read())
    for signature, at in ((b'PK\x03\x04', 8), (b'PK\x01\x02', 10)):
        struct.pack_into('<H', data, data.find(signature) + at, 99)
    open(path, 'wb').write(data)
    zf, buffer, infos = members_of(path)
    with pytest.raises(FormatError, match="compression method"):
        member_bytes(zf, buffer, infos['a.bin'], path)


def test_an_lzma_member_claiming_a_huge_dictionary_reads_with_one_its_output_needs(tmp_path,
                                                                                  monkeypatch):
    """A 4 GiB dictionary size from the file was allocated (MemoryError under a memory limit)."""
    import io
    import lzma

    from jckpt import adapters
    buf = io.BytesIO()
    np.save(buf, np.arange(2000, dtype=np.float32))
    path = tmp_path / 'l.npz'
    with zipfile.ZipFile(path, 'w', zipfile.ZIP_LZMA) as zf:
        zf.writestr('a.npy', buf.getvalue())
    raw = bytearray(path.read_bytes())
    at = raw.index(b'\x05\x00', 30)  # the properties' size, then lc/lp/pb and the dictionary size
    raw[at + 3:at + 7] = b'\xff\xff\xff\xff'
    path.write_bytes(bytes(raw))
    asked = []
    real = lzma.LZMADecompressor

    def recording(format, filters):
        asked.append(filters[0]['dict_size'])
        return real(format, filters=filters)
    monkeypatch.setattr(lzma, 'LZMADecompressor', recording)
    assert adapters.read(path)['jckpt']['a'][-1] == 1999
    assert asked and max(asked) <= max(4096, len(buf.getvalue()))
