"""What is on disk in a manager's directory: step files, step directories, and staging left behind.

A step is a jckpt file, a multi-process directory checkpoint (with an index), or a step
directory of the format layer (with a `trainer_state.json`, `jckpt.services.formats`, read
by `jckpt.services.format_reading`). These functions read any of them the same way for
`CheckpointManager`; `jckpt.services.step_removal` removes steps and what a writer that died left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from typing import Any

from jckpt import api
from jckpt.adapters import orbax as orbax_adapter
from jckpt.api.context import Context
from jckpt.api.loading import Namespaces, restore_alone
from jckpt.errors import CheckpointError, FormatError, InputError, StorageError
from jckpt.format import metadata
from jckpt.format.entries import Header
from jckpt.format.names import (
    INDEX_NAME,
    METRICS_KEY,
    STEP_RE,
    TRAINER_STATE_NAME,
)
from jckpt.services import format_reading, formats
from jckpt.services.formats import CheckpointLoadOptions
from jckpt.services.snapshot import Digest, content_digest
from jckpt.services.step_cache import StepCache
from jckpt.services.step_removal import Listing, clean_staging, remove_unfinished
from jckpt.storage import step_directory
from jckpt.storage.backend import LOCAL, Backend, backend_for, is_url
from jckpt.storage.checkpoint import open_checkpoint, reusing
from jckpt.storage.directory import NO_INDEX, DirectoryReader
from jckpt.storage.object_backend import NO_SUCH_OBJECT, OBJECT_STORE, concurrency
from jckpt.storage.object_store import MISSING_OBJECT
from jckpt.storage.remote_reader import concurrently

log = logging.getLogger('jckpt')


def read_metadata(path: str, step: int | None = None, *,
                  prefix: bool | None = None) -> dict[str, str]:
    """A step's metadata (a file's header, a directory's index, or a step directory's record).

    `prefix`, when the caller's listing knows it: whether the step is a directory (a prefix
    in a bucket), so that a file step costs its header's GET alone and a step directory no
    failed GET (a request more per step, and per manager open, either way). A step that is
    a link out of its directory is refused (`step_directory.check_step_link`).
    """
    return _read_step(path, step, prefix)[0]


def _read_step(path: str, step: int | None, prefix: bool | None,
               opened: dict[int, Any] | None = None) -> tuple[dict[str, str], Header | None]:
    """A step's metadata, its header for a jckpt file or directory (a file's reader put in `opened`)."""
    step_directory.check_step_link(path)
    if prefix and is_url(path):
        got = _read_bucket_folder(path, step)
        if got is None:
            raise FormatError(f"holds neither {TRAINER_STATE_NAME} nor {INDEX_NAME}: no step, "
                              "what a save or a deletion that did not finish leaves", file=path,
                              fix="restore another step (a manager that opens removes it)")
        return got[0], got[1]
    if prefix is False or not formats.is_step_directory(path):  # a file, or a directory's index
        reader = open_checkpoint(path, mapped=False)
        if opened is not None and prefix is False and step is not None:
            opened[step] = reader
        return reader.header.metadata_dict(), reader.header
    return format_reading.read_metadata(path, step), None


def _read_bucket_folder(path: str, step: int | None, *, check_pieces: bool = False
                        ) -> tuple[dict[str, str], Header | None, Any] | None:
    """A step that is a prefix in a bucket: `(metadata, header, source)` from its record (a step
    directory: one GET; no header, the record as its source) or else its index (a directory
    checkpoint: the failed GET of the record, the index's GET, and with `check_pieces` a LIST,
    as a restore checks them; its reader as the source); None when it holds neither
    (unfinished)."""
    try:
        record = step_directory.read_record(path, step)
        return format_reading.metadata_of(record), None, record
    except FormatError as e:
        if e.message != NO_SUCH_OBJECT:
            raise
    try:
        reader = DirectoryReader(path, check_pieces=check_pieces)
    except FormatError as e:
        if e.message != NO_INDEX:
            raise
        return None
    return reader.header.metadata_dict(), reader.header, reader


@dataclasses.dataclass(frozen=True)
class Found:
    """What a manager finds in its directory.

    Attributes:
      metrics: the metrics of every readable step, by step.
      folders: the steps stored as directories (prefixes in a bucket): step directories and
        directory checkpoints; the others are single files.
      latest: the latest step's metadata and header (`None` for a step directory's): the
        lineage check takes them from here rather than reading the step again.
      unfinished: the names of the step prefixes in a bucket that hold neither a record nor
        an index but hold pieces, numbered above every readable step (a save under way, or
        that died: a manager saves only above its steps): `remove_unfinished`.
      indexed: the folders that are directory checkpoints (read by their index), not step
        directories (read by their record).
      vanished: the steps listed but gone when read (removed by the writer; a prefix: empty).
      removing: such prefixes numbered below a readable step: steps that retention, which
        deletes a prefix's markers first and never the latest step, is deleting (or failed
        to delete whole). No step, as a removed one is (`deleted`); removed as unfinished.
      reader: the latest step's reader (a file step in a bucket this scan read), for a restore.
    """

    metrics: dict[int, dict[str, float]]
    folders: frozenset[int]
    latest: tuple[dict[str, str], Header | None] | None
    unfinished: tuple[str, ...] = ()
    indexed: frozenset[int] = frozenset()
    vanished: tuple[str, ...] = ()
    removing: tuple[str, ...] = ()
    reader: Any = None

    @property
    def deleted(self) -> frozenset[int]:
        """The steps of `removing`: a restore of one says that retention deleted it."""
        return frozenset(int(m.group(1)) for n in self.removing if (m := STEP_RE.match(n)))



def recover(backend: Backend, directory: str, *, clean: bool, cache: StepCache | None = None) -> Found:
    """What a manager opening `directory` does: with `clean` (process 0), remove what killed
    writers left (`clean_staging`, `remove_unfinished`), and find the steps (`scan`, through
    `cache`). A bucket's prefix is listed once for both."""
    listing = listed(backend, directory)
    if clean:
        clean_staging(backend, directory, listing)
    found = scan(backend, directory, listing, cache)
    if clean:
        remove_unfinished(backend, directory, found.unfinished + found.removing)
    return found


