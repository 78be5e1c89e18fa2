"""Checking and comparing checkpoints without JAX: ``verify`` and ``diff``.

``verify(path)`` checks a file's layout and recomputes every payload's
checksum, collecting every fault instead of stopping at the first one.
``diff(a, b)`` compares two checkpoints entry by entry: entries only in one,
dtype and shape changes, and the largest absolute and relative differences.
Both read payloads through the private mapping, a bounded chunk at a time.

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
>>> verify(a).ok
True
>>> r = diff(a, b)
>>> r.same, r.entries[0].max_abs, diff(a, b, atol=0.5).same
(False, 0.5, True)
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from jckpt.api import progress as progress_mod
from jckpt.errors import ChecksumError, FormatError, StorageError
from jckpt.format import payload as payload_mod
from jckpt.format import precs
from jckpt.format.header import Entry
from jckpt.storage.reader import CheckpointReader
from jckpt.tools.info import format_shape

#: Elements compared per step by :func:`diff` (bounds its temporary memory).
DIFF_CHUNK = 1 << 20
#: Bytes read per step when checking the zero fill between payloads.
GAP_CHUNK = 16 << 20


def _missing(path: str) -> FormatError:
    return FormatError("no such checkpoint file", file=path,
                       fix="check the path, or save a checkpoint there first")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One fault found by :func:`verify`.

    ``severity`` is ``'error'`` (the file is damaged: a bad header, a bad
    checksum) or ``'warning'`` (the file is readable but not as a jckpt writer
    lays it out, or a payload could not be checked).
    """

    severity: str
    message: str
    file: str
    entry: str | None = None

    def __str__(self) -> str:
        where = f"entry {self.entry}: " if self.entry else ''
        return f"{self.file}: {where}{self.message}"


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found.

    Attributes:
      path: the checkpoint checked.
      entries: how many entries the header lists.
      checked: how many payloads had their checksum recomputed and matched.
      unchecked: names of the entries that carry no checksum this version knows.
      problems: every error and warning, in file order.
      files: how many files were checked (a manager directory's steps).
    """

    path: str
    entries: int
    checked: int
    unchecked: tuple[str, ...]
    problems: tuple[Problem, ...]
    files: int = 1

    @property
    def errors(self) -> tuple[Problem, ...]:
        """The problems that mean the file is damaged."""
        return tuple(p for p in self.problems if p.severity == 'error')

    @property
    def warnings(self) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.severity == 'warning')

    @property
    def ok(self) -> bool:
        """True when the layout is valid and every stored checksum holds."""
        return not self.errors

    def render(self) -> str:
        """The text ``jckpt verify`` prints."""
        lines = [f"{p.severity.upper()}: {p}" for p in self.problems]
        verdict = 'OK' if self.ok else 'FAILED'
        where = f"{self.path} ({self.files} files)" if self.files != 1 else self.path
        summary = (f"{verdict}: {where}: {self.checked} of {self.entries} checksums verified"
                   f", {len(self.errors)} error{'s' if len(self.errors) != 1 else ''}"
                   f", {len(self.warnings)} warning{'s' if len(self.warnings) != 1 else ''}")
        return '\n'.join([*lines, summary])

    def __repr__(self) -> str:
        return self.render()

    def to_dict(self) -> dict[str, Any]:
        return {'path': self.path, 'ok': self.ok, 'files': self.files, 'entries': self.entries,
                'checked': self.checked, 'unchecked': list(self.unchecked),
                'problems': [dataclasses.asdict(p) for p in self.problems]}


def verify(path: str | os.PathLike, *, progress: bool = False) -> VerifyReport:
    """Check the layout of ``path`` and recompute every payload checksum.

    Never raises for a damaged file: a header that does not decode, payloads
    past the end or overlapping, and checksum mismatches are reported as
    errors in the returned :class:`VerifyReport` (``report.ok`` is False),
    each naming its entry. Payloads off the writer's alignment, non-zero
    bytes between payloads, bytes after the last payload and entries without
    a checksum are warnings. Raises :class:`~jckpt.errors.FormatError` only
    when ``path`` does not exist, and :class:`~jckpt.errors.StorageError`
    when it cannot be read.

    ``progress=True`` draws a bar on stderr when stderr is a terminal.

    Example::

        report = jckpt.verify("ckpt.jckpt")
        if not report.ok:
            print(report)
    """
    path = os.fspath(path)
    if not os.path.lexists(path):
        raise _missing(path)
    if os.path.isdir(path):
        return _verify_directory(path, progress)
    return _verify_file(path, progress)


def _verify_file(path: str, progress: bool, *, follow_symlinks: bool = True) -> VerifyReport:
    try:
        reader = CheckpointReader(path, follow_symlinks=follow_symlinks)
    except StorageError:
        raise
    except FormatError as err:
        problem = Problem('error', f"{err.message} ({err.fix})" if err.fix else err.message, path,
                          err.entry)
        return VerifyReport(path, 0, 0, (), (problem,))
    header = reader.header
    problems: list[Problem] = []
    unchecked: list[str] = []
    checked = 0
    problems.extend(_layout_problems(reader))
    total = sum(e.byte_length for e in header.tensors)
    with progress_mod.bar(f"verifying {os.path.basename(path)}", total, enabled=progress) as bar:
        for e in header.tensors:
            if e.checksum is None:
                unchecked.append(e.name)
                problems.append(Problem('warning', "no checksum stored; payload not checked",
                                        path, e.name))
            elif e.checksum[0] != payload_mod.CHECKSUM_ALGORITHM:
                unchecked.append(e.name)
                problems.append(Problem('warning', f"checksum algorithm {e.checksum[0]!r} is "
                                        "unknown to this version; payload not checked", path, e.name))
            else:
                try:
                    reader.verify_entry(e)
                    checked += 1
                except ChecksumError as err:
                    problems.append(Problem('error', err.message, path, e.name))
            bar.advance(e.byte_length)
    return VerifyReport(path, len(header.tensors), checked, tuple(unchecked), tuple(problems))


def _combine(path: str, reports: list[VerifyReport], extra: list[Problem]) -> VerifyReport:
    return VerifyReport(path, sum(r.entries for r in reports), sum(r.checked for r in reports),
                        tuple(u for r in reports for u in r.unchecked),
                        (*extra, *(p for r in reports for p in r.problems)),
                        files=sum(r.files for r in reports))


def _verify_directory(path: str, progress: bool) -> VerifyReport:
    """A multi-process checkpoint (its index and every piece), or every step of a manager's
    directory, as one report."""
    from jckpt.format.names import INDEX_NAME, PIECE_RE
    from jckpt.tools.info import STEP_RE

    if os.path.exists(os.path.join(path, INDEX_NAME)):
        return _verify_sharded(path, progress)
    listing = os.listdir(path)
    if any(PIECE_RE.match(n) for n in listing):
        return VerifyReport(path, 0, 0, (), (Problem(
            'error', f"piece files but no {INDEX_NAME}: a multi-process save that did not "
            "finish; it is not a checkpoint", path),))
    names = sorted(n for n in listing if STEP_RE.match(n))
    if not names:
        raise FormatError("directory holds no checkpoint (no index.jckpt, no "
                          "step_NNNNNNNN.jckpt steps)", file=path,
                          fix="pass a checkpoint file, a multi-process checkpoint directory or "
                              "a checkpoint manager's directory")
    return _combine(path, [verify(os.path.join(path, n), progress=progress) for n in names], [])


def _verify_sharded(path: str, progress: bool) -> VerifyReport:
    """The index of a directory checkpoint, each piece file, and that the index matches them."""
    from jckpt.format.names import INDEX_NAME, PIECE_RE
    from jckpt.storage.directory import DirectoryReader

    try:
        reader = DirectoryReader(path)
    except FormatError as err:
        message = f"{err.message} ({err.fix})" if err.fix else err.message
        return VerifyReport(path, 0, 0, (), (Problem('error', message, err.file or path,
                                                     err.entry),))
    problems: list[Problem] = []
    reports = []
    pieces: dict[int, dict] = {}
    for fi, name in enumerate(reader.files):
        piece_path = os.path.join(path, name)
        if not os.path.exists(piece_path):
            problems.append(Problem('error', f"piece file {name} listed in the index is missing",
                                    path))
            continue
        report = _verify_file(piece_path, progress, follow_symlinks=False)
        reports.append(report)
        if report.errors and report.entries == 0:
            continue  # the piece file itself is unreadable: already reported
        pieces[fi] = {(e.identity, e.slice): e for e in
                      CheckpointReader(piece_path, follow_symlinks=False).header.tensors}
    for info in reader.arrays.values():
        g = info.entry
        for fi, box in info.pieces:
            if fi not in pieces:
                continue
            e = pieces[fi].get((g.identity, box))
            if e is None or e.prec != g.prec:
                problems.append(Problem('error', f"piece {list(box)} is not in "
                                        f"{reader.files[fi]} as the index says", path, g.name))
    listed = set(reader.files)
    for name in sorted(os.listdir(path)):
        if PIECE_RE.match(name) and name not in listed:
            problems.append(Problem('warning', f"piece file {name} is not listed in {INDEX_NAME}",
                                    path))
    return _combine(path, reports, problems)


def _layout_problems(reader: CheckpointReader) -> list[Problem]:
    """Warnings about a readable file not laid out as a jckpt writer lays it out."""
    header, path, out = reader.header, reader.path, []
    align = header.alignment
    if align > 1 and reader.data_start % align:
        out.append(Problem('warning', f"data starts at byte {reader.data_start}, not a multiple "
                           f"of the alignment {align}", path))
    for e in header.tensors:
        if align > 1 and (reader.data_start + e.offset) % align:
            mapped = payload_mod.can_map(e, reader.data_start) or e.padding is not None
            out.append(Problem('warning', f"payload at offset {e.offset} is not aligned to "
                               f"{align} bytes" + ('' if mapped else "; it is copied, not mapped"),
                               path, e.name))
    buffer = reader.buffer
    cursor = reader.data_start
    for e in sorted(header.tensors, key=lambda e: e.offset):
        start = reader.data_start + e.offset
        if start > cursor and _nonzero(buffer, cursor, start):
            out.append(Problem('warning', f"the {start - cursor} bytes before this payload are "
                               "not zero-filled", path, e.name))
        cursor = max(cursor, start + e.byte_length)
    if reader.size > cursor:
        out.append(Problem('warning', f"{reader.size - cursor} bytes follow the last payload",
                           path))
    del buffer
    return out


def _nonzero(buffer: Any, start: int, stop: int) -> bool:
    for lo in range(start, stop, GAP_CHUNK):
        chunk = np.frombuffer(buffer, np.uint8, count=min(GAP_CHUNK, stop - lo), offset=lo)
        if chunk.any():
            return True
    return False


# --- diff --------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EntryDiff:
    """How one entry present in both checkpoints compares.

    Attributes:
      name: ``namespace/path``.
      dtype_a, dtype_b, shape_a, shape_b: as stored.
      size: elements compared (0 when the shapes differ).
      max_abs: the largest ``|a - b|`` (``inf`` where exactly one side is NaN).
      max_rel: the largest ``|a - b| / |b|`` (``inf`` where ``b`` is 0 and ``a`` is not).
      mismatched: elements with ``|a - b| > atol + rtol * |b|`` (NaNs in the same
        place count as equal).
      same: dtypes and shapes agree and no element is mismatched.
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

    @property
    def changes(self) -> list[str]:
        """Readable descriptions of what differs (empty when ``same``)."""
        out = []
        if self.dtype_a != self.dtype_b:
            out.append(f"dtype {self.dtype_a} -> {self.dtype_b}")
        if self.shape_a != self.shape_b:
            out.append(f"shape {format_shape(self.shape_a)} -> {format_shape(self.shape_b)}")
        if self.mismatched:
            out.append(f"{self.mismatched} of {self.size} values differ")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d['shape_a'], d['shape_b'] = list(self.shape_a), list(self.shape_b)
        for k in ('max_abs', 'max_rel'):  # JSON has no inf or nan
            if not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d


@dataclasses.dataclass(frozen=True)
class DiffReport:
    """What :func:`diff` found between checkpoints ``a`` and ``b``.

    ``same`` is True when both hold the same entries with the same dtypes
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
        """The text ``jckpt diff`` prints (``show_all``: also the entries that match)."""
        from jckpt.tools.info import text_table

        lines = [f"only in {self.a}: {n}" for n in self.only_a]
        lines += [f"only in {self.b}: {n}" for n in self.only_b]
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
    return 'void' if e.prec == precs.VOID else e.dtype.name


def _comparable(x: np.ndarray) -> np.ndarray:
    """``x`` as float64 (complex128 for complex types), where differences can be taken."""
    return x.astype(np.complex128 if x.dtype.kind == 'c' else np.float64)


def _compare(a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> tuple[float, float, int]:
    """``(max_abs, max_rel, mismatched)`` of two same-shaped arrays, in bounded chunks."""
    a, b = a.reshape(-1), b.reshape(-1)
    same_dtype = a.dtype == b.dtype
    exact = atol == 0 and rtol == 0
    max_abs = max_rel = 0.0
    bad = 0
    for lo in range(0, a.size, DIFF_CHUNK):
        xa, xb = a[lo:lo + DIFF_CHUNK], b[lo:lo + DIFF_CHUNK]
        if same_dtype and np.array_equal(xa.view(np.uint8), xb.view(np.uint8)):
            continue  # identical bytes: identical values
        x, y = _comparable(xa), _comparable(xb)
        with np.errstate(invalid='ignore', divide='ignore', over='ignore'):
            equal = (x == y) | (np.isnan(x) & np.isnan(y))
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
            if exact:
                bad += int(np.count_nonzero(~equal))
            else:
                bad += int(np.count_nonzero(~equal & ~(d <= atol + rtol * ay)))
        max_abs = max(max_abs, float(d.max()))
        max_rel = max(max_rel, float(rel.max()))
    return max_abs, max_rel, bad


def _diff_entry(ra: Any, ea: Entry, rb: Any, eb: Entry,
                atol: float, rtol: float) -> EntryDiff:
    dtype_a, dtype_b = _dtype_name(ea), _dtype_name(eb)
    same_shape = ea.shape == eb.shape
    size, max_abs, max_rel, bad = 0, 0.0, 0.0, 0
    if same_shape and precs.VOID not in (ea.prec, eb.prec):
        x = np.asarray(ra.decode(ea, mmap=True, count=False))  # a directory's arrays are lazy
        y = np.asarray(rb.decode(eb, mmap=True, count=False))
        size = int(x.size)
        max_abs, max_rel, bad = _compare(x, y, atol, rtol)
    same = dtype_a == dtype_b and same_shape and ea.key_impl == eb.key_impl and bad == 0
    return EntryDiff(ea.name, dtype_a, dtype_b, tuple(ea.shape), tuple(eb.shape), size,
                     max_abs, max_rel, bad, same)


def diff(a: str | os.PathLike, b: str | os.PathLike, *, atol: float = 0.0, rtol: float = 0.0,
         progress: bool = False) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (files or multi-process directories) entry by entry.

    Entries are matched by ``(namespace, path)``. For each shared entry the
    report gives dtype and shape changes and, when the shapes agree, the
    largest absolute and relative differences and how many values lie
    outside ``atol + rtol * |b|`` (exact comparison by default; NaNs in the
    same place are equal). Raises :class:`~jckpt.errors.FormatError` naming
    the file if either is missing or damaged.

    Example::

        report = jckpt.tools.check.diff("before.jckpt", "after.jckpt", atol=1e-6)
        print(report)            # entries only in one, and what changed
    """
    a, b = os.fspath(a), os.fspath(b)
    if atol < 0 or rtol < 0 or math.isnan(atol) or math.isnan(rtol):
        raise ValueError(f"tolerances must be >= 0, got atol={atol}, rtol={rtol}")
    from jckpt.storage.checkpoint import open_checkpoint
    from jckpt.tools.info import STEP_RE, is_directory_checkpoint, is_manager_directory

    readers = []
    for p in (a, b):
        if not os.path.lexists(p):
            raise _missing(p)
        if is_manager_directory(p) and not is_directory_checkpoint(p):
            first = min(n for n in os.listdir(p) if STEP_RE.match(n))
            raise FormatError("a checkpoint manager's directory holds one checkpoint per step",
                              file=p, fix=f"compare two of its steps, e.g. {os.path.join(p, first)}")
        readers.append(open_checkpoint(p))
    ra, rb = readers
    ia = {e.identity: e for e in ra.header.tensors}
    ib = {e.identity: e for e in rb.header.tensors}
    only_a = tuple(e.name for k, e in ia.items() if k not in ib)
    only_b = tuple(e.name for k, e in ib.items() if k not in ia)
    shared = [(ea, ib[k]) for k, ea in ia.items() if k in ib]
    total = sum(ea.byte_length + eb.byte_length for ea, eb in shared)
    out = []
    with progress_mod.bar(f"comparing {os.path.basename(a)}", total, enabled=progress) as bar:
        for ea, eb in shared:
            out.append(_diff_entry(ra, ea, rb, eb, atol, rtol))
            bar.advance(ea.byte_length + eb.byte_length)
    return DiffReport(a, b, float(atol), float(rtol), only_a, only_b, tuple(out))


__all__ = ['DiffReport', 'EntryDiff', 'Problem', 'VerifyReport', 'diff', 'verify']
