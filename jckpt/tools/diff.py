"""Comparing two checkpoints without JAX: `diff` entry by entry.

`diff(a, b)` matches entries by `(namespace, path)` (then by path less key kinds, as
`restore` does, `pair_entries`) and reports entries
only in one, dtype and shape changes, and the largest absolute and relative
differences. Payloads are read through the private mapping (a directory
checkpoint's pieces on demand) and compared a bounded chunk at a time.

>>> import numpy as np, tempfile, os
>>> from jckpt.format import Entry, Header, lay_out
>>> from jckpt.storage import ArraySource, write_checkpoint
>>> d = tempfile.mkdtemp()
>>> def write(name, w):
...     e = Entry(id=0, namespace='jckpt', prec='Single_prec', dims=(3,), offset=0,
...               byte_length=12, path=(('k', 'w'),))
...     _ = write_checkpoint(os.path.join(d, name), lay_out(Header(tensors=(e,))),
...                          [ArraySource(np.asarray(w, np.float32))], durable=False)
...     return os.path.join(d, name)
>>> a, b = write('a.jckpt', [1, 2, 3]), write('b.jckpt', [1, 2, 3.5])
>>> r = diff(a, b)
>>> r.same, r.entries[0].max_abs, diff(a, b, atol=0.5).same
(False, 0.5, True)
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jckpt.adapters.tree_reader import open_foreign
from jckpt.api import progress as progress_mod
from jckpt.errors import FormatError, InputError
from jckpt.format import precs
from jckpt.format.entries import loose_path
from jckpt.format.header import Entry
from jckpt.format.names import STEP_RE
from jckpt.format.strict_json import strict
from jckpt.storage import open_checkpoint
from jckpt.storage.backend import backend_for, checked_path
from jckpt.tools.classify import FOREIGN, MANAGER, classify
from jckpt.tools.render import format_shape, printable, text_table

#: Elements compared per step by :func:`diff` (bounds its temporary memory).
DIFF_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class EntryDiff:
    """How one entry present in both checkpoints compares.

    Attributes:
      name: `namespace/path`.
      dtype_a, dtype_b, shape_a, shape_b: as stored (a typed PRNG key's: the key array's,
        `Entry.array_shape`).
      size: elements compared (0 when the shapes differ).
      max_abs: the largest `|a - b|` (`inf` where exactly one side is NaN).
      max_rel: the largest `|a - b| / |b|` (`inf` where `b` is 0 and `a` is not, and
        where a NaN or an infinity differs from the other side).
      mismatched: elements with `|a - b| > atol + rtol * |b|` (NaNs in the same
        place count as equal; a complex value's real and imaginary parts each); a NaN
        or an infinity matches only itself, whatever the tolerances.
      same: dtypes, shapes and key implementations agree and no element is mismatched.
      key_impl_a, key_impl_b: the PRNG key implementation of a typed-key entry (`rbg`;
        None for a plain array).
    """

    name: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    size: int
    max_abs: float
    max_rel: float
    mismatched: int
    same: bool
    key_impl_a: str | None = None
    key_impl_b: str | None = None

    @property
    def changes(self) -> list[str]:
        """Readable descriptions of what differs (empty when `same`)."""
        out = []
        if self.dtype_a != self.dtype_b:
            out.append(f"dtype {self.dtype_a} -> {self.dtype_b}")
        if self.shape_a != self.shape_b:
            out.append(f"shape {format_shape(self.shape_a)} -> {format_shape(self.shape_b)}")
        if self.key_impl_a != self.key_impl_b:
            out.append(f"key {self.key_impl_a or '(plain array)'} -> "
                       f"{self.key_impl_b or '(plain array)'}")
        if self.mismatched:
            out.append(f"{self.mismatched} of {self.size} values differ")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d['shape_a'], d['shape_b'] = list(self.shape_a), list(self.shape_b)
        return strict(d)  # JSON has no inf: written {"$float": "inf"}, as `inspect --json` does


@dataclasses.dataclass(frozen=True)
class DiffReport:
    """What `diff` found between checkpoints `a` and `b`.

    `same` is True when both hold the same entries with the same dtypes
    and shapes and every value is within tolerance.
    """

    a: str
    b: str
    atol: float
    rtol: float
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    entries: tuple[EntryDiff, ...]

    @property
    def differing(self) -> tuple[EntryDiff, ...]:
        return tuple(d for d in self.entries if not d.same)

    @property
    def same(self) -> bool:
        return not (self.only_a or self.only_b or self.differing)

    def render(self, *, show_all: bool = False) -> str:
        """The text `jckpt diff` prints (`show_all`: also the entries that match)."""
        # a name read from a file is escaped: a newline in it would forge a line of the report
        lines = [printable(f"only in {self.a}: {n}") for n in self.only_a]
        lines += [printable(f"only in {self.b}: {n}") for n in self.only_b]
        rows = [[d.name, '; '.join(d.changes) or 'same', _num(d.max_abs), _num(d.max_rel)]
                for d in self.entries if show_all or not d.same]
        if rows:
            lines.append(text_table(['entry', 'change', 'max abs diff', 'max rel diff'], rows,
                                    right=[2, 3]))
        tol = f" (atol {self.atol:g}, rtol {self.rtol:g})"
        if self.same:
            lines.append(f"SAME: {len(self.entries)} entries match{tol}")
        else:
            lines.append(f"DIFFERENT: {len(self.only_a)} only in A, {len(self.only_b)} only in B, "
                         f"{len(self.differing)} of {len(self.entries)} shared entries differ{tol}")
        return '\n'.join(lines)

    def __repr__(self) -> str:
        return self.render()

    def to_dict(self) -> dict[str, Any]:
        return {'a': self.a, 'b': self.b, 'atol': self.atol, 'rtol': self.rtol,
                'same': self.same, 'only_a': list(self.only_a), 'only_b': list(self.only_b),
                'entries': [d.to_dict() for d in self.entries]}


def _num(x: float) -> str:
    return f"{x:.6g}"


def _dtype_name(e: Entry) -> str:
    return precs.dtype_name(e.prec)


def _comparable(x: np.ndarray) -> np.ndarray:
    """`x` as float64 (complex128 for complex types), where differences can be taken."""
    return x.astype(np.complex128 if x.dtype.kind == 'c' else np.float64)


def _same_or_both_nan(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Where `x` equals `y` or both are NaN; a complex value part by part, so that
    `nan+1j` and `1+nanj` differ (numpy calls both NaN).

    >>> nan = float('nan')
    >>> _same_or_both_nan(np.array([nan, complex(nan, 1)]), np.array([nan, complex(1, nan)]))
    array([ True, False])
    """
    if x.dtype.kind == 'c':
        return _same_or_both_nan(x.real, y.real) & _same_or_both_nan(x.imag, y.imag)
    return (x == y) | (np.isnan(x) & np.isnan(y))


def _compare(a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> tuple[float, float, int]:
    """`(max_abs, max_rel, mismatched)` of two same-shaped arrays, in bounded chunks."""
    a, b = a.reshape(-1), b.reshape(-1)
    same_dtype = a.dtype == b.dtype
    exact = atol == 0 and rtol == 0
    max_abs = max_rel = 0.0
    bad = 0
    for lo in range(0, a.size, DIFF_CHUNK):
        # a foreign file's view (a torch tensor's column) is strided: bytes compare contiguous
        xa = np.ascontiguousarray(a[lo:lo + DIFF_CHUNK])
        xb = np.ascontiguousarray(b[lo:lo + DIFF_CHUNK])
        if same_dtype and np.array_equal(xa.view(np.uint8), xb.view(np.uint8)):
            continue  # identical bytes: identical values
        with np.errstate(invalid='ignore', divide='ignore', over='ignore'):
            x, y = _comparable(xa), _comparable(xb)  # a signaling NaN's cast is 'invalid'
            equal = _same_or_both_nan(x, y)
            if same_dtype and xa.dtype.kind in 'iu':
                # 64-bit integers are not all exact in float64: compare and subtract as integers
                # (max - min wraps into the exact unsigned difference)
                equal = xa == xb
                wide = np.int64 if xa.dtype.kind == 'i' else np.uint64
                d = (np.maximum(xa, xb).astype(wide) - np.minimum(xa, xb).astype(wide)).view(
                    np.uint64).astype(np.float64)
            else:
                d = np.abs(x - y)
            d[equal] = 0.0
            d[np.isnan(d)] = np.inf
            ay = np.abs(y)
            rel = np.where(ay > 0, d / np.where(ay > 0, ay, 1.0), np.where(d > 0, np.inf, 0.0))
            rel[np.isnan(rel)] = np.inf  # inf / inf: an infinity against another value
            if exact:
                bad += int(np.count_nonzero(~equal))
            else:
                # a NaN or an infinity matches only itself: no tolerance covers `inf` or `nan`
                finite = np.isfinite(x) & np.isfinite(y)
                bad += int(np.count_nonzero(~equal & ~(finite & (d <= atol + rtol * ay))))
        max_abs = max(max_abs, float(d.max()))
        max_rel = max(max_rel, float(rel.max()))
    return max_abs, max_rel, bad


def _diff_entry(ra: Any, ea: Entry, rb: Any, eb: Entry,
                atol: float, rtol: float, verify: bool) -> EntryDiff:
    dtype_a, dtype_b = _dtype_name(ea), _dtype_name(eb)
    same_shape = ea.shape == eb.shape
    size, max_abs, max_rel, bad = 0, 0.0, 0.0, 0
    if same_shape and precs.VOID not in (ea.prec, eb.prec):
        x = np.asarray(ra.decode(ea, mmap=True, verify=verify, count=False))  # lazy: a directory's
        y = np.asarray(rb.decode(eb, mmap=True, verify=verify, count=False))
        size = int(x.size)
        max_abs, max_rel, bad = _compare(x, y, atol, rtol)
    same = dtype_a == dtype_b and same_shape and ea.key_impl == eb.key_impl and bad == 0
    return EntryDiff(ea.name, dtype_a, dtype_b, tuple(ea.array_shape), tuple(eb.array_shape), size,
                     max_abs, max_rel, bad, same, ea.key_impl, eb.key_impl)



def pair_entries(a: Sequence[Entry], b: Sequence[Entry]) -> tuple[
        list[tuple[Entry, Entry]], tuple[str, ...], tuple[str, ...]]:
    """`(pairs, names only in a, names only in b)`: entries paired by `(namespace, path)`, then
    those left over by the one entry on each side whose path differs only in key kinds
    (`loose_path`), as `restore` matches a target's leaf. Another format holds an attribute
    as a dict key (`nnx.State`'s `value`, an optax state's fields), and orbax an integer dict
    key as a string: an export then pairs with its source.

    >>> from jckpt.format.entries import entry_for
    >>> w = lambda *path: entry_for('jckpt', path, 'float32', (2,), id=0)
    >>> pairs, only_a, only_b = pair_entries([w(('k', 'w'), ('a', 'value'))],
    ...                                      [w(('k', 'w'), ('k', 'value')), w(('k', 'b'),)])
    >>> len(pairs), only_a, only_b
    (1, (), ('jckpt/b',))
    """
    ia = {e.identity: e for e in a}
    ib = {e.identity: e for e in b}
    pairs = [(ea, ib[k]) for k, ea in ia.items() if k in ib]
    left_a = [e for k, e in ia.items() if k not in ib]
    left_b = [e for k, e in ib.items() if k not in ia]
    la, lb = _by_loose_identity(left_a), _by_loose_identity(left_b)
    loose = {k: (ea[0], lb[k][0]) for k, ea in la.items()
             if len(ea) == 1 and len(lb.get(k, ())) == 1}
    paired = {id(e) for pair in loose.values() for e in pair}
    return (pairs + list(loose.values()),
            tuple(e.name for e in left_a if id(e) not in paired),
            tuple(e.name for e in left_b if id(e) not in paired))


def _by_loose_identity(entries: Sequence[Entry]) -> dict[tuple[str, Any], list[Entry]]:
    """Entries with a path, by namespace and path less key kinds."""
    out: dict[tuple[str, Any], list[Entry]] = {}
    for e in entries:
        if e.path is not None:
            out.setdefault((e.namespace, loose_path(e.path)), []).append(e)
    return out


def diff(a: str | os.PathLike, b: str | os.PathLike, *, atol: float = 0.0, rtol: float = 0.0,
         progress: bool = False, verify: bool = True) -> DiffReport:
    """Compare checkpoints `a` and `b` (files or multi-process directories, in jckpt's format
    or another's) entry by entry.

    Entries are matched by `(namespace, path)`, then by the one path that differs only
    in key kinds (`pair_entries`: an export's dict key for an attribute). For each shared entry the
    report gives dtype and shape changes and, when the shapes agree, the
    largest absolute and relative differences and how many values lie
    outside `atol + rtol * |b|` (exact comparison by default; NaNs in the
    same place are equal). A checkpoint in another format (safetensors, `.pt`,
    numpy, llm.c, orbax) is compared as `jckpt.convert` reads it, so an
    export can be checked against its source. Raises `FormatError` naming
    the file if either is missing, damaged or not a checkpoint, and `ChecksumError` naming
    the entry for a payload that does not match its checksum (`verify=False` compares the
    values as stored: a damaged copy within `atol` would otherwise pass as the same).

    Example:
        ```python
        report = jckpt.diff("before.jckpt", "after.jckpt", atol=1e-6)
        print(report)            # entries only in one, and what changed
        ```
    """
    a, b = checked_path(a), checked_path(b)
    for path in (a, b):  # a URL no backend serves is refused before either is read
        backend_for(path)
    if atol < 0 or rtol < 0 or math.isnan(atol) or math.isnan(rtol):
        raise InputError(f"tolerances must be >= 0, got atol={atol}, rtol={rtol}",
                         fix="pass atol and rtol of zero or more")
    ra, rb = _open(a), _open(b)
    shared, only_a, only_b = pair_entries(ra.header.tensors, rb.header.tensors)
    total = sum(ea.byte_length + eb.byte_length for ea, eb in shared)
    out = []
    with progress_mod.bar(f"comparing {os.path.basename(a)}", total, enabled=progress) as bar:
        for ea, eb in shared:
            out.append(_diff_entry(ra, ea, rb, eb, atol, rtol, verify))
            bar.advance(ea.byte_length + eb.byte_length)
    return DiffReport(a, b, float(atol), float(rtol), only_a, only_b, tuple(out))


def _open(path: str) -> Any:
    """A reader of the checkpoint file or directory at `path`; the error for anything else."""
    kind = classify(path)
    if kind.name == MANAGER:
        first = min(n for n in backend_for(path).list(path) if STEP_RE.match(n))  # a URL too
        raise FormatError("a checkpoint manager's directory holds one checkpoint per step",
                          file=path, fix=f"compare two of its steps, e.g. {os.path.join(path, first)}")
    if kind.name == FOREIGN:  # compared as the converter reads it
        assert kind.detail is not None
        return open_foreign(path, kind.detail)
    if kind.error is not None:
        raise kind.error  # missing, unreadable, or a directory holding none
    return kind.reader or open_checkpoint(path)  # an object's reader, its header read


__all__ = ['DiffReport', 'EntryDiff', 'diff', 'pair_entries']
