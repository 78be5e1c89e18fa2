"""The directory form on disk: staged, indexed, published with one rename, read piece by piece.

A directory checkpoint (written by the processes of a `jax.distributed` run,
see `jckpt.api.multiprocess`) is built in a staging sibling
`<path>.jckpt-stage-dir.<random>` that holds a locked `.writer.lock`
while it is written; every process writes its piece files into it, then
`write_index` checks that the pieces tile every array and writes
`index.jckpt`, and `publish_directory` makes the directory appear at
`path` with one atomic rename (swapping out what was there). A directory
without `index.jckpt` is never read as a checkpoint, and staging directories
whose writer died are removed by `reclaim_stage_dirs`.

`DirectoryReader` reads one: its header lists one global entry per
array, and `DirectoryReader.decode` returns a
`LazyArray` that opens and reads only the pieces
overlapping the boxes asked of it.

>>> # reader = DirectoryReader("ckpt"); reader.header.tensors[0].dims   # global dims
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import operator
import os
import re
import secrets
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from jckpt.errors import CheckpointError, DistributedError, FormatError, StorageError
from jckpt.format._gc import paused
from jckpt.format.boxes import Box, box_shape, box_size, box_slices, check_tiling, full_box
from jckpt.format.header import Entry, Header
from jckpt.format.index import IndexedArray, global_entry, index_header, overlapping, parse_index
from jckpt.format.layout import WRITER
from jckpt.format.names import (
    DIRECTORY_LOCK_NAME,
    INDEX_NAME,
    OLD_DIR_TAG,
    SAVE_KEY,
    STAGE_DIR_TAG,
    piece_name,
    piece_tag,
)
from jckpt.storage.backend import LOCAL, Backend, backend_for
from jckpt.storage.lazy import FetchCache, LazyArray, note_read
from jckpt.storage.no_index import NO_INDEX, no_index_fix
from jckpt.storage.object_store import MISSING_OBJECT, pieces_replaced
from jckpt.storage.publish import STALE_AFTER, exchange, fsync_dir, storage_error
from jckpt.storage.reader import CheckpointReader, Need, advice_budget, payload_spans
from jckpt.storage.writer import write_checkpoint

log = logging.getLogger('jckpt')

# --- staging ------------------------------------------------------------------------------------

def make_stage(path: str) -> tuple[str, int]:
    """Create `path`'s staging directory and lock it; return it and the lock's descriptor.

    The lock (`flock` on `.writer.lock` inside) is held until the
    directory is published or abandoned, so `reclaim_stage_dirs` never
    removes a live save's directory. Close the descriptor when done.
    """
    parent = os.path.dirname(path)
    for _ in range(100):
        stage = f"{path}{STAGE_DIR_TAG}{secrets.token_hex(8)}"
        try:
            os.mkdir(stage)
        except FileExistsError:
            continue
        except OSError as e:
            raise storage_error(e, "creating the staging directory", path) from e
        lock = os.path.join(stage, DIRECTORY_LOCK_NAME)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except FileNotFoundError:  # reclaimed by another save before the lock existed: retry
            continue
        except OSError as e:
            raise storage_error(e, "creating the staging directory's lock", path) from e
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:  # still the lock of a directory in place (not reclaimed between open and flock)
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return stage, fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise StorageError("could not create a unique staging directory", file=parent)


def _stage_free(stage: str) -> bool:
    """Whether no live writer holds `stage`: its lock file is missing, or free to take."""
    try:
        fd = os.open(os.path.join(stage, DIRECTORY_LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def reclaim_stage_dirs(path: str | os.PathLike, *, stale_after: float = STALE_AFTER) -> list[str]:
    """Remove staging directories of `path` left by a save whose process 0 is gone.

    A staging directory is reclaimed when its lock file is missing (its
    writer died before creating it: a live save holds it until the directory
    is renamed) or free (the writer died), or when it is older than
    `stale_after` seconds (for filesystems without `flock`). First, a
    checkpoint that a killed save had set aside is put back (`recover_set_aside`).
    """
    path = os.fspath(path)
    recover_set_aside(path)
    parent = os.path.dirname(path) or '.'
    pattern = re.compile(re.escape(os.path.basename(path)) + re.escape(STAGE_DIR_TAG)
                         + r'[0-9a-f]{16}\Z')
    removed: list[str] = []
    try:
        names = LOCAL.list(parent)
    except StorageError:
        return removed
    for name in names:
        if not pattern.match(name):
            continue
        stage = os.path.join(parent, name)
        try:
            old = time.time() - os.lstat(stage).st_mtime > stale_after
        except OSError:
            continue
        if _stage_free(stage) or old:
            LOCAL.remove(stage)
            removed.append(stage)
    return removed


def set_aside(path: str) -> list[str]:
    """The checkpoints of `path` that a save renamed aside (`OLD_DIR_TAG`), newest last."""
    parent, base = os.path.dirname(path) or '.', os.path.basename(path)
    pattern = re.compile(re.escape(base) + re.escape(OLD_DIR_TAG) + r'[0-9a-f]{16}\Z')
    try:
        names = [n for n in LOCAL.list(parent) if pattern.match(n)]
    except StorageError:
        return []
    found = []
    for name in names:
        with contextlib.suppress(OSError):
            found.append((os.lstat(os.path.join(parent, name)).st_mtime_ns, name))
    return [os.path.join(parent, name) for _, name in sorted(found)]


def recover_set_aside(path: str) -> None:
    """Put back the checkpoint a save set aside and then died before renaming its replacement
    in (on a filesystem that cannot swap two paths); remove what is aside beside a checkpoint.

    An aside is named after its save's staging directory: while that save lives (its stage
    is locked) it is left alone, as the save is about to rename its replacement in.
    """
    for aside in reversed(set_aside(path)):  # the newest is the last published
        stage = f"{path}{STAGE_DIR_TAG}{aside.rpartition(OLD_DIR_TAG)[2]}"
        if not _stage_free(stage):
            continue
        try:
            if os.path.lexists(path):
                LOCAL.remove(aside)
            else:
                os.rename(aside, path)
        except OSError as e:
            log.warning("could not recover %s: %s", aside, e)


# --- publishing ---------------------------------------------------------------------------------

#: Bytes of remote pieces a reader keeps, fetched and verified, for the boxes that overlap them.
PIECE_CACHE_BYTES = 1 << 30


def publish_directory(stage: str, path: str, *, durable: bool = True) -> None:
    """Make the complete directory `stage` appear at `path` with one atomic rename.

    An existing checkpoint (file or directory) at `path` is swapped out in
    the same step (`renameat2(RENAME_EXCHANGE)`) and then removed; where the
    filesystem cannot swap, it is renamed aside first, and a save killed between
    the two renames leaves it there: the next save of `path` puts it back
    (`reclaim_stage_dirs`) and readers find it meanwhile (`open_checkpoint`).
    """
    try:
        if durable:
            fsync_dir(stage)
        if not os.path.lexists(path):
            os.rename(stage, path)
        elif exchange(stage, path):
            LOCAL.remove(stage)
        else:
            token = stage.rpartition(STAGE_DIR_TAG)[2] if STAGE_DIR_TAG in stage else ''
            aside = f"{path}{OLD_DIR_TAG}{token or secrets.token_hex(8)}"  # its save's token
            os.rename(path, aside)
            os.rename(stage, path)
            LOCAL.remove(aside)
        if durable:
            fsync_dir(os.path.dirname(path))
    except OSError as e:
        raise storage_error(e, "publishing the checkpoint directory", path) from e


# --- the index ----------------------------------------------------------------------------------

@paused  # a million pieces, and no cycles among them
def collect_arrays(stage: str, names: Iterable[str],
                   backend: Backend | None = None) -> list[IndexedArray]:
    """Every array of the piece files `names` with its pieces, ordered by namespace and id."""
    backend = backend if backend is not None else backend_for(stage)
    arrays: dict[tuple[str, Any], tuple[tuple[Any, ...], Entry, list[tuple[int, Box]]]] = {}
    names = list(names)
    for fi, name in enumerate(names):
        reader = backend.open(os.path.join(stage, name))
        for e in reader.header.tensors:
            if e.slice is None:
                raise FormatError("piece entry without slice", file=reader.path, entry=e.name)
            # what global_entry(e) depends on, compared without building it for every piece
            same = (e.id, e.prec, e.global_dims, e.label, e.key_impl)
            have = arrays.get(e.identity)
            if have is None:
                have = arrays[e.identity] = (same, global_entry(e), [])
            elif have[0] != same:
                first = names[have[2][0][0]] if have[2] else '?'
                raise DistributedError(
                    f"processes disagree about this array: {_disagreement(have[0], same)} in "
                    f"{first} and {name}", file=stage, entry=e.name,
                    fix="save the same tree structure from every process (a leaf one process "
                        "has and another lacks shifts the ids of the leaves after it)")
            have[2].append((fi, e.slice))
    by_box = operator.itemgetter(1)
    return [IndexedArray(g, tuple(sorted(pieces, key=by_box)))
            for _, g, pieces in sorted(arrays.values(), key=lambda v: (v[1].namespace, v[1].id))]


def _disagreement(a: tuple[Any, ...], b: tuple[Any, ...]) -> str:
    """What differs between two pieces' `(id, prec, global dims, label, key impl)`, in words."""
    fields = ('id', 'element type', 'global dims', 'label', 'PRNG key implementation')
    return '; '.join(f"its {name} is {x} and {y}" for name, x, y in zip(fields, a, b) if x != y)


