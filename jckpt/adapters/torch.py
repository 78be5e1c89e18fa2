"""PyTorch `torch.save` files (`.pt`, `.pth`), read and written without importing torch.

A `torch.save` file is an uncompressed zip with one root folder holding
`data.pkl` (the pickled structure, tensors as references to storages),
`data/<key>` (each storage's raw bytes, 64-byte aligned) and `byteorder`.
Reading maps the archive and unpickles `data.pkl` with an allow-list: only
the tensor and parameter rebuild functions, storage types, dtypes and
`OrderedDict` are known, and any other global (`os.system`, a model
class, ...) is refused with `FormatError` before
anything is called, so a malicious file cannot run code. Tensors come back as
numpy views of the mapped storages (shared storages stay shared), parameters
as their data; ints, floats, bools and strings as themselves.

Writing emits the same archive and a pickle that uses only what
`torch.load(..., weights_only=True)` accepts (no torch needed).

Tree form: the pickled object is the namespace's subtree, read into
`{'jckpt': obj}`; a tree of one namespace is saved as its subtree, several
as `{namespace: subtree}`.

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), 'm.pt')
>>> write({'jckpt': {'w': np.arange(4, dtype=np.float32), 'epoch': 3}}, path)
>>> tree = read(path)['jckpt']
>>> tree['w'].tolist(), tree['epoch']
([0.0, 1.0, 2.0, 3.0], 3)
"""

from __future__ import annotations

import codecs
import io
import math
import os
import pickle
import zipfile
from typing import Any

import numpy as np

from jckpt.adapters import _zip
from jckpt.adapters._common import DEFAULT_NAMESPACE, check_namespaced, map_file, published, single_content
from jckpt.adapters._torch_pickle import DTYPES, STORAGES, Pickler
from jckpt.errors import FormatError
from jckpt.format import limits
from jckpt.format.payload import iter_payload_chunks

# --- reading ----------------------------------------------------------------

class _StorageType:
    """A storage class named in the pickle: its element dtype (None: untyped bytes)."""

    def __init__(self, name: str, dtype: Any) -> None:
        self.name = name
        self.dtype = None if dtype is None else np.dtype(dtype)


