"""Storage backends: where a checkpoint's bytes live, behind one small interface.

Everything above storage names a checkpoint by a path or a URL and
asks `backend_for` for the backend that holds it: the library's entry
points (save and load, the mirror and the manager, conversion, the tools and
the command line) all do, before they create or read anything. A backend
offers six things: opening a stored checkpoint for ranged reads, mapping a
stored file of any format whole, a streaming write that publishes
atomically, listing, removal, and a writer lease. Local POSIX files are
one backend (`LocalBackend`: mapped reads, a staging file renamed over the
target, `flock` leases); object stores are the other
(`jckpt.storage.object_backend`: ranged reads, uploads completed at publish,
conditional-create leases), registered by URL scheme (`s3`, `gs`, `az`,
`memory`).

A URL of a scheme no backend serves is refused with a clear error, rather
than taken for a relative local path (`s3x://b/x` would otherwise create
`./s3x:/b/x`); `backend_for` says exactly which strings count as URLs:

>>> backend_for('model.jckpt') is LOCAL
True
>>> try:
...     backend_for('ftp://host/model.jckpt')
... except InputError as e:
...     print(e.message)
no storage backend for URL scheme 'ftp'
"""

from __future__ import annotations

import mmap as mmap_mod
import os
import re
import shutil
import stat
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from jckpt.errors import FormatError, InputError
from jckpt.format.names import INDEX_NAME, is_step_member
from jckpt.format.sniff import looks_like_header
from jckpt.storage import object_store
from jckpt.storage.lease import WriterLease
from jckpt.storage.object_backend import OBJECT_STORE
from jckpt.storage.publish import StagingFile, remove_file, storage_error
from jckpt.storage.reader import CheckpointReader
from jckpt.storage.regular import open_regular

#: A URL: at the very start, a scheme of two or more characters (RFC 3986: a letter, then
#: letters, digits, `+ - .`) and `:/`. See `backend_for` for why this rule.
_URL = re.compile(r'([A-Za-z][A-Za-z0-9+.-]+):/')

#: A whole stored file: locally a private (copy-on-write) mapping, `b''` for an empty file.
Buffer = mmap_mod.mmap | bytes


@runtime_checkable
class Backend(Protocol):
    """The operations jckpt needs from where checkpoints are stored.

    Paths are the backend's own (a local path, or a URL of an object or a
    prefix). Failures raise `StorageError` (or
    `FormatError` for bytes that are not a checkpoint).
    """

    def open(self, path: str, *, follow_symlinks: bool = True) -> CheckpointReader:
        """A stored checkpoint file, its header validated, its payloads read by range on demand."""

    def map(self, path: str) -> Buffer:
        """The whole stored file `path`, in any format, as a buffer (the format adapters read this).

        `open` is for jckpt checkpoints (it validates their header); this is
        for the files of other formats (safetensors, npz, llm.c, PyTorch),
        which the adapters parse themselves. Raises
        `FormatError` when `path` is missing or a directory.
        """

    def head(self, path: str, length: int) -> bytes:
        """The first `length` bytes of the stored file `path` (fewer if shorter); errors as `map`."""

    def exists(self, path: str) -> bool:
        """Whether something is stored at `path` (locally a file or a directory; in a store, an object)."""

    def isdir(self, path: str) -> bool:
        """Whether `path` is a directory (a directory checkpoint, or a manager's root)."""

    def check_target(self, path: str) -> None:
        """Refuse, before any byte is written or any request made, a path no checkpoint file
        can be saved at (`InputError`): a local directory in the way, a bucket's root."""

    def create(self, target: str, *, durable: bool = True) -> StagingFile:
        """A streaming write that replaces `target` atomically when published.

        Use as a context manager: leaving it without `publish()` discards
        what was written and leaves `target` as it was. Writers stream to
        its descriptor `fd` (the checkpoint writer patches checksums into
        the header in place); a writer that needs a file object (`zipfile`,
        the format adapters) wraps a duplicate of that descriptor.
        """

    def list(self, path: str) -> list[str]:
        """The names directly under `path`, sorted."""

    def list_kinds(self, path: str) -> tuple[list[str], list[str]]:
        """The names directly under `path` as `(files, directories)`, each sorted (in a
        bucket: objects and prefixes, and a name may be both)."""

    def size(self, path: str) -> int:
        """Bytes of the file `path`, or of every file under the directory `path`; 0 if missing."""

    def remove(self, path: str, *, below: bool = True) -> None:
        """Remove `path` (a file, or a directory and everything in it); missing is fine.
        `below=False` removes a file (an object) alone, without looking below it."""

    def remove_all(self, paths: Sequence[str], *, below: bool = True) -> None:
        """Remove each of `paths` as `remove` does, in as few requests as the store allows (an
        object store deletes up to 1,000 keys per request); a failure is a `StorageError`
        naming what was being removed."""

    def lease(self, path: str) -> WriterLease:
        """Take the exclusive writer lease on `path`; raises `InUseError`. The lease's
        `check()` raises `InUseError` once another writer has taken it over."""

    def reclaim_uploads(self, path: str) -> int:
        """Abort the incomplete uploads of `path` that killed writers left; how many (object stores)."""


