"""Removing steps from a manager's directory so that no moment shows half a step, and clearing
what a killed writer left there: staging files and directories, aborted uploads, and step
prefixes that never got their index or record.

A local step directory is renamed aside before it is deleted; a bucket's step loses its
markers (index, record) first, so that whatever a failure leaves is no step.

>>> import tempfile, os, numpy as np, jckpt
>>> from jckpt.storage.backend import LOCAL
>>> d = tempfile.mkdtemp(); path = os.path.join(d, 'step_00000001.jckpt')
>>> jckpt.save(jckpt.Context(), {'w': np.zeros(2)}, path)
>>> remove_step(LOCAL, path); os.listdir(d)
[]
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence

from jckpt.format.names import (
    INDEX_NAME,
    NEXT_TAG,
    STAGE_DIR_TAG,
    STAGE_TAG,
    STEP_RE,
    TRAINER_STATE_NAME,
    UPLOAD_TAG,
    is_step_member,
)
from jckpt.services import formats
from jckpt.storage import step_directory
from jckpt.storage.backend import LOCAL, Backend
from jckpt.storage.directory import reclaim_stage_dirs
from jckpt.storage.publish import reclaim_staging, storage_error
from jckpt.storage.staging import next_name, remove_staged, remove_staged_below

log = logging.getLogger('jckpt')

#: A directory's listing: its objects, its prefixes and, in a bucket, each object's version.
Listing = tuple[list[str], list[str], Mapping[str, str] | None]


def remove_step(backend: Backend, path: str, folder: bool | None = None) -> None:
    """Delete the step at `path` so that no moment shows a half-deleted step.

    A local step directory is first renamed to a staging name (generation 0, which no
    writer stages; `clean_staging` removes it should this process die), then deleted;
    one in a bucket loses its markers (index, record) first, so what is left is no step.
    A step that is a symbolic link is unlinked; what it points at is left alone.
    `folder`, when the caller knows it: whether the step is a directory (a prefix in a
    bucket); a file step in a bucket is then one DELETE, with no listing.
    """
    if backend is not LOCAL and folder is False:
        backend.remove(path, below=False)
        return
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
    if folder or (folder is None and backend.isdir(path)):
        for marker in (INDEX_NAME, TRAINER_STATE_NAME):
            backend.remove(os.path.join(path, marker), below=False)
    backend.remove(path)


def remove_steps(backend: Backend, doomed: Mapping[str, bool],
                 gone: Callable[[list[str]], None]) -> None:
    """Delete the steps at `doomed`'s paths (`True`: a directory step), calling `gone(paths)` as
    soon as those paths hold no step any more (even if what is left of them fails to go).

    In a bucket: one multi-object DELETE per 1,000 keys removes the file steps and the markers
    (index, record) of the directory steps, so that no step is ever seen half deleted; then
    one LIST per directory step and one DELETE per 1,000 keys remove what they hold (what a
    failure leaves, the next manager to open removes as unfinished). Locally, each step as
    `remove_step` removes it. A failure is a `StorageError` naming what was being deleted;
    the steps `gone` was not told of are all still there, or some of them only partly
    (a file step deleted, a directory step's record and not its index): a retry deletes
    what is left.
    """
    if backend is LOCAL:
        for path, folder in doomed.items():
            remove_step(backend, path, folder=folder)
            gone([path])
        return
    folders = [path for path, folder in doomed.items() if folder]
    backend.remove_all([path for path, folder in doomed.items() if not folder]
                       + [os.path.join(p, m) for p in folders for m in (INDEX_NAME, TRAINER_STATE_NAME)],
                       below=False)
    gone(list(doomed))
    backend.remove_all(folders)


def _remove_unfinished(backend: Backend, path: str, published: bool | None = None) -> None:
    """Remove a step directory (a prefix in a bucket) without its index or record, if all it holds
    is what a manager writes there; one holding anything else is left, with a warning.
    `published=False`: the caller found neither (no request asks again)."""
    if published is None and any(backend.exists(os.path.join(path, marker))
                                 for marker in (INDEX_NAME, TRAINER_STATE_NAME)):
        return  # published: a directory checkpoint has its index, a step directory its record
    foreign = [n for n in backend.list(path) if not is_step_member(n)]
    if foreign:
        log.warning("leaving %s: named as a step, it holds no index or record but files no "
                    "manager writes (%s)", path, ', '.join(foreign[:3]))
        return
    log.info("removing the unfinished step directory %s", path)
    backend.remove(path)


def clean_staging(backend: Backend, directory: str, listing: Listing | None = None) -> None:
    """Remove staging files and directories of steps whose writer died (incomplete steps).

    In an object store, file steps are staged in local files and uploaded whole;
    what a dead save leaves there is the marker of a step's multipart upload, whose
    upload is aborted here (`listing`: the directory's `list_kinds`, made once by the
    caller), and a step prefix without its index or record, which `scan` finds as it
    reads the steps and `remove_unfinished` removes.
    """
    if backend is not LOCAL:
        remove_staged_below(directory, STEP_RE)  # local files of steps never uploaded
        objects = (listing or backend.list_kinds(directory))[0]
        for name in objects:
            head, tag, _ = name.partition(UPLOAD_TAG)
            if tag and STEP_RE.match(head):
                backend.reclaim_uploads(os.path.join(directory, head))
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


def remove_unfinished(backend: Backend, directory: str, names: Sequence[str]) -> None:
    """Remove the step prefixes `scan` found unfinished (`Found.unfinished`), each if all it
    holds is what a manager writes there."""
    for name in names:
        _remove_unfinished(backend, os.path.join(directory, name), published=False)



__all__ = ['Listing', 'clean_staging', 'remove_step', 'remove_steps', 'remove_unfinished']
