"""Markers of multipart uploads in flight, so the next writer of a key aborts a killed writer's.

A writer killed during a multipart upload leaves the upload incomplete: no
object and invisible to readers, but stored (and billed) until aborted.
Locally, the staging file of a killed writer is found and removed by the
next writer of that path; here, before a multipart upload of key `K`
starts, `UploadMarker` puts a small object `K.jckpt-upload.<random>`
holding its writer's record (host, pid, time: the lease's record of
`jckpt.storage.object_lease`), rewrites it every `REFRESH_SECONDS` while
the upload runs, and deletes it once the upload is completed or aborted.

A marker whose writer is gone (the lease's rule: a process of this host
that no longer runs, or a marker not rewritten for `STALE_SECONDS`) is left
by a killed writer. Before its own upload, a writer looks for such markers
(`reclaim`), and when it finds one and no other writer of `K` is live:

1. lists the incomplete multipart uploads of exactly `K`, then lists the
   markers again: a writer puts its marker before it starts its upload, so
   every upload in the first listing has its marker in the second, and a
   live marker there means the upload may be live: nothing is aborted;
2. aborts the uploads the dead writers could own: those initiated no later
   than `SLACK_SECONDS` after the last rewrite of a dead marker (the
   store's own clock on both sides), and deletes the dead markers.

The extra requests are few: a multipart save makes 3 (its marker's PUT and
DELETE, one listing), plus one PUT every 30 s of upload; only a dead marker
costs more. The listing is sent with the marker's PUT, not after it: the
two add one round trip to the upload, not two (the second listing of step
1, which must follow the PUT, is made only when a dead marker was listed).

The listing and the aborts are S3 calls that obstore lacks, made through
botocore (`jckpt.storage.s3_api`); without botocore the marker is still put
(other writers then spare this upload) but nothing is reclaimed. Other
stores have no way to list incomplete uploads: for them no marker is put,
and a lifecycle rule (GCS) or the 7-day expiry of uncommitted blocks
(Azure) removes what a killed writer left.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import logging
import os
import secrets
import socket
import threading
from collections.abc import Iterable
from typing import Any

from jckpt.format.names import UPLOAD_TAG
from jckpt.storage.object_lease import REFRESH_SECONDS, gone, record
from jckpt.storage.object_store import ObjectURL, is_missing, obstore_module, store_for
from jckpt.storage.s3_api import S3Api, api_for

log = logging.getLogger('jckpt')

#: An upload initiated this long after a dead marker's last rewrite is not its writer's: a live
#: writer rewrites its marker every `REFRESH_SECONDS`, so it started its upload before then.
SLACK_SECONDS = 2 * REFRESH_SECONDS
#: A marker whose record cannot be read (but that is there): its writer may be live.
UNKNOWN: dict[str, Any] = {}


def owned(uploads: Iterable[tuple[str, datetime.datetime]], dead: Iterable[datetime.datetime]) -> list[str]:
    """The ids of the `uploads` (id, initiated) that writers whose markers were last rewritten at
    `dead` could own: initiated no later than `SLACK_SECONDS` after the latest of those times.

    >>> t = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    >>> owned([('a', t), ('b', t + datetime.timedelta(minutes=5))], [t])
    ['a']
    """
    times = list(dead)
    if not times:
        return []
    latest = max(times) + datetime.timedelta(seconds=SLACK_SECONDS)
    return [upload_id for upload_id, initiated in uploads if initiated <= latest]


Holders = dict[str, dict[str, Any]]


def _holders(u: ObjectURL, keys: Iterable[str], known: Holders) -> Holders:
    """The record in each marker of `keys` (`UNKNOWN` when unreadable; a marker gone meanwhile is
    left out: its upload is over), reusing the records in `known`."""
    obs, store = obstore_module(), store_for(u)
    found: Holders = {}
    for key in keys:
        if key in known:
            found[key] = known[key]
            continue
        try:
            data = bytes(obs.get(store, key).bytes())
        except Exception as e:
            if not is_missing(e):
                found[key] = UNKNOWN
            continue
        found[key] = _parse(data)
    return found


def _parse(data: bytes) -> dict[str, Any]:
    """A marker's record; a damaged one is a record without a time, which `gone` takes as stale."""
    try:
        holder = json.loads(data)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


#: `(bucket, marker key)` of this process's uploads in progress: a marker of this process not
#: among them is its writer's, whose upload ended without deleting it (the store did not answer).
_OPEN: set[tuple[str, str]] = set()


def _is_dead(bucket: str, key: str, holder: dict[str, Any]) -> bool:
    if holder is UNKNOWN:
        return False
    mine = holder.get('host') == socket.gethostname() and holder.get('pid') == os.getpid()
    return gone(holder) or (mine and (bucket, key) not in _OPEN)


