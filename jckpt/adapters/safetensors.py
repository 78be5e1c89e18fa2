"""safetensors files, read and written with numpy alone (the safetensors package is not needed).

The format: 8 bytes of little-endian header size `N`, `N` bytes of JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}`), then the tensors' bytes, C order, little-endian, offsets
relative to the end of the header. This implementation gets right what the
safetensors package's numpy functions get wrong: non-contiguous and
Fortran-ordered arrays are written as their values (C order), bfloat16 needs
no import ritual, and the float8 types read and write.

Tree form: tensors are named by key path joined with `.`; the exact
namespaces and paths are recorded as JSON under the `__metadata__` key
`jckpt.paths`, and the nodes without arrays (optax's `EmptyState`, `None`, empty
containers) under `jckpt.empty_nodes` as a jckpt file records them, so a jckpt tree
round-trips with its structure (those nodes read as `None`). A file from
elsewhere reads as `{'jckpt': {name: array}}`. Hugging Face's sharded layout
reads from its `*.safetensors.index.json` file (or the directory that holds
it), whose `weight_map` names each tensor's shard, and writing to a path
of that name writes shards and an index (`write_sharded`). Written
files carry `"format": "pt"` in their metadata unless told otherwise, as
Hugging Face transformers requires.

Tensors are written largest element first, then by name (as the safetensors
package does), so every tensor starts at a multiple of its element size and
loads as a zero-copy view of a private mapping of the file; a tensor that a
foreign writer left misaligned is copied.

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), 'm.safetensors')
>>> write({'jckpt': {'w': np.arange(6.0).reshape(2, 3).T}}, path)   # Fortran-ordered view
>>> read(path)['jckpt']['w'].tolist()
[[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jckpt.adapters import safetensors_bulk as bulk
from jckpt.adapters._common import (
    abstract_items,
    check_namespaced,
    empty_record,
    flat_names,
    host_items,
    inside,
    map_file,
    paths_json,
    published,
    refuse_dtypes,
    tree_from_names,
    warn_key_data,
)
from jckpt.adapters.hf_index import hf_index, shard_path
from jckpt.adapters.safetensors_header import DTYPES as DTYPES  # the header's codec, named here too
from jckpt.adapters.safetensors_header import (
    MAX_HEADER_BYTES,
    METADATA_KEY,
    dtype_name,
    encode_header,
    header_end,
    read_header,
)
from jckpt.errors import FormatError, InputError
from jckpt.format._gc import paused
from jckpt.format.names import EMPTY_NODES_KEY, RESERVED_PREFIX
from jckpt.format.payload import iter_payload_chunks, stored_dtype
from jckpt.storage.backend import is_url

PATHS_KEY = 'jckpt.paths'
INDEX_SUFFIX = '.safetensors.index.json'
# --- reading ----------------------------------------------------------------

@paused  # the parse and the views make an object or more per tensor, and no cycle
def read_arrays(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """`({name: array}, metadata)` of one safetensors file; arrays are zero-copy when aligned."""
    buffer = map_file(path)
    found, metadata, start = read_header(buffer, path)
    return bulk.views(buffer, start, found, path), metadata


def _index_file(path: str) -> str | None:
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.endswith(INDEX_SUFFIX))
        if len(found) == 1:
            return os.path.join(path, found[0])
        if found:
            raise FormatError(f"directory holds several index files {found}", file=path,
                              fix="pass the index file to read")
        return None
    return path if path.endswith('.json') else None


def read_sharded(index_path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors of a Hugging Face sharded checkpoint, from its `*.safetensors.index.json`."""
    index = hf_index(index_path)
    weight_map = index['weight_map']
    arrays: dict[str, np.ndarray] = {}
    metadata: dict[str, str] = {}
    index_meta = index.get('metadata')
    for shard in sorted(set(weight_map.values())):
        shard_arrays, shard_meta = read_arrays(shard_path(index_path, shard))
        metadata.update(shard_meta)
        for name, file in weight_map.items():
            if file == shard:
                if name not in shard_arrays:
                    raise FormatError(f"the index places {name!r} in {shard}, which lacks it",
                                      file=index_path, entry=name, fix="the shards are incomplete")
                arrays[name] = shard_arrays[name]
    for key in (PATHS_KEY, EMPTY_NODES_KEY):  # the tree's records, which the index holds
        if isinstance(index_meta, dict) and isinstance(index_meta.get(key), str):
            metadata[key] = index_meta[key]
    return arrays, metadata


