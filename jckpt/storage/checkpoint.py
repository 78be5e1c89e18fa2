"""Opening a checkpoint for reading, whatever form it has on its backend.

A file opens as a `CheckpointReader`; a directory holding `index.jckpt` as a
`DirectoryReader` (written by several processes). Another tool's directory
(an orbax step) opens through a *directory reader* that a higher layer
registered with `register_directory_reader` (a local directory, or a prefix
in an object store, without `index.jckpt`): storage cannot import the
adapters, so the adapters register themselves here when `jckpt` is imported,
and every caller of `open_checkpoint` (`load`, `restore`, `describe`, `diff`)
reads such a directory without knowing it is foreign.

>>> # reader = open_checkpoint("model.jckpt")  # a CheckpointReader
>>> # reader = open_checkpoint("ckpt")         # a DirectoryReader (written by several processes)
>>> # reader = open_checkpoint("orbax/100")    # the orbax adapter's reader, read-only
>>> # reader.header.tensors[0].dims          # the same surface each way
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from jckpt.errors import FormatError
from jckpt.format.names import INDEX_NAME
from jckpt.storage.backend import (
    LOCAL,
    backend_for,
    checked_path,
    folder_path_error,
    names_folder,
    refuse_file_as_folder,
)
from jckpt.storage.directory import NO_INDEX, DirectoryReader, set_aside
from jckpt.storage.object_store import MISSING_OBJECT
from jckpt.storage.reader import CheckpointReader


@dataclasses.dataclass(frozen=True)
class DirectoryFormat:
    """A reader of another tool's checkpoint directories.

    Attributes:
      name: the format's name (`'orbax'`), for messages.
      claims: `claims(path) -> bool`: whether the directory (one without
        `index.jckpt`) is in this format; must be cheap and never raise.
        `path` may be a URL (a prefix in an object store, listed through
        `jckpt.storage.backend_for(path)`): a reader that cannot read it
        there claims it anyway when it can say so, and `open` raises the
        error that says what to do.
      open: `open(path) -> reader`: an object with a `header` (a
        `jckpt.format.entries.Header` of the directory's arrays) and
        `decode(entry, *, mmap, verify)` returning the entry's array, as
        `CheckpointReader` has; it raises a `CheckpointError` for a damaged
        directory.
    """

    name: str
    claims: Callable[[str], bool]
    open: Callable[[str], Any]


_LOCK = threading.Lock()
_DIRECTORY_FORMATS: dict[str, DirectoryFormat] = {}


def register_directory_reader(name: str, *, claims: Callable[[str], bool],
                              open: Callable[[str], Any]) -> DirectoryFormat:
    """Let `open_checkpoint` read directories of another format (registered later: tried first).

    Registering a name again replaces its reader.
    """
    fmt = DirectoryFormat(name=name, claims=claims, open=open)
    with _LOCK:
        _DIRECTORY_FORMATS.pop(name, None)
        _DIRECTORY_FORMATS[name] = fmt
    return fmt


def directory_format(path: str) -> DirectoryFormat | None:
    """The registered format that claims the directory `path`, or None."""
    with _LOCK:
        known = list(_DIRECTORY_FORMATS.values())
    for fmt in reversed(known):
        try:
            if fmt.claims(path):
                return fmt
        except Exception:  # a claim that fails does not claim the directory
            continue
    return None


_REUSED: contextvars.ContextVar[Any] = contextvars.ContextVar('jckpt_reused_reader', default=None)


@contextlib.contextmanager
def reusing(reader: Any) -> Iterator[Any]:
    """Within the block, `open_checkpoint(reader.path)` returns `reader` instead of opening again.

    A caller that reads a checkpoint's metadata and then its arrays through calls that each
    open it (the manager's restore: the step's metadata, then `restore`) reads the header
    once (one GET fewer from a store) and both from one version of the object.

    Example:
        ```python
        with reusing(open_checkpoint(url)) as reader:
            meta = reader.header.metadata_dict()
            tree = jckpt.restore(ctx, target, url)  # the same reader, no second GET
        ```
    """
    token = _REUSED.set(reader)
    try:
        yield reader
    finally:
        _REUSED.reset(token)


def open_checkpoint(path: str | os.PathLike, *, mapped: bool = True) -> Any:
    """Open a checkpoint file, a directory checkpoint, or a registered foreign directory.

    Validates the header (and a directory's index) without touching a
    payload. Raises `jckpt.errors.FormatError` for something that is not a
    checkpoint, and `jckpt.errors.InputError` for a URL no storage backend
    serves. `mapped=False`: a local file is not mapped, its reader's header alone
    is for use (`describe`).
    """
    path = checked_path(path)
    reused = _REUSED.get()
    if reused is not None and reused.path == path:
        return reused
    backend = backend_for(path)
    if backend is not LOCAL:
        return _open_url(backend, path)
    if not backend.isdir(path):
        refuse_file_as_folder(path, LOCAL)  # not the OS's "not a directory"
        aside = set_aside(path) if not os.path.lexists(path) else []
        if aside:  # a save killed between renaming the old checkpoint aside and the new one in
            return open_checkpoint(aside[-1], mapped=mapped)
        return LOCAL.open(path, mapped=mapped)
    if not os.path.exists(os.path.join(path, INDEX_NAME)):
        fmt = directory_format(path)
        if fmt is not None:
            return fmt.open(path)
    return DirectoryReader(path, check_pieces=True)


def _open_url(backend: Any, path: str) -> Any:
    """A checkpoint at a URL: an object, its header's GET first, and a prefix listed only if no
    object is there; a URL that ends with '/' names a prefix alone (no GET of the object)."""
    missing = FormatError(MISSING_OBJECT, file=path, fix="check the URL, or save a checkpoint there first")
    if not names_folder(path):
        try:
            return backend.open(path)
        except FormatError as e:
            if e.message != MISSING_OBJECT:
                raise
            missing = e
    if not backend.isdir(path):
        if names_folder(path) and backend.exists(path.rstrip('/')):
            raise folder_path_error(path, saving=False)
        raise missing
    try:
        return DirectoryReader(path, check_pieces=True)
    except FormatError as e:  # no index: a registered reader may claim the prefix
        fmt = directory_format(path) if e.message == NO_INDEX else None
        if fmt is None:
            raise
        return fmt.open(path)


__all__ = ['CheckpointReader', 'DirectoryFormat', 'DirectoryReader', 'directory_format',
           'open_checkpoint', 'register_directory_reader', 'reusing']
