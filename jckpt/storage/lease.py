"""Writer leases: at most one writer of a checkpoint path at a time, across threads and processes.

A lease is an exclusive `flock` on a sidecar file, `<path>.jckpt-lease`
(for a directory, `<dir>/.jckpt-lease`). `flock` locks belong to an open
file description, so a second lease taken in the same process (another
thread, another mirror) conflicts just as one in another process does, and
the kernel releases the lock of a killed writer. The holder's pid is written
into the file so the refusal can name it. Readers never take the lease.

>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), 'model.jckpt')
>>> with WriterLease(path):
...     try:
...         WriterLease(path)
...     except InUseError as e:
...         print('in use' in str(e))
True
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterable

from jckpt.errors import InUseError, StorageError
from jckpt.format.names import LEASE_SUFFIX
from jckpt.storage.publish import storage_error

#: How to read what a lease holder writes: a mirror or manager is a writer, and a second one
#: on its path is refused, an evaluation job's too.
READ_WHILE_HELD = ("to read what it writes while it runs (an evaluation job), open "
                   "jckpt.CheckpointManager(path, read_only=True) on a manager's directory, or "
                   "jckpt.restore the files jckpt.info(path) lists")


def lease_path(path: str | os.PathLike) -> str:
    """The sidecar lock file guarding writes to `path`."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return os.path.join(path, LEASE_SUFFIX)
    return path.rstrip(os.sep) + LEASE_SUFFIX


class WriterLease:
    """An exclusive lease on `path`, taken at construction, released by `release`.

    Raises `InUseError` (its message says "in use" and
    names the holder's pid) when another writer holds it.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.lock_path = lease_path(self.path)
        self.fd = -1
        self._pid = os.getpid()  # a forked child's copy never removes its parent's lease
        for _ in range(100):
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
                             | os.O_NONBLOCK, 0o666)
            except OSError as e:
                if e.errno == errno.ELOOP:  # a planted symlink must not redirect the write
                    raise StorageError("the writer lease is a symbolic link; not following it",
                                       errno=e.errno, file=self.lock_path,
                                       fix="remove the symbolic link, then save again") from None
                raise storage_error(e, "creating the writer lease", self.lock_path) from e
            _refuse_unless_regular(fd, self.lock_path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise _in_use(holder, self.lock_path, self.path) from None
            except OSError as e:  # no flock on this filesystem
                os.close(fd)
                raise storage_error(e, "locking the writer lease", self.lock_path) from e
            # The previous holder may have unlinked the file between our open and lock.
            try:
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return
            os.close(fd)
        raise InUseError("in use: the lease file keeps changing", file=self.path,
                         fix="check for a flood of writers on this path")

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def check(self) -> None:
        """Raise `InUseError` if another writer took the lease over (a `flock` is never taken
        over while held: nothing to raise; `ObjectLease`'s can be)."""

    def release(self) -> None:
        """Remove the sidecar file and drop the lock (idempotent). In a forked child, only
        its copy of the descriptor is closed: the parent still holds the lock, and unlinking
        the file would let another writer lock a new one beside it."""
        if self.fd < 0:
            return
        if os.getpid() == self._pid:
            try:
                os.unlink(self.lock_path)
            except OSError:
                pass
        fd, self.fd = self.fd, -1
        os.close(fd)

    def __enter__(self) -> WriterLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"WriterLease({self.path!r}, held={self.held})"


def leases(directory: str, process_index: int, process_count: int) -> tuple[str, list[str]]:
    """`(lease, rivals)`: the path whose writer lease a checkpoint manager takes (the
    directory; in a multi-process run, one per process of it), and the lease files (local
    ones) no other writer may hold meanwhile: a single-process manager and a multi-process
    run never write one directory together.

    >>> leases('run', 1, 2)
    ('run/.process00001', ['run.jckpt-lease'])
    """
    if process_count == 1:
        try:
            names = os.listdir(directory)
        except OSError:  # an object store, or not there yet: no process leases to ask
            names = []
        return directory, [os.path.join(directory, n) for n in sorted(names)
                           if n.startswith('.process') and n.endswith(LEASE_SUFFIX)]
    return os.path.join(directory, f".process{process_index:05d}"), [lease_path(directory)]


def refuse_if_held(lock_paths: Iterable[str], *, file: str) -> None:
    """`InUseError` if another writer holds one of the leases `lock_paths` (sidecar files).

    For writers whose leases differ but must not share a path: a manager's
    directory is leased whole by a single-process manager, and per process by
    a multi-process run. Each takes its own lease first and then asks here,
    so of two that start together at least one is refused.
    """
    for lock_path in lock_paths:
        try:
            fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # no such lease: no one holds it
        regular = True
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
            if regular:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InUseError(f"in use: another writer{_read_holder(fd)} holds the lease "
                             f"{os.path.basename(lock_path)}", file=file,
                             fix="a single-process manager and a multi-process run cannot "
                                 "share a directory: close the other one first, or write "
                                 "to another directory") from None
        except OSError:
            pass  # no flock on this filesystem: the writer's own lease said so already
        finally:
            os.close(fd)
        if not regular:
            raise _not_a_lease(lock_path)


def _refuse_unless_regular(fd: int, lock_path: str) -> None:
    """`StorageError` (closing `fd`) unless `fd` is a regular file: a FIFO planted at a lease's
    name would block its reader (leases are opened with `O_NONBLOCK` so that this check is
    reached) and takes no truncation, and a device or a directory is no lease either."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_a_lease(lock_path)


def _not_a_lease(lock_path: str) -> StorageError:
    return StorageError("the writer lease is not a regular file; not using it", file=lock_path,
                        fix="remove what is at the lease's name (no writer makes one), then "
                            "open the writer again")


def _in_use(holder: str, lock_path: str, path: str) -> InUseError:
    """The refusal of a lease another writer holds. A holder of this very process is a mirror
    or manager opened earlier and not closed (a notebook cell that opens one run again): its
    pid alone read as another program's."""
    lease = os.path.basename(lock_path)
    if holder == f" (pid {os.getpid()})":
        return InUseError(f"in use: a writer of this process{holder} holds the lease {lease}: a "
                          "Mirror or CheckpointManager opened on this path earlier and not closed",
                          file=path,
                          fix="close that one first (mirror.close(), mgr.close(), or open it in a "
                              "`with` block); one no variable refers to any more (a notebook cell "
                              "run again) holds the lease until the process ends: restart it, or "
                              "write to another path")
    return InUseError(f"in use: another writer{holder} holds the lease {lease}", file=path,
                      fix=f"close the other mirror or manager first, or write to another path; "
                          f"{READ_WHILE_HELD}")


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode('ascii', 'replace').strip()
    except OSError:
        return ''
    return f" (pid {text})" if text.isdigit() else ''
