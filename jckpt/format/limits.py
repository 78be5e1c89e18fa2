"""Bounds on untrusted input that no real checkpoint reaches, checked before anything is built.

Every reader (the header codec, the directory index, the foreign-format
adapters) hands shapes, dtypes, integers, key paths and JSON it read from a
file through these functions before a numpy constructor, `int()` or a
recursive walk sees them, so a crafted file gets a `ValueError` here
(which each reader reports as a `FormatError` naming
the file) instead of a numpy `ValueError`, a `RecursionError` or an
allocation far beyond the file.

>>> check_shape((2, 3), 4)
(2, 3)
>>> check_shape((0, 10**30), 4)
Traceback (most recent call last):
...
ValueError: shape (0, 1000000000000000000000000000000) is larger than any array (2**63 - 1 bytes)
>>> json_loads('{"loss": 1.5}')
{'loss': 1.5}
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Iterator
from typing import Any

import numpy as np

from jckpt.errors import InputError

#: Most dimensions an array may have (numpy's own limit: 32 before numpy 2, 64 since).
MAX_NDIM = 64 if int(np.__version__.split('.')[0]) >= 2 else 32
#: Most digits (sign excluded) of an integer in a header: any 64-bit integer fits in 19.
MAX_INT_DIGITS = 20
#: Most components of a key path (a real model's paths are under 20 deep).
MAX_PATH_LENGTH = 256
#: Deepest nesting of JSON values and of pickled containers a reader builds.
MAX_NESTING = 100
#: Largest header alignment: a header and every payload are padded up to it, so a tiny file
#: that names a huge one would make every rewrite allocate and write that much. 16 MiB is
#: far beyond any page or block size a checkpoint aligns to.
MAX_ALIGNMENT = 1 << 24
#: What the padded entries of one file may rebuild in all, as a multiple of the file's size
#: (plus 1 MiB): padding costs header bytes only, so without a bound per file a few KB of
#: header could make a reader allocate gigabytes.
PADDED_ALLOCATION_FACTOR = 64
#: What the compressed members of an archive (.npz, .pth) may decompress to in all, as a
#: multiple of the archive's size (plus 1 MiB). Deflate, which numpy and torch write, cannot
#: expand more than 1032 times; bzip2 and lzma can reach millions, which only bombs do.
MAX_DECOMPRESSION_RATIO = 1100
#: What the leaves read from a file whose arrays are views of shared storage (.pth) may hold
#: in all, as a multiple of the file's size (plus 1 MiB): a view costs the file a few bytes of
#: pickle, and each leaf becomes a payload of its own when the tree is converted or saved.
#: Tied weights double a storage; nothing real repeats one 64 times.
MAX_LEAF_EXPANSION = 64
#: Most lists the general S-expression reader builds for the pieces of a directory index not
#: laid out as jckpt writes it (about four per piece of a 1-D array, 700 bytes and 13 us a
#: piece): jckpt's own pieces, blanks aside, are read as text at once and never count.
MAX_LOOSE_INDEX_LISTS = 1 << 18
#: The largest array, in bytes, numpy can describe (and any 64-bit offset can address).
MAX_BYTES = 2**63 - 1
#: Largest text file of a step directory (`trainer_state.json`) a reader takes: its metadata
#: and metrics are strings a header would hold, and far below this.
MAX_RECORD_BYTES = 64 << 20



def check_shape(shape: Any, itemsize: int) -> tuple[int, ...]:
    """`shape` as a tuple of ints that numpy can build an array of `itemsize` bytes with.

    Refuses non-integers (`True` included), negative dims, more than
    `MAX_NDIM` dims and shapes whose non-zero dims multiply past
    `MAX_BYTES` (numpy refuses those even when another dim is 0).
    """
    if not isinstance(shape, (tuple, list)):
        raise ValueError(f"shape {shape!r} is not a sequence of integers")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"shape has {len(shape)} dimensions, more than {MAX_NDIM}")
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_))
               for d in shape):
        raise ValueError(f"shape {tuple(shape)!r} holds something other than integers")
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"shape {dims} has a negative dimension")
    if math.prod(max(d, 1) for d in dims) * max(itemsize, 1) > MAX_BYTES:
        raise ValueError(f"shape {dims} is larger than any array (2**63 - 1 bytes)")
    return dims


def check_alignment(alignment: Any, file: str | None = None) -> int:
    """`alignment` as an int when a writer accepts it: a power of two from 1 to
    `MAX_ALIGNMENT` (numpy integers too, `bool` not); `InputError` naming `file` otherwise.

    The format lets a reader take any alignment from 1 up (a file OCANNL or an old jckpt
    wrote with 3 still reads), but a writer's alignment exists to put payloads at addresses
    the hardware likes, which only a power of two does: 3 or 48 is a typo, not a choice.
    The one check of every writer.

    >>> check_alignment(64)
    64
    """
    try:
        value = None if isinstance(alignment, bool) else operator.index(alignment)
    except TypeError:
        value = None
    if value is None or not 1 <= value <= MAX_ALIGNMENT or value & (value - 1):
        raise InputError(f"alignment must be a power of two from 1 to {MAX_ALIGNMENT}, "
                         f"not {alignment!r}", file=file,
                         fix="use a power of two such as 32 (the default), 64 or 4096")
    return value


def check_itemsize(dtype: np.dtype) -> np.dtype:
    """Refuse a dtype of zero-sized elements (`'U0'`, `'S0'`): no array data has that form."""
    if dtype.itemsize == 0:
        raise ValueError(f"dtype {dtype.str!r} has elements of 0 bytes")
    return dtype


def check_path_length(length: int) -> None:
    """Refuse a key path of more than `MAX_PATH_LENGTH` components."""
    if length > MAX_PATH_LENGTH:
        raise ValueError(f"key path of {length} components is deeper than {MAX_PATH_LENGTH}")


def json_depth(text: str) -> int:
    """How deeply the arrays and objects of JSON `text` nest (strings skipped).

    Counted a MiB at a time, so checking a large document costs the copy of its text
    outside strings (twice that while the copy is joined) and a few MiB, not that copy
    encoded whole as well.

    >>> json_depth('{"a": [1, {"b": "[[["}]}')
    3
    """
    return max([0, *(int(depths.max()) for _, depths in _depths(text))])


def json_top_keys(text: str) -> int:
    """How many keys the outermost object of JSON `text` holds, counted without parsing it
    (as `json_depth` counts: no object built, so a crafted text of millions of short keys
    is known for what it is before `json.loads` spends ten times its size on them).

    >>> json_top_keys('{"a": {"b": 1, "c:": [2]}, "d": 3}')
    2
    """
    return sum(int(np.count_nonzero((chunk == 58) & (depths == 1)))  # ':' in the outer object
               for chunk, depths in _depths(text))


def _depths(text: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`(bytes, nesting after each)` of `text` outside its strings, `_JSON_CHUNK` characters at
    a time, with nothing copied but a chunk: a byte after an odd number of quotes is inside a
    string, the quotes escaped (after an odd run of backslashes) left out where the text has
    a backslash. (Its strings were cut out with `re.sub` there: a copy, and a string object a
    piece while it joined them, eight times the size of a header of millions of escaped keys.)"""
    escaped = '\\' in text
    depth = open_quote = run = 0
    for start in range(0, len(text), _JSON_CHUNK):
        chunk = np.frombuffer(text[start:start + _JSON_CHUNK].encode('utf-8', 'surrogatepass'),
                              dtype=np.uint8)
        quotes = chunk == 34
        if escaped:
            quotes, run = _unescaped(chunk, quotes, run)
        seen = np.cumsum(quotes, dtype=np.uint8)  # wraps, keeping the parity
        seen += np.uint8(open_quote)
        open_quote = int(seen[-1]) & 1
        chunk = np.where(seen & 1, np.uint8(0), chunk)
        steps = (chunk == 91).astype(np.int32)  # [ and { open, ] and } close
        steps += chunk == 123
        steps -= chunk == 93
        steps -= chunk == 125
        np.cumsum(steps, out=steps)  # in place: a chunk's depth fits in 32 bits
        steps += depth
        yield chunk, steps
        depth = int(steps[-1])