def scan(backend: Backend, directory: str, listing: Listing | None = None,
         cache: StepCache | None = None) -> Found:
    """Every readable step in `directory` (an unreadable one is logged, left out): one listing (or
    the caller's `listing`), then each step's metadata, unless in `cache` (in a bucket, the
    store's `concurrency` GETs at once: `jckpt.storage.object_backend.concurrency`)."""
    files, dirs, versions = listing if listing is not None else (*backend.list_kinds(directory), None)
    folders, plain = set(dirs), set(files)
    names = [(int(m.group(1)), name) for name in sorted(plain | folders) if (m := STEP_RE.match(name))]
    bare, vanished = list[tuple[int, str]](), list[str]()
    opened, last = ({} if backend is not LOCAL else None), max(names, default=None)  # its reader kept

    def read(item: tuple[int, str]) -> tuple[dict[str, str], Header | None] | None:
        path, prefix = os.path.join(directory, item[1]), item[1] in folders and item[1] not in plain
        try:
            if prefix and backend is not LOCAL:  # its record, else its index: no HEAD first
                got = _read_bucket_folder(path, item[0])
                if got is None:  # an emptied prefix was removed since; one holding pieces is not
                    bare.append(item) if backend.isdir(path) else vanished.append(item[1])
                return None if got is None else (got[0], got[1])
            return _read_step(path, item[0], prefix, opened if item == last else None)
        except CheckpointError as e:
            if not (prefix and backend is not LOCAL) and gone(path, prefix):  # removed since
                vanished.append(item[1])
            elif isinstance(e, StorageError):  # refused or failed, not damaged: left out, saved over
                raise
            else:
                log.warning("ignoring unreadable step %s: %s", item[1], e)
            return None
    read = cache.reading(read, directory, versions) if cache is not None else read
    read_all = concurrently(read, names, 1 if backend is LOCAL else concurrency(directory))
    found = {step: (name, got) for (step, name), got in zip(names, read_all) if got is not None}
    metrics = {step: parse_metrics(got[0].get(METRICS_KEY), os.path.join(directory, name))
               for step, (name, got) in found.items()}
    dirs_found = {step: got for step, (name, got) in found.items() if name in folders}
    latest = cache.keep(found) if cache is not None else found[max(found)] if found else None
    below = {name for step, name in bare if found and step < max(found)}  # being deleted
    return Found(metrics, frozenset(dirs_found), latest and latest[1],
                 tuple(sorted(name for _, name in bare if name not in below)),
                 frozenset(step for step, got in dirs_found.items() if got[1] is not None),
                 tuple(sorted(vanished)), tuple(sorted(below)), (opened or {}).get(max(found, default=-1)))


