"""The safetensors header, read and written: its JSON checked as the safetensors reader checks
it (refused before it is parsed where it could only be crafted), and encoded for a writer.

Functions of bytes and text alone: `jckpt.adapters.safetensors` reads and writes files with
them; the sniffer and `jckpt.adapters.cut_short` read a file's first bytes with `header_end`.

>>> import numpy as np
>>> raw = encode_header([('w', np.dtype(np.float32), (2,), 8)], {'format': 'pt'}) + bytes(8)
>>> layout, metadata, start = read_header(raw, 'm.safetensors')
>>> layout.names, metadata, header_end(raw) == start
(['w'], {'format': 'pt'}, True)
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import ml_dtypes
import numpy as np

from jckpt.adapters import safetensors_bulk as bulk
from jckpt.adapters.safetensors_bulk import Layout
from jckpt.errors import FormatError
from jckpt.format import limits

#: The safetensors reader refuses headers larger than this.
MAX_HEADER_BYTES = 100_000_000
_LAYOUT_DEPTH = 3  # the header, a tensor's info, its shape or offsets
_MIN_ENTRY = 50  # a tensor's entry at its shortest: "":{"dtype":"U8","shape":[],"data_offsets":[0,0]},
METADATA_KEY = '__metadata__'

DTYPES: dict[str, np.dtype] = {name: np.dtype(t).newbyteorder('<') for name, t in {
    'BOOL': np.bool_, 'U8': np.uint8, 'I8': np.int8, 'I16': np.int16, 'U16': np.uint16,
    'F16': np.float16, 'BF16': ml_dtypes.bfloat16, 'I32': np.int32, 'U32': np.uint32,
    'F32': np.float32, 'F64': np.float64, 'I64': np.int64, 'U64': np.uint64,
    'C64': np.complex64, 'F8_E5M2': ml_dtypes.float8_e5m2, 'F8_E4M3': ml_dtypes.float8_e4m3fn,
    'F8_E8M0': ml_dtypes.float8_e8m0fnu, 'F8_E4M3FNUZ': ml_dtypes.float8_e4m3fnuz,
    'F8_E5M2FNUZ': ml_dtypes.float8_e5m2fnuz,
}.items()}
_NAMES: dict[np.dtype, str] = {dt.newbyteorder('='): name for name, dt in DTYPES.items()}
#: Sub-byte types safetensors packs several to a byte; jckpt refuses them with a message.
_PACKED = {'F4', 'F6_E2M3', 'F6_E3M2'}


def dtype_name(dtype: np.dtype) -> str | None:
    """The safetensors dtype name of a numpy dtype, or None when safetensors has none."""
    dt = np.dtype(dtype)
    return _NAMES.get(dt.newbyteorder('=') if dt.byteorder in '<>' else dt)



def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; ValueError naming a key that appears twice (called
    for every object of a header: a dict built in C, the pairs searched only on a repeat)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"key {k!r} appears twice")
            seen.add(k)
    return out


def _fail(msg: str, file: str, entry: str | None = None) -> FormatError:
    return FormatError(msg, file=file, entry=entry,
                       fix="the file is truncated, damaged or not a safetensors file")


def _dtype(dtype: Any, file: str, name: str) -> str:
    """A tensor's safetensors dtype name, one this reader knows."""
    if not isinstance(dtype, str):
        raise _fail(f"dtype {dtype!r:.60} is not a string", file, name)
    if dtype in _PACKED:
        raise FormatError(f"dtype {dtype} (packed sub-byte) is not supported", file=file,
                          entry=name, fix="convert it to a byte-sized dtype first")
    if dtype not in DTYPES:
        raise _fail(f"unknown dtype {dtype!r}", file, name)
    return dtype


