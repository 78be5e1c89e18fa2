"""Staged generations: written under a temporary name now, made durable and renamed into place later.

A background writer (the mirror, the manager) writes each generation of a
checkpoint `target` as `<target>.jckpt-next.<n>` without waiting for the
disk (`stage_items`), and publishes it afterwards (`finish_staged`:
fsync the file, rename it over the target, fsync the directory), so writing
generation n+1 overlaps with persisting generation n. Readers of `target`
only ever see a complete generation. `remove_staged` clears what a
writer that died left behind.

A `target` in an object store (a URL) is staged in a local file instead
(in the temporary directory, named after the URL), and publishing uploads it
whole: an object has no rename, and the upload is what makes it durable.

>>> import os, tempfile
>>> import numpy as np
>>> from jckpt.format import precs
>>> from jckpt.storage.writer import ArraySource
>>> target = os.path.join(tempfile.mkdtemp(), 'run.jckpt')
>>> array = np.arange(3, dtype=np.float32)
>>> entry = Entry(id=0, namespace='jckpt', prec=precs.prec_of(array.dtype), dims=(3,), offset=0,
...               byte_length=array.nbytes, label=('w',), path=(('k', 'w'),))
>>> temporary = next_name(target, 1)
>>> stage_items(temporary, target, [entry], [ArraySource(array)], metadata={}, alignment=64)
>>> finish_staged(temporary, target, durable=True)
>>> sorted(os.listdir(os.path.dirname(target)))
['run.jckpt']
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Mapping, Sequence

from jckpt.errors import CheckpointError
from jckpt.format.header import Entry, Header
from jckpt.format.layout import written_header
from jckpt.format.names import NEXT_TAG
from jckpt.storage.backend import LOCAL, backend_for, is_url
from jckpt.storage.lease import WriterLease, lease_path
from jckpt.storage.publish import fsync_dir, fsync_file, reclaim_staging, replace, storage_error
from jckpt.storage.writer import PayloadSource, write_checkpoint


def next_name(target: str, seq: int) -> str:
    """The temporary name generation `seq` of `target` is staged under before it is durable."""
    if is_url(target):
        return f"{_local_stem(target)}{NEXT_TAG}{seq}"
    return f"{target}{NEXT_TAG}{seq}"


def _local_stem(url: str) -> str:
    """Where the generations of the object `url` are staged locally (one name per URL): named
    by its prefix's digest and its own name, so that what a dead writer staged for any object
    of a prefix is found from the prefix (`remove_staged_below`)."""
    parent, _, name = url.rstrip('/').rpartition('/')
    return os.path.join(tempfile.gettempdir(), f"{_prefix_tag(parent)}{name}")


def _prefix_tag(parent: str) -> str:
    return f"jckpt-{hashlib.sha256(parent.encode()).hexdigest()[:16]}-"


def write_items(target: str, entries: Sequence[Entry], sources: Sequence[PayloadSource], *,
                metadata: Mapping[str, str], alignment: int, durable: bool) -> Header:
    """Lay out `entries` and publish a file of their payloads at `target` (atomically).

    `sources[i]` streams the payload of `entries[i]`; `durable` says
    whether the file and its directory are fsynced before this returns.
    """
    header = written_header(entries, alignment, metadata=list(metadata.items()))
    return write_checkpoint(target, header, sources, durable=durable)


def stage_items(temporary: str, target: str, entries: Sequence[Entry],
                sources: Sequence[PayloadSource], *, metadata: Mapping[str, str],
                alignment: int) -> None:
    """Write a generation of `target` under `temporary`, not yet durable (errors name `target`)."""
    try:
        write_items(temporary, entries, sources, metadata=metadata, alignment=alignment,
                    durable=False)
    except CheckpointError as e:
        e.file = target
        raise


def finish_staged(temporary: str, target: str, *, durable: bool) -> None:
    """fsync `temporary`, rename it over `target`, fsync the directory (`durable=False`: rename)."""
    backend = backend_for(target)
    if backend is not LOCAL:  # an object: the upload publishes it
        backend.upload(temporary, target)
        discard_staged(temporary)
        return
    try:
        if durable:
            fsync_file(temporary)
        replace(temporary, target)
        if durable:
            fsync_dir(os.path.dirname(os.path.abspath(target)))
    except OSError as e:
        raise storage_error(e, "publishing the checkpoint", target) from e


def discard_staged(temporary: str) -> None:
    """Remove a staged generation that will not be published (gone already is fine)."""
    try:
        os.unlink(temporary)
    except FileNotFoundError:
        pass


def remove_abandoned(target: str) -> list[str]:
    """`remove_staged` of a local `target` whose mirror was killed: its lease file is still
    there and no one holds it, so this takes the lease, clears what was staged, and lets go
    (removing the lease file). A live mirror's generations are left alone; with no lease
    file (the usual case: no mirror, or one closed cleanly) nothing is even listed.

    >>> remove_abandoned(os.path.join(tempfile.mkdtemp(), 'm.jckpt'))
    []
    """
    if is_url(target) or not os.path.lexists(lease_path(target)):
        return []
    try:
        lease = WriterLease(target)
    except CheckpointError:  # a live mirror holds it (or it cannot be taken): not ours to clear
        return []
    with lease:
        return remove_staged(target)


def remove_staged(target: str) -> list[str]:
    """Remove what a writer of `target` that died left staged; return the names.

    That is its generations written but not made durable (`<target>.jckpt-next.<n>`)
    and the staging files of those (reclaimed as `reclaim_staging`
    does).
    """
    stem = _local_stem(target) if is_url(target) else target
    directory = os.path.dirname(os.path.abspath(stem))
    pattern = re.compile(re.escape(os.path.basename(stem)) + re.escape(NEXT_TAG) + r'([0-9]+)')
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    temporaries = set()
    for name in names:
        m = pattern.match(name)
        if m is None:
            continue
        temporary = os.path.join(directory, m.group(0))
        temporaries.add(temporary)
        if m.end() == len(name):
            try:
                os.unlink(temporary)
                removed.append(name)
            except OSError:
                pass
    for temporary in sorted(temporaries):
        removed.extend(os.path.basename(p) for p in reclaim_staging(temporary))
    return removed


def remove_staged_below(directory: str, names: re.Pattern[str]) -> list[str]:
    """`remove_staged` of the objects directly under the URL `directory` whose names match
    `names` (a manager's steps) that a dead writer staged locally: a step that never reached
    the bucket left its whole file in the temporary directory. The caller holds the writer
    lease of those names (another writer's, a mirror's file beside them, are left alone)."""
    tag = _prefix_tag(directory.rstrip('/'))
    try:
        found = os.listdir(tempfile.gettempdir())
    except OSError:
        return []
    heads = {name[len(tag):].partition(NEXT_TAG)[0] for name in found
             if name.startswith(tag) and NEXT_TAG in name}
    heads = {head for head in heads if names.match(head)}
    return [r for head in sorted(heads) for r in remove_staged(f"{directory.rstrip('/')}/{head}")]


__all__ = ['discard_staged', 'finish_staged', 'next_name', 'remove_staged', 'remove_staged_below',
           'stage_items', 'write_items']