def described(path: str, found: tuple[dict[str, str], Header | None] | None
              ) -> tuple[dict[str, str], Digest | None]:
    """The metadata and content digest of the step at `path` (a step directory has no digest),
    from `found` (`Found.latest`) when the scan read it, else read now."""
    meta, header = found if found is not None else _read_step(path, None, None)
    return meta, None if header is None else content_digest(header.tensors, meta)


StepRead = tuple[dict[str, str], str | None, dict[str, Any] | None]


@contextlib.contextmanager
def step_metadata(path: str, step: int, folder: bool | None, indexed: bool = False, *,
                  absent: FormatError | None = None) -> Iterator[StepRead]:
    """A step's metadata, what the step is (`'file'`, `'record'`: a step directory,
    `'index'`: a directory checkpoint; None: not known) and a step directory's record
    (else None), for `read_tree`. A step known to be a file (`folder` False), or a prefix
    in a bucket, is read once: within the block, `read_tree` reads its arrays through the
    same reader (the same version of the object), or from the record read here. A prefix
    known to be a directory checkpoint (`indexed`) is read by its index, no record asked for.

    A step in a bucket that the caller does not know (`folder` None: saved since it listed
    the steps) is read as a file step first, its GET telling whether the object is there,
    then as a prefix (its record, else its index): no request asks what it is first. Where
    nothing is stored, one LIST tells an unfinished step from none, which is `absent` (by
    default "no step").
    """
    step_directory.check_step_link(path)
    unlisted = folder is None and is_url(path)
    if (folder is None and not unlisted) or (folder and not is_url(path)):
        yield read_metadata(path, step, prefix=folder), None, None
        return
    if folder and indexed:
        with reusing(_index_reader(path, step)) as reader:
            yield reader.header.metadata_dict(), 'index', None
        return
    reader = None if folder else _file_reader(path, step, missing_ok=unlisted)
    if reader is not None:
        with reusing(reader):
            yield reader.header.metadata_dict(), 'file', None
        return
    got = _read_bucket_folder(path, step, check_pieces=True)  # for the restore's reader
    if got is None:
        if unlisted and not backend_for(path).isdir(path):
            raise absent or FormatError(f"no step {step}", file=path, fix=RELIST)
        if not unlisted:  # listed with its record or index, gone since
            raise removed(step, path)
        _read_step(path, step, True)  # its error
    assert got is not None
    meta, header, source = got
    if header is None:
        yield meta, 'record', source
        return
    with reusing(source):
        yield meta, 'index', None


#: How a manager lists the steps there now.
RELIST = "reload() a read-only manager, or open the manager again, to list the steps there now"


def removed(step: int, path: str) -> FormatError:
    """The error of a step listed and gone since (retention, by the directory's writer)."""
    return FormatError(f"no step {step}: it was removed since the manager listed its steps",
                       file=path, fix=RELIST)


def gone(path: str, folder: bool, indexed: bool = False) -> bool:
    """Whether a step the manager listed is no step any more (removed by the directory's
    writer): locally, nothing at `path`; in a bucket, the object of a file step, or the marker
    a step prefix is listed by (its index when `indexed`, else its record), which a removal
    deletes first (`remove_step`). One request, asked only once a read of the step failed;
    where it fails too, False: the read's own error is the one to report.

    The one answer for every reader of a listed step: `scan` (which lists again while steps
    it listed are gone), a restore's error (`removed`), a multi-process reader's restore.
    """
    marker = path if not folder else os.path.join(path, INDEX_NAME if indexed else TRAINER_STATE_NAME)
    try:
        return not (backend_for(path).exists(marker) if is_url(path) else os.path.lexists(path))
    except CheckpointError:
        return False


