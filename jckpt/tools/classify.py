"""What a path holds: `classify(path)` says which kind of checkpoint is there, if any.

Every tool starts from the same question (a jckpt file? a multi-process
directory? a manager's directory of steps? a file in another format?), and
asks it here, so they all answer it alike and name the same error when the
answer is "no checkpoint". Nothing but a regular file is ever opened: a FIFO
or a device is refused from its `stat`, so classifying never blocks.

>>> import numpy as np, tempfile, os
>>> d = tempfile.mkdtemp()
>>> np.savez(os.path.join(d, 'w.npz'), w=np.zeros(3))
>>> classify(os.path.join(d, 'w.npz')).name, classify(os.path.join(d, 'w.npz')).detail
('foreign', 'npz')
>>> classify(os.path.join(d, 'gone.jckpt')).name
'missing'
>>> kind = classify(d)
>>> kind.name, kind.detail, kind.error.message[:29]
('unknown', 'no checkpoint', 'directory holds no checkpoint')
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import stat
from collections.abc import Callable
from typing import Any

from jckpt.adapters import SNIFF_BYTES, detect_format
from jckpt.adapters.cut_short import cut_short_error
from jckpt.adapters.orbax import manager_step_names
from jckpt.errors import CheckpointError, FormatError
from jckpt.format.names import INDEX_NAME, PIECE_RE, STEP_RE, is_format_step
from jckpt.format.sniff import looks_like_header
from jckpt.storage.backend import (
    LOCAL,
    backend_for,
    checked_path,
    folder_path_error,
    is_url,
    names_folder,
    refuse_file_as_folder,
)
from jckpt.storage.directory import set_aside
from jckpt.storage.object_store import MISSING_OBJECT
from jckpt.storage.publish import storage_error
from jckpt.storage.reader import CheckpointReader
from jckpt.storage.regular import open_regular, special_name
from jckpt.storage.remote_reader import concurrently

# --- the kinds (Kind.name) ------------------------------------------------------------------

#: A checkpoint file (jckpt or OCANNL); its header may still be damaged: reading it says how.
FILE = 'file'
#: A multi-process checkpoint: a directory with an index (`index.jckpt`) and piece files.
DIRECTORY = 'directory'
#: A checkpoint manager's directory: `step_NNNNNNNN.jckpt` steps (files or directories).
MANAGER = 'manager'
#: A file in another format a format adapter recognises (`Kind.detail` names it).
FOREIGN = 'foreign'
#: Nothing at the path (a dangling symbolic link included).
MISSING = 'missing'
#: Something that holds no checkpoint (`Kind.detail` says what: one of the three below).
UNKNOWN = 'unknown'

#: An UNKNOWN directory of piece files without an index: a save that did not finish.
UNFINISHED = 'unfinished save'
#: An UNKNOWN directory holding no checkpoint at all.
NO_CHECKPOINT = 'no checkpoint'
#: An UNKNOWN regular file that no reader accepts (`Kind.error` is the reader's).
UNREADABLE = 'unreadable file'
#: An UNKNOWN regular file of another format cut short (a zip archive without its end, a
#: safetensors file shorter than its header): `Kind.error` says which.
CUT_SHORT = 'cut short'
#: An UNKNOWN directory that is one step of a manager writing its model in another format
#: (`CheckpointOptions(format=...)`): a model file, `optimizer.jckpt`, `trainer_state.json`.
FORMAT_STEP = 'manager step'

@dataclasses.dataclass(frozen=True)
class Kind:
    """What `classify` found at `path`.

    Attributes:
      name: `FILE`, `DIRECTORY`, `MANAGER`, `FOREIGN`,
        `MISSING` or `UNKNOWN`.
      path: the path classified.
      detail: for FOREIGN the format's name (`'safetensors'`); for UNKNOWN
        `UNFINISHED`, `NO_CHECKPOINT`, `FORMAT_STEP`, `UNREADABLE` or `CUT_SHORT`.
      error: for the kinds that hold no checkpoint (FOREIGN, MISSING, UNKNOWN),
        the error that says so, naming the path and what to do; else None.
      reader: for a FILE in an object store, the reader `classify` opened it with (its
        header read), so that a tool reads it without another GET; else None.
      listing: for a prefix in an object store, its `list_kinds` as `classify` listed it
        (`(objects, prefixes)`), so that a tool reads a manager's steps without another LIST;
        else None.
    """

    name: str
    path: str
    detail: str | None = None
    error: CheckpointError | None = dataclasses.field(default=None, compare=False, repr=False)
    reader: Any = dataclasses.field(default=None, compare=False, repr=False)
    listing: tuple[list[str], list[str]] | None = dataclasses.field(default=None, compare=False,
                                                                     repr=False)

    @property
    def is_checkpoint(self) -> bool:
        """Whether a checkpoint is there (a file, a directory checkpoint, a manager's directory)."""
        return self.error is None


def classify(path: str | os.PathLike) -> Kind:
    """What `path` holds, from its `stat`, its listing or its first bytes.

    A directory with an index is a multi-process checkpoint (even if it also
    holds steps); one with `step_NNNNNNNN.jckpt` entries is a manager's
    directory. A regular file is a jckpt file when it starts like one,
    else a foreign file when a format adapter recognises it, else a jckpt
    file when its header still reads (OCANNL writes headers in other forms),
    else unknown. Raises `FormatError` for a path that
    is neither a regular file nor a directory (a FIFO, a device, a socket),
    without opening it, `StorageError` when the
    path cannot be read, and `InputError` for a URL no
    storage backend serves (every tool asks here first, so every tool
    refuses one alike).

    Example:
        ```python
        kind = classify("ckpt.jckpt")
        if kind.error is not None:
            raise kind.error
        ```
    """
    path = checked_path(path)
    backend = backend_for(path)  # a URL no backend serves: an InputError, not a "missing" file
    if backend is not LOCAL:
        return _classify_url(path, backend)
    refuse_file_as_folder(path, backend)  # as open_checkpoint does
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        aside = set_aside(path)  # a save killed between renaming the old one aside and the new in
        return classify(aside[-1]) if aside else Kind(MISSING, path, error=missing_error(path))
    except OSError as e:
        raise storage_error(e, "reading", path) from e
    if stat.S_ISDIR(mode):
        return _classify_directory(path)
    if not stat.S_ISREG(mode):
        raise FormatError(f"is {special_name(mode)}, not a checkpoint file or directory",
                          file=path, fix="pass a checkpoint file or directory")
    return _classify_file(path)


def missing_error(path: str) -> FormatError:
    """The error for a checkpoint that is not there."""
    return FormatError("no such checkpoint file", file=path,
                       fix="check the path, or save a checkpoint there first")


def not_jckpt_error(path: str | os.PathLike, fmt: str) -> FormatError:
    """The error for a file in another format, with the command that converts it."""
    path = os.fspath(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    what = 'directory' if not is_url(path) and os.path.isdir(path) else 'file'
    steps = manager_step_names(path) if what == 'directory' and fmt == 'orbax' else []
    if steps:  # orbax's CheckpointManager directory: a step is what converts (and restores)
        return FormatError(f"this directory holds orbax steps ({', '.join(steps[-3:])}), not a "
                           "jckpt checkpoint", file=path,
                           fix=f"convert a step first: jckpt convert "
                               f"{shlex.quote(os.path.join(path, steps[-1]))} "
                               f"{shlex.quote(steps[-1] + '.jckpt')}; jckpt.restore and "
                               "jckpt.load read a step as it is")
    direct = "; jckpt.restore and jckpt.load read it as it is" if fmt == 'orbax' else ''
    return FormatError(f"this {what} is in {fmt} format, not a jckpt checkpoint", file=path,
                       fix=f"convert it first: jckpt convert {shlex.quote(path)} "
                           f"{shlex.quote(stem + '.jckpt')} "
                           f"(or jckpt.convert in Python){direct}")



def _classify_url(path: str, backend: Any) -> Kind:
    """What a URL holds: an object (read as a checkpoint, else sniffed), a prefix of objects, or
    nothing, asked with no HEAD. A URL whose last name has a suffix (`model.jckpt`) is most
    often an object: its header GET goes first, and the prefix is listed only if it is
    missing. Any other (`run`, `run/`) is most often a prefix (a manager's run, a directory
    checkpoint): the GET and the LIST go at once, one round trip where they took two in turn.
    A URL ending with '/' names a prefix: what is listed there, else `folder_path_error` when
    an object is there without it (`refuse_file_as_folder`'s rule, told by the same two
    requests, where its HEAD went first, a round trip of its own)."""
    if _names_a_file(path):
        kind = _as_object(path, backend)
        return kind if kind is not None else _as_prefix(path, backend.list_kinds(path))
    (kind, failed), (listing, unlisted) = concurrently(
        _outcome, [lambda: _as_object(path, backend), lambda: backend.list_kinds(path)], 2)
    if failed is not None:
        raise failed
    if kind is not None and not names_folder(path):
        return kind
    if unlisted is not None:
        raise unlisted
    if kind is not None and not any(listing) and '/' in path.rstrip('/').partition('://')[2]:
        raise folder_path_error(path, saving=False)  # an object named as a folder
    return _as_prefix(path, listing)


def _names_a_file(path: str) -> bool:
    """Whether the URL's last name has a suffix, as a file's (`s3://b/run/model.jckpt`).

    >>> _names_a_file('s3://b/run/model.jckpt'), _names_a_file('s3://b/run'), _names_a_file('s3://b/r/')
    (True, False, False)
    """
    return bool(os.path.splitext(path.rpartition('/')[2])[1])


def _outcome(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """`(call(), None)`, or `(None, the error it raised)`: both of two requests made at once are
    waited for, whichever fails."""
    try:
        return call(), None
    except CheckpointError as e:
        return None, e


def _as_object(path: str, backend: Any) -> Kind | None:
    """The kind of the object at `path` (a checkpoint, a foreign file, unreadable), or None when
    no object is there."""
    try:
        return Kind(FILE, path, reader=backend.open(path))
    except FormatError as e:
        if e.message == MISSING_OBJECT:
            return None
        fmt = _foreign_format(path)
        if fmt is not None:
            return Kind(FOREIGN, path, fmt, not_jckpt_error(path, fmt))
        return Kind(UNKNOWN, path, UNREADABLE, e)


def _as_prefix(path: str, listing: tuple[list[str], list[str]]) -> Kind:
    """The kind of the prefix `path` from its `listing` (`list_kinds`): nothing, or what is in it."""
    names = sorted(set(listing[0]) | set(listing[1]))
    if not names:
        return Kind(MISSING, path, error=missing_error(path))
    return dataclasses.replace(_classify_names(path, names), listing=listing)


def _classify_directory(path: str) -> Kind:
    try:
        names = os.listdir(path)
    except OSError as e:
        raise storage_error(e, "listing", path) from e
    if os.path.isfile(os.path.join(path, INDEX_NAME)):
        return Kind(DIRECTORY, path)
    return _classify_names(path, names)


def _classify_names(path: str, names: list[str]) -> Kind:
    """A directory's (or a prefix's) kind from the names in it."""
    if INDEX_NAME in names:
        return Kind(DIRECTORY, path)
    if any(STEP_RE.match(n) for n in names):
        return Kind(MANAGER, path)
    if any(PIECE_RE.match(n) for n in names):
        return Kind(UNKNOWN, path, UNFINISHED, FormatError(
            f"piece files but no {INDEX_NAME}: a multi-process save that did not finish; it is "
            "not a checkpoint", file=path, fix="use the previous complete checkpoint"))
    if is_format_step(path, names):
        files = sorted(n for n in names if n.endswith('.jckpt'))
        one = f" (a jckpt file in it: {os.path.join(path, files[0])})" if files else ''
        return Kind(UNKNOWN, path, FORMAT_STEP, FormatError(
            "one step of a checkpoint manager that writes its model in another format: its "
            f"files are read one by one ({', '.join(sorted(names))})", file=path,
            fix=f"inspect the manager's directory ({os.path.dirname(path.rstrip('/')) or '.'}), "
                "restore the step with CheckpointManager(directory).restore(step), or name "
                f"one of its files{one}"))
    fmt = _foreign_format(path)
    if fmt is not None:  # an orbax step or item, a Hugging Face checkpoint-500/
        return Kind(FOREIGN, path, fmt, not_jckpt_error(path, fmt))
    return Kind(UNKNOWN, path, NO_CHECKPOINT, FormatError(
        "directory holds no checkpoint (no index.jckpt, no step_NNNNNNNN.jckpt steps)", file=path,
        fix="pass a checkpoint file, a multi-process checkpoint directory or a checkpoint "
            "manager's directory"))


def _foreign_format(path: str) -> str | None:
    """The format of another tool's checkpoint file or directory at `path`, or None (none
    recognises it, or it is jckpt's own)."""
    try:
        fmt: str | None = detect_format(path)
    except CheckpointError:
        return None
    return fmt if fmt not in ('jckpt', 'ocannl') else None


def _classify_file(path: str) -> Kind:
    head = _head(path)
    if looks_like_header(head):
        return Kind(FILE, path)
    fmt = _foreign_format(path)
    if fmt is not None:
        return Kind(FOREIGN, path, fmt, not_jckpt_error(path, fmt))
    cut = cut_short_error(path, head)  # another format's file cut short: not one to convert
    if cut is not None:
        return Kind(UNKNOWN, path, CUT_SHORT, cut)
    try:
        CheckpointReader(path)
    except FormatError as e:
        return Kind(UNKNOWN, path, UNREADABLE, e)
    return Kind(FILE, path)


def _head(path: str) -> bytes:
    """The first bytes of a regular file (it may have become a FIFO since its stat)."""
    try:
        with open_regular(path) as f:
            return f.read(SNIFF_BYTES)
    except FileNotFoundError:
        return b''  # removed since its stat: what reads it next will say so
    except IsADirectoryError:
        raise FormatError("became a directory while being read", file=path,
                          fix="try again once nothing else writes there") from None
    except OSError as e:
        raise storage_error(e, "reading", path) from e


__all__ = ['CUT_SHORT', 'DIRECTORY', 'FILE', 'FOREIGN', 'MANAGER', 'MISSING', 'NO_CHECKPOINT', 'UNFINISHED',
           'UNKNOWN', 'UNREADABLE', 'Kind', 'classify', 'missing_error', 'not_jckpt_error']
