"""The pickle side of `torch.save` files: torch's dtype vocabulary, and an emitter of the
`data.pkl` that `torch.load(..., weights_only=True)` accepts.

The emitter writes protocol 2 by hand, using only the globals torch's
weights-only unpickler allows (its tensor rebuild functions, storage types
and `OrderedDict`), so writing needs no torch. `jckpt.adapters.torch` puts
its output and the storages it collects into the zip archive.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import ml_dtypes
import numpy as np

from jckpt.errors import InputError
from jckpt.format.payload import stored_dtype

#: Typed storages torch pickles by class name (the classic dtypes).
STORAGES = {
    'FloatStorage': np.float32, 'DoubleStorage': np.float64, 'HalfStorage': np.float16,
    'BFloat16Storage': ml_dtypes.bfloat16, 'LongStorage': np.int64, 'IntStorage': np.int32,
    'ShortStorage': np.int16, 'CharStorage': np.int8, 'ByteStorage': np.uint8,
    'BoolStorage': np.bool_, 'ComplexFloatStorage': np.complex64,
    'ComplexDoubleStorage': np.complex128,
}
#: torch dtypes by the name torch pickles them under.
DTYPES = {
    'float32': np.float32, 'float64': np.float64, 'float16': np.float16,
    'bfloat16': ml_dtypes.bfloat16, 'int64': np.int64, 'int32': np.int32, 'int16': np.int16,
    'int8': np.int8, 'uint8': np.uint8, 'bool': np.bool_, 'complex64': np.complex64,
    'complex128': np.complex128, 'uint16': np.uint16, 'uint32': np.uint32, 'uint64': np.uint64,
    'float8_e4m3fn': ml_dtypes.float8_e4m3fn, 'float8_e5m2': ml_dtypes.float8_e5m2,
    'float8_e4m3fnuz': ml_dtypes.float8_e4m3fnuz, 'float8_e5m2fnuz': ml_dtypes.float8_e5m2fnuz,
    'float8_e8m0fnu': ml_dtypes.float8_e8m0fnu,
}

_TYPED = {np.dtype(dt): name for name, dt in STORAGES.items()}
_UNTYPED = {np.dtype(dt): name for name, dt in DTYPES.items()
            if np.dtype(dt) not in _TYPED}


def _child(where: str, key: Any) -> str:
    """The name of `where`'s child `key` in errors (`a/b/0`)."""
    return f"{where}/{key}" if where else str(key)


