"""The backend of object store URLs: `s3://`, `gs://`, `az://` and `memory://` checkpoints.

`backend_for` hands `OBJECT_STORE` out for every URL of those schemes. It
implements the `Backend` protocol of `jckpt.storage.backend` over obstore
(`jckpt.storage.object_store` holds the configuration and the ranged
source, `jckpt.storage.object_uploads` the uploads,
`jckpt.storage.remote_reader` the reader, `jckpt.storage.object_lease`
the writer lease). A "directory" is a key
prefix: `s3://b/run` holds `s3://b/run/step_00000100.jckpt`.

>>> OBJECT_STORE.list('memory://doc-backend/run')
[]
"""

from __future__ import annotations

import bisect
import logging
import posixpath
from collections.abc import Iterator, Sequence
from typing import Any

from jckpt.errors import FormatError, InputError
from jckpt.format.names import UPLOAD_TAG
from jckpt.storage.object_lease import ObjectLease
from jckpt.storage.object_store import (
    ObjectSource,
    ObjectURL,
    is_missing,
    obstore_module,
    store_error,
    store_for,
    tuning,
)
from jckpt.storage.object_uploads import ObjectStaging, upload, upload_stream
from jckpt.storage.remote_reader import RemoteReader
from jckpt.storage.s3_api import api_for
from jckpt.storage.upload_markers import reclaim

log = logging.getLogger('jckpt')

#: The message of the `FormatError` of `map` and `head` for a URL where no object is stored.
NO_SUCH_OBJECT = "no such object"


def _object(path: str) -> ObjectURL:
    """The URL of one checkpoint object (or directory): it names a key inside its bucket.

    A bucket's root is refused: S3 takes no empty key, a lease beside it would
    land in another bucket, and its removal would empty the bucket.
    """
    u = ObjectURL.parse(path)
    if not u.key:
        raise InputError("the URL names a bucket, not a checkpoint inside it", file=path,
                         fix=f"add a path: {u.scheme}://{u.bucket}/run/model.jckpt")
    return u


