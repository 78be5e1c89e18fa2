"""Writes to object stores: one PUT, or a multipart upload completed only when every part is in.

What `save`, the mirror and the manager write to a URL goes up here, so a
checkpoint object appears whole or not at all: up to `part_size` bytes in
one PUT, above that in a multipart upload of `part_size` parts
(`concurrency` at a time) that is completed at the end and aborted when
producing or sending a part fails. `upload_stream` sends buffers as they
are produced (the streaming writer); `upload` sends a local file (the
mirror's and the manager's staged files); `ObjectStaging` spools a write
to a local file and uploads it at `publish`, for writers that patch what
they wrote (the surface of `jckpt.storage.publish.StagingFile`).

Every multipart upload runs inside an `UploadMarker`
(`jckpt.storage.upload_markers`), which also aborts the incomplete uploads
that killed writers of the same key left behind.

>>> url = ObjectURL.parse('memory://doc-uploads/a.jckpt')
>>> upload_stream(url, iter([b'ab', b'cd']), 4)
>>> bytes(obstore_module().get(store_for(url), url.key).bytes())
b'abcd'
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jckpt.errors import StorageError
from jckpt.storage.object_store import ObjectURL, obstore_module, store_error, store_for, tuning
from jckpt.storage.upload_markers import UploadMarker


def upload(local: str, u: ObjectURL) -> None:
    """Put the local file `local` at `u`: one PUT, or a multipart upload completed at the end.

    The object is the previous one (or none) until the upload completes; a
    failed multipart upload is aborted.
    """
    part, concurrency = tuning(u)
    store = store_for(u)
    try:
        if os.path.getsize(local) <= part:
            obstore_module().put(store, u.key, Path(local), use_multipart=False)
            return
        with UploadMarker(u):
            obstore_module().put(store, u.key, Path(local), chunk_size=part, max_concurrency=concurrency,
                                 use_multipart=True)
    except Exception as e:
        raise store_error(e, "uploading the checkpoint", u.url) from e


def upload_stream(u: ObjectURL, chunks: Iterator[Any], size: int) -> None:
    """Put the `size` bytes of `chunks` (buffers) at `u`, whole or not at all.

    Up to one part, one PUT of the joined bytes; above, a multipart upload
    that sends parts while `chunks` is still being produced, completed at
    the end and aborted if producing or sending fails.
    """
    part, concurrency = tuning(u)
    obs, store = obstore_module(), store_for(u)
    try:
        if size <= part:
            obs.put(store, u.key, b''.join(bytes(memoryview(c).cast('B')) for c in chunks),
                    use_multipart=False)
        else:
            with UploadMarker(u):
                obs.put(store, u.key, chunks, chunk_size=part, max_concurrency=concurrency)
    except Exception as e:
        raise store_error(e, "uploading the checkpoint", u.url) from e


class ObjectStaging:
    """A write to an object: spooled to a local file, uploaded whole at `publish`.

    The surface of `jckpt.storage.publish.StagingFile` (`fd`, `publish`,
    `discard`, a context manager), so the streaming writer and the format
    adapters write an object as they write a file. Leaving without
    `publish` uploads nothing. The upload is one PUT, or a multipart upload
    of `part_size` parts that is completed only when every part is in and
    aborted on any failure: the object is the previous one until then.
    """

    def __init__(self, u: ObjectURL) -> None:
        self.u, self.target = u, u.url
        store_for(u)  # a bad configuration is refused before anything is written
        self.published = False
        try:
            self.fd, self.path = tempfile.mkstemp(prefix='jckpt-upload-')
        except OSError as e:
            raise StorageError(f"creating the local spool file failed: {e.strerror}", file=u.url,
                               fix="free space in the temporary directory (TMPDIR)") from e

    def publish(self) -> None:
        """Upload the spooled bytes as the object (one PUT, or a multipart upload completed at the end)."""
        try:
            upload(self.path, self.u)
            self.published = True
        finally:
            self.discard()

    def discard(self) -> None:
        """Close and remove the spool file."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> ObjectStaging:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.discard()

    def __repr__(self) -> str:
        return f"ObjectStaging({self.target!r})"


__all__ = ['ObjectStaging', 'upload', 'upload_stream']
