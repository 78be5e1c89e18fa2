"""The reading side of `torch.save` files: an unpickler that builds nothing but tensors.

`data.pkl` (and a legacy file's pickles) are read by the pure-Python unpickler
with an allow-list: only the tensor and parameter rebuild functions, storage
types, dtypes, `torch.Size` and `OrderedDict` are known, and any other global
(`os.system`, a model class, ...) is refused before anything is called, so a
malicious file cannot run code. Tensors are numpy views of the storages the
caller hands in; what comes out is made plain dicts, lists and tuples, and
refused when it expands far beyond the file (`to_tree`).

>>> import io, pickle
>>> unpickle(io.BytesIO(pickle.dumps({'epoch': 3}, protocol=2)), None, 'm.pt')
{'epoch': 3}
"""

from __future__ import annotations

import codecs
import math
import pickle
import reprlib
from collections.abc import Callable
from typing import IO, Any

import numpy as np

from jckpt.adapters._torch_pickle import DTYPES, STORAGES
from jckpt.errors import FormatError
from jckpt.format import limits

#: The storage callback: `(storage type, key, element count) -> numpy array of the storage`.
Storage = Callable[['StorageType', str, int], np.ndarray]


class StorageType:
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
    if isinstance(obj, _DType):
        return f"torch.{obj.name}"  # a dtype as a value (a config's): its name, as str() gives
    if isinstance(obj, (StorageType, _TensorClass)) or obj is _Device or obj is complex:
        raise ValueError(f"a bare {getattr(obj, 'name', type(obj).__name__)} is no value")
    if isinstance(obj, str):
        obj.encode('utf-8')  # a lone surrogate (pickles may spell one) is no name: ValueError
        obj = str(obj)  # a torch.device read as its name
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


class _TensorClass:
    """`torch.Tensor` (or `Parameter`, `Buffer`) named as the class of a rebuilt tensor."""


class _Device(str):
    """`torch.device` as unpickled: its name (`'cuda:0'`), a string a tree can hold."""

    def __new__(cls, kind: Any, index: Any = None) -> _Device:
        if not isinstance(kind, str) or not (index is None or type(index) is int):
            raise ValueError("torch.device is allowed only from a name and an index")
        return super().__new__(cls, kind if index is None or ':' in kind else f"{kind}:{index}")


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> np.ndarray:
    """A tensor pickled with Python attributes (a `Buffer`, a tagged parameter): the tensor,
    its attributes (`state`) dropped."""
    if func not in (_rebuild_tensor_v2, _rebuild_tensor_v3, _rebuild_parameter) \
            or not isinstance(new_type, _TensorClass) or not isinstance(args, tuple):
        raise ValueError("_rebuild_from_type_v2 is allowed only for tensors")
    return func(*args)


_ALLOWED: dict[tuple[str, str], Any] = {
    ('torch._tensor', '_rebuild_from_type_v2'): _rebuild_from_type_v2,
    ('torch', 'Tensor'): _TensorClass(),
    ('torch.nn.parameter', 'Parameter'): _TensorClass(),
    ('torch.nn.parameter', 'Buffer'): _TensorClass(),
    ('torch', 'device'): _Device,
    ('builtins', 'complex'): complex,
    ('__builtin__', 'complex'): complex,
    ('torch._utils', '_rebuild_tensor_v2'): _rebuild_tensor_v2,
    ('torch._utils', '_rebuild_tensor_v3'): _rebuild_tensor_v3,
    ('torch._utils', '_rebuild_parameter'): _rebuild_parameter,
    ('torch._utils', '_rebuild_parameter_with_state'): _rebuild_parameter_with_state,
    ('collections', 'OrderedDict'): _StateDict,
    ('torch', 'Size'): _size,
    ('_codecs', 'encode'): _encode,
    ('torch.storage', 'UntypedStorage'): StorageType('UntypedStorage', None),
    **{('torch', name): StorageType(name, dt) for name, dt in STORAGES.items()},
    **{('torch', name): _DType(name) for name in DTYPES},
}


def _dtypes(names: str, fix: str) -> dict[tuple[str, str], tuple[str, str]]:
    return {('torch', n): (f"a tensor of dtype torch.{n.replace('Storage', '')}",
                           f"numpy has no such type: {fix} in torch and save it again")
            for n in names.split()}