class Pickler:
    """A minimal protocol-2 pickle emitter for containers, numbers, strings and tensors.

    `fetch=False` only checks: each tensor is described (dtype, shape), not
    brought to host, and no storage is kept, so a tree is refused for what
    `fetch=True` would refuse without its data being read.

    >>> p = Pickler('m.pt')
    >>> p.value({'w': np.ones(2, np.float32), 'n': 3}, '')
    >>> [s.dtype.name for s in p.storages]
    ['float32']
    """

    def __init__(self, path: str, fetch: bool = True) -> None:
        self.out = bytearray(b'\x80\x02')
        self.path = path
        self.fetch = fetch
        self.storages: list[np.ndarray] = []
        self.tensors = 0  # storages emitted (kept in `storages` only when fetching)
        self._seen: dict[tuple, tuple[str, Any]] = {}  # a leaf's identity: its key, the leaf
        self._keep: list[Any] = []  # the leaves seen, alive while their ids are keys
        self._views: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # see `share`
        self._spans: list[np.ndarray] = []  # the storages `share` found, by number
        self._span_keys: dict[int, str] = {}  # a span's storage key, once emitted

    def share(self, content: Any) -> None:
        """Plan one storage for the numpy arrays of `content` that view overlapping memory
        (`w`, `w[0]`, `w.T`, as tensors read from one storage are), each a view of it with
        its own offset and strides, as `torch.save` keeps them; see `overlapping_views`."""
        if self.fetch:
            self._keep.append(content)  # the ids below stay valid while it lives
            self._spans, self._views = overlapping_views(_arrays(content))

    def glob(self, module: str, name: str) -> None:
        self.out += b'c' + module.encode() + b'\n' + name.encode() + b'\n'

    def int(self, v: int) -> None:
        if 0 <= v < 256:
            self.out += b'K' + bytes([v])
        elif 0 <= v < 65536:
            self.out += b'M' + struct.pack('<H', v)
        elif -2**31 <= v < 2**31:
            self.out += b'J' + struct.pack('<i', v)
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, 'little', signed=True)
            self.out += b'\x8a' + bytes([len(raw)]) + raw

    def tuple(self, items, where: str) -> None:
        if not items:
            self.out += b')'
            return
        if len(items) > 3:
            self.out += b'('
        for i, x in enumerate(items):
            self.value(x, _child(where, i))
        self.out += {1: b'\x85', 2: b'\x86', 3: b'\x87'}.get(len(items), b't')

    def value(self, x: Any, where: str) -> None:
        if x is None:
            self.out += b'N'
        elif isinstance(x, np.generic):  # np.float64 is a float, but a scalar array to the user
            self.tensor(x, where)
        elif isinstance(x, bool):
            self.out += b'\x88' if x else b'\x89'
        elif isinstance(x, int):
            self.int(x)
        elif isinstance(x, float):
            self.out += b'G' + struct.pack('>d', x)
        elif isinstance(x, str):
            try:  # a lone surrogate: pickle spells it, but jckpt's reader refuses the file
                raw = x.encode('utf-8')
            except UnicodeEncodeError:
                raise InputError(f"the string {x!r:.60} holds a lone surrogate, which no UTF-8 "
                                 "text can hold", file=self.path,
                                 entry=where.encode('utf-8', 'backslashreplace').decode() or None,
                                 fix="use plain text") from None
            self.out += b'X' + struct.pack('<I', len(raw)) + raw
        elif isinstance(x, complex):  # as torch pickles one (its weights-only loading takes it)
            self.glob('__builtin__', 'complex')
            self.tuple((x.real, x.imag), where)
            self.out += b'R'
        elif isinstance(x, bytes):  # protocol 2's spelling: _codecs.encode(text, 'latin1')
            self.glob('_codecs', 'encode')
            self.tuple((x.decode('latin1'), 'latin1'), where)
            self.out += b'R'
        elif isinstance(x, dict):
            self.out += b'}'
            if x:
                self.out += b'('
                for k, v in x.items():
                    if isinstance(k, bool) or not isinstance(k, (str, int)):
                        raise InputError(f"dict key {k!r} cannot be saved", file=self.path,
                                         entry=where or None, fix="use str or int keys")
                    self.value(k, where)
                    self.value(v, _child(where, k))
                self.out += b'u'
        elif isinstance(x, list):
            self.out += b']'
            if x:
                self.out += b'('
                for i, v in enumerate(x):
                    self.value(v, _child(where, i))
                self.out += b'e'
        elif isinstance(x, tuple) and not hasattr(x, '_fields'):
            self.tuple(x, where)
        else:
            self.tensor(x, where)

    def tensor(self, x: Any, where: str) -> None:
        """Emit `x` as a tensor; a leaf met again (tied weights: the same array, or a numpy
        view of the same memory) reuses its storage, as torch's own `state_dict` does, and
        a view `share` planned is emitted on its span's storage."""
        if id(x) in self._views:
            self._view(x, where)
            return
        ident = _identity(x)
        if ident in self._seen:
            key, leaf = self._seen[ident]
        else:
            from jckpt.trees import to_host
            try:
                leaf = to_host.host_leaves([(where, x)], fetch=self.fetch)[0]
            except InputError as e:
                raise InputError(e.message, file=self.path, entry=where, fix=e.fix) from None
            key = None
        self._emit(leaf, key, where)
        if key is None:
            self._seen[ident] = (str(self.tensors - 1), leaf)
        self._keep.append(x)

    def _view(self, x: np.ndarray, where: str) -> None:
        """Emit `x` on the storage of the span `share` placed it in (emitted at its first view)."""
        span, offset, strides = self._views[id(x)]
        new = span not in self._span_keys
        if new:
            self._span_keys[span] = str(self.tensors)
        self._emit(x, self._span_keys[span], where, (self._spans[span], offset, strides), new=new)

    def _emit(self, leaf: Any, key: str | None, where: str,
              view: tuple[np.ndarray, int, tuple[int, ...]] | None = None, new: bool = False
              ) -> None:
        """The rebuild call of `leaf` on storage `key` (None: a new storage, kept), at
        `view`'s `(storage, offset, strides)` (in elements) when given (`new`: the storage
        is emitted here first), else contiguous from its start."""
        dtype = stored_dtype(leaf.dtype)
        plain = dtype.newbyteorder('=') if dtype.byteorder == '<' else dtype
        shape = tuple(int(d) for d in leaf.shape)
        whole = leaf if view is None else view[0]
        if plain in _TYPED:
            rebuild, kind = '_rebuild_tensor_v2', ('torch', _TYPED[plain])
            numel = math.prod(shape) if view is None else view[0].size
        elif plain in _UNTYPED:
            rebuild, kind, numel = '_rebuild_tensor_v3', ('torch.storage', 'UntypedStorage'), \
                whole.nbytes
        else:
            raise InputError(f"dtype {leaf.dtype} has no torch equivalent", file=self.path,
                             entry=where, fix="cast it, or write a jckpt or npz file instead")
        if key is None or new:
            key = str(self.tensors)
            self.tensors += 1
            if self.fetch:
                self.storages.append(leaf.array if view is None else view[0])
        self.glob('torch._utils', rebuild)
        self.out += b'(('
        self.value('storage', where)
        self.glob(*kind)
        self.value(key, where)
        self.value('cpu', where)
        self.int(numel)
        self.out += b'tQ'
        self.int(0 if view is None else view[1])
        self.tuple(shape, where)
        self.tuple(tuple(math.prod(shape[i + 1:]) for i in range(len(shape))) if view is None
                   else view[2], where)
        self.out += b'\x89'
        self.glob('collections', 'OrderedDict')
        self.out += b')R'
        if rebuild == '_rebuild_tensor_v3':
            self.glob('torch', _UNTYPED[plain])
        self.out += b'tR'


