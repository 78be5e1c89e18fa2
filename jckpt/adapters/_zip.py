"""Zip archives for the adapters: member data located for zero-copy reads, aligned writes.

Readers map the archive and view a stored (uncompressed) member's bytes in
place; writers store members uncompressed with their data aligned to 64
bytes (padding in the local header's extra field, as `torch.save` does), so
they can be mapped in turn.

A compressed member (deflate, bzip2 or lzma) is decompressed here, not by
`zipfile`, in steps of at most `STEP` bytes of output: a member
may produce no more than its declared size, no more than the caller says it
must hold (an `.npy`'s header plus its shape's data), and all members of
one archive together no more than a `Budget` of
`jckpt.format.limits.MAX_DECOMPRESSION_RATIO` times the archive's
size. So a kilobyte that decompresses to gigabytes (a "zip bomb") is
refused after at most one step past its bound, never held in memory.
"""

from __future__ import annotations

import bz2
import io
import struct
import zipfile
import zlib
from collections.abc import Iterable
from typing import Any

from jckpt.adapters._common import check_member_name, map_file
from jckpt.errors import FormatError
from jckpt.format import limits
from jckpt.format.sniff import ZIP_LOCAL
from jckpt.storage.backend import is_url

try:
    import lzma
except ImportError:  # pragma: no cover - Python built without lzma
    lzma = None  # type: ignore[assignment]

ALIGNMENT = 64
#: Most bytes one decompression step produces (and so the most a bomb costs past its bound).
STEP = 1 << 20
_ZLIB = type(zlib.decompressobj())
_DECOMPRESS_ERRORS: tuple[type[BaseException], ...] = (zlib.error, OSError, EOFError, ValueError) \
    + ((lzma.LZMAError,) if lzma is not None else ())
_LOCAL_HEADER = struct.Struct('<4sHHHHHIIIHH')
_PAD_ID = 0x4246  # 'FB': the padding record torch.save uses
#: An archive's end, the end-of-central-directory record: the first bytes of an empty archive.
ZIP_END = b'PK\x05\x06'


def zip_source(path: str, buffer: Any = None) -> Any:
    """What `zipfile.ZipFile` reads `path` from: the local path, or in memory an object's bytes
    (those held for it, `holding`, when they are)."""
    if not is_url(path):
        return path
    return io.BytesIO(buffer if buffer is not None else map_file(path))


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
    if fields[0] != ZIP_LOCAL:
        raise FormatError(f"archive member {info.filename!r} has no local header", file=file,
                          fix="the file is damaged")
    _check_local_name(buffer, at + _LOCAL_HEADER.size, fields, info, file)
    start = at + _LOCAL_HEADER.size + fields[9] + fields[10]
    if start + info.compress_size > len(buffer):
        raise FormatError(f"archive member {info.filename!r} extends past the end of the file",
                          file=file, fix="the file is truncated")
    return start, info.compress_size


def _check_local_name(buffer, at: int, fields: tuple, info: zipfile.ZipInfo, file: str) -> None:
    """Refuse a member whose local header names another file than the central directory.

    No checksum covers names: a damaged directory entry would otherwise hand
    the member's data out under another name (`zipfile` refuses it too).
    """
    raw = bytes(buffer[at:at + fields[9]])
    name = raw.decode('utf-8' if fields[2] & 0x800 else 'cp437', errors='replace')
    if len(raw) != fields[9] or name != info.orig_filename:
        raise FormatError(f"archive member {info.filename!r} is named {name!r} in its local "
                          f"header", file=file, fix="the archive is damaged; write it again")


class Budget:
    """What the compressed members of one archive may decompress to, in all.

    `jckpt.format.limits.MAX_DECOMPRESSION_RATIO` times the archive's
    size, plus 1 MiB: deflate (what `np.savez_compressed` writes) never
    expands more than 1032 times, so only bzip2 or lzma bombs reach it.
    """

    def __init__(self, archive_size: int) -> None:
        self.left = limits.MAX_DECOMPRESSION_RATIO * archive_size + (1 << 20)

    def take(self, n: int, name: str, file: str) -> None:
        """Spend `n` bytes of output; `FormatError` when that is more than is left."""
        if n > self.left:
            raise FormatError(
                f"archive member {name!r} would decompress past what the archive may hold: "
                f"its members may expand to {limits.MAX_DECOMPRESSION_RATIO} times its size in all",
                file=file, fix="the archive is a decompression bomb or damaged; do not use it")
        self.left -= n


