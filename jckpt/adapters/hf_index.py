"""A Hugging Face sharded checkpoint's index (`*.index.json`), read one way by every reader.

The index is JSON whose `weight_map` gives each tensor's shard file; safetensors and torch
checkpoints are sharded so. The safetensors and torch readers, and the listing of what a
path's files are (`jckpt inspect`), each read it: `hf_index` (and `weight_map`) reads it
capped at `MAX_RECORD_BYTES` from a regular file (a crafted index of gigabytes, or a FIFO,
is refused, never read whole or waited on), and `shard_path` places a shard it names.

Example:
    ```python
    for shard in sorted(set(weight_map('model.safetensors.index.json').values())):
        print(shard_path('model.safetensors.index.json', shard))
    ```
"""

from __future__ import annotations

import os
from typing import Any

from jckpt.adapters._common import check_member_name, inside, unsafe_member_name
from jckpt.errors import CheckpointError, FormatError
from jckpt.format.limits import MAX_RECORD_BYTES, json_loads
from jckpt.storage.regular import open_regular


def shard_path(index_path: str, shard: str) -> str:
    """The path of `shard`, a file a Hugging Face index (`*.index.json`) names, beside the index;
    a `FormatError` naming the index and the shard when the name is unsafe, the file a symbolic
    link or outside the index's directory, or missing (a download that stopped part way).

    >>> import tempfile
    >>> shard_path(os.path.join(tempfile.mkdtemp(), 'm.index.json'), 'm-1.bin')
    Traceback (most recent call last):
    ...
    jckpt.errors.FormatError: ...: the index names shard 'm-1.bin', which is not beside it...
    """
    check_member_name(shard, index_path)
    directory = os.path.dirname(os.path.abspath(index_path))
    path = os.path.join(directory, shard)
    if not inside(directory, path):
        raise FormatError(f"shard {shard!r} is a symbolic link or lies outside the index's "
                          "directory", file=index_path, entry=shard,
                          fix="put the shard files themselves beside the index")
    if not os.path.exists(path):
        raise FormatError(f"the index names shard {shard!r}, which is not beside it ({path})",
                          file=index_path, entry=shard,
                          fix="fetch every shard the index's weight_map names into the index's "
                              "directory (a download that stopped part way lacks some)")
    return path


def hf_index(path: str) -> dict[str, Any]:
    """The Hugging Face sharded index `path` (`*.index.json`), its `weight_map` a dict of
    tensor name -> shard file name (`weight_map` gives it alone). Read as no index is large:
    a regular file of at most `MAX_RECORD_BYTES`, JSON nested within `MAX_NESTING`; a
    `FormatError` naming the file otherwise.

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), 'm.index.json')
    >>> _ = open(path, 'w').write('{"weight_map": {"w": "m-1.safetensors"}}')
    >>> weight_map(path)
    {'w': 'm-1.safetensors'}
    """
    try:
        with open_regular(path) as f:
            raw = f.read(MAX_RECORD_BYTES + 1)
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError(f"over {MAX_RECORD_BYTES} bytes, more than an index of shards holds")
        index = json_loads(raw.decode('utf-8'))
    except FileNotFoundError:
        raise FormatError("no such file", file=path, fix="check the path") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"index cannot be read: {e}", file=path,
                          fix="the index file is damaged, or is no index") from None
    found = index.get('weight_map') if isinstance(index, dict) else None
    if not (isinstance(found, dict) and all(isinstance(v, str) for v in found.values())):
        raise FormatError("index has no weight_map of tensor name -> shard file", file=path,
                          fix="pass the *.index.json file of a sharded checkpoint")
    return index


def weight_map(path: str) -> dict[str, str]:
    """The `weight_map` of the Hugging Face index `path` (`hf_index`)."""
    return hf_index(path)['weight_map']


def index_shards(path: str) -> list[str]:
    """The shard files beside `path` that it names, when it is a local Hugging Face index
    (`*.index.json` with a `weight_map` of file names), in name order; [] for another file.
    What a listing adds to the index's own size (the index holds none of the arrays)."""
    if not path.endswith('.index.json') or not os.path.isfile(path):
        return []
    try:
        names = sorted({v for v in weight_map(path).values() if not unsafe_member_name(v)})
    except CheckpointError:
        return []
    directory = os.path.dirname(os.path.abspath(path))
    return [p for p in (os.path.join(directory, n) for n in names)
            if inside(directory, p) and os.path.isfile(p)]


__all__ = ['hf_index', 'index_shards', 'shard_path', 'weight_map']