#: Characters of JSON text `_depths` reads at once (its temporaries: some 20 bytes each, a
#: MiB or two whatever the text's size).
_JSON_CHUNK = 1 << 16


def _unescaped(chunk: np.ndarray, quotes: np.ndarray, run: int) -> tuple[np.ndarray, int]:
    """`quotes` without those after an odd run of backslashes (`run`: the backslashes that
    ended the chunk before), and the run that ends this one."""
    at = np.arange(chunk.size, dtype=np.int32)
    last = np.maximum.accumulate(np.where(chunk == 92, np.int32(-1), at))  # its last non-\
    before = np.empty(chunk.size, np.int32)  # the backslashes just before each byte
    before[0] = run
    before[1:] = at[:-1] - last[:-1]
    before[1:] += np.where(last[:-1] < 0, run, 0)  # a run from the chunk before, unbroken
    end = chunk.size - 1 - int(last[-1]) + (run if last[-1] < 0 else 0)
    return quotes & (before % 2 == 0), end


def _openers(text: str) -> int:
    """How many `[` and `{` `text` holds, strings included: a bound on its nesting that costs
    two C-speed counts (a metrics record of a few names is far below `MAX_NESTING`, and
    `json_depth`'s scan was most of reading one)."""
    return text.count('[') + text.count('{')