def check_arrays(stage: str, arrays: Iterable[IndexedArray]) -> None:
    """Refuse, with `DistributedError`, an array whose pieces do not tile it exactly."""
    for a in arrays:
        try:
            boxes: Any = a.bounds  # all at once (and kept for encoding the index)
        except ValueError:  # boxes of another rank than the array: said box by box
            boxes = [b for _, b in a.pieces]
        why = check_tiling(boxes, a.entry.dims)
        if why:
            raise DistributedError(f"pieces do not tile the array: {why}", file=stage,
                                   entry=a.entry.name,
                                   fix="every process must save the same global arrays")


def write_index_file(stage: str, names: list[str], process_count: int,
                     arrays: list[IndexedArray], alignment: int, metadata: dict[str, str], *,
                     durable: bool = True) -> Header:
    """Encode the index of `arrays` (checked) and write it as `stage`'s `index.jckpt`."""
    header = index_header(names, process_count, arrays, alignment, metadata,
                          writer=WRITER)
    write_checkpoint(os.path.join(stage, INDEX_NAME), header, [], durable=durable)
    return header


def indexed_pieces(stage: str, process_count: int, tag: str = '') -> tuple[list[str], list[IndexedArray]]:
    """The piece files of the save `tag` in `stage` and their arrays, checked to tile them."""
    backend = backend_for(stage)
    names = [n for n in backend.list(stage) if piece_tag(n) == tag]
    for p in range(process_count):
        if piece_name(p, 0, tag) not in names:
            raise DistributedError(f"process {p} wrote no piece file", file=stage,
                                   fix="check that process's log")
    arrays = collect_arrays(stage, names, backend)
    check_arrays(stage, arrays)
    return names, arrays