def read_header(buffer, file: str) -> tuple[Layout, dict[str, str], int]:
    """`(layout, metadata, data_start)` of a safetensors file's bytes, validated as the
    safetensors reader does (no overlaps, gaps or trailing bytes; sizes match shapes).

    The checks run over whole columns first (`safetensors_bulk.layout`); only a header
    they cannot accept is parsed again and checked tensor by tensor, which names the fault.
    """
    if len(buffer) < 8:
        raise _fail(f"file is {len(buffer)} bytes, shorter than the 8-byte header size", file)
    (n,) = struct.unpack_from('<Q', buffer, 0)
    if n > MAX_HEADER_BYTES:
        raise _fail(f"header size {n} is over the {MAX_HEADER_BYTES}-byte limit", file)
    if 8 + n > len(buffer):
        raise _fail(f"header of {n} bytes extends past the end of the file ({len(buffer)} bytes)",
                    file)
    try:
        text = str(memoryview(buffer)[8:8 + n], 'utf-8')  # no copy of the bytes first
    except UnicodeDecodeError as e:
        raise _fail(f"header is not valid JSON ({e})", file) from None
    _refuse_unparsable(text, file)
    size = len(buffer) - 8 - n
    try:  # `layout` checks every part's type: nothing nests deeper than it accepts
        header, metadata = _parsed(text, file, None, shallow=True)
        found = bulk.layout(header, metadata, text, size, DTYPES)
    except FormatError:
        found = None
    if found is None:  # something is amiss (or merely unusual): find it entry by entry,
        header = metadata = None  # from a second parse that never meets the first (held at
        header, metadata = _parsed(text, file, _no_duplicates)  # once: twice the memory)
        found = _checked_entries(header, size, file)
    return found, metadata or {}, 8 + n


def _refuse_unparsable(text: str, file: str) -> None:
    """Refuse, before `json.loads` builds every list and key of it, a header nested deeper
    than the layout (the header, a tensor's info, its shape or offsets: 3; a crafted 32 MB
    header of a 40-deep list repeated took 15 million lists, over a GiB), or of more entries
    than its size holds (`_MIN_ENTRY` bytes each at least; millions of short keys cost 35
    times its size). Only a header dense with brackets or colons is scanned: a legitimate
    one holds a bracket in some fifteen characters, four colons in some seventy; or one
    whose colons could be too many entries and are not four an object, as a tensor's are
    (keys of 13 to 50 bytes each, escapes in them, built in full: 8 to 21 times its size)."""
    if text.count('[') + text.count('{') > len(text) // 4:
        depth = limits.json_depth(text)
        if depth > _LAYOUT_DEPTH:
            raise _fail(f"header nests {depth} deep; a safetensors header nests "
                        f"{_LAYOUT_DEPTH} deep at most", file)
    colons = text.count(':')
    if colons * _MIN_ENTRY > 4 * len(text) or (
            colons * _MIN_ENTRY > len(text) and not _four_an_object(colons, text.count('{'))):
        entries = limits.json_top_keys(text)
        if entries * _MIN_ENTRY > len(text) + _MIN_ENTRY:  # `__metadata__`'s may be shorter
            raise _fail(f"header of {len(text)} bytes holds {entries} entries; a tensor's "
                        f"entry takes {_MIN_ENTRY} bytes at least, so no more than "
                        f"{len(text) // _MIN_ENTRY + 1} fit", file)


def _four_an_object(colons: int, braces: int) -> bool:
    """Whether a header's colons are four an object (a tensor's entry: its key and three
    fields), give or take its metadata's (the `__metadata__` key, an object, and a colon a
    pair: up to `_EXTRA_COLONS`), as in every header a writer lays out.

    >>> _four_an_object(4 * 1000, 1 + 1000), _four_an_object(1000, 1)
    (True, False)
    """
    return -3 <= colons - 4 * (braces - 1) <= _EXTRA_COLONS


#: Colons a header may hold beyond four an object (its metadata's pairs, names with colons)
#: before its entries are counted on its text.
_EXTRA_COLONS = 64


