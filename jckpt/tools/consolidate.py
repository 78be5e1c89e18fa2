"""`consolidate`: a directory checkpoint written as one ordinary checkpoint file.

A directory checkpoint (one piece file per process of a `jax.distributed`
run) is read by any process of any run; `consolidate` turns it into a
single file for tools, other frameworks or a single-process job. Each array
is assembled in place in the new file from the pieces that tile it, so no
array is ever whole in memory.

>>> # jckpt.consolidate("ckpt", "ckpt.jckpt")
"""

from __future__ import annotations

import functools
import os

from jckpt.adapters import refuse_replacing_other_files
from jckpt.api import progress as progress_mod
from jckpt.format.header import Header
from jckpt.format.layout import written_header
from jckpt.format.limits import check_alignment
from jckpt.format.names import SAVE_KEY
from jckpt.storage.backend import backend_for, checked_path
from jckpt.storage.directory import DirectoryReader
from jckpt.storage.regions import ShardedSource
from jckpt.storage.writer import write_checkpoint


def consolidate(directory: str | os.PathLike, file: str | os.PathLike, *, durable: bool = True,
                verify: bool = True, alignment: int | None = None,
                progress: bool = False) -> Header:
    """Write the directory checkpoint `directory` as one checkpoint file `file`.

    Each array is assembled in place from its pieces (never whole in memory);
    pieces are checked against their checksums first (`verify=True`) so a
    damaged piece is reported rather than sealed under a new checksum. Ids,
    paths, key implementations and metadata are kept. Returns the header written.
    A checkpoint at `file` is replaced; anything else there (a text file, a folder of other
    files, a FIFO) is refused with `InputError`, as `convert` refuses it.
    `progress` draws a bar on stderr while writing (only when stderr is a terminal).

    Example:
        ```python
        jckpt.consolidate("ckpt", "ckpt.jckpt")
        ```
    """
    directory, file = checked_path(directory), checked_path(file)
    backend_for(file)  # a URL no backend serves is refused before the directory is read
    refuse_replacing_other_files(file, "consolidating")  # a checkpoint there is replaced
    alignment = None if alignment is None else check_alignment(alignment, file)
    reader = DirectoryReader(directory, check_pieces=True)  # a missing piece named as such
    entries, sources = [], []
    for array in reader.arrays.values():
        e = array.entry
        pieces = [(pbox, functools.partial(reader.piece, fi, array, pbox, verify=verify))
                  for fi, pbox in array.pieces]
        entries.append(e)
        sources.append(ShardedSource(e.dims, e.dtype, pieces))
    header = written_header(
        entries, reader.header.alignment if alignment is None else alignment,
        metadata=[(k, v) for k, v in reader.header.metadata if k != SAVE_KEY])
    total = sum(e.byte_length for e in header.tensors)
    with progress_mod.bar(f"consolidating {os.path.basename(file)}", total, enabled=progress) as bar:
        return write_checkpoint(file, header, sources, durable=durable,
                                on_payload=lambda e: bar.advance(e.byte_length))


__all__ = ['consolidate']