#: Globals torch's own weights-only loading accepts but a tree of numpy arrays cannot hold:
#: refused saying what they are, not as code.
_UNSUPPORTED: dict[tuple[str, str], tuple[str, str]] = {
    **_dtypes('complex32 chalf ComplexHalfStorage', "convert it with t.to(torch.complex64)"),
    **_dtypes('qint8 quint8 qint32 quint4x2 quint2x4 QInt8Storage QUInt8Storage QInt32Storage '
              'QUInt4x2Storage QUInt2x4Storage', "dequantize it with t.dequantize()"),
    **_dtypes('float4_e2m1fn_x2 bits8 bits16 bits1x8 bits2x4 bits4x2 int1 int2 int3 int4 int5 '
              'int6 int7 uint1 uint2 uint3 uint4 uint5 uint6 uint7',
              "view or convert it (t.view(torch.uint8), t.to(torch.float32))"),
    ('torch._utils', '_rebuild_qtensor'): ("a quantized tensor",
                                           "dequantize it in torch first (t.dequantize())"),
    ('torch._utils', '_rebuild_sparse_tensor'): ("a sparse tensor",
                                                 "make it dense in torch first (t.to_dense())"),
    ('torch._utils', '_rebuild_nested_tensor'): ("a nested tensor",
                                                 "save its components (t.unbind()) instead"),
    ('torch._utils', '_rebuild_meta_tensor_no_storage'): (
        "a tensor on the meta device (a shape without data)", "save a tensor that holds data"),
    ('torch._utils', '_rebuild_wrapper_subclass'): (
        "a tensor subclass without storage (a meta or distributed tensor)",
        "save plain tensors (for a DTensor, t.full_tensor())"),
}


class _Unpickler(pickle._Unpickler):
    """The pure-Python unpickler, so that BUILD can be limited too: it may set state only on
    unpickled `OrderedDict`s (whose state is ignored), never on arrays or anything else."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: IO[bytes], storage: Storage | None) -> None:
        super().__init__(file)
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
            if (module, name) in _UNSUPPORTED:
                raise _Unsupported(*_UNSUPPORTED[module, name])
            if module.startswith('torch.distributed'):
                raise _Unsupported(f"a distributed (sharded) tensor ({module}.{name})",
                                   "gather it into plain tensors first: a FULL_STATE_DICT of "
                                   "FSDP, or DTensor.full_tensor()")
            if module.split('.')[0] == 'numpy':
                raise _Unsupported(f"a numpy object ({module}.{name}: an np.ndarray or "
                                   "np.random.get_state()), which torch.load(weights_only=True) "
                                   "refuses too", "save tensors (torch.from_numpy(a)) or plain "
                                                  "numbers instead of numpy objects")
            raise _Refused(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        # ('storage', type, key, location, numel), and a legacy file's view metadata after it
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == 'storage'
                and isinstance(pid[1], StorageType) and isinstance(pid[2], str)
                and self._storage is not None):
            raise ValueError(f"unknown persistent reference {reprlib.repr(pid):.100}")  # bounded:
            # a list of itself twice, 40 deep, has a full repr of 2**40 items
        if len(pid) == 6 and pid[5] is not None:
            raise ValueError("a view of a storage (written by torch before 1.0) is not supported")
        return self._storage(pid[1], pid[2], _int(pid[4], 'storage size'))


class _Refused(Exception):
    pass


class _Unsupported(Exception):
    def __init__(self, what: str, fix: str) -> None:
        super().__init__(what)
        self.what, self.fix = what, fix


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


def unpickle(file: IO[bytes], storage: Storage | None, path: str, what: str = 'data.pkl') -> Any:
    """The object pickled in `file` (up to its STOP), storages through `storage`.

    A global outside the allow-list, or any other failure, is a `FormatError` naming `path`.
    """
    try:
        return _Unpickler(file, storage).load()
    except _Unsupported as e:
        raise FormatError(f"it holds {e.what}, which jckpt cannot read", file=path,
                          fix=e.fix) from None
    except _Refused as e:
        raise FormatError(f"refusing to unpickle global {e}: only tensors, storages, dtypes "
                          "and plain containers are allowed", file=path,
                          fix="the file holds code or objects, not just weights; do not "
                              "trust it, or save only a state_dict") from None
    except FormatError:
        raise
    except Exception as e:
        raise FormatError(f"{what} is not a valid torch pickle ({type(e).__name__}: {e})",
                          file=path, fix="the file is damaged or not written by torch.save") \
            from None


def to_tree(obj: Any, pickled: int, file_size: int, path: str) -> Any:
    """`obj` as plain dicts, lists and tuples; `FormatError` for what no tree can be (see
    `_plain`; `pickled` is the pickle's length) or a tree far larger than the file."""
    try:
        tree = _plain(obj, [pickled + 16])
    except ValueError as e:
        raise FormatError(f"data.pkl holds no tree: {e}", file=path,
                          fix="the file is damaged or crafted; save a plain state_dict") from None
    _check_expansion(tree, file_size, path)
    return tree


__all__ = ['Storage', 'StorageType', 'to_tree', 'unpickle']
