"""Checking a checkpoint without JAX: `verify` checks layout and every checksum.

`verify(path)` checks a file's layout and recomputes every payload's
checksum, collecting every fault instead of stopping at the first one. A
multi-process directory is checked file by file and against its index; a
checkpoint manager's directory step by step. Payloads are read through the
private mapping, a bounded chunk at a time.

>>> import numpy as np, tempfile, os
>>> from jckpt.format import Entry, Header, lay_out
>>> from jckpt.storage import ArraySource, write_checkpoint
>>> path = os.path.join(tempfile.mkdtemp(), 'a.jckpt')
>>> e = Entry(id=0, namespace='jckpt', prec='Single_prec', dims=(3,), offset=0,
...           byte_length=12, path=(('k', 'w'),))
>>> _ = write_checkpoint(path, lay_out(Header(tensors=(e,))),
...                      [ArraySource(np.ones(3, np.float32))], durable=False)
>>> verify(path).ok
True
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from jckpt.api import progress as progress_mod
from jckpt.errors import CheckpointError, ChecksumError, FormatError
from jckpt.format import payload as payload_mod
from jckpt.format.header import Entry
from jckpt.format.names import INDEX_NAME, PIECE_RE, STEP_RE
from jckpt.storage import step_directory
from jckpt.storage.backend import backend_for, checked_path
from jckpt.storage.directory import DirectoryReader
from jckpt.storage.reader import CheckpointReader
from jckpt.tools.classify import (
    CUT_SHORT,
    DIRECTORY,
    FILE,
    FOREIGN,
    FORMAT_STEP,
    MANAGER,
    UNREADABLE,
    Kind,
    classify,
)
from jckpt.tools.render import printable

#: Bytes read per step when checking the zero fill between payloads.
GAP_CHUNK = 16 << 20


@dataclasses.dataclass(frozen=True)
class Problem:
    """One fault found by `verify`.

    `severity` is `'error'` (the file is damaged: a bad header, a bad
    checksum) or `'warning'` (the file is readable but not as a jckpt writer
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
    """What `verify` found.

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

    def render(self, strict: bool = False) -> str:
        """The text `jckpt verify` prints; `strict`: warnings fail it too (`--strict`)."""
        # names read from a file are escaped: a newline in one would forge a line (an `OK:`)
        lines = [printable(f"{p.severity.upper()}: {p}") for p in self.problems]
        failed = not self.ok or (strict and bool(self.warnings))
        verdict = 'FAILED' if failed else 'OK'
        where = f"{self.path} ({self.files} files)" if self.files != 1 else self.path
        # a file whose header cannot be taken (cut short, damaged) has no count to give
        counted = (f"{self.checked} of {self.entries} checksums verified"
                   if self.entries or self.ok else "no checksum verified")
        summary = (f"{verdict}: {where}: {counted}"
                   f", {len(self.errors)} error{'s' if len(self.errors) != 1 else ''}"
                   f", {len(self.warnings)} warning{'s' if len(self.warnings) != 1 else ''}"
                   + (" (--strict: warnings fail)" if strict and self.ok and self.warnings else ''))
        return '\n'.join([*lines, summary])

    def __repr__(self) -> str:
        return self.render()

    def to_dict(self, strict: bool = False) -> dict[str, Any]:
        """The report as JSON data (`jckpt verify --json`); `strict`: warnings make `ok` false."""
        ok = self.ok and not (strict and self.warnings)
        return {'path': self.path, 'ok': ok, 'files': self.files, 'entries': self.entries,
                'checked': self.checked, 'unchecked': list(self.unchecked),
                'problems': [dataclasses.asdict(p) for p in self.problems]}



def verify(path: str | os.PathLike, *, progress: bool = False) -> VerifyReport:
    """Check the layout of `path` and recompute every payload checksum.

    Never raises for what is (or is not) at `path`: every fault is an error in
    the returned `VerifyReport` (`report.ok` is False), each naming its file
    and entry. A header that does not decode, payloads past the end or
    overlapping and checksum mismatches are errors, and so is a path that
    holds no checkpoint at all (missing, a FIFO or device, a directory
    without one, a file in another format) and one that cannot be read.
    Only an argument that is no local path raises `InputError`, as every
    tool does: not a `str` or `os.PathLike`, a NUL character in it, or a URL
    no storage backend serves. Payloads off
    the writer's alignment, non-zero bytes between payloads, bytes after the
    last payload and entries without a checksum are warnings. A
    multi-process directory is checked piece file by piece file and against
    its index; a checkpoint manager's directory step by step (a step whose
    model is in another format has that file read whole: a warning says its
    payloads carry no checksums).

    `progress=True` draws a bar on stderr when stderr is a terminal.

    Example:
        ```python
        report = jckpt.verify("ckpt.jckpt")
        if not report.ok:
            print(report)
        ```
    """
    path = checked_path(path)  # no path at all (wrong type, NUL, a URL): an InputError
    backend_for(path)
    return _guarded(path, lambda: _verify(classify(path), progress))


def verify_classified(kind: Kind, *, progress: bool = False) -> VerifyReport:
    """`verify` of what `classify` found: for a caller that classified the path first (the
    command line), so that nothing is listed or read twice (an object's header GET is reused)."""
    return _guarded(kind.path, lambda: _verify(kind, progress))


def _guarded(path: str, run: Callable[[], VerifyReport]) -> VerifyReport:
    """`run()`, a failure to read at all reported as an error, not raised."""
    try:
        return run()
    except CheckpointError as err:
        where = err.file or path
        return _failed(where, _unreadable(where, err))
    except OSError as err:  # a read failing halfway: an I/O error, a file cut short under a mapping
        return _failed(path, Problem('error', f"cannot be read ({err})", path))


def _verify(kind: Kind, progress: bool) -> VerifyReport:
    if kind.name == DIRECTORY:
        return _verify_sharded(kind.path, progress)
    if kind.name == MANAGER:
        return _verify_steps(kind.path, progress)
    if kind.detail == CUT_SHORT:  # another format's file cut short: damaged, said as such
        assert kind.error is not None
        return _failed(kind.path, _unreadable(kind.path, kind.error))
    if kind.name in (FILE, FOREIGN) or kind.detail == UNREADABLE:
        return _verify_file(kind.path, progress, reader=kind.reader)
    if kind.detail == FORMAT_STEP:
        return _verify_step(kind.path, progress)
    assert kind.error is not None  # the kinds left hold no checkpoint
    return _failed(kind.path, Problem('error', kind.error.message, kind.path))


def _failed(path: str, problem: Problem) -> VerifyReport:
    """The report on a checkpoint that could not be read at all."""
    return VerifyReport(path, 0, 0, (), (problem,))


def _unreadable(path: str, err: CheckpointError) -> Problem:
    """The error reported for a file or index whose header cannot be read."""
    return Problem('error', f"{err.message} ({err.fix})" if err.fix else err.message,
                   err.file or path, err.entry)


def _verify_file(path: str, progress: bool, *, follow_symlinks: bool = True,
                 reader: Any = None) -> VerifyReport:
    """One checkpoint file: its header, its layout, every payload's checksum (`reader`: the
    file already opened, by `classify`)."""
    try:
        reader = reader or backend_for(path).open(path, follow_symlinks=follow_symlinks)
    except FormatError as err:
        return _failed(path, _unreadable(path, err))
    problems = _layout_problems(reader)
    checked, unchecked, bad = _check_payloads(reader, progress)
    return VerifyReport(path, len(reader.header.tensors), checked, tuple(unchecked),
                        (*problems, *bad))


def _check_payloads(reader: CheckpointReader,
                    progress: bool) -> tuple[int, list[str], list[Problem]]:
    """`(checked, unchecked entry names, problems)` of recomputing every checksum."""
    checked, unchecked, problems = 0, [], []
    tensors = reader.header.tensors
    total = sum(e.byte_length for e in tensors)
    with progress_mod.bar(f"verifying {os.path.basename(reader.path)}", total,
                          enabled=progress) as bar:
        for e in tensors:
            why = _why_unchecked(e)
            if why is not None:
                unchecked.append(e.name)
                problems.append(Problem('warning', why, reader.path, e.name))
            else:
                try:
                    reader.verify_entry(e)
                    checked += 1
                except ChecksumError as err:
                    problems.append(Problem('error', err.message, reader.path, e.name))
            bar.advance(e.byte_length)
    return checked, unchecked, problems


def _why_unchecked(e: Entry) -> str | None:
    """Why the payload of `e` cannot be checked (None when it can)."""
    if e.checksum is None:
        return "no checksum stored; payload not checked"
    if e.checksum[0] != payload_mod.CHECKSUM_ALGORITHM:
        return f"checksum algorithm {e.checksum[0]!r} is unknown to this version; payload not checked"
    return None


def _combine(path: str, reports: list[VerifyReport], extra: list[Problem]) -> VerifyReport:
    return VerifyReport(path, sum(r.entries for r in reports), sum(r.checked for r in reports),
                        tuple(u for r in reports for u in r.unchecked),
                        (*extra, *(p for r in reports for p in r.problems)),
                        files=sum(r.files for r in reports))


def _verify_steps(path: str, progress: bool) -> VerifyReport:
    """Every step of a checkpoint manager's directory, as one report."""
    names = sorted(n for n in backend_for(path).list(path) if STEP_RE.match(n))
    return _combine(path, [_verify_listed(os.path.join(path, n), progress) for n in names], [])


def _verify_listed(step: str, progress: bool) -> VerifyReport:
    """A step as the manager reads it: a symbolic link out of its directory, or to the
    directory itself (which made verify go round through it until the stack ran out), is
    reported, not followed."""
    try:
        step_directory.check_step_link(step)
    except CheckpointError as err:
        return _failed(step, _unreadable(step, err))
    return verify(step, progress=progress)


def _verify_step(path: str, progress: bool) -> VerifyReport:
    """A manager's step directory whose model is in another format
    (`CheckpointOptions(format=...)`): its record read, its model file read whole by its
    format's reader (another format's payloads carry no jckpt checksums: a warning says
    so), its optimizer file verified."""
    try:
        record = step_directory.read_record(path)
    except CheckpointError as err:
        return _failed(path, _unreadable(path, err))
    members = [os.path.join(path, record['model'])]
    members += [os.path.join(path, record['optimizer'])] if record.get('optimizer') else []
    try:
        for member in members:
            step_directory.is_file(member)  # a symbolic link is refused
    except CheckpointError as err:
        return _failed(path, _unreadable(path, err))
    reports = [_verify_model(members[0], progress)]
    reports += [_verify_file(member, progress) for member in members[1:]]
    return _combine(path, reports, [])


def _verify_model(path: str, progress: bool) -> VerifyReport:
    """A format step's model file: verified as jckpt, else read whole by its format's reader."""
    kind = classify(path)
    if kind.name == FILE:
        return _verify_file(path, progress)
    if kind.name != FOREIGN:
        assert kind.error is not None
        return _failed(path, _unreadable(path, kind.error))
    from jckpt import adapters
    try:
        tree = adapters.read(path, format=kind.detail)
    except CheckpointError as err:
        return _failed(path, _unreadable(path, err))
    names = _leaf_names(tree)
    return VerifyReport(path, len(names), 0, tuple(names), (Problem(
        'warning', f"{kind.detail} stores no jckpt checksums: the model was read whole, its "
                   f"{len(names)} payloads not checked", path),))


def _leaf_names(tree: dict[str, Any]) -> list[str]:
    """`ns/a/0/b` of every array of a tree an adapter read (dicts, lists and tuples of host
    arrays: no JAX needed to walk it)."""
    names, stack = [], list(tree.items())
    while stack:
        name, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((f"{name}/{k}", v) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((f"{name}/{i}", v) for i, v in enumerate(node))
        elif node is not None:
            names.append(name)
    return sorted(names)


def _verify_sharded(path: str, progress: bool) -> VerifyReport:
    """The index of a directory checkpoint, each piece file, and that the index matches them."""
    try:
        reader = DirectoryReader(path)
    except FormatError as err:
        return _failed(path, _unreadable(path, err))
    reports, problems, pieces = _verify_pieces(reader, progress)
    problems += _index_mismatches(reader, pieces)
    listed = set(reader.files)
    problems += [Problem('warning', f"piece file {name} is not listed in {INDEX_NAME}", path)
                 for name in backend_for(path).list(path) if PIECE_RE.match(name) and name not in listed]
    return _combine(path, reports, problems)


def _verify_pieces(reader: DirectoryReader, progress: bool) -> tuple[
        list[VerifyReport], list[Problem], dict[int, dict[tuple, Entry]]]:
    """Each piece file's report, the files the index lists but that are missing, and the
    pieces each readable file holds, by `(identity, slice)`."""
    reports, problems, pieces = [], [], {}
    for fi, name in enumerate(reader.files):
        piece_path = os.path.join(reader.path, name)
        if not reader.backend.exists(piece_path):
            problems.append(Problem('error', f"piece file {name} listed in the index is missing",
                                    reader.path))
            continue
        report = _verify_file(piece_path, progress, follow_symlinks=False)
        reports.append(report)
        if report.errors and report.entries == 0:
            continue  # the piece file itself is unreadable: already reported
        piece = reader.backend.open(piece_path, follow_symlinks=False)
        try:
            reader.check_save(piece, piece_path)
        except FormatError as e:
            problems.append(Problem('error', e.message, piece_path))
        pieces[fi] = {(e.identity, e.slice): e for e in piece.header.tensors}
    return reports, problems, pieces


def _index_mismatches(reader: DirectoryReader,
                      pieces: dict[int, dict[tuple, Entry]]) -> list[Problem]:
    """The pieces the index places in a readable file that does not hold them."""
    out = []
    for info in reader.arrays.values():
        g = info.entry
        for fi, box in info.pieces:
            if fi not in pieces:
                continue
            e = pieces[fi].get((g.identity, box))
            if e is None or e.prec != g.prec:
                out.append(Problem('error', f"piece {list(box)} is not in "
                                   f"{reader.files[fi]} as the index says", reader.path, g.name))
    return out


def _layout_problems(reader: CheckpointReader) -> list[Problem]:
    """Warnings about a readable file not laid out as a jckpt writer lays it out."""
    header, path, out = reader.header, reader.path, []
    if not getattr(reader, 'sealed', True):
        out.append(Problem('warning', "the header carries no checksum (written by an older or "
                           "another writer, or its checksum field is damaged): it was not checked",
                           path))
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


__all__ = ['Problem', 'VerifyReport', 'verify', 'verify_classified']