def _decompressor(info: zipfile.ZipInfo, data: memoryview, file: str):
    """A decompressor of the member's method, and its compressed stream (zip framing removed)."""
    method = info.compress_type
    if method == zipfile.ZIP_DEFLATED:
        return zlib.decompressobj(-15), data
    if method == zipfile.ZIP_BZIP2:
        return bz2.BZ2Decompressor(), data
    if method == zipfile.ZIP_LZMA and lzma is not None and len(data) >= 4:
        # 2 bytes of LZMA SDK version, 2 of properties size, then LZMA1 properties (5 bytes:
        # lc/lp/pb packed in one, then the dictionary size); the raw stream follows
        (size,) = struct.unpack_from('<H', data, 2)
        props = bytes(data[4:4 + size])
        if size == 5 and len(props) == 5 and props[0] < 9 * 5 * 5:
            lc, rest = props[0] % 9, props[0] // 9
            # no output needs a dictionary larger than itself, and the output is bounded: the
            # file's 4 GiB claim would be allocated otherwise
            most = max(4096, min(info.file_size, limits.MAX_DECOMPRESSION_RATIO * len(data)))
            flt = {'id': lzma.FILTER_LZMA1, 'lc': lc, 'lp': rest % 5, 'pb': rest // 5,
                   'dict_size': min(int.from_bytes(props[1:], 'little'), most)}
            try:
                return lzma.LZMADecompressor(lzma.FORMAT_RAW, filters=[flt]), data[4 + size:]
            except (lzma.LZMAError, MemoryError):
                pass
    raise FormatError(f"archive member {info.filename!r} uses a compression method "
                      f"({method}) or parameters this reader does not know", file=file,
                      fix="re-save it uncompressed or deflated")


def _step(d, data: memoryview, pos: int, room: int) -> tuple[bytes, int]:
    """One bounded decompression step: `(output of at most room bytes, new input position)`."""
    if isinstance(d, _ZLIB):
        tail = d.unconsumed_tail
        if tail:
            return d.decompress(tail, room), pos
        chunk = data[pos:pos + STEP]
        return d.decompress(chunk, room), pos + len(chunk)
    if d.needs_input:
        chunk = data[pos:pos + STEP]
        return d.decompress(chunk, room), pos + len(chunk)
    return d.decompress(b'', room), pos


def _inflate(info: zipfile.ZipInfo, data: memoryview, cap: int, file: str,
             head: bool = False) -> bytearray:
    """The member's decompressed bytes, at most `cap` of them.

    Refuses a stream that produces more than `cap` bytes (unless `head`:
    the first `cap` bytes are then all that is wanted) or ends early.
    """
    d, data = _decompressor(info, data, file)
    out = bytearray()
    pos = 0
    try:
        while len(out) <= cap and not d.eof:
            chunk, after = _step(d, data, pos, min(STEP, cap + 1 - len(out)))
            if not chunk and after == pos:  # the input is used up
                break
            pos = after
            out += chunk
            if head and len(out) >= cap:
                return out[:cap]
    except _DECOMPRESS_ERRORS as e:
        raise FormatError(f"archive member {info.filename!r} cannot be read ({e})",
                          file=file, fix="the file is truncated or damaged") from None
    if len(out) > cap:
        raise FormatError(f"archive member {info.filename!r} decompresses to more than the "
                          f"{cap} bytes it may hold", file=file,
                          fix="the archive is a decompression bomb or damaged; do not use it")
    if not d.eof and not head:
        raise FormatError(f"archive member {info.filename!r} ends before its compressed "
                          "stream does", file=file, fix="the file is truncated or damaged")
    return out


def _check_readable(info: zipfile.ZipInfo, file: str) -> None:
    if info.flag_bits & 0x1:
        raise FormatError(f"archive member {info.filename!r} is encrypted", file=file,
                          fix="checkpoints are never encrypted: the file is damaged or not one")


def member_head(buffer, info: zipfile.ZipInfo, file: str, n: int):
    """Up to the first `n` bytes of a member's content (decompressed, unchecked)."""
    _check_readable(info, file)
    start, length = member_span(buffer, info, file)
    view = memoryview(buffer)[start:start + length]
    if info.compress_type == zipfile.ZIP_STORED:
        return view[:n]
    return _inflate(info, view, n, file, head=True)


def member_bytes(zf: zipfile.ZipFile, buffer, info: zipfile.ZipInfo, file: str, *,
                 limit: int | None = None, budget: Budget | None = None, check_crc: bool = True):
    """A member's content: a zero-copy memoryview when stored, else decompressed bytes.

    Either way its CRC-32 is checked and an encrypted member is refused. A
    compressed member is decompressed to at most `limit` bytes (what the
    caller knows it must hold) and its declared size, each step charged to
    `budget` (by default one of its own archive's); beyond any of these it
    is refused with `FormatError`. `zf` is the open archive (kept
    for callers; the bytes are read from `buffer`). `check_crc=False` skips the CRC-32 (an
    archive written without them: `torch.serialization.set_crc32_options(False)`).
    """
    _check_readable(info, file)
    start, length = member_span(buffer, info, file)
    view = memoryview(buffer)[start:start + length]
    if info.compress_type != zipfile.ZIP_STORED:
        cap = info.file_size if limit is None else min(limit, info.file_size)
        (budget or Budget(len(buffer))).take(cap, info.filename, file)
        view = _inflate(info, view, cap, file)
        if len(view) != info.file_size:
            raise FormatError(f"archive member {info.filename!r} decompresses to {len(view)} "
                              f"bytes, not the {info.file_size} it declares", file=file,
                              fix="the file is damaged")
    if check_crc and zlib.crc32(view) != info.CRC:
        what = ("fails its CRC-32 check" if info.compress_type == zipfile.ZIP_STORED else
                f"cannot be read (Bad CRC-32 for file {info.filename!r})")
        raise FormatError(f"archive member {info.filename!r} {what}",
                          file=file, fix="the file is damaged; use another copy")
    return view


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
