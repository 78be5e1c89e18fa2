"""Zip archives for the adapters: member data located for zero-copy reads, aligned writes.

Readers map the archive and view a stored (uncompressed) member's bytes in
place; writers store members uncompressed with their data aligned to 64
bytes (padding in the local header's extra field, as `torch.save` does), so
they can be mapped in turn.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from collections.abc import Iterable
from typing import Any

from jckpt.adapters._common import check_member_name
from jckpt.errors import FormatError
from jckpt.storage.backend import backend_for, is_url

ALIGNMENT = 64
#: What reading a damaged member raises: zipfile's own errors and its decompressors'.
_READ_ERRORS: tuple[type[BaseException], ...] = (
    zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, zlib.error)
try:
    import lzma

    _READ_ERRORS += (lzma.LZMAError,)
except ImportError:  # pragma: no cover - Python built without lzma
    pass
_LOCAL_HEADER = struct.Struct('<4sHHHHHIIIHH')
_PAD_ID = 0x4246  # 'FB': the padding record torch.save uses


def zip_source(path: str, buffer: Any = None) -> Any:
    """What `zipfile.ZipFile` reads `path` from: the local path, or an object's bytes in memory."""
    if not is_url(path):
        return path
    return io.BytesIO(buffer if buffer is not None else backend_for(path).map(path))


def open_zip(path: str, buffer: Any = None) -> zipfile.ZipFile:
    """Open `path` as a zip archive; `FormatError` if it is not one or is truncated,
    or if a member name could escape a directory. A URL's `buffer` (its bytes) is read
    again from the store when not given."""
    try:
        zf = zipfile.ZipFile(zip_source(path, buffer))
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError,
            struct.error) as e:
        raise FormatError(f"not a readable zip archive ({e})", file=path,
                          fix="the file is truncated or damaged") from None
    for info in zf.infolist():
        check_member_name(info.filename, path)
    return zf


def member_span(buffer, info: zipfile.ZipInfo, file: str) -> tuple[int, int]:
    """`(start, length)` of a member's stored bytes inside the archive `buffer`."""
    at = info.header_offset
    if at < 0 or at + _LOCAL_HEADER.size > len(buffer):
        raise FormatError(f"archive member {info.filename!r} lies past the end of the file",
                          file=file, fix="the file is truncated or damaged")
    fields = _LOCAL_HEADER.unpack_from(buffer, at)
    if fields[0] != b'PK\x03\x04':
        raise FormatError(f"archive member {info.filename!r} has no local header", file=file,
                          fix="the file is damaged")
    start = at + _LOCAL_HEADER.size + fields[9] + fields[10]
    if start + info.compress_size > len(buffer):
        raise FormatError(f"archive member {info.filename!r} extends past the end of the file",
                          file=file, fix="the file is truncated")
    return start, info.compress_size


def member_bytes(zf: zipfile.ZipFile, buffer, info: zipfile.ZipInfo, file: str):
    """A member's content: a zero-copy memoryview when stored, else decompressed bytes.

    Either way its CRC-32 is checked (zipfile checks a decompressed member's; a
    stored member's is checked here), and an encrypted member is refused.
    """
    if info.flag_bits & 0x1:
        raise FormatError(f"archive member {info.filename!r} is encrypted", file=file,
                          fix="checkpoints are never encrypted: the file is damaged or not one")
    if info.compress_type == zipfile.ZIP_STORED:
        start, length = member_span(buffer, info, file)
        view = memoryview(buffer)[start:start + length]
        if zlib.crc32(view) != info.CRC:
            raise FormatError(f"archive member {info.filename!r} fails its CRC-32 check",
                              file=file, fix="the file is damaged; use another copy")
        return view
    try:
        return zf.read(info)
    except _READ_ERRORS as e:
        raise FormatError(f"archive member {info.filename!r} cannot be read ({e})", file=file,
                          fix="the file is truncated or damaged") from None


def write_member(zf: zipfile.ZipFile, name: str, chunks: Iterable, size: int) -> None:
    """Store `size` bytes from `chunks` as member `name`, its data 64-byte aligned."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    info.file_size = size
    zip64 = size > zipfile.ZIP64_LIMIT
    position = zf.fp.tell()
    fixed = _LOCAL_HEADER.size + len(name.encode('utf-8')) + (20 if zip64 else 0)
    pad = -(position + fixed + 4) % ALIGNMENT
    info.extra = struct.pack('<HH', _PAD_ID, pad) + b'Z' * pad
    written = 0
    with zf.open(info, 'w', force_zip64=zip64) as out:
        for chunk in chunks:
            out.write(chunk)
            written += len(memoryview(chunk).cast('B'))
    if written != size:
        raise FormatError(f"wrote {written} bytes for member {name!r} of {size}")
