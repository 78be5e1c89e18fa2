"""`jckpt.info(path)`: what a checkpoint holds, as a value that shows itself.

The summary of a jckpt checkpoint is read from headers alone (no payload is
touched, no JAX is imported), so it is instant even for very large files;
another format's is read as the converter reads it (mapped where the format
allows, a compressed npz inflated). Which summary
depends on what `classify` finds at the path: a
file (`FileInfo`), a multi-process directory
(`DirectoryInfo`), a checkpoint manager's
directory (`ManagerInfo`) or another tool's checkpoint (`ForeignInfo`). Each one's
`repr` is a readable table, in Jupyter an HTML table; `to_dict()` gives
the same content as JSON-ready data (what `jckpt inspect --json` prints).

>>> import numpy as np, tempfile, os
>>> from jckpt.format import Entry, Header, lay_out
>>> from jckpt.storage import ArraySource, write_checkpoint
>>> path = os.path.join(tempfile.mkdtemp(), 'm.jckpt')
>>> e = Entry(id=0, namespace='jckpt', prec='Single_prec', dims=(2, 3), offset=0,
...           byte_length=24, path=(('k', 'w'),))
>>> _ = write_checkpoint(path, lay_out(Header(tensors=(e,))),
...                      [ArraySource(np.ones((2, 3), np.float32))], durable=False)
>>> s = info(path)
>>> s.entries[0].name, s.entries[0].shape, s.entries[0].mappable
('jckpt/w', (2, 3), True)
"""

from __future__ import annotations

import os

from jckpt.tools.classify import DIRECTORY, FILE, FOREIGN, MANAGER, classify
from jckpt.tools.foreign_info import ForeignInfo, foreign_info
from jckpt.tools.manager_info import ManagerInfo, manager_info
from jckpt.tools.summary import DirectoryInfo, FileInfo, directory_info, file_info


def info(path: str | os.PathLike, *, best_metric: str | None = None,
         best_mode: str = 'min') -> FileInfo | DirectoryInfo | ManagerInfo | ForeignInfo:
    """A summary of the checkpoint at `path`, read from its header alone (another format's,
    as the converter reads it).

    Returns a value whose `repr` is a table of namespaces, paths, dtypes,
    shapes, sizes, offsets and whether each payload can be memory-mapped,
    with totals and the header's metadata (writer, step, trainer state,
    lineage, ...). In Jupyter it renders as an HTML table.

    A multi-process checkpoint (a directory with an index) gives a
    `DirectoryInfo`: the global arrays and the
    piece files holding them. A checkpoint manager directory
    (`step_00000100.jckpt` steps) gives a
    `ManagerInfo` instead: a table of steps,
    sizes and metrics, with the latest step and the best one by
    `best_metric` (`best_mode` `'min'` or `'max'`). Another tool's checkpoint
    (safetensors, PyTorch, numpy, llm.c, orbax) gives a `ForeignInfo`: its
    arrays as `jckpt.convert` reads them, and the file's own metadata.

    Raises:
        FormatError: naming the file when it is missing or not a valid checkpoint.

    Examples:
        >>> jckpt.info("ckpt.jckpt")                 # doctest: +SKIP
        ckpt.jckpt: jckpt file, 3 entries in 1 namespace, 1.5 MiB of payloads, ...
    """
    kind = classify(path)
    if kind.name == FILE:
        return file_info(kind.path, kind.reader)
    if kind.name == DIRECTORY:
        return directory_info(kind.path)
    if kind.name == MANAGER:
        return manager_info(kind.path, best_metric=best_metric, best_mode=best_mode,
                            listing=kind.listing)
    if kind.name == FOREIGN:
        assert kind.detail is not None  # the format's name
        return foreign_info(kind.path, kind.detail)
    assert kind.error is not None  # missing or unknown: no checkpoint
    raise kind.error


__all__ = ['info']
