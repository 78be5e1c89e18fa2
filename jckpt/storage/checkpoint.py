"""Opening a checkpoint for reading, whatever form it has on its backend.

>>> # reader = open_checkpoint("model.jckpt")  # a CheckpointReader
>>> # reader = open_checkpoint("ckpt")         # a DirectoryReader (written by several processes)
>>> # reader.header.tensors[0].dims          # the same surface either way
"""

from __future__ import annotations

import os

from jckpt.storage.backend import backend_for, checked_path
from jckpt.storage.directory import DirectoryReader
from jckpt.storage.reader import CheckpointReader


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader | DirectoryReader:
    """Open a checkpoint file, or a directory checkpoint, for reading.

    Validates the header (and a directory's index) without touching a
    payload. Raises :class:`~jckpt.errors.FormatError` for something that is
    not a checkpoint, and :class:`~jckpt.errors.InputError` for a URL no
    storage backend serves.
    """
    path = checked_path(path)
    backend = backend_for(path)
    return DirectoryReader(path) if backend.isdir(path) else backend.open(path)


__all__ = ['open_checkpoint']