class ObjectStoreBackend:
    """Checkpoints in an object store (the `Backend` of `jckpt.storage.backend` for URLs).

    Paths are URLs; a "directory" is a key prefix (`s3://b/run` holds
    `s3://b/run/step_00000100.jckpt`).
    """

    name = 'object store'
    #: Uploads can be streamed (`stream`): the writer sends host arrays without a spool file.
    streams = True

    def open(self, path: str, *, follow_symlinks: bool = True) -> RemoteReader:
        u = _object(path)
        part, concurrency = tuning(u)
        return RemoteReader(ObjectSource(u), path, part=part, concurrency=concurrency)

    def check_target(self, path: str) -> None:
        _object(path)

    def map(self, path: str) -> bytes:
        u = _object(path)
        try:
            return bytes(obstore_module().get(store_for(u), u.key).bytes())
        except Exception as e:
            if is_missing(e):
                raise FormatError(NO_SUCH_OBJECT, file=path, fix="check the URL") from None
            raise store_error(e, "reading", path) from e

    def head(self, path: str, length: int) -> bytes:
        u = _object(path)
        try:
            return ObjectSource(u).head(length)[0]
        except FormatError as e:
            raise FormatError(NO_SUCH_OBJECT, file=path, fix="check the URL") from e

    def exists(self, path: str) -> bool:
        """Whether an object is stored at `path`."""
        u = ObjectURL.parse(path)
        try:
            obstore_module().head(store_for(u), u.key)
            return True
        except Exception as e:
            if is_missing(e):
                return False
            raise store_error(e, "looking up", path) from e

    def isdir(self, path: str) -> bool:
        u = ObjectURL.parse(path)
        try:
            for chunk in obstore_module().list(store_for(u), prefix=u.prefix, chunk_size=1):
                return bool(chunk)
            return False
        except Exception as e:
            raise store_error(e, "listing", path) from e

    def create(self, target: str, *, durable: bool = True) -> ObjectStaging:
        return ObjectStaging(_object(target))

    def stream(self, target: str, chunks: Iterator[Any], size: int) -> None:
        """Upload the `size` bytes of `chunks` as the object `target`, whole or not at all."""
        upload_stream(_object(target), chunks, size)

    def upload(self, local: str, target: str) -> None:
        """Put the local file `local` at `target` whole (see `upload`)."""
        upload(local, _object(target))

    def list(self, path: str) -> list[str]:
        objects, prefixes = self.list_kinds(path)
        return sorted(set(objects) | set(prefixes))

    def list_kinds(self, path: str) -> tuple[list[str], list[str]]:
        """The names directly under `path`: `(objects, prefixes)`, each sorted (a name may be
        both). One listing tells a manager's file steps from its directory steps."""
        objects, prefixes, _ = self.list_versions(path)
        return objects, prefixes

    def list_versions(self, path: str) -> tuple[list[str], list[str], dict[str, str]]:
        """`list_kinds`, with the version of each object the listing names (its ETag and size,
        which the listing carries: no request more), by name: what tells a reader's `reload`
        which steps were replaced since it read them (`jckpt.services.step_cache`)."""
        u = ObjectURL.parse(path)
        try:
            found = obstore_module().list_with_delimiter(store_for(u), prefix=u.prefix or None)
        except Exception as e:
            raise store_error(e, "listing", path) from e

        def names(keys: Any) -> list[str]:
            return sorted({k.rstrip('/').rsplit('/', 1)[-1] for k in keys} - {''})
        versions = {o['path'].rsplit('/', 1)[-1]: f"{o['e_tag']}:{o['size']}"
                    for o in found['objects'] if o.get('e_tag')}
        return names(o['path'] for o in found['objects']), names(found['common_prefixes']), versions

    def size(self, path: str) -> int:
        """Bytes of the object `path`, or of every object under the prefix `path/`; 0 if none."""
        u = ObjectURL.parse(path)
        obs, store = obstore_module(), store_for(u)
        try:
            below = [o['size'] for chunk in obs.list(store, prefix=u.prefix) for o in chunk]
            return sum(below) if below or not u.key else obs.head(store, u.key)['size']
        except Exception as e:
            if is_missing(e):
                return 0
            raise store_error(e, "listing", path) from e

    def remove(self, path: str, *, below: bool = True) -> None:
        """Remove the object `path` and everything under the prefix `path/`; missing is fine.

        The uploads that killed writers left for objects under it (found by
        their markers) are aborted first: no later writer would find them.
        With `below=False`, the object `path` alone: one DELETE, no listing
        (a caller that knows nothing is under it: a manager's file step).
        """
        self.remove_all([path], below=below)

    def remove_all(self, paths: Sequence[str], *, below: bool = True) -> None:
        """Remove each of `paths` as `remove` does, deleting every key found in one request per
        1,000 keys of a bucket (obstore's `delete` of a list: S3's DeleteObjects, Azure's blob
        batches of 256; GCS deletes one key a request, 10 at a time); with `below` (each path a
        prefix too), one LIST per path first. Missing keys are fine.

        A failed request is a `StorageError` naming the keys it was deleting (any of them may
        be gone or still there: a retry deletes what is left).

        >>> OBJECT_STORE.remove_all(['memory://doc-remove/run/a', 'memory://doc-remove/run/b'])
        """
        by_bucket: dict[tuple[str, str], list[ObjectURL]] = {}
        for path in paths:
            u = _object(path)
            by_bucket.setdefault((u.scheme, u.bucket), []).append(u)
        for group in by_bucket.values():
            keys = self._below(group) if below else []
            delete_keys(group[0], list(dict.fromkeys(keys + [u.key for u in group])))

    def _below(self, group: list[ObjectURL]) -> list[str]:
        """The keys under the prefixes of `group` (URLs of one bucket), once the uploads killed
        writers left for them are aborted. One listing serves them all: from the first prefix
        to the last, 1,000 keys a page (for a manager's old steps side by side, one LIST)."""
        prefixes = sorted({u.prefix for u in group})
        listing = obstore_module().list(store_for(group[0]), prefix=posixpath.commonpath(prefixes)
                                        + '/', offset=prefixes[0][:-1], chunk_size=1000)
        keys: list[str] = []
        try:
            for key in (o['path'] for chunk in listing for o in chunk):
                if key > prefixes[-1] and not key.startswith(prefixes[-1]):
                    break  # past the last prefix: no further page is asked for
                at = bisect.bisect_right(prefixes, key) - 1
                if at >= 0 and key.startswith(prefixes[at]):
                    keys.append(key)
        except Exception as e:
            raise store_error(e, "listing", group[0].url) from e
        for key in sorted({k.partition(UPLOAD_TAG)[0] for k in keys if UPLOAD_TAG in k}):
            self.reclaim_uploads(f"{group[0].scheme}://{group[0].bucket}/{key}")
        return keys

    def lease(self, path: str) -> ObjectLease:
        return ObjectLease(_object(path))

    def reclaim_uploads(self, path: str) -> int:
        """Abort the incomplete uploads of `path` that killed writers left (see
        `jckpt.storage.upload_markers`); how many. Only S3 with botocore can; failures are logged."""
        u = ObjectURL.parse(path)
        try:
            api = api_for(u, store_for(u))
            return 0 if api is None else reclaim(api, u, '')
        except Exception as e:
            log.warning("could not look for incomplete uploads of %s left by killed writers: %s",
                        path, e)
            return 0

    def __repr__(self) -> str:
        return 'ObjectStoreBackend()'


def delete_keys(u: ObjectURL, keys: list[str]) -> None:
    """Delete the objects `keys` (keys as stored, not URLs) of `u`'s bucket, `DELETE_BATCH` to a
    request (as `ObjectStoreBackend.remove_all`: missing keys are fine, a failed request is a
    `StorageError` naming its keys)."""
    obs, store = obstore_module(), store_for(u)
    for start in range(0, len(keys), DELETE_BATCH):
        batch = keys[start:start + DELETE_BATCH]
        try:
            obs.delete(store, batch)
        except Exception as e:
            if not is_missing(e):
                more = f" and {len(batch) - 3} more" if len(batch) > 3 else ''
                raise store_error(e, f"deleting {', '.join(batch[:3])}{more}",
                                  f"{u.scheme}://{u.bucket}/{batch[0]}") from e


def concurrency(path: str) -> int:
    """The requests in flight the store of the URL `path` allows (`configure`'s `concurrency`,
    8 by default): how many objects under a prefix are read at once (a manager's steps).

    >>> concurrency('memory://doc-concurrency/run')
    8
    """
    return tuning(ObjectURL.parse(path))[1]


#: Keys per multi-object DELETE request (S3's limit for one).
DELETE_BATCH = 1000


#: The object store backend (one for every scheme; stores are per bucket).
OBJECT_STORE = ObjectStoreBackend()


__all__ = ['DELETE_BATCH', 'NO_SUCH_OBJECT', 'OBJECT_STORE', 'ObjectStoreBackend', 'concurrency',
           'delete_keys']