class _DType:
    """A torch dtype named in the pickle."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype = np.dtype(DTYPES[name])


def _int(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{what} must be an integer, not {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{what} is negative")
    return x


#: A tensor may view its storage's elements repeatedly (stride 0), but a view this many times
#: larger than its storage is refused: converting it would write a file sized by the pickle.
_VIEW_FACTOR = 64


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, dtype: np.dtype | None = None
             ) -> np.ndarray:
    if not isinstance(storage, np.ndarray):
        raise ValueError("tensor storage is not a storage reference")
    if dtype is not None and storage.dtype != dtype:
        if storage.dtype != np.uint8 or storage.size % dtype.itemsize:
            raise ValueError(f"storage of {storage.dtype} cannot hold {dtype}")
        storage = storage.view(dtype)
    offset = _int(offset, 'storage offset')
    if not (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride)):
        raise ValueError("size and stride must be tuples of the same length")
    size = tuple(_int(s, 'size') for s in size)
    stride = tuple(_int(s, 'stride') for s in stride)
    limits.check_shape(size, storage.itemsize)  # (0, 10**30) or 70 dims: no array has them
    if 0 in size:
        return np.zeros(size, storage.dtype)
    if math.prod(size) > _VIEW_FACTOR * storage.size + (1 << 20):
        raise ValueError(f"tensor of shape {size} repeats a storage of {storage.size} elements "
                         "implausibly often")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= storage.size:
        raise ValueError(f"tensor reaches element {last} of a storage of {storage.size}")
    base = storage[offset:]
    contiguous = tuple(math.prod(size[i + 1:]) for i in range(len(size)))
    if stride == contiguous:
        return base[:math.prod(size)].reshape(size)
    raw = base.view(np.dtype((np.void, storage.itemsize)))  # as_strided goes through the
    # array interface, which cannot name some ml_dtypes (float8_e5m2 says '<f1')
    return np.lib.stride_tricks.as_strided(raw, shape=size,
                                           strides=tuple(s * storage.itemsize for s in stride),
                                           writeable=False).view(storage.dtype)


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None,
                       metadata=None):
    return _rebuild(storage, offset, size, stride)


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    if not isinstance(dtype, _DType):
        raise ValueError("tensor dtype is not a torch dtype")
    return _rebuild(storage, offset, size, stride, dtype.dtype)


def _rebuild_parameter(data, requires_grad=False, hooks=None):
    if not isinstance(data, np.ndarray):
        raise ValueError("parameter data is not a tensor")
    return data


def _rebuild_parameter_with_state(data, requires_grad, hooks, state):
    return _rebuild_parameter(data)


def _encode(text, encoding='latin1'):
    if not (isinstance(text, str) and encoding in ('latin1', 'latin-1')):
        raise ValueError("_codecs.encode is allowed only for latin1 text")
    return codecs.encode(text, encoding)


class _StateDict(dict):
    """`OrderedDict` as unpickled: a dict that ignores the `_metadata` state torch attaches.

    Built from nothing (torch pickles `OrderedDict()`, then its items) or from a
    list of pairs, never from a tensor: iterating a crafted view of a tiny storage
    would cost time and memory far beyond the pickle's size.
    """

    def __init__(self, *args: Any) -> None:
        if args and (len(args) > 1 or not isinstance(args[0], (list, tuple))):
            raise ValueError("OrderedDict is allowed only empty or from a list of pairs")
        super().__init__(*args)

    def __setstate__(self, state: Any) -> None:
        pass


def _size(dims: Any = ()) -> tuple[int, ...]:
    """`torch.Size` as unpickled: a tuple of ints, never built from a tensor (see `_StateDict`)."""
    if not isinstance(dims, (list, tuple)) or not all(type(d) is int for d in dims):
        raise ValueError("torch.Size is allowed only from a tuple of ints")
    return tuple(dims)


def _plain(obj: Any, budget: list[int], depth: int = 0, open_ids: frozenset = frozenset()) -> Any:
    """Plain dicts, lists and tuples all the way down (JAX trees know exact types only).

    Refuses with `ValueError` what a pickle can build but no tree can be:
    nesting deeper than `jckpt.format.limits.MAX_NESTING`, a container
    holding itself, dict keys that cannot be sorted together (JAX sorts them),
    and more nodes than `budget[0]` (shared sub-containers expanded
    exponentially; each visit costs a reference in the pickle, so a budget of
    its length refuses only such expansions).
    """
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError("shared references expand to more objects than the pickle holds")
    if isinstance(obj, str):
        obj.encode('utf-8')  # a lone surrogate (pickles may spell one) is no name: ValueError
    if not isinstance(obj, (dict, list, tuple)):
        return obj
    if depth >= limits.MAX_NESTING:
        raise ValueError(f"containers nest deeper than {limits.MAX_NESTING}")
    if id(obj) in open_ids:
        raise ValueError(f"a {type(obj).__name__} contains itself")
    inner = open_ids | {id(obj)}
    if isinstance(obj, dict):
        try:
            sorted(obj)
        except TypeError:
            kinds = sorted({type(k).__name__ for k in obj})
            raise ValueError(f"a dict mixes keys of types {', '.join(kinds)}, which a tree "
                             "cannot order") from None
        return {_plain(k, budget, depth + 1, inner): _plain(v, budget, depth + 1, inner)
                for k, v in obj.items()}
    out = [_plain(v, budget, depth + 1, inner) for v in obj]
    return out if isinstance(obj, list) else tuple(out)


_ALLOWED: dict[tuple[str, str], Any] = {
    ('torch._utils', '_rebuild_tensor_v2'): _rebuild_tensor_v2,
    ('torch._utils', '_rebuild_tensor_v3'): _rebuild_tensor_v3,
    ('torch._utils', '_rebuild_parameter'): _rebuild_parameter,
    ('torch._utils', '_rebuild_parameter_with_state'): _rebuild_parameter_with_state,
    ('collections', 'OrderedDict'): _StateDict,
    ('torch', 'Size'): _size,
    ('_codecs', 'encode'): _encode,
    ('torch.storage', 'UntypedStorage'): _StorageType('UntypedStorage', None),
    **{('torch', name): _StorageType(name, dt) for name, dt in STORAGES.items()},
    **{('torch', name): _DType(name) for name in DTYPES},
}


class _Unpickler(pickle._Unpickler):
    """The pure-Python unpickler, so that BUILD can be limited too: it may set state only on
    unpickled `OrderedDict`s (whose state is ignored), never on arrays or anything else."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data, storage) -> None:
        super().__init__(io.BytesIO(data))
        self._storage = storage

    def load_build(self) -> None:
        state = self.stack.pop()
        if not isinstance(self.stack[-1], _StateDict):
            raise ValueError(f"BUILD on a {type(self.stack[-1]).__name__} is not allowed")
        del state

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == 'storage'
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str)):
            raise ValueError(f"unknown persistent reference {pid!r:.100}")
        return self._storage(pid[1], pid[2], _int(pid[4], 'storage size'))


