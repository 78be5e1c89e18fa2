"""A zarr array's metadata (`.zarray`, `zarr.json`), checked before tensorstore reads it.

orbax saves an array without OCDBT as a zarr array (version 2, or 3 with `use_zarr3`), and
tensorstore reads it: it allocates the whole array, and each chunk it decodes whole, at the
sizes its metadata gives, and a failed allocation there ends the process (`std::bad_alloc`,
SIGABRT) where Python would raise. Crafted or damaged metadata must be refused first:
`zarray_claim` reads it (a regular file, at most a MiB, JSON nested within
`jckpt.format.limits.MAX_NESTING`), checks the fields tensorstore sizes memory by, and gives
the bytes reading the array takes, which `jckpt.adapters.orbax` bounds by what the
checkpoint's files could hold and by the memory this process may take (`memory_bytes`).

Example:
    ```python
    nbytes = zarray_claim('step/default/w/.zarray')  # FormatError for a damaged one
    ```
"""

from __future__ import annotations

import math
import os
import resource
from typing import Any

import numpy as np

from jckpt.errors import FormatError
from jckpt.format.limits import json_loads
from jckpt.storage.regular import open_regular

#: The most bytes of one small JSON file of orbax's (array metadata, a `.zarray`) read.
MAX_SMALL_JSON = 1 << 20
#: The most dimensions tensorstore's arrays have.
MAX_RANK = 32
#: How much larger than its array a chunk may be (bytes): a writer chunks an array by parts
#: of it, and tensorstore decodes a chunk whole, whatever its array holds.
CHUNK_SLACK = 1 << 20


def small_json(path: str, limit: int = MAX_SMALL_JSON) -> Any:
    """A JSON file of the checkpoint: a regular file, at most `limit` bytes, nested at most
    `jckpt.format.limits.MAX_NESTING` deep (`ValueError` otherwise)."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"over {limit} bytes")
    return json_loads(data)


def _dims(dims: Any, what: str, least: int) -> list[int]:
    """`dims` (a shape, a chunk shape) when it is a list of at most `MAX_RANK` integers, each
    at least `least`."""
    if not (isinstance(dims, list) and len(dims) <= MAX_RANK
            and all(type(d) is int and d >= least for d in dims)):
        raise ValueError(f"{what} {dims!r:.80}")
    return dims


def _itemsize(name: Any) -> int:
    """The bytes of an element of the zarr data type `name` (`'<f4'`, `'float32'`,
    `'bfloat16'`); 1 for a name numpy does not know (tensorstore refuses it itself)."""
    try:
        return max(1, np.dtype(name).itemsize)
    except (TypeError, ValueError):
        digits = ''.join(c for c in name if c.isdigit())[-3:] if isinstance(name, str) else ''
        return max(1, int(digits) // 8) if digits else 1


def _inner_chunks(codecs: Any) -> list[Any]:
    """The chunk shapes zarr version 3's sharding codecs in `codecs` decode (a shard's inner
    chunks, at any depth of sharding)."""
    found = []
    for codec in codecs if isinstance(codecs, list) else []:
        config = codec.get('configuration') if isinstance(codec, dict) else None
        if isinstance(config, dict) and 'chunk_shape' in config:
            found.append(config['chunk_shape'])
            found.extend(_inner_chunks(config.get('codecs')))
    return found


def _chunk_bytes(shape: list[int], chunks: list[int], itemsize: int) -> int:
    """The bytes tensorstore allocates to decode one chunk of the array (0 if it is empty:
    no chunk is read), refused when a chunk is larger than its whole array."""
    if len(chunks) != len(shape):
        raise ValueError(f"chunks {chunks!r:.80} for shape {shape!r:.80}")
    if 0 in shape:
        return 0
    nbytes = math.prod(chunks) * itemsize
    if nbytes > math.prod(shape) * itemsize + CHUNK_SLACK:
        raise ValueError(f"a chunk {chunks!r:.80} of {nbytes} bytes is larger than its array "
                         f"(shape {shape!r:.80})")
    return nbytes


def zarray_claim(path: str) -> int:
    """The bytes reading the zarr array `path` (its `.zarray`, or zarr version 3's
    `zarr.json`) allocates at once: the array whole, or one chunk decoded where that is larger
    (at most `CHUNK_SLACK` more); 0 for a group's `zarr.json`.

    A `FormatError` naming the file for metadata of another zarr version than the file's
    name says, a shape or chunk shape that is not a list of at most `MAX_RANK` integers
    (chunks positive, one for each dim), or a chunk (or a shard's inner chunk) larger than
    its array.

    >>> import json, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), '.zarray')
    >>> _ = open(path, 'w').write(json.dumps({'zarr_format': 2, 'shape': [2, 3],
    ...                                       'chunks': [2, 3], 'dtype': '<f2'}))
    >>> zarray_claim(path)
    12
    """
    try:
        meta = small_json(path)
        version = 3 if os.path.basename(path) == 'zarr.json' else 2
        if not isinstance(meta, dict) or meta.get('zarr_format', 2) != version:
            raise ValueError(f"not zarr version {version} metadata")
        if version == 3 and meta.get('node_type') != 'array':
            return 0
        shape = _dims(meta['shape'], 'shape', 0)
        if version == 2:
            itemsize, chunks = _itemsize(meta.get('dtype')), [meta.get('chunks', shape)]
        else:
            itemsize = _itemsize(meta.get('data_type'))
            chunks = [meta['chunk_grid']['configuration']['chunk_shape'],
                      *_inner_chunks(meta.get('codecs'))]
        return max(math.prod(shape) * itemsize, *(
            _chunk_bytes(shape, _dims(c, 'chunks', 1), itemsize) for c in chunks))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"zarr metadata cannot be read: {e}", file=path,
                          fix="the checkpoint is damaged") from None


def memory_bytes() -> int:
    """The memory this process may still take, in bytes: the machine's physical memory, or
    less where an address-space limit (`ulimit -v`) leaves less (0 where the system does not
    say). tensorstore aborts the process when an allocation fails, not only when memory runs
    out: under such a limit, an allocation past it."""
    try:
        physical = os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')
    except (ValueError, OSError, AttributeError):
        physical = 0
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return physical
    try:
        with open('/proc/self/statm', 'rb') as f:
            used = int(f.read().split()[0]) * os.sysconf('SC_PAGE_SIZE')
    except (OSError, ValueError, IndexError):
        used = 0
    left = max(0, limit - used)
    return min(physical, left) if physical else left


__all__ = ['CHUNK_SLACK', 'MAX_RANK', 'MAX_SMALL_JSON', 'memory_bytes', 'small_json',
           'zarray_claim']
