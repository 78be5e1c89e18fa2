"""Storage backends: where a checkpoint's bytes live, behind one small interface.

Everything above storage names a checkpoint by a path (or, later, a URL) and
asks :func:`backend_for` for the backend that holds it. A backend offers five
things: opening a stored file for ranged reads, a streaming write that
publishes atomically, listing, removal, and a writer lease. Local POSIX files
are the one backend today (:class:`LocalBackend`: mapped reads, a staging
file renamed over the target, ``flock`` leases); an object store is another
module implementing :class:`Backend`, registered by its URL scheme.

Until then a URL is refused with a clear error, rather than taken for a
relative local path (``s3://b/x`` would otherwise create ``./s3:/b/x``):

>>> backend_for('model.jckpt') is LOCAL
True
>>> try:
...     backend_for('s3://bucket/model.jckpt')
... except InputError as e:
...     print(e.message)
no storage backend for URL scheme 's3'
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Protocol, runtime_checkable

from jckpt.errors import InputError
from jckpt.storage.lease import WriterLease
from jckpt.storage.publish import StagingFile, storage_error
from jckpt.storage.reader import CheckpointReader

#: ``scheme://`` at the start of a path: a URL, never a local file name.
_URL = re.compile(r'([A-Za-z][A-Za-z0-9+.-]*)://')


@runtime_checkable
class Backend(Protocol):
    """The operations jckpt needs from where checkpoints are stored.

    Paths are the backend's own (a local path, or later an object key under a
    URL). Failures raise :class:`~jckpt.errors.StorageError` (or
    :class:`~jckpt.errors.FormatError` for bytes that are not a checkpoint).
    """

    def open(self, path: str, *, follow_symlinks: bool = True) -> CheckpointReader:
        """A stored checkpoint file, its header validated, its payloads read by range on demand."""

    def isdir(self, path: str) -> bool:
        """Whether ``path`` is a directory (a directory checkpoint, or a manager's root)."""

    def create(self, target: str, *, durable: bool = True) -> StagingFile:
        """A streaming write that replaces ``target`` atomically when published.

        Use as a context manager: leaving it without ``publish()`` discards
        what was written and leaves ``target`` as it was.
        """

    def list(self, path: str) -> list[str]:
        """The names directly under ``path``, sorted."""

    def remove(self, path: str) -> None:
        """Remove ``path`` (a file, or a directory and everything in it); missing is fine."""

    def lease(self, path: str) -> WriterLease:
        """Take the exclusive writer lease on ``path``; raises :class:`~jckpt.errors.InUseError`."""


class LocalBackend:
    """Checkpoints on a local (POSIX) filesystem.

    Reads map the file (:class:`~jckpt.storage.reader.CheckpointReader`),
    writes stream to a locked staging sibling renamed over the target
    (:class:`~jckpt.storage.publish.StagingFile`), and the lease is a
    ``flock`` on a sidecar file (:class:`~jckpt.storage.lease.WriterLease`).
    """

    name = 'local'

    def open(self, path: str, *, follow_symlinks: bool = True) -> CheckpointReader:
        return CheckpointReader(path, follow_symlinks=follow_symlinks)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def create(self, target: str, *, durable: bool = True) -> StagingFile:
        return StagingFile(target, durable=durable)

    def list(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError as e:
            raise storage_error(e, "listing the directory", path) from e

    def remove(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error(e, "removing", path) from e

    def lease(self, path: str) -> WriterLease:
        return WriterLease(path)

    def __repr__(self) -> str:
        return 'LocalBackend()'


#: The local filesystem backend (there is one; it holds no state).
LOCAL = LocalBackend()


def url_scheme(path: str | os.PathLike) -> str | None:
    """The scheme of ``path`` when it is a URL (``'s3'`` for ``s3://b/k``), else None."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    m = _URL.match(text)
    return m.group(1).lower() if m else None


def backend_for(path: str | os.PathLike) -> Backend:
    """The backend that stores ``path``: the local one for a filesystem path.

    Raises :class:`~jckpt.errors.InputError` for a URL (``scheme://...``):
    no backend for object stores ships yet.
    """
    scheme = url_scheme(path)
    if scheme is None:
        return LOCAL
    raise InputError(f"no storage backend for URL scheme {scheme!r}", file=os.fspath(path),
                     fix="save to and read from a local filesystem path; this version of jckpt "
                         "stores checkpoints on local (POSIX) filesystems only")


__all__ = ['LOCAL', 'Backend', 'LocalBackend', 'backend_for', 'url_scheme']