def _arrays(tree: Any) -> list[np.ndarray]:
    """The numpy arrays in the plain containers of `tree` (what `Pickler.value` walks)."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, np.ndarray):
            out.append(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return out


def _root(x: Any) -> Any:
    """The object whose memory `x` views (a mapped file, the array that owns it), through
    the views between (`as_strided` leaves one that is not an array but has a `base`)."""
    while getattr(x, 'base', None) is not None:
        x = x.base
    return x


def has_torch_dtype(dtype: np.dtype) -> bool:
    """Whether torch has a tensor dtype for arrays of `dtype`, as `Pickler` writes them
    (`bfloat16`, `float8_e4m3fn` yes; `int4`, `float4_e2m1fn` no)."""
    stored = stored_dtype(np.dtype(dtype))
    plain = stored.newbyteorder('=') if stored.byteorder == '<' else stored
    return plain in _TYPED or plain in _UNTYPED


def _viewable(x: np.ndarray) -> bool:
    """Whether a torch tensor can view `x` where it lies: elements, strides >= 0, little-endian."""
    item, plain = x.dtype.itemsize, x.dtype.newbyteorder('=')
    return bool(x.size) and x.dtype.byteorder in '=<|' and (plain in _TYPED or plain in _UNTYPED) \
        and all(s >= 0 and s % item == 0 for s in x.strides)


def overlapping_views(arrays: list[np.ndarray]
                      ) -> tuple[list[np.ndarray], dict[int, tuple[int, int, tuple[int, ...]]]]:
    """Spans of memory that several of `arrays` view, and each such array's place in one:
    `(spans, {id(array): (span, offset, strides)})`, offset and strides in elements.

    Arrays whose memory overlaps (`w`, `w[0]`, `w.T`) share a span when they have one dtype,
    view one allocation and the span is no larger than their copies would be together (two
    columns of a large matrix are written as copies, not as the matrix). Others are left out.

    >>> w = np.arange(6.0).reshape(2, 3)
    >>> spans, views = overlapping_views([w, w[1], w.T])
    >>> spans[0].tolist(), sorted(v[1:] for v in views.values())
    ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [(0, (1, 3)), (0, (3, 1)), (3, (1,))])
    """
    try:
        from numpy.lib.array_utils import byte_bounds
    except ImportError:  # numpy 1.x, where it is np.byte_bounds
        byte_bounds = np.byte_bounds

    found = sorted(((*byte_bounds(a), n) for n, a in enumerate(arrays) if _viewable(a)))
    groups: list[tuple[int, int, list[tuple[int, int]]]] = []  # (lo, hi, [(start, index)])
    for lo, hi, n in found:
        if groups and lo < groups[-1][1]:  # overlaps the group before: joins it
            groups[-1][2].append((lo, n))
            groups[-1] = (groups[-1][0], max(groups[-1][1], hi), groups[-1][2])
        else:
            groups.append((lo, hi, [(lo, n)]))
    spans: list[np.ndarray] = []
    views: dict[int, tuple[int, int, tuple[int, ...]]] = {}
    for lo, hi, group in groups:
        members = [arrays[n] for _, n in group]
        first = members[0]
        item = first.dtype.itemsize
        if (len(members) < 2 or any(m.dtype != first.dtype or _root(m) is not _root(first)
                                    or (b - lo) % item for m, (b, _) in zip(members, group))
                or hi - lo > sum(m.nbytes for m in members) or (hi - lo) % item):
            continue
        raw = first.view(np.dtype((np.void, item)))  # as_strided cannot name some ml_dtypes
        span = np.lib.stride_tricks.as_strided(raw, shape=((hi - lo) // item,), strides=(item,),
                                               writeable=False).view(first.dtype)
        for m, (b, _) in zip(members, group):
            views[id(m)] = (len(spans), (b - lo) // item, tuple(s // item for s in m.strides))
        spans.append(span)
    return spans, views


def _identity(x: Any) -> tuple:
    """What makes two leaves one tensor: the same object, or numpy arrays over the same
    memory with the same dtype, shape and strides (tied weights read from a torch file)."""
    if isinstance(x, np.ndarray) and x.size:
        return ('memory', x.ctypes.data, x.dtype.str, x.dtype.name, x.shape, x.strides)
    return ('object', id(x))


__all__ = ['DTYPES', 'STORAGES', 'Pickler']
