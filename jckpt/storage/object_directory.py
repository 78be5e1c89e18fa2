"""The directory form in an object store: pieces named by their save, the index as the commit.

An object store has no rename, so a directory checkpoint at a URL cannot be
staged beside it and swapped in as it is on disk (`jckpt.storage.directory`).
Instead each save draws a tag (`new_tag`) and every process writes its
pieces under names that carry it (`process_00000.s<24 hex digits>.jckpt`),
so they never overwrite the pieces of the checkpoint already at the URL.
Process 0 then replaces `index.jckpt` with one PUT: that is the commit.
Readers see the previous checkpoint (its index naming its own pieces) until
then and the new one after; a save that fails or dies before it leaves the
previous checkpoint whole. Process 0 of a save that fails deletes the pieces
of its tag (`discard`).

Once its index is in, the writer deletes what no index names any more
(`clean_after_commit`): the pieces of the index it replaced (read just
before the PUT, `current_files`), a file checkpoint at the URL itself
(which readers would otherwise see first), and orphans, the pieces of saves
that died before their index, when their writer is surely gone (its host
and pid are in the tag: a process of this host that no longer runs, or a
finished save of this very process) or when they are older than an hour by
the store's clock. A save still running elsewhere therefore keeps its
pieces. The multipart uploads that killed writers left for such pieces are
aborted too (by their markers, `jckpt.storage.upload_markers`, on S3): no
later writer of those keys would, since a piece name is used by one save
only. A reader that read the index before the replacement and then asks for
a deleted piece gets a `FormatError` saying so, never another checkpoint's
bytes: piece names are never reused.

>>> from jckpt.format.names import piece_name
>>> tag = new_tag()
>>> piece_tag(piece_name(0, 0, tag)) == tag and writer_gone(tag)   # no save of it runs here
True
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import secrets
import socket
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jckpt.errors import CheckpointError, FormatError
from jckpt.format.index import index_files
from jckpt.format.names import INDEX_NAME, UPLOAD_TAG, piece_tag, save_tag, tag_writer
from jckpt.storage.object_backend import OBJECT_STORE, delete_keys
from jckpt.storage.object_store import ObjectURL, obstore_module, store_error, store_for
from jckpt.storage.publish import STALE_AFTER

log = logging.getLogger('jckpt')

_LIVE: set[str] = set()  # the tags of this process's saves in progress
_LIVE_LOCK = threading.Lock()


def _host() -> int:
    return zlib.crc32(socket.gethostname().encode())


def new_tag() -> str:
    """A fresh save tag: this host, this process, and 32 random bits."""
    return save_tag(_host(), os.getpid(), secrets.randbits(32))


@contextlib.contextmanager
def saving(tag: str) -> Iterator[str]:
    """Mark the save `tag` as running in this process while the block runs (see `writer_gone`);
    an empty `tag` (a local save, or a process other than 0) marks nothing."""
    if not tag:
        yield tag
        return
    with _LIVE_LOCK:
        _LIVE.add(tag)
    try:
        yield tag
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(tag)


def writer_gone(tag: str) -> bool:
    """Whether the save `tag` surely runs no more: a process of this host that is gone, or a save
    of this process that has ended. False when it cannot be told (another host: see the age rule)."""
    writer = tag_writer(tag)
    if writer is None or writer[0] != _host():
        return False
    pid = writer[1]
    if pid == os.getpid() & 0xffffffff:
        with _LIVE_LOCK:
            return tag not in _LIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):
        return False
    return False


def current_files(url: str) -> list[str]:
    """The piece files the index at `url` names now; empty when there is none (or it is damaged)."""
    index = os.path.join(url, INDEX_NAME)
    try:
        return index_files(OBJECT_STORE.open(index).header, index)
    except FormatError:  # no index, or not one: its pieces are orphans, removed by the age rule
        return []


def _listing(u: ObjectURL) -> tuple[list[dict[str, Any]], datetime.datetime]:
    """The objects directly under `u`'s prefix, and the time of its index by the store's clock."""
    try:  # one level only: what lies deeper is no piece
        found = obstore_module().list_with_delimiter(store_for(u), prefix=u.prefix or None)['objects']
    except Exception as e:
        raise store_error(e, "listing", u.url) from e
    now = next((o['last_modified'] for o in found if o['path'] == u.prefix + INDEX_NAME),
               datetime.datetime.now(datetime.UTC))
    return found, now


def _orphan(name: str, modified: datetime.datetime, now: datetime.datetime) -> bool:
    tag = piece_tag(name)
    if tag and writer_gone(tag):
        return True
    return (now - modified).total_seconds() > STALE_AFTER


def _reclaim_uploads(u: ObjectURL, found: list[dict[str, Any]], doomed: Callable[[str], bool]) -> None:
    """Abort the uploads that killed writers left for the pieces here that `doomed` names (found by
    their markers, `jckpt.storage.upload_markers`): a piece name is used by one save only, so no
    later writer of that key would. Uploads of live writers are spared."""
    names = [o['path'][len(u.prefix):] for o in found]
    for head in sorted({n.partition(UPLOAD_TAG)[0] for n in names if UPLOAD_TAG in n}):
        if piece_tag(head) is not None and doomed(head):
            OBJECT_STORE.reclaim_uploads(u.child(head).url)


def clean_after_commit(url: str, files: Iterable[str], replaced: Iterable[str]) -> list[str]:
    """After the index naming `files` is in: delete the pieces no index names any more.

    Deleted: the pieces of the index this one `replaced`, orphans (see the
    module's docstring), and an object at `url` itself (a file checkpoint
    replaced by this directory). The save is done whatever happens here: a
    failure is logged, and what is left is cleaned by the next save. Returns
    the names deleted.
    """
    u = ObjectURL.parse(url)
    keep, replaced = set(files), set(replaced)
    try:
        found, now = _listing(u)
        doomed = [o['path'] for o in found if (name := o['path'][len(u.prefix):]) not in keep
                  and piece_tag(name) is not None
                  and (name in replaced or _orphan(name, o['last_modified'], now))]
        delete_keys(u, doomed)
        _reclaim_uploads(u, found, lambda name: name not in keep)
        if u.key:  # apart: a store that reports a missing key must not stop the others' deletion
            delete_keys(u, [u.key])
    except CheckpointError as e:
        log.warning("the checkpoint %s is saved, but deleting the pieces it replaced failed "
                    "(the next save deletes them): %s", url, e)
        return []
    return [k[len(u.prefix):] for k in doomed]


def discard(url: str, tag: str) -> None:
    """Delete the pieces of the save `tag`, which failed before its index was written.

    A failure here is logged, not raised (the save's own error is the one to
    report): the pieces left are orphans, which the next save deletes.
    """
    u = ObjectURL.parse(url)
    try:
        found, _ = _listing(u)
        delete_keys(u, [o['path'] for o in found if piece_tag(o['path'][len(u.prefix):]) == tag])
        _reclaim_uploads(u, found, lambda name: piece_tag(name) == tag)
    except CheckpointError as e:
        log.warning("deleting the pieces of the failed save of %s failed (the next save "
                    "deletes them): %s", url, e)


__all__ = ['clean_after_commit', 'current_files', 'discard', 'new_tag', 'saving', 'writer_gone']
