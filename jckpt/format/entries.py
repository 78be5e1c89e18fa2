"""The header's values: `Entry`, `Padding`, `Header`, key paths.

Frozen dataclasses with no behaviour beyond derived properties, and
`entry_for`, the one builder of an `Entry` from a leaf's
namespace, path and array description. Every writer (`save`, the mirror,
directory checkpoints, the native adapter) builds its entries through it,
so the label, prec and byte length of an entry are computed in one place.
`jckpt.format.header` encodes these values to bytes and decodes them back.

>>> e = entry_for('jckpt', (('k', 'w'), ('i', 0)), 'float32', (2, 3), id=4)
>>> e.prec, e.dims, e.byte_length, e.label, e.name
('Single_prec', (2, 3), 24, ('w', '0'), 'jckpt/w/0')
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from jckpt.errors import InputError
from jckpt.format import precs
from jckpt.format.limits import MAX_INT_DIGITS, MAX_PATH_LENGTH

FORMAT_VERSION = 1
DEFAULT_ALIGNMENT = 32
#: The largest offset, length or element count a header may hold.
MAX_INT64 = 2**63 - 1

NAMESPACE_RE = re.compile(r'[A-Za-z_][A-Za-z0-9_]*\Z')
LEGACY_NAMESPACE = 'ocannl'  # what a legacy empty namespace "" reads as

#: Path component kinds: dict key, integer dict key, sequence index, attribute, flattened index.
PATH_KINDS = frozenset({'k', 'ki', 'i', 'a', 'f'})
#: The kinds whose value is an integer.
INT_KINDS = frozenset({'ki', 'i', 'f'})

PathComponent = tuple[str, 'str | int']
KeyPath = tuple[PathComponent, ...]


@dataclasses.dataclass(frozen=True)
class Padding:
    """OCANNL padding: `(left, right)` per dim, and the value the margin holds."""

    pairs: tuple[tuple[int, int], ...]
    value: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One stored array: where its payload is and how to read it.

    `path` is the pytree key path (`None` for OCANNL entries, which are
    addressed as `n<id>`). `extra` holds entry fields this version does not
    know, kept verbatim when the file is rewritten.
    """

    id: int
    namespace: str
    prec: str
    dims: tuple[int, ...]
    offset: int
    byte_length: int
    label: tuple[str, ...] = ()
    padding: Padding | None = None
    path: KeyPath | None = None
    checksum: tuple[str, str] | None = None
    key_impl: str | None = None
    slice: tuple[tuple[int, int], ...] | None = None
    global_dims: tuple[int, ...] | None = None
    extra: tuple[Any, ...] = ()

    @property
    def dtype(self) -> np.dtype:
        """The little-endian numpy dtype of one stored element."""
        return precs.dtype_of(self.prec)

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy shape of the decoded array (`Uint4x32_prec` adds a dim of 4)."""
        return (*self.dims, 4) if self.prec == precs.UINT4X32 else self.dims

    @property
    def array_shape(self) -> tuple[int, ...]:
        """The shape of the array a load returns: `shape`, less a typed PRNG key's key-data
        dim (a scalar `threefry2x32` key stores data of shape `(2,)`, `jax.random.key_data`'s,
        and is a key array of shape `()`).

        >>> Entry(0, 'n', 'uint32_prec', (2,), 0, 8, key_impl='threefry2x32').array_shape
        ()
        """
        return self.shape[:-1] if self.key_impl is not None and self.shape else self.shape

    @property
    def logical_dims(self) -> tuple[int, ...]:
        """`dims` less the padding: the region actually stored."""
        if self.padding is None:
            return self.dims
        return tuple(d - lo - hi for d, (lo, hi) in zip(self.dims, self.padding.pairs))

    @property
    def identity(self) -> tuple[str, Any]:
        """`(namespace, path)`, or `(namespace, id)` for path-less entries."""
        return (self.namespace, self.path if self.path is not None else self.id)

    @property
    def name(self) -> str:
        """A readable `namespace/a/b/0` name for messages."""
        return f"{self.namespace}/{path_name(self.path) if self.path is not None else f'n{self.id}'}"


@dataclasses.dataclass(frozen=True)
class Header:
    """A whole header: format version, alignment, entries in payload order, metadata."""

    tensors: tuple[Entry, ...] = ()
    alignment: int = DEFAULT_ALIGNMENT
    version: int = FORMAT_VERSION
    writer: str | None = None
    metadata: tuple[tuple[str, str], ...] = ()
    extra: tuple[Any, ...] = ()

    def metadata_dict(self) -> dict[str, str]:
        """The metadata as a dict (later keys win)."""
        return dict(self.metadata)


def path_name(path: KeyPath) -> str:
    """`(('k', 'params'), ('i', 0))` -> `'params/0'`."""
    return '/'.join([str(v) for _, v in path])  # a list: join makes one of a generator anyway


#: Key kinds that differ only in how a node keeps its children: by name, or by number.
_LOOSE_KIND = {'k': 'name', 'a': 'name', 'i': 'number', 'f': 'number', 'ki': 'number'}


def loose_path(path: KeyPath) -> KeyPath:
    """`path` less its key kinds: a dict key and an attribute of one name compare equal,
    and so do a sequence index, a flattened index, an integer dict key of one number and a
    string dict key that is that number written out (`'0'`: orbax records every dict key
    as a string, so an `nnx.State`'s integer keys come back from it as `'0'`, `'1'`).

    >>> loose_path((('i', 0), ('a', 'count'))) == loose_path((('i', 0), ('k', 'count')))
    True
    >>> loose_path((('ki', 1), ('i', 0))) == loose_path((('k', '1'), ('k', '0')))
    True
    >>> loose_path((('k', '01'),)) == loose_path((('i', 1),))
    False
    """
    return tuple([_loose_component(kind, key) for kind, key in path])


def _loose_component(kind: str, key: str | int) -> tuple[str, str | int]:
    """One component of `loose_path`: a string key that is an integer's decimal form (exactly
    as `str` writes it: no sign but `-`, no leading zero, no `_`) as that number."""
    if kind == 'k' and type(key) is str and 0 < len(key) <= MAX_INT_DIGITS:
        digits = key[1:] if key[:1] == '-' else key
        if digits.isascii() and digits.isdigit() and str(int(key)) == key:
            return ('number', int(key))
    return (_LOOSE_KIND.get(kind, kind), key)


def nearest_paths(paths: Iterable[KeyPath], path: KeyPath, count: int = 5) -> list[KeyPath]:
    """Up to `count` of `paths`, in their order, that share the longest leading part with
    `path` (key kinds aside, as `loose_path` compares them): where a leaf a restore looks for
    is missing, what the file holds beside it (a renamed leaf's old name), not its first
    entries.

    >>> nearest_paths([(('k', 'a'),), (('k', 'l'), ('i', 7), ('k', 'w1')),
    ...                (('k', 'l'), ('i', 7), ('k', 'w2'))], (('k', 'l'), ('k', '7'), ('k', 'fc1')))
    [(('k', 'l'), ('i', 7), ('k', 'w1')), (('k', 'l'), ('i', 7), ('k', 'w2'))]
    """
    want = loose_path(path)

    def shared(q: KeyPath) -> int:
        n = 0
        for mine, theirs in zip(loose_path(q), want):
            if mine != theirs:
                break
            n += 1
        return n
    scored = [(shared(q), q) for q in paths]
    best = max((n for n, _ in scored), default=0)
    return [q for n, q in scored if n == best][:count]


def round_up(n: int, a: int) -> int:
    """`n` rounded up to a multiple of `a` (`a <= 1` leaves it alone)."""
    return n if a <= 1 else -(-n // a) * a


#: dtype -> (prec, bytes per element), for the dtypes met so far (one save meets a few).
_PREC_SIZES: dict[np.dtype, tuple[str, int]] = {}


def entry_for(namespace: str, path: KeyPath | None, dtype: Any, shape: Sequence[int], *, id: int,
              key_impl: str | None = None, checksum: tuple[str, str] | None = None,
              offset: int = 0, slice: Sequence[tuple[int, int]] | None = None,
              global_dims: Sequence[int] | None = None) -> Entry:
    """The `Entry` of an array of `dtype` and `shape` stored at `(namespace, path)`.

    Computes what follows from the array: `prec` (`KeyError` for a dtype
    the format cannot store: check with `jckpt.format.precs.is_supported`
    first), `byte_length` and the `label` (the path's values as text).
    `shape` is what this entry stores: for a piece of a sharded array, the
    piece's shape, with `slice` its box and `global_dims` the whole
    array's shape. `offset` is usually left at 0 for
    `jckpt.format.layout.lay_out` to plan; `checksum` None lets the
    writer compute it.

    >>> entry_for('opt', (('k', 'mu'),), np.dtype('int8'), (4,), id=0, slice=((4, 8),),
    ...           global_dims=(8,)).byte_length
    4
    """
    try:
        prec, size = _PREC_SIZES[dtype]
    except (KeyError, TypeError):  # first of its dtype, or a dtype given as a type or string
        prec = precs.prec_of(dtype)
        size = precs.element_size(prec)
        if isinstance(dtype, np.dtype):
            _PREC_SIZES[dtype] = (prec, size)
    dims = tuple(shape)
    if path is not None and len(path) > MAX_PATH_LENGTH:
        raise InputError(f"key path of {len(path)} components is deeper than {MAX_PATH_LENGTH}, "
                         "more than readers accept", entry=f"{namespace}/{path_name(path[:8])}/...",
                         fix="store the tree flatter")
    return _new_entry(id, namespace, prec, dims, offset, math.prod(dims) * size,
                      () if path is None else tuple([v if type(v) is str else str(v) for _, v in path]),
                      None, path, checksum, key_impl,
                      None if slice is None else tuple((a, b) for a, b in slice),
                      None if global_dims is None else tuple(global_dims), ())


def _entry_maker() -> Callable[..., Entry]:
    """A constructor of `Entry` from all its fields in order, for the save's hot loop.

    A frozen dataclass's `__init__` sets each field through
    `object.__setattr__`; this one sets the slots directly (a function
    written out once, as `dataclasses` writes `__init__`), more than twice
    as fast, which counts when a save builds 100,000 entries. It skips no
    check: `Entry` has no `__post_init__`.
    """
    names = [f.name for f in dataclasses.fields(Entry)]
    scope = {'new': object.__new__, 'Entry': Entry, **{f'set_{n}': getattr(Entry, n).__set__ for n in names}}
    body = ''.join(f'    set_{n}(e, {n})\n' for n in names)
    exec(f"def make({', '.join(names)}):\n    e = new(Entry)\n{body}    return e\n", scope)
    return scope['make']


_new_entry = _entry_maker()


def check_namespace(namespace: Any, *, file: str | None = None, entry: str | None = None) -> str:
    """`namespace` when every reader accepts it (an identifier), else `InputError`: what
    `Context` checks for `save`, and the writer for every header it publishes.

    >>> check_namespace('params')
    'params'
    >>> check_namespace('ns.2', file='m.jckpt')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    jckpt.errors.InputError: m.jckpt: invalid namespace 'ns.2': must match ... (fix: use letters, ...)
    """
    if not isinstance(namespace, str) or not NAMESPACE_RE.match(namespace):
        raise InputError(f"invalid namespace {namespace!r:.80}: must match [A-Za-z_][A-Za-z0-9_]*",
                         file=file, entry=entry, fix="use letters, digits and underscores")
    return namespace


def check_namespaces(entries: Sequence[Entry], *, file: str | None = None) -> None:
    """`check_namespace` of each distinct namespace of `entries` (what a writer checks before
    publishing a header), naming the first entry in a refused one."""
    firsts = {e.namespace: e for e in reversed(entries)}  # each namespace's first entry
    for namespace, first in firsts.items():
        check_namespace(namespace, file=file, entry=first.name)


def check_prefix(prefix: str | None) -> None:
    """Raise `InputError` unless `prefix` is `None`, `""` or an identifier (what `prefixed`
    puts before a namespace)."""
    if prefix is not None and not isinstance(prefix, str):
        raise InputError(f"a namespace prefix must be a string or None, not {prefix!r:.80}",
                         fix="use letters, digits and underscores")
    if prefix and not NAMESPACE_RE.match(prefix):
        raise InputError(f"invalid namespace prefix {prefix!r}: must match "
                         "[A-Za-z_][A-Za-z0-9_]*", fix="use letters, digits and underscores")


def prefixed(namespace: str, prefix: str | None) -> str:
    """`prefix + '__' + namespace` (unchanged for `None` or `""`).

    >>> prefixed('params', 'teacher'), prefixed('params', None)
    ('teacher__params', 'params')
    """
    return f"{prefix}__{namespace}" if prefix else namespace


__all__ = ['DEFAULT_ALIGNMENT', 'FORMAT_VERSION', 'LEGACY_NAMESPACE', 'NAMESPACE_RE', 'PATH_KINDS',
           'check_namespace', 'check_namespaces', 'check_prefix', 'prefixed',
           'Entry', 'Header', 'KeyPath', 'Padding', 'PathComponent', 'entry_for', 'loose_path',
           'nearest_paths', 'path_name',
           'round_up']
