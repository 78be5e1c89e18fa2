"""The error hierarchy: every failure jckpt reports is a `CheckpointError`.

Each error carries the file, the entry and a fix when they are known, and its
message names all three, so one line is enough to act on:

>>> print(FormatError("unknown prec Foo_prec", file="m.jckpt", entry="jckpt/w",
...                   fix="upgrade jckpt"))
m.jckpt: entry jckpt/w: unknown prec Foo_prec (fix: upgrade jckpt)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


class CheckpointError(Exception):
    """Base of every jckpt error.

    Attributes:
      message: what went wrong.
      file: the checkpoint file or directory concerned, if any.
      entry: the entry (`namespace/path`) or leaf concerned, if any.
      fix: what the user can do about it, if known.
    """

    def __init__(self, message: str, *, file: str | os.PathLike | None = None,
                 entry: str | None = None, fix: str | None = None) -> None:
        self.message = message
        self.file = os.fspath(file) if file is not None else None
        self.entry = entry
        self.fix = fix
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = []
        if self.file is not None:
            parts.append(f"{self.file}: ")
        if self.entry is not None:
            parts.append(f"entry {self.entry}: ")
        parts.append(self.message)
        if self.fix:
            parts.append(f" (fix: {self.fix})")
        return ''.join(parts)

    def __repr__(self) -> str:
        fields = [repr(self.message)]
        for name in ('file', 'entry', 'fix'):
            value = getattr(self, name)
            if value is not None:
                fields.append(f"{name}={value!r}")
        return f"{type(self).__name__}({', '.join(fields)})"

    def __reduce__(self):  # keep the keyword fields across pickling (multiprocessing)
        return (_rebuild, (type(self), self.message, self.file, self.entry, self.fix))

    def published_as(self, staged: str, target: str) -> None:
        """Name `target` where the error names a file under its staging name `staged`,
        which is gone once the save failed: the path the user gave is what they look for.

        >>> e = CheckpointError("disk full", file="run/ckpt.stage-1/piece")
        >>> e.published_as("run/ckpt.stage-1", "run/ckpt"); e.file
        'run/ckpt/piece'
        """
        if self.file is not None and staged and self.file.startswith(staged):
            self.file = target + self.file[len(staged):]


@contextlib.contextmanager
def naming_file(file: str) -> Iterator[None]:
    """Name `file` in a `CheckpointError` raised inside that names no file (a leaf's check
    knows the leaf, not the file it is saved to).

    >>> with naming_file("m.jckpt"):
    ...     raise InputError("dtype object cannot be stored", entry="jckpt/n")
    Traceback (most recent call last):
    ...
    jckpt.errors.InputError: m.jckpt: entry jckpt/n: dtype object cannot be stored
    """
    try:
        yield
    except CheckpointError as e:
        if e.file is None:
            e.file = file
        raise


def _rebuild(cls, message, file, entry, fix):
    return cls(message, file=file, entry=entry, fix=fix)


class FormatError(CheckpointError, ValueError):
    """No valid checkpoint is there: missing, malformed, truncated or inconsistent (or a
    manager's step that is gone)."""


class ChecksumError(FormatError):
    """A payload's bytes do not match the checksum stored in the header."""


class TargetError(CheckpointError, ValueError):
    """`restore` cannot fill the target from the file (missing leaf, mismatch)."""


class MissingEntryError(TargetError):
    """The target asks for a leaf the file does not hold."""


class MismatchError(TargetError):
    """A stored entry's dtype, shape or padding differs from the target leaf's."""


class ClashError(CheckpointError, ValueError):
    """`load` would register an entry the context already holds."""


class InputError(CheckpointError, TypeError):
    """An argument cannot be used: a leaf `save` cannot store, an invalid option or
    metadata, or a call the object refuses (a read-only manager's `save`)."""


class StorageError(CheckpointError):
    """Reading or publishing failed in the operating system (disk full, I/O, permissions).

    `errno` is the underlying error number when there is one.
    """

    def __init__(self, message: str, *, errno: int | None = None, **kwargs) -> None:
        self.errno = errno
        super().__init__(message, **kwargs)

    def __reduce__(self):
        return (_rebuild_storage, (type(self), self.message, self.file, self.entry, self.fix,
                                   self.errno))


def _rebuild_storage(cls, message, file, entry, fix, errno):
    return cls(message, file=file, entry=entry, fix=fix, errno=errno)


class InUseError(CheckpointError):
    """Another writer holds the lease on this checkpoint path (or replaced the file an
    appending save was reading)."""


class CapacityError(CheckpointError):
    """Every snapshot slot is still pending and the writer was told not to wait."""


class LineageError(CheckpointError):
    """The path holds another run's checkpoints (another lineage of a mirror or a manager)."""


class DistributedError(CheckpointError):
    """The processes of a multi-process run could not act together: a peer failed, died or
    timed out in a save, a manager's opening, or a read-only manager's `reload` or `restore`.

    A failed save published nothing; the previous checkpoint at the path is intact.
    """
