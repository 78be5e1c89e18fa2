"""What is on disk in a manager's directory: step files, step directories, and staging left behind.

A step is a jckpt file, a multi-process directory checkpoint (with an
index), or a step directory of the format layer (with a `trainer_state.json`,
`jckpt.services.formats`). These functions read any of them the same way
for `CheckpointManager`, and clear what a
writer that died left.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from jckpt import api
from jckpt.adapters import orbax as orbax_adapter
from jckpt.api.context import Context
from jckpt.api.loading import Namespaces
from jckpt.errors import CheckpointError, InputError
from jckpt.format import metadata
from jckpt.format.names import (
    INDEX_NAME,
    LEASE_SUFFIX,
    METRICS_KEY,
    NEXT_TAG,
    STAGE_DIR_TAG,
    STAGE_TAG,
    STEP_RE,
    TRAINER_STATE_NAME,
    UPLOAD_TAG,
    is_step_member,
)
from jckpt.services import formats
from jckpt.services.formats import CheckpointLoadOptions
from jckpt.storage import step_directory
from jckpt.storage.backend import LOCAL, Backend
from jckpt.storage.directory import reclaim_stage_dirs
from jckpt.storage.lease import lease_path
from jckpt.storage.publish import reclaim_staging, storage_error
from jckpt.storage.staging import next_name, remove_staged, remove_staged_below

log = logging.getLogger('jckpt')


def read_metadata(path: str, step: int | None = None, *,
                  prefix: bool | None = None) -> dict[str, str]:
    """A step's metadata (a file's header, a directory's index, or a step directory's record).

    `prefix`, when the caller's listing knows it: whether the step is a directory (a prefix
    in a bucket), so that a file step costs its header's GET alone and a step directory no
    failed GET (a request more per step, and per manager open, either way).
    """
    if prefix is False or not formats.is_step_directory(path):  # a file, or a directory's index
        return api.describe(path).metadata_dict()
    return formats.read_metadata(path, step)


def scan(backend: Backend, directory: str) -> dict[int, dict[str, float]]:
    """The metrics of every readable step in `directory`, by step (an unreadable one is
    logged and left out): one listing, then each step's metadata."""
    found: dict[int, dict[str, float]] = {}
    files, dirs = backend.list_kinds(directory)
    folders = set(dirs)
    for name in sorted(set(files) | folders):
        m = STEP_RE.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        try:
            meta = read_metadata(path, prefix=name in folders and name not in files)
        except CheckpointError as e:
            log.warning("ignoring unreadable step %s: %s", name, e)
            continue
        found[int(m.group(1))] = parse_metrics(meta.get(METRICS_KEY), path)
    return found


def read_tree(ctx: Context, path: str, step: int, target: Any, namespaces: Namespaces | None,
              cast: bool, options: CheckpointLoadOptions, verify: bool = True) -> Any:
    """The arrays of a step, a jckpt file or directory or a step directory, as restore returns them."""
    if formats.is_step_directory(path):
        return formats.load_step(ctx, path, step, target, namespaces=namespaces, cast=cast,
                                 options=options, verify=verify)
    if target is None:
        return api.load(ctx, path, namespaces=namespaces, verify=verify)[1]
    return api.restore(ctx, target, path, cast=cast, namespaces=namespaces, verify=verify)


def parse_metrics(text: str | None, path: str) -> dict[str, float]:
    """The metrics of a step's metadata (`{}`, with a warning, when unreadable)."""
    metrics = metadata.parse_metrics(text)
    if metrics is None:
        log.warning("unreadable metrics in %s", path)
        return {}
    return metrics


def remove_step(backend: Backend, path: str) -> None:
    """Delete the step at `path` so that no moment shows a half-deleted step.

    A local step directory is first renamed to a staging name (generation 0, which no
    writer stages; `clean_staging` removes it should this process die), then deleted;
    one in a bucket loses its markers (index, record) first, so what is left is no step.
    A step that is a symbolic link is unlinked; what it points at is left alone.
    """
    if backend is LOCAL and os.path.islink(path):  # the link goes, not what it points at
        backend.remove(path)
        return
    if backend is LOCAL and os.path.isdir(path):
        doomed = next_name(path, 0)
        formats.staging_remove(doomed)  # left by a deletion killed before it finished
        try:
            os.rename(path, doomed)
        except OSError as e:
            raise storage_error(e, "removing the step", path) from e
        formats.staging_remove(doomed)
        return
    if backend.isdir(path):
        for marker in (INDEX_NAME, TRAINER_STATE_NAME):
            backend.remove(os.path.join(path, marker))
    backend.remove(path)