def _all_dead(bucket: str, holders: Holders) -> bool:
    return bool(holders) and all(_is_dead(bucket, k, h) for k, h in holders.items())


def reclaim(api: S3Api, u: ObjectURL, own: str,
            first: list[tuple[str, datetime.datetime]] | None = None) -> int:
    """Abort the multipart uploads of `u`'s key left by killed writers; how many were aborted.

    `own` is the key of the caller's own marker, which is not looked at
    (`''` for none). `first` is the markers' first listing when the caller
    made it (`UploadMarker` lists while its own marker is put: that listing
    only tells whether a dead marker is there, and the second listing, made
    here once the own marker is in, is what spares live uploads). Does
    nothing while another writer of the key is live.
    """
    listed = dict(first if first is not None else api.keys(u.key + UPLOAD_TAG))
    listed.pop(own, None)
    holders = _holders(u, listed, {})
    if not _all_dead(u.bucket, holders):
        return 0
    uploads = api.uploads(u.key)
    again = dict(api.keys(u.key + UPLOAD_TAG))
    again.pop(own, None)
    holders = _holders(u, again, holders)
    if not _all_dead(u.bucket, holders):
        return 0
    aborted = sum(api.abort(u.key, upload_id) for upload_id in owned(uploads, again.values()))
    obstore_module().delete(store_for(u), list(holders))
    who = ', '.join(sorted({f"pid {h.get('pid')} on {h.get('host')}" for h in holders.values()}))
    log.log(logging.WARNING if aborted else logging.INFO,
            "aborted %d incomplete upload(s) of %s left by writers that are gone (%s), and "
            "removed their markers", aborted, u.url, who)
    return aborted


class UploadMarker:
    """The marker of one multipart upload of `u` (a context manager around the upload).

    Entering puts the marker (on S3 stores) and reclaims what killed writers
    of the key left; leaving stops its refreshing and deletes it (unless `leave` was
    called: the upload is left behind, and the marker names it to the next writer). Failures of
    either are logged, never raised: the upload goes on without them.
    """

    def __init__(self, u: ObjectURL) -> None:
        self.u = u
        self.key = f"{u.key}{UPLOAD_TAG}{secrets.token_hex(8)}"
        self.placed = self.left = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> UploadMarker:
        store = store_for(self.u)
        if self.u.kind != 's3' or type(store).__name__ != 'S3Store':
            return self
        _OPEN.add((self.u.bucket, self.key))  # before it is seen: never taken for a dead one's
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='jckpt-marker') as pool:
            # the markers' first listing goes with the PUT of this one, not after it: one round
            # trip less, and reclaim's own second listing is still made once this marker is in
            listing = pool.submit(self._listing, store)
            try:
                obstore_module().put(store, self.key, record())
                self.placed = True
            except Exception as e:
                log.warning("could not put the upload marker of %s (%s); uploading without it",
                            self.u.url, e)
                return self
            # refreshed from now on, so that the upload, which starts after the reclaim, is always
            # initiated within REFRESH_SECONDS of a rewrite of its marker (see `owned`)
            self._thread = threading.Thread(target=self._refresh, name='jckpt-upload-marker',
                                            daemon=True)
            self._thread.start()
            api, first = listing.result()
        try:
            if api is not None and first is not None:
                reclaim(api, self.u, self.key, first)
        except Exception as e:
            log.warning("could not look for incomplete uploads of %s left by killed writers: %s",
                        self.u.url, e)
        return self

    def _listing(self, store: Any) -> tuple[S3Api | None, list[tuple[str, datetime.datetime]] | None]:
        """The S3 calls' client and the markers of the key (`None` for those that failed: logged)."""
        try:
            api = api_for(self.u, store)
            return api, None if api is None else api.keys(self.u.key + UPLOAD_TAG)
        except Exception as e:
            log.warning("could not look for incomplete uploads of %s left by killed writers: %s",
                        self.u.url, e)
            return None, None

    def leave(self) -> None:
        """Keep the marker when leaving: its upload is left in the bucket (obstore's abort of
        it failed), and the marker, its writer gone, has the next writer of the key abort it."""
        self.left = True

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_SECONDS):
            try:
                obstore_module().put(store_for(self.u), self.key, record())
            except Exception as e:
                log.warning("could not refresh the upload marker of %s: %s", self.u.url, e)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.placed and not self.left:
            try:
                obstore_module().delete(store_for(self.u), self.key)
            except Exception as e:
                log.warning("could not delete the upload marker %s/%s: %s", self.u.bucket, self.key, e)
            self.placed = False
        _OPEN.discard((self.u.bucket, self.key))  # a marker left behind is now a dead one's

    def __repr__(self) -> str:
        return f"UploadMarker({self.u.url!r}, placed={self.placed})"


__all__ = ['SLACK_SECONDS', 'UploadMarker', 'owned', 'reclaim']