def _parsed(text: str, file: str, hook: Any, shallow: bool = False
            ) -> tuple[dict[str, Any], dict[str, str] | None]:
    """The header's tensor infos and its `__metadata__` (None when absent), parsed from
    `text` (`hook`: the `object_pairs_hook`, `_no_duplicates` to refuse a key twice;
    `shallow`: `limits.json_loads`'s)."""
    try:
        header = limits.json_loads(text, shallow=shallow, object_pairs_hook=hook)
    except (ValueError, RecursionError) as e:
        raise _fail(f"header is not valid JSON ({e})", file) from None
    if not isinstance(header, dict):
        raise _fail("header is not a JSON object", file)
    metadata = (header.pop(METADATA_KEY) or {}) if METADATA_KEY in header else None
    if not (isinstance(metadata or {}, dict)
            and all(isinstance(v, str) for v in (metadata or {}).values())):
        raise _fail("__metadata__ must map strings to strings", file)
    return header, metadata


def _checked_entries(header: dict[str, Any], size: int, file: str) -> Layout:
    """The layout of the tensor infos over `size` data bytes, checked tensor by tensor:
    a `FormatError` naming the first entry at fault."""
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {'dtype', 'shape', 'data_offsets'}:
            raise _fail("tensor info must have exactly dtype, shape and data_offsets", file, name)
        dtype, shape, offsets = _dtype(info['dtype'], file, name), info['shape'], info['data_offsets']
        try:
            shape = limits.check_shape(shape if isinstance(shape, list) else None,
                                       DTYPES[dtype].itemsize)
        except ValueError as e:
            raise _fail(f"invalid shape: {e}", file, name) from None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int and 0 <= o < 1 << 64 for o in offsets)
                and offsets[0] <= offsets[1]):
            raise _fail(f"invalid data_offsets {offsets!r:.80}", file, name)
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != expected:
            raise _fail(f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes; "
                        f"dtype {dtype} and shape {shape} need {expected}", file, name)
        spans.append((offsets[0], offsets[1], name, DTYPES[dtype], tuple(shape)))
    cursor = 0
    for begin, end, name, _, _ in sorted(spans, key=lambda s: s[:3]):
        if begin != cursor:
            raise _fail(f"tensor data at {begin} {'overlaps' if begin < cursor else 'leaves a gap'} "
                        f"(previous data ends at {cursor})", file, name)
        cursor = end
    if cursor != size:
        raise _fail(f"the tensors cover {cursor} data bytes but the file holds {size} "
                    f"({'truncated' if cursor > size else 'trailing bytes'})", file)
    return Layout([s[2] for s in spans], [s[3] for s in spans], [s[4] for s in spans],
                  [s[0] for s in spans])


def header_end(head: bytes) -> int | None:
    """Where the header of a safetensors file starting with `head` ends (its 8-byte length and
    the JSON it announces), or None when `head` starts no safetensors file: a length out of
    bounds, or no `{` after it. A file shorter than this was cut short.

    >>> header_end(struct.pack('<Q', 2) + b'{}'), header_end(b'not a safetensors file')
    (10, None)
    """
    if len(head) < 9 or head[8:9] != b'{':
        return None
    (n,) = struct.unpack_from('<Q', head, 0)
    return 8 + n if 2 <= n <= MAX_HEADER_BYTES else None


def encode_header(entries: list[tuple[str, np.dtype, tuple[int, ...], int]],
                  metadata: dict[str, str] | None) -> bytes:
    """Header bytes (size + JSON padded with spaces to a multiple of 8) for
    `(name, dtype, shape, nbytes)` entries in data order."""
    header: dict[str, Any] = {}
    if metadata:
        header[METADATA_KEY] = metadata
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {'dtype': dtype_name(dtype), 'shape': list(shape),
                        'data_offsets': [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(',', ':'), ensure_ascii=False).encode('utf-8')
    text += b' ' * (-len(text) % 8)
    return struct.pack('<Q', len(text)) + text


__all__ = ['DTYPES', 'MAX_HEADER_BYTES', 'METADATA_KEY', 'dtype_name', 'encode_header',
           'header_end', 'read_header']
