"""Legacy `torch.save` files: torch before 1.6, or `_use_new_zipfile_serialization=False`.

Such a file is five pickles in a row, then the storages' bytes:

1. torch's magic number, 2. the protocol version (1001), 3. the system's
facts (byte order, C type sizes), 4. the object, its storages as persistent
references `('storage', type, key, location, numel, view)`, 5. the storage
keys in the order their data follows; then for each key an int64 element
count and that many elements, little-endian whatever the writer's byte order.

The object is unpickled with the same allow-list as a zip file's `data.pkl`
(`jckpt.adapters._torch_unpickle`), so no code runs. Its storages' data
comes after it, so it is unpickled twice: first to learn each storage's type
(against stand-ins that hold no memory), then against the file's bytes. The
older tar form (torch before 0.4) is not read.

>>> import io, pickle
>>> raw = LEGACY_MAGIC + b''.join(pickle.dumps(x, protocol=2) for x in (1001, {}, {'epoch': 3}, []))
>>> read(raw, 'old.pt')
{'epoch': 3}
"""

from __future__ import annotations

import reprlib
from typing import Any

import numpy as np

from jckpt.adapters._common import array_view
from jckpt.adapters._torch_unpickle import StorageType, to_tree, unpickle
from jckpt.errors import FormatError

#: How a legacy file starts: pickle protocol 2, then torch's magic number (a LONG1).
LEGACY_MAGIC = b'\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.'
_PROTOCOL = 1001


class _Reader:
    """A read-only file over a buffer, so pickles are read from a mapping without a copy."""

    def __init__(self, buffer: Any, pos: int = 0) -> None:
        self.view = memoryview(buffer).cast('B')
        self.pos = pos

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        out = bytes(self.view[self.pos:end])
        self.pos = end
        return out

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def readline(self) -> bytes:
        start = self.pos
        while self.pos < len(self.view):
            chunk = bytes(self.view[self.pos:self.pos + 256])
            at = chunk.find(b'\n')
            if at >= 0:
                self.pos += at + 1
                return bytes(self.view[start:self.pos])
            self.pos += len(chunk)
        return bytes(self.view[start:])


def read(buffer: Any, path: str) -> Any:
    """The object a legacy `torch.save` file `buffer` holds, tensors as numpy views of it."""
    reader = _Reader(buffer, len(LEGACY_MAGIC))
    protocol = unpickle(reader, None, path, 'the legacy header')
    facts = unpickle(reader, None, path, 'the legacy header')
    if protocol != _PROTOCOL or not isinstance(facts, dict):
        raise FormatError(f"legacy torch.save header of protocol {reprlib.repr(protocol):.40}, not "
                          f"{_PROTOCOL}", file=path, fix="the file is damaged or not written by "
                                                         "torch.save")
    start = reader.pos
    kinds: dict[str, tuple[np.dtype, int]] = {}

    def stand_in(kind: StorageType, key: str, numel: int) -> np.ndarray:
        dtype = np.dtype(np.uint8) if kind.dtype is None else kind.dtype
        if kinds.setdefault(key, (dtype, numel)) != (dtype, numel):
            raise ValueError(f"storage {key!r} is referenced with two types or sizes")
        if numel * dtype.itemsize > len(buffer):
            raise ValueError(f"storage {key!r} of {numel} elements is larger than the file")
        return np.zeros(numel, dtype)  # calloc: pages untouched, nothing read or copied

    unpickle(reader, stand_in, path)
    end = reader.pos
    keys = unpickle(reader, None, path, 'the legacy storage list')
    storages = _storages(buffer, reader.pos, keys, kinds, path)

    def storage(kind: StorageType, key: str, numel: int) -> np.ndarray:
        return storages[key]

    obj = unpickle(_Reader(buffer, start), storage, path)
    return to_tree(obj, end - start, len(buffer), path)


def _storages(buffer: Any, pos: int, keys: Any, kinds: dict[str, tuple[np.dtype, int]],
              path: str) -> dict[str, np.ndarray]:
    """Each storage's elements, from `pos` on: per key, an int64 count, then the data."""
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)
            and len(set(keys)) == len(keys) and set(keys) == set(kinds)):
        raise FormatError("the legacy storage list does not name each storage once", file=path,
                          fix="the file is damaged or not written by torch.save")
    out = {}
    for key in keys:
        dtype, numel = kinds[key]
        count = array_view(buffer, np.dtype('<i8'), (), pos, path, f"storage {key}")
        if int(count) != numel:
            raise FormatError(f"storage {key!r} holds {int(count)} elements, not the {numel} its "
                              "tensors name", file=path, fix="the file is damaged")
        out[key] = array_view(buffer, dtype.newbyteorder('<'), (numel,), pos + 8, path,
                              f"storage {key}")
        pos += 8 + numel * dtype.itemsize
    return out