class _Refused(Exception):
    pass


def _root(zf: zipfile.ZipFile, path: str) -> str:
    pkls = [n for n in zf.namelist() if n.split('/')[-1] == 'data.pkl' and n.count('/') <= 1]
    if len(pkls) != 1:
        raise FormatError("archive holds no single <root>/data.pkl", file=path,
                          fix="pass a file written by torch.save")
    return pkls[0][:-len('data.pkl')]


#: How a legacy (non-zip) `torch.save` file starts: pickle protocol 2, then torch's magic number.
LEGACY_MAGIC = b'\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.'


def sniff(path: str, head: bytes | None) -> bool:
    if head is not None and head.startswith(LEGACY_MAGIC):
        return True  # recognised, so that reading it says why it is refused
    if head is None or head[:4] != b'PK\x03\x04':
        return False
    with zipfile.ZipFile(_zip.zip_source(path)) as zf:
        return any(n.endswith('/data.pkl') and n.count('/') == 1 for n in zf.namelist())


def read(path: str) -> dict[str, Any]:
    """A `torch.save` file as `{'jckpt': obj}`, tensors as numpy views; no code runs."""
    path = os.fspath(path)
    buffer = map_file(path)
    if bytes(buffer[:1]) == b'\x80':
        raise FormatError("a legacy torch.save file (not a zip archive: written by torch before "
                          "1.6 or with _use_new_zipfile_serialization=False), which jckpt does "
                          "not read", file=path,
                          fix="load it with torch.load and save it again with torch.save's "
                              "default (zip) format")
    budget = _zip.Budget(len(buffer))
    with _zip.open_zip(path, buffer) as zf:
        root = _root(zf, path)
        infos = {i.filename: i for i in zf.infolist()}
        order = bytes(_zip.member_bytes(zf, buffer, infos[root + 'byteorder'], path, limit=16,
                                        budget=budget)).decode(
            'ascii', 'replace').strip() if root + 'byteorder' in infos else 'little'
        if order not in ('little', 'big'):
            raise FormatError(f"unknown byteorder {order!r}", file=path, fix="the file is damaged")
        cache: dict[str, np.ndarray] = {}

        def storage(kind: _StorageType, key: str, numel: int) -> np.ndarray:
            name = f"{root}data/{key}"
            info = infos.get(name)
            if info is None or '/' in key or key in ('', '.', '..'):
                raise ValueError(f"storage {key!r} is not in the archive")
            if name not in cache:
                data = _zip.member_bytes(zf, buffer, info, path, budget=budget)
                cache[name] = np.frombuffer(data, dtype=np.uint8)
            raw = cache[name]
            dtype = np.dtype(np.uint8) if kind.dtype is None else kind.dtype
            if order == 'big':
                dtype = dtype.newbyteorder('>')
            if numel * dtype.itemsize > raw.size:
                raise ValueError(f"storage {key!r} holds {raw.size} bytes, fewer than "
                                 f"{numel} x {dtype.itemsize}")
            return raw[:numel * dtype.itemsize].view(dtype)

        pickled = bytes(_zip.member_bytes(zf, buffer, infos[root + 'data.pkl'], path,
                                          budget=budget))
        try:
            obj = _Unpickler(pickled, storage).load()
        except _Refused as e:
            raise FormatError(f"refusing to unpickle global {e}: only tensors, storages, dtypes "
                              "and plain containers are allowed", file=path,
                              fix="the file holds code or objects, not just weights; do not "
                                  "trust it, or save only a state_dict") from None
        except FormatError:
            raise
        except Exception as e:
            raise FormatError(f"data.pkl is not a valid torch pickle ({type(e).__name__}: {e})",
                              file=path, fix="the file is damaged or not written by torch.save") \
                from None
    try:
        tree = _plain(obj, [len(pickled) + 16])
    except ValueError as e:
        raise FormatError(f"data.pkl holds no tree: {e}", file=path,
                          fix="the file is damaged or crafted; save a plain state_dict") from None
    _check_expansion(tree, len(buffer), path)
    return {DEFAULT_NAMESPACE: tree}