def read(path: str) -> dict[str, Any]:
    """A safetensors file, sharded index or directory holding one, as `{namespace: subtree}`."""
    return read_with_metadata(path)[0]


def read_with_metadata(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """`(read(path), read_metadata(path))` from one parse of the header (of 200,000 tensors,
    seconds), so `convert` and `jckpt inspect` parse it once."""
    arrays, metadata = _arrays_and_metadata(os.fspath(path))
    return (tree_from_names(arrays, metadata.get(PATHS_KEY), empty=metadata.get(EMPTY_NODES_KEY)),
            {k: v for k, v in metadata.items() if not k.startswith(RESERVED_PREFIX)})


def read_metadata(path: str) -> dict[str, str]:
    """The file's own `__metadata__` (what `jckpt.convert` keeps as a jckpt file's metadata),
    less the keys jckpt records there for itself.

    >>> import numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), 'm.safetensors')
    >>> _ = write({'jckpt': {'w': np.ones(2)}}, p, metadata={'source': 'hub'})
    >>> read_metadata(p)
    {'format': 'pt', 'source': 'hub'}
    """
    return read_with_metadata(path)[1]


def _arrays_and_metadata(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every array by name (mapped views) and the `__metadata__`, of a file, index or directory."""
    index = _index_file(path)
    if index is not None:
        arrays, metadata = read_sharded(index)
    elif os.path.isdir(path):
        single = os.path.join(path, 'model.safetensors')
        if not os.path.exists(single):
            raise FormatError("directory holds neither a *.safetensors.index.json nor a "
                              "model.safetensors", file=path, fix="pass the file to read")
        if not inside(path, single):
            raise FormatError("model.safetensors is a symbolic link or lies outside the directory",
                              file=single, fix="put the file itself in the directory")
        arrays, metadata = read_arrays(single)
    else:
        arrays, metadata = read_arrays(path)
    return arrays, metadata


def sniff(path: str, head: bytes | None) -> bool:
    """A plausible header size followed by `{`, in a file that holds that header; or a sharded
    index (file or directory). (One shorter than its header: `jckpt.adapters.cut_short`.)"""
    if head is None:
        return _index_file(path) is not None or os.path.exists(os.path.join(path, 'model.safetensors'))
    if head[:1] == b'{' and b'"weight_map"' in head:
        return True
    end = header_end(head)
    return end is not None and (is_url(path) or end <= os.path.getsize(path))


# --- writing ----------------------------------------------------------------

def _prepare(tree: Any, path: str) -> tuple[list, list[str], list[int]]:
    """Host items, their names, and the write order (largest element first, then name)."""
    items = host_items(check_namespaced(tree, path), path)
    names = _checked_names(items, path)  # everything refused before the keys are warned of
    warn_key_data(tree, path, 'safetensors')
    order = sorted(range(len(items)), key=lambda i: (-items[i][2].dtype.itemsize, names[i]))
    return items, names, order


def _checked_names(items: list, path: str) -> list[str]:
    """The items' tensor names, every dtype one safetensors has, none the header's own
    `__metadata__` key (`InputError` otherwise)."""
    names = flat_names(items, path)
    if METADATA_KEY in names:  # the file's JSON would hold the key twice: no reader takes it
        raise InputError(f"a tensor cannot be named {METADATA_KEY!r}, the header's key for "
                         "the file's metadata", file=path, entry=METADATA_KEY,
                         fix="rename the leaf, or write a jckpt or npz file instead")
    refuse_dtypes([(name, array.dtype) for (_, _, array), name in zip(items, names)
                   if dtype_name(array.dtype) is None], path, 'safetensors')
    return names


def check(tree: Any, path: str) -> None:
    """Refuse a tree `write` cannot hold (a dtype, two names alike), reading no data."""
    _checked_names(abstract_items(tree, path), path)


def _write_file(path: str, items: list, names: list[str], order: list[int],
                meta: dict[str, str]) -> None:
    entries = [(names[i], stored_dtype(items[i][2].dtype), items[i][2].shape, items[i][2].nbytes)
               for i in order]
    raw = encode_header(entries, meta)
    if len(raw) - 8 > MAX_HEADER_BYTES:
        raise InputError(f"header of {len(raw) - 8} bytes is over safetensors' limit", file=path,
                         fix="split the tree into several files (write a sharded index)")
    with published(path) as f:
        f.write(raw)
        for i in order:
            for chunk in iter_payload_chunks(items[i][2]):
                f.write(chunk)


def write(tree: Any, path: str, *, metadata: dict[str, str] | None = None) -> None:
    """Write `{namespace: subtree}` as one safetensors file (C order, little-endian values).

    `metadata` adds string pairs to the file's `__metadata__`. A `path`
    ending in `.safetensors.index.json` writes a sharded checkpoint there
    instead (`write_sharded`).
    """
    path = os.fspath(path)
    if path.endswith(INDEX_SUFFIX):
        write_sharded(tree, path, metadata=metadata)
        return
    items, names, order = _prepare(tree, path)
    meta = {**_metadata(metadata), **_tree_records(tree, items, names, path)}
    _write_file(path, items, names, order, meta)


def _tree_records(tree: Any, items: list, names: list[str], path: str) -> dict[str, str]:
    """What the `__metadata__` records of the tree's structure: the paths of its arrays
    (`PATHS_KEY`) and, when it has any, its nodes without arrays (`EMPTY_NODES_KEY`)."""
    empty = empty_record(tree)
    return {PATHS_KEY: paths_json(items, names, path),
            **({EMPTY_NODES_KEY: empty} if empty else {})}


def _metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    """The `__metadata__` to write: the caller's, with `format` defaulting to `pt`
    (Hugging Face transformers refuses files whose metadata names no format it knows)."""
    meta = {'format': 'pt'}
    meta.update(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InputError("safetensors metadata must map strings to strings",
                         fix="convert the values with str() or json.dumps()")
    return meta


#: Hugging Face's default shard size.
DEFAULT_SHARD_BYTES = 5 * 10**9


def write_sharded(tree: Any, index_path: str, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                  metadata: dict[str, str] | None = None) -> list[str]:
    """Write Hugging Face's sharded layout: `<prefix>-0000i-of-0000n.safetensors` files
    beside `index_path` (`<prefix>.safetensors.index.json`), then the index.

    Each shard holds tensors up to `max_shard_bytes` (a larger tensor gets a
    shard of its own). Every file is published atomically and the index last,
    so a reader that finds the index finds every shard it names. Returns the
    shard file names.

    Example:
        ```python
        write_sharded({'jckpt': params}, 'out/model.safetensors.index.json',
                      max_shard_bytes=2 * 10**9)
        ```
    """
    index_path = os.fspath(index_path)
    base = os.path.basename(index_path)
    if not base.endswith(INDEX_SUFFIX) or base == INDEX_SUFFIX:
        raise InputError(f"the index must be named <prefix>{INDEX_SUFFIX}", file=index_path)
    prefix = base[:-len(INDEX_SUFFIX)]
    items, names, order = _prepare(tree, index_path)
    groups: list[list[int]] = []
    size = 0
    for i in order:
        nbytes = items[i][2].nbytes
        if not groups or (size + nbytes > max_shard_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    directory = os.path.dirname(os.path.abspath(index_path))
    files = [f"{prefix}-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    meta = _metadata(metadata)
    records = _tree_records(tree, items, names, index_path)  # refuses before a shard is written
    for group, file in zip(groups, files):
        _write_file(os.path.join(directory, file), items, names, group, dict(meta))
    index = {'metadata': {**meta, 'total_size': sum(a.nbytes for _, _, a in items), **records},
             'weight_map': {names[i]: file for group, file in zip(groups, files) for i in group}}
    with published(index_path) as f:
        f.write(json.dumps(index, indent=2, ensure_ascii=False).encode('utf-8'))
    return files


def register() -> None:
    from jckpt.adapters import register_format

    register_format('safetensors', read=read, write=write, sniff=sniff, read_metadata=read_metadata,
                    check=check, extensions=('.safetensors', INDEX_SUFFIX), keeps_metadata=True,
                    replace=True, read_with_metadata=read_with_metadata)
