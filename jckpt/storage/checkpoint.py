"""Opening a checkpoint for reading, whatever form it has on its backend.

>>> # reader = open_checkpoint("model.jckpt")  # a CheckpointReader
>>> # reader = open_checkpoint("ckpt")         # a DirectoryReader (written by several processes)
>>> # reader.header.tensors[0].dims          # the same surface either way
"""

from __future__ import annotations

import os

from jckpt.errors import FormatError
from jckpt.storage.backend import LOCAL, backend_for, checked_path
from jckpt.storage.directory import DirectoryReader
from jckpt.storage.object_store import MISSING_OBJECT
from jckpt.storage.reader import CheckpointReader
from jckpt.storage.remote_reader import RemoteReader


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader | RemoteReader | DirectoryReader:
    """Open a checkpoint file, or a directory checkpoint, for reading.

    Validates the header (and a directory's index) without touching a
    payload. Raises :class:`~jckpt.errors.FormatError` for something that is
    not a checkpoint, and :class:`~jckpt.errors.InputError` for a URL no
    storage backend serves.
    """
    path = checked_path(path)
    backend = backend_for(path)
    if backend is LOCAL:
        return DirectoryReader(path) if backend.isdir(path) else backend.open(path)
    try:  # an object: the header's GET is the first request; a prefix is listed only if none is there
        return backend.open(path)
    except FormatError as e:
        if e.message != MISSING_OBJECT or not backend.isdir(path):
            raise
    return DirectoryReader(path)


__all__ = ['open_checkpoint']