def _leaf_bytes(tree: Any) -> int:
    """The bytes of every array leaf of a plain tree, a leaf met twice counted twice."""
    total, stack = 0, [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, np.ndarray):
            total += node.nbytes
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return total


def _check_expansion(tree: Any, file_size: int, path: str) -> None:
    """Refuse a tree whose leaves hold far more bytes than the file (a storage viewed a
    thousand times): every leaf becomes a payload of its own when the tree is converted."""
    total = _leaf_bytes(tree)
    bound = limits.MAX_LEAF_EXPANSION * file_size + (1 << 20)
    if total > bound:
        raise FormatError(f"its tensors view {total} bytes of storage in all, more than "
                          f"{limits.MAX_LEAF_EXPANSION} times the file's {file_size}: the same "
                          "storage is viewed many times over", file=path,
                          fix="the file is crafted or damaged; save each tensor once "
                              "(tied weights once per tie)")


def check(tree: Any, path: str) -> None:
    """Refuse a tree `write` cannot hold (a dtype torch lacks, a key that is not a str or an
    int, a leaf that is not an array or a number), reading no data.

    >>> check({'jckpt': {'w': np.ones(2, 'int4')}}, 'm.pt')
    Traceback (most recent call last):
    ...
    jckpt.errors.InputError: m.pt: entry w: dtype int4 has no torch equivalent ...
    """
    path = os.fspath(path)
    Pickler(path, fetch=False).value(single_content(check_namespaced(tree, path)), '')


def write(tree: Any, path: str) -> None:
    """Write `{namespace: subtree}` as a file `torch.load(path, weights_only=True)` reads.

    Containers (dict, list, tuple), Python numbers, strings and None are
    pickled as themselves; arrays (numpy, JAX) become CPU tensors.
    """
    path = os.fspath(path)
    pickler = Pickler(path)
    pickler.value(single_content(check_namespaced(tree, path)), '')
    pickler.out += b'.'
    root = 'archive/'
    with published(path) as f, zipfile.ZipFile(f, 'w', zipfile.ZIP_STORED, allowZip64=True) as zf:
        def small(name: str, data: bytes) -> None:
            _zip.write_member(zf, root + name, [data], len(data))
        small('data.pkl', bytes(pickler.out))
        small('.format_version', b'1')
        small('.storage_alignment', b'64')
        small('byteorder', b'little')
        for key, array in enumerate(pickler.storages):
            _zip.write_member(zf, f"{root}data/{key}", iter_payload_chunks(array), array.nbytes)
        small('version', b'3\n')
        small('.data/serialization_id', b'%040d' % (int.from_bytes(os.urandom(16), 'little') % 10**40))


def register() -> None:
    from jckpt.adapters import register_format

    register_format('torch', read=read, write=write, sniff=sniff, check=check,
                    extensions=('.pt', '.pth'), replace=True)