def _remove_unfinished(backend: Backend, path: str) -> None:
    """Remove a step directory (a prefix in a bucket) without its index or record, if all it holds
    is what a manager writes there; one holding anything else is left, with a warning."""
    if any(backend.exists(os.path.join(path, marker)) for marker in (INDEX_NAME, TRAINER_STATE_NAME)):
        return  # published: a directory checkpoint has its index, a step directory its record
    foreign = [n for n in backend.list(path) if not is_step_member(n)]
    if foreign:
        log.warning("leaving %s: named as a step, it holds no index or record but files no "
                    "manager writes (%s)", path, ', '.join(foreign[:3]))
        return
    log.info("removing the unfinished step directory %s", path)
    backend.remove(path)


def clean_staging(backend: Backend, directory: str) -> None:
    """Remove staging files and directories of steps whose writer died (incomplete steps).

    In an object store, file steps are staged in local files and uploaded whole;
    what a dead save leaves there is a step prefix of pieces without its index,
    and the marker of a step's multipart upload, whose upload is aborted.
    """
    if backend is not LOCAL:
        remove_staged_below(directory, STEP_RE)  # local files of steps never uploaded
        objects, prefixes = backend.list_kinds(directory)  # file steps need no request more
        folders = set(prefixes)
        for name in sorted(set(objects) | folders):
            path = os.path.join(directory, name)
            head, tag, _ = name.partition(UPLOAD_TAG)
            if tag and STEP_RE.match(head):
                backend.reclaim_uploads(os.path.join(directory, head))
            if STEP_RE.match(name):
                if name in folders:
                    _remove_unfinished(backend, path)
        return
    files, dirs = set(), set()
    for name in backend.list(directory):
        path = os.path.join(directory, name)
        if STEP_RE.match(name) and backend.isdir(path) and not os.path.islink(path):
            _remove_unfinished(backend, path)
            continue
        head, sep, _ = name.partition(NEXT_TAG)
        if sep and STEP_RE.match(head):
            if step_directory.recover_aside(path, os.path.join(directory, head)):
                continue  # a step its replacement set aside, whose writer died: back in place
            formats.staging_remove(path)  # a staged step directory
            remove_staged(os.path.join(directory, head))
            continue
        for tag, found in ((STAGE_TAG, files), (STAGE_DIR_TAG, dirs)):
            head, sep, _ = name.partition(tag)
            if sep and STEP_RE.match(head):
                found.add(os.path.join(directory, head))
    for target in sorted(files):
        reclaim_staging(target)
    for target in sorted(dirs):
        reclaim_stage_dirs(target)


def checked(value: Any, kind: type, name: str, default: Any = None) -> Any:
    """`value` if it is a `kind` (`None`: `default`, else `kind()`), else InputError."""
    if value is None:
        return default if default is not None else kind()
    if not isinstance(value, kind):
        raise InputError(f"{name} must be a {kind.__name__}, not {type(value).__name__}")
    return value


def leases(directory: str, process_index: int, process_count: int) -> tuple[str, list[str]]:
    """`(lease, rivals)`: the path whose writer lease a manager takes (the directory; in a
    multi-process run, one per process of it), and the lease files (local ones) no other
    writer may hold meanwhile: a single-process manager and a multi-process run never
    write one directory together."""
    if process_count == 1:
        try:
            names = os.listdir(directory)
        except OSError:  # an object store, or not there yet: no process leases to ask
            names = []
        return directory, [os.path.join(directory, n) for n in sorted(names)
                           if n.startswith('.process') and n.endswith(LEASE_SUFFIX)]
    return os.path.join(directory, f".process{process_index:05d}"), [lease_path(directory)]


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


__all__ = ['checked', 'clean_staging', 'leases', 'parse_metrics', 'read_metadata', 'read_tree',
           'say_if_orbax']