def json_loads(text: str | bytes, *, shallow: bool = False, **options: Any) -> Any:
    """`json.loads`, refusing with a ValueError nesting deeper than `MAX_NESTING` (`json.loads`
    itself raises `RecursionError`, and what walks the result later would too) and strings
    with a lone surrogate (`"\\ud800"`: no name or text can hold one, and writing it fails).

    `shallow=True` skips the nesting scan (a fifth of reading a large safetensors header),
    for a caller that checks the type of every part of the value itself and so accepts no
    nesting deeper than its own layout (`json.loads` still raises `RecursionError` for
    nesting deeper than Python's recursion limit).

    >>> json_loads('{"a": ["\\u00e9"]}')
    {'a': ['é']}
    """
    if isinstance(text, (bytes, bytearray)):
        text = text.decode('utf-8')
    if not shallow and _openers(text) > MAX_NESTING and json_depth(text) > MAX_NESTING:
        raise ValueError(f"JSON nests deeper than {MAX_NESTING}")
    value = json.loads(text, **options)  # options: `json.loads`'s (`object_pairs_hook`)
    if '\\ud' in text or '\\uD' in text:  # only an escape can spell a surrogate
        _refuse_surrogates(value)
    return value


def json_as(text: str | bytes | None, kind: type | tuple[type, ...], **options: Any) -> Any:
    """The JSON value of `text` when it parses (`json_loads`, with `options`) and is a `kind`;
    None otherwise.

    For records that are only hints (metrics, a writer's notes on the tree): a damaged or
    foreign value is ignored, never an error.

    >>> json_as('{"a": 1}', dict), json_as('[1]', dict), json_as('{', list), json_as(None, list)
    ({'a': 1}, None, None, None)
    """
    if not text:
        return None
    try:
        value = json_loads(text, **options)
    except ValueError:
        return None
    return value if isinstance(value, kind) else None


def _refuse_surrogates(value: Any) -> None:
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str):
            try:
                node.encode('utf-8')
            except UnicodeEncodeError:
                raise ValueError(f"the string {node[:40]!r} holds a lone surrogate, which no "
                                 "text can") from None


__all__ = ['MAX_ALIGNMENT', 'check_alignment', 'MAX_BYTES', 'MAX_DECOMPRESSION_RATIO', 'MAX_INT_DIGITS',
           'MAX_LEAF_EXPANSION', 'MAX_LOOSE_INDEX_LISTS', 'MAX_NDIM', 'MAX_NESTING', 'MAX_PATH_LENGTH',
           'PADDED_ALLOCATION_FACTOR', 'check_itemsize', 'check_path_length', 'check_shape',
           'json_depth', 'json_loads', 'json_top_keys']