def write_index(stage: str, process_count: int, alignment: int, metadata: dict[str, str], *,
                durable: bool = True, tag: str = '') -> Header:
    """Read the header of every piece file of the save `tag` in `stage`, check the tiling,
    write `index.jckpt`."""
    names, arrays = indexed_pieces(stage, process_count, tag)
    return write_index_file(stage, names, process_count, arrays, alignment, metadata,
                            durable=durable)


# --- reading ------------------------------------------------------------------------------------

class DirectoryReader:
    """An open directory checkpoint: the global entries, read piece by piece on demand.

    `header` lists one entry per array (dims = the global dims), so code
    written for `CheckpointReader` works on it;
    `decode` returns a `LazyArray` that reads
    only the pieces overlapping the boxes asked of it. `arrays` maps each
    entry's identity to its `IndexedArray`. `check_pieces=True` (what a
    restore opens) refuses, at once, an index naming a piece file not there.
    """

    def __init__(self, path: str | os.PathLike, *, check_pieces: bool = False) -> None:
        self.backend = backend_for(path)
        self.path = os.fspath(path)
        index = os.path.join(self.path, INDEX_NAME)
        try:  # opened first: in a bucket, no HEAD before the GET
            self.index = self.backend.open(index, follow_symlinks=False)
        except CheckpointError:
            if self.backend.exists(index):
                raise
            raise FormatError(NO_INDEX, file=self.path, fix=no_index_fix(self.path)) from None
        #: Whether the pieces are objects read by range (checksums are then verified by default).
        self.remote = getattr(self.index, 'remote', False)
        self.files, arrays = parse_index(self.index.header, index)
        if check_pieces:
            self._check_present()
        self.arrays = {a.entry.identity: a for a in arrays}
        ih = self.index.header
        self.header = Header(tensors=tuple(a.entry for a in arrays), alignment=ih.alignment,
                             writer=ih.writer, metadata=ih.metadata)
        self._readers: dict[int, CheckpointReader] = {}
        self._open = threading.Lock()  # placement reads several arrays at once: one open per piece
        self._entries: dict[int, dict[tuple[str, Any], Entry]] = {}
        self._verified: set[tuple[int, Any]] = set()
        self._pieces = FetchCache(PIECE_CACHE_BYTES)  # remote pieces, fetched and verified

    def _check_present(self) -> None:
        """Refuse an index naming a piece file that is not there, at open: every process of a
        restore then fails alike (one that reads only present pieces would go on, and wait
        for the others in its next collective)."""
        present = set(self.backend.list(self.path))
        missing = [f for f in self.files if '/' not in f and f not in present]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ''
            raise FormatError(f"piece file {missing[0]}{more}, which the index names, is missing: "
                              f"the checkpoint is incomplete", file=os.path.join(self.path, missing[0]),
                              fix="restore the directory from a complete copy, or use an earlier "
                                  "checkpoint")

    def _reader(self, fi: int) -> CheckpointReader:
        with self._open:
            return self._opened(fi)

    def _opened(self, fi: int) -> CheckpointReader:
        reader = self._readers.get(fi)
        if reader is None:
            path = os.path.join(self.path, self.files[fi])
            try:
                reader = self.backend.open(path, follow_symlinks=False)
            except FormatError as e:
                if e.message != MISSING_OBJECT:
                    raise
                raise FormatError(f"piece file {self.files[fi]}, which the index names, is gone: the "
                                  "checkpoint was replaced (or removed) after its index was read",
                                  file=path, fix="open the checkpoint again to read the one there "
                                                 "now") from None
            self.check_save(reader, path)
            self._entries[fi] = {e.identity: e for e in reader.header.tensors}
            self._readers[fi] = reader
        return reader

    def check_save(self, reader: CheckpointReader, path: str) -> None:
        """Refuse a piece file of another save than its index's (both record theirs)."""
        mine = self.header.metadata_dict().get(SAVE_KEY)
        theirs = reader.header.metadata_dict().get(SAVE_KEY)
        if mine is not None and theirs is not None and mine != theirs:
            raise FormatError("this piece file belongs to another save than the index (copied "
                              "in from another checkpoint, or left by an earlier save)",
                              file=path, fix="restore the directory from a complete copy, or use "
                                             "an earlier checkpoint")

    def _piece_entry(self, fi: int, array: IndexedArray, box: Box) -> tuple[CheckpointReader, Entry]:
        """File `fi`'s reader and entry of the piece `box` of `array`, checked against the index."""
        reader = self._reader(fi)
        e = self._entries[fi].get(array.entry.identity)
        if e is None or e.slice != box or e.prec != array.entry.prec:
            raise FormatError(f"piece {box} is not in {self.files[fi]} as the index says",
                              file=reader.path, entry=array.entry.name,
                              fix="the directory is damaged; restore it from a good copy")
        return reader, e

    def piece(self, fi: int, array: IndexedArray, box: Box, *, verify: bool) -> np.ndarray:
        """The stored piece `box` of `array` in file `fi` (a mapped view)."""
        reader, e = self._piece_entry(fi, array, box)
        if verify and getattr(reader, 'remote', False):  # fetched once, checked as it is decoded
            # kept for the other devices' boxes it overlaps, which fetched it again
            with pieces_replaced():
                return self._pieces.get((fi, e.identity),
                                        lambda: reader.decode(e, verify=True, count=False))
        if verify and (fi, e.identity) not in self._verified:
            reader.verify_entry(e)
            self._verified.add((fi, e.identity))
        return reader.decode(e, mmap=True, count=False)

    def advise(self, needs: Sequence[Need], *, verify: bool = False, mmap: bool = True) -> None:
        """`CheckpointReader.advise` of each piece file, planned from the index before any
        piece is read: the bytes of each box asked in each piece it overlaps, or those whole
        pieces when `verify`'d (a checksum covers a piece whole); nothing for objects in a
        store. (Pieces are always mapped: `mmap` changes nothing.)"""
        if self.remote:
            return
        spans: dict[int, list[tuple[int, int]]] = {}
        for entry, boxes in needs:
            array = self.arrays[entry.identity]
            whole = full_box(array.entry.dims)
            for box in [whole] if boxes is None else boxes:
                for fi, pbox, common in overlapping(array, (*box[:len(whole)], *whole[len(box):])):
                    e = self._piece_entry(fi, array, pbox)[1]
                    spans.setdefault(fi, []).extend(payload_spans(e, pbox, None if verify else [common]))
        budget = advice_budget()
        for fi in sorted(spans):
            budget = self._readers[fi].advise_spans(spans[fi], budget)

    def read_box(self, array: IndexedArray, box: Box, *, verify: bool = False) -> np.ndarray:
        """Assemble `box` of an array from the pieces that overlap it. `box` is over the
        array's `shape`: a `Uint4x32_prec` element's trailing dim of 4, which no piece splits,
        is sliced after the pieces of `box`'s leading dims are assembled."""
        dims = len(array.entry.dims)
        box, within = box[:dims], box[dims:]
        out = self._assemble(array, box, verify)
        return out[(..., *box_slices(within))] if within else out

    def _assemble(self, array: IndexedArray, box: Box, verify: bool) -> np.ndarray:
        e = array.entry
        # Every overlapping piece is found in its file (and so within that file's size) before
        # the box is allocated: an index cannot make a reader allocate more than the pieces hold.
        parts = [(common, pbox, self.piece(fi, array, pbox, verify=verify))
                 for fi, pbox, common in overlapping(array, box)]
        out = np.empty(box_shape(box) + (e.shape[len(e.dims):]), dtype=e.dtype)
        copied = 0
        for common, pbox, src in parts:
            with pieces_replaced():  # a lazily read piece is fetched here
                out[box_slices(common, box)] = src[box_slices(common, pbox)]
            copied += box_size(common) * e.dtype.itemsize
        note_read(box, copied)
        return out

    def decode(self, entry: Entry, *, mmap: bool = True, verify: bool = False,
               count: bool = True) -> LazyArray:
        """A lazy view of the array `entry` (one of `header`'s entries)."""
        array = self.arrays[entry.identity]
        return LazyArray(entry.shape, entry.dtype,
                         functools.partial(self.read_box, array, verify=verify))

    def verify(self, entries: Any = None) -> list[CheckpointError]:
        """Check every piece's checksum; return the failures."""
        bad: list[CheckpointError] = []
        for fi in range(len(self.files)):
            bad.extend(self._reader(fi).verify())
        return bad


__all__ = ['NO_INDEX', 'DirectoryReader', 'check_arrays', 'collect_arrays', 'indexed_pieces', 'make_stage',
           'overlapping', 'publish_directory', 'reclaim_stage_dirs', 'write_index', 'write_index_file']