class LocalBackend:
    """Checkpoints on a local (POSIX) filesystem.

    Reads map the file (`CheckpointReader`),
    writes stream to a locked staging sibling renamed over the target
    (`StagingFile`), and the lease is a
    `flock` on a sidecar file (`WriterLease`).
    """

    name = 'local'

    def open(self, path: str, *, follow_symlinks: bool = True, mapped: bool = True
             ) -> CheckpointReader:
        return CheckpointReader(path, follow_symlinks=follow_symlinks, mapped=mapped)

    def map(self, path: str) -> Buffer:
        try:
            with open_regular(path) as f:
                size = os.fstat(f.fileno()).st_size
                return mmap_mod.mmap(f.fileno(), 0, access=mmap_mod.ACCESS_COPY) if size else b''
        except FileNotFoundError:
            raise FormatError("no such file or directory", file=path, fix="check the path") from None
        except IsADirectoryError:
            raise FormatError("is a directory, not a file", file=path,
                              fix="pass a file, or the format that reads this directory") from None
        except OSError as e:
            raise storage_error(e, "reading", path) from e

    def head(self, path: str, length: int) -> bytes:
        return bytes(self.map(path)[:length])

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def check_target(self, path: str) -> None:
        # a save would write its whole staging file, then fail to rename it over a directory;
        # a symbolic link to one is replaced, as any link at a checkpoint's path is
        if os.path.isdir(path) and not os.path.islink(path) \
                and not os.path.isfile(os.path.join(path, INDEX_NAME)):
            raise InputError("is a directory that holds no directory checkpoint", file=path,
                             fix="save to a file path (inside it, perhaps), or remove it first")
        # a directory checkpoint's files are looked at once, by the directory save that would
        # replace them (`refuse_others_files`); a file's save fails to publish over it

    def create(self, target: str, *, durable: bool = True) -> StagingFile:
        return StagingFile(target, durable=durable)

    def list(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError as e:
            raise storage_error(e, "listing the directory", path) from e

    def list_kinds(self, path: str) -> tuple[list[str], list[str]]:
        names = self.list(path)
        dirs = [n for n in names if os.path.isdir(os.path.join(path, n))]
        known = set(dirs)
        return [n for n in names if n not in known], dirs

    def size(self, path: str) -> int:
        """Bytes of `path` or of every file under it (symbolic links counted as links)."""
        if not os.path.isdir(path) or os.path.islink(path):
            try:
                return os.lstat(path).st_size
            except OSError:
                return 0
        total = 0
        for root, _dirs, files in os.walk(path):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_size
                except OSError:
                    pass
        return total

    def remove(self, path: str, *, below: bool = True) -> None:
        if below and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            return
        try:
            remove_file(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error(e, "removing", path) from e

    def remove_all(self, paths: Sequence[str], *, below: bool = True) -> None:
        for path in paths:
            self.remove(path, below=below)

    def lease(self, path: str) -> WriterLease:
        return WriterLease(path)

    def reclaim_uploads(self, path: str) -> int:
        """Nothing to do: a killed writer's staging file is reclaimed by `reclaim_staging`."""
        return 0

    def __repr__(self) -> str:
        return 'LocalBackend()'


#: The local filesystem backend (there is one; it holds no state).
LOCAL = LocalBackend()


def names_folder(path: str) -> bool:
    """Whether `path` ends with a separator: it names a directory (a prefix in a bucket).

    >>> names_folder('s3://b/run/'), names_folder('run/model.jckpt')
    (True, False)
    """
    return path.endswith(('/', os.sep))


def folder_path_error(path: str, *, saving: bool) -> InputError:
    """The error of a checkpoint file named with a trailing '/' (`names_folder`), saved or
    read: the same locally and in a bucket, where a save went to the object without the '/'
    and a read read it, while locally a save said a directory did not exist.

    >>> print(folder_path_error('run/m.jckpt/', saving=False).fix)
    read 'run/m.jckpt', without the trailing '/'
    """
    bare = path.rstrip('/' + os.sep)
    if saving:
        return InputError("a checkpoint file's path cannot end with '/', which names a directory",
                          file=path, fix=f"save to {bare!r}, without the trailing '/' (a directory "
                                         "checkpoint, which several processes save together, may keep it)")
    return InputError(f"ends with '/', which names a directory, but {bare.rsplit('/', 1)[-1]!r} is "
                      "a checkpoint file", file=path, fix=f"read {bare!r}, without the trailing '/'")


def foreign_at(path: str, claims: Callable[[str], bool] | None = None, *,
               kind: str = 'a checkpoint',
               strays: Callable[[str], list[str]] | None = None) -> str | None:
    """What stands at `path` that replacing it would lose, in words; None where nothing would
    be: nothing there, a symbolic link (replaced, never followed), a FIFO, device or socket
    (`publish.refuse_special` says so, never opening it), an empty directory, a directory of
    what a directory checkpoint or a manager's step holds (`is_step_member`), or a checkpoint
    `claims` recognises (a file, or a directory without a jckpt index; by default a file that
    starts like a jckpt header), unless `strays` names entries of that directory that are no
    part of it (a user's note put in an orbax step). The one test every guard against
    replacing a user's own files makes (`refuse_foreign`), on a local path or in a bucket.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> foreign_at(d) is None
    True
    >>> open(os.path.join(d, 'notes.txt'), 'w').close()
    >>> foreign_at(d)
    'a directory holding 1 entry that is no part of a checkpoint (notes.txt)'
    """
    backend = backend_for(path)
    if backend is LOCAL:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return None
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            return None
    elif not occupied(path):
        return None
    if backend.isdir(path):
        names = backend.list(path)
        others = [n for n in names if not is_step_member(n)]
        if others and INDEX_NAME not in names and claims is not None and claims(path):
            others = strays(path) if strays is not None else []
        if not others:
            return None
        shown = ', '.join(others[:3]) + (', ...' if len(others) > 3 else '')
        one = len(others) == 1
        return (f"a directory holding {len(others)} entr{'y that is' if one else 'ies that are'} "
                f"no part of {kind} ({shown})")
    if (claims or _starts_like_jckpt)(path):
        return None
    return f"a file that is not {kind} ({backend.size(path)} bytes)"


def _starts_like_jckpt(path: str) -> bool:
    return looks_like_header(backend_for(path).head(path, 64))


#: The fix of every refusal to replace what jckpt did not write (`refuse_foreign`).
FOREIGN_FIX = ("choose another path, or move what is there out first: jckpt never deletes what "
               "is not a checkpoint's")


def refuse_foreign(path: str, operation: str, claims: Callable[[str], bool] | None = None, *,
                   kind: str = 'a checkpoint',
                   strays: Callable[[str], list[str]] | None = None) -> None:
    """Raise `InputError` naming what is at `path` (`foreign_at`) that `operation` (a save, a
    conversion, a merge, an export) would replace: replacing a checkpoint is what these
    operations mean; deleting a user's other files never is, whatever the options.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> open(os.path.join(d, 'notes.txt'), 'w').close()
    >>> refuse_foreign(d, 'merging')
    Traceback (most recent call last):
    jckpt.errors.InputError: ...: merging would replace a directory holding 1 entry that is no part of ...
    """
    there = foreign_at(path, claims, kind=kind, strays=strays)
    if there is not None:
        raise InputError(f"{operation} would replace {there}", file=path, fix=FOREIGN_FIX)


def refuse_others_files(path: str) -> None:
    """`refuse_foreign` for a directory checkpoint's save: publishing it locally swaps the
    whole directory, so a folder of the user's own files, or a note beside the pieces, was
    deleted. In a bucket a save replaces only its own objects.

    >>> refuse_others_files('no/such/dir.jckpt')  # nothing there
    """
    if not is_url(path):
        refuse_foreign(path, "saving a directory checkpoint")


def refuse_file_as_folder(path: str, backend: Backend) -> None:
    """Raise `folder_path_error` when `path` ends with '/' but names a file (an object in a
    bucket), for every reader alike: a bucket read `s3://b/m.jckpt/` as `m.jckpt`, while
    locally the OS said "not a directory".

    >>> import tempfile
    >>> f = tempfile.mkstemp(suffix='.jckpt')[1]
    >>> refuse_file_as_folder(f + '/', LOCAL)
    Traceback (most recent call last):
    jckpt.errors.InputError: ...: ends with '/', which names a directory, but ... (fix: ...)
    """
    if not names_folder(path):
        return
    bare = path.rstrip('/' + os.sep)
    if backend is LOCAL:
        found = os.path.isfile(bare)
    else:  # an object there (not the bucket itself, which no object is), and no prefix of it
        found = '/' in bare.partition('://')[2] and backend.exists(bare) and not backend.isdir(path)
    if found:
        raise folder_path_error(path, saving=False)


def checked_path(path: str | os.PathLike) -> str:
    """`path` as a `str`: a `str`, `bytes` or `os.PathLike`, else an `InputError`.

    Every public call takes its path arguments through here (or through
    `backend_for`), so a path of the wrong type is a `CheckpointError` with a
    fix, not a bare `TypeError` (or, for a NUL character, `ValueError`)
    from deep inside.

    >>> checked_path(b'a/b.jckpt')
    'a/b.jckpt'
    """
    try:
        text = os.fspath(path)
    except TypeError:
        raise InputError(f"a path must be a str or os.PathLike, not {type(path).__name__} {path!r:.80}",
                         fix="pass the checkpoint's path as a string or a pathlib.Path") from None
    text = os.fsdecode(text) if isinstance(text, bytes) else text
    if '\0' in text:  # no file system names one; os.stat would raise a bare ValueError
        raise InputError(f"a path cannot hold a NUL character: {text!r:.80}",
                         fix="pass the checkpoint's real path")
    return text


def url_scheme(path: str | os.PathLike) -> str | None:
    """The scheme of `path` when it is a URL (`'s3'` for `s3://b/k`), else None.

    The rule is `backend_for`'s.

    >>> url_scheme('GS://bucket/run'), url_scheme('C:/x'), url_scheme('dir/a://b')
    ('gs', None, None)
    """
    m = _URL.match(checked_path(path))
    return m.group(1).lower() if m else None


def is_url(path: str | os.PathLike) -> bool:
    """Whether `path` is a URL (by `backend_for`'s rule), not a local path.

    >>> is_url('s3://b/x'), is_url('run/x.jckpt')
    (True, False)
    """
    return url_scheme(path) is not None


def backend_for(path: str | os.PathLike) -> Backend:
    """The backend that stores `path`: the local one for a filesystem path.

    This is the one place a path becomes a backend: every entry point of the
    library calls it before it creates or reads anything, so a URL is refused
    before a local file or directory of that name could appear.

    **What counts as a URL.** `path` (a `str`, `bytes` or `os.PathLike`)
    is a URL when it starts with a scheme of two or more characters (a
    letter, then letters, digits, `+`, `-` or `.`, as RFC 3986 spells a
    scheme) followed by `:/`. The scheme is matched case-insensitively and
    reported in lower case. So these are URLs: `s3://bucket/x`,
    `gs://b/x`, `memory://x`, `file:///tmp/x`, and `s3:/bucket/x`,
    which is what `pathlib.Path('s3://bucket/x')` turns a URL into. These
    stay local paths: `C:/x` and `C:\\x` (a one-letter scheme is a Windows
    drive), `dir/a://b` and `./s3://b` (`://` not at the start),
    `s3:x` and `run:1/ckpt` (no `/` right after the colon),
    `2024-01-01T10:00/ckpt` (a scheme starts with a letter).

    A URL of a scheme in `jckpt.storage.object_store.SCHEMES` (`s3`, `gs`,
    `az`, `memory` and their aliases) is served by the object store backend;
    its library is imported when the first object is read or written, and a
    missing library is an `InputError` saying what to install. Such a URL
    must not hold `.` or `..` segments or credentials (`InputError`
    otherwise). Any other URL is an
    `InputError` naming its scheme.

    >>> backend_for('C:/x') is backend_for('dir/a://b') is LOCAL
    True
    """
    scheme = url_scheme(path)
    if scheme is None:
        return LOCAL
    if scheme in object_store.SCHEMES:
        if not object_store.available():
            raise InputError(f"URLs of scheme {scheme!r} need obstore, which is not installed",
                             file=checked_path(path), fix="pip install 'jckpt[cloud]'")
        object_store.ObjectURL.parse(checked_path(path))  # credentials, '..': refused up front
        return OBJECT_STORE
    raise InputError(f"no storage backend for URL scheme {scheme!r}", file=checked_path(path),
                     fix="use a local filesystem path, or a URL of a scheme jckpt stores to: "
                         + ", ".join(f"{s}://" for s in sorted(object_store.SCHEMES)))


def occupied(path: str) -> bool:
    """Whether anything is at `path`: a file, a directory or a link; an object or a prefix.

    >>> occupied('no/such/file')
    False
    """
    backend = backend_for(path)
    if backend is LOCAL:
        return os.path.lexists(path)
    return backend.exists(path) or backend.isdir(path)


def same_place(a: str, b: str) -> bool:
    """Whether `a` and `b` name one checkpoint: one local file or directory (links and
    relative paths resolved; False while either is missing), or one object.

    >>> same_place('s3://b/run/x', 's3a://b//run/x'), same_place('s3://b/x', 'x')
    (True, False)
    """
    if is_url(a) or is_url(b):
        if not (is_url(a) and is_url(b)):
            return False
        ua, ub = object_store.ObjectURL.parse(a), object_store.ObjectURL.parse(b)
        return (ua.kind, ua.bucket, ua.key) == (ub.kind, ub.bucket, ub.key)
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


__all__ = ['FOREIGN_FIX', 'LOCAL', 'Backend', 'Buffer', 'LocalBackend', 'backend_for',
           'folder_path_error', 'foreign_at', 'is_url', 'names_folder', 'occupied', 'open_regular',
           'refuse_file_as_folder', 'refuse_foreign', 'refuse_others_files', 'same_place',
           'url_scheme']