def _file_reader(path: str, step: int, *, missing_ok: bool) -> Any:
    """The reader of a file step (one GET of its header, from a bucket); with `missing_ok`,
    None when there is no such object (no prefix is looked for), else the error of a step
    removed since it was listed."""
    try:
        return backend_for(path).open(path) if missing_ok else open_checkpoint(path)
    except FormatError as e:
        if e.message != MISSING_OBJECT:
            raise
        if missing_ok:
            return None
        raise removed(step, path) from None


def _index_reader(path: str, step: int) -> DirectoryReader:
    """The reader of a directory checkpoint step in a bucket, its pieces checked as a restore
    checks them; its index gone is the error of a step removed since it was listed."""
    try:
        return DirectoryReader(path, check_pieces=True)
    except FormatError as e:
        if e.message != NO_INDEX:
            raise
        raise removed(step, path) from None


def read_tree(ctx: Context, path: str, step: int, target: Any, namespaces: Namespaces | None,
              cast: bool, options: CheckpointLoadOptions, verify: bool = True,
              kind: str | None = None, record: dict[str, Any] | None = None) -> Any:
    """The arrays of a step, a jckpt file or directory or a step directory, as restore returns them
    (`kind` and `record` as `step_metadata` says them: a step of known kind is not asked what
    it is, and a record read is not read again)."""
    step_directory.check_step_link(path)
    if kind == 'record' or (kind is None and formats.is_step_directory(path)):
        return format_reading.load_step(ctx, path, step, target, namespaces=namespaces, cast=cast,
                                 options=options, verify=verify, record=record)
    if target is None:
        return api.load(ctx, path, namespaces=namespaces, verify=verify)[1]
    return restore_alone(ctx, target, path, cast=cast, namespaces=namespaces, verify=verify)


def parse_metrics(text: str | None, path: str) -> dict[str, float]:
    """The metrics of a step's metadata (`{}`, with a warning, when unreadable)."""
    metrics = metadata.parse_metrics(text)
    if metrics is None:
        log.warning("unreadable metrics in %s", path)
        return {}
    return metrics


def listed(backend: Backend, directory: str) -> Listing | None:
    """A bucket directory's `list_versions` (names and versions), made once for `clean_staging`
    and `scan` (None for a local directory, which each lists itself).

    A URL with nothing below it that is an object itself (a checkpoint file's URL given as a
    manager's directory, whose steps would go under the file's name) is refused: one HEAD,
    asked only when the listing found nothing.
    """
    if backend is LOCAL:
        return None
    listing = OBJECT_STORE.list_versions(directory)
    if not any(listing[:2]) and backend.exists(directory):
        raise InputError("is an object, not a directory of steps: a manager keeps its steps "
                         "under a prefix", file=directory,
                         fix="give the manager another URL (a prefix such as s3://bucket/run), or "
                             "restore the object with jckpt.restore")
    return listing


def checked(value: Any, kind: type, name: str, default: Any = None) -> Any:
    """`value` if it is a `kind` (`None`: `default`, else `kind()`), else InputError."""
    if value is None:
        return default if default is not None else kind()
    if not isinstance(value, kind):
        raise InputError(f"{name} must be a {kind.__name__}, not {type(value).__name__}")
    return value


def say_if_orbax(directory: str, own: object) -> None:
    """Warn (once per directory) when a manager finds no steps of its own (`own` is empty)
    but orbax's there."""
    found = [] if own else orbax_adapter.manager_step_names(directory)
    if found and directory not in _ORBAX_SAID:
        _ORBAX_SAID.add(directory)
        log.warning("%s holds orbax steps %s and no jckpt steps, and this manager lists "
                    "and restores jckpt steps only: read one with jckpt.restore(ctx, target, "
                    "%r) or jckpt.convert it", directory, orbax_adapter.manager_steps(directory)[-5:],
                    os.path.join(directory, found[-1]))


_ORBAX_SAID: set[str] = set()


__all__ = ['Found', 'checked', 'described', 'listed', 'parse_metrics', 'gone', 'read_metadata',
           'read_tree', 'recover', 'removed', 'say_if_orbax', 'scan', 'step_metadata']
