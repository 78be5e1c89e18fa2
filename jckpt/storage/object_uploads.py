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
import re
import shlex
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jckpt.errors import CheckpointError, StorageError
from jckpt.storage.object_store import ObjectURL, is_missing, obstore_module, store_error, store_for, tuning
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
        with UploadMarker(u) as marker:
            _multipart(marker, lambda: obstore_module().put(
                store, u.key, Path(local), chunk_size=part, max_concurrency=concurrency,
                use_multipart=True))
    except CheckpointError:
        raise  # its own cause kept (a failed abort's: the upload's error)
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
            failed: list[BaseException] = []
            with UploadMarker(u) as marker:
                _multipart(marker, lambda: obs.put(store, u.key, _noting(chunks, failed),
                                                   chunk_size=part, max_concurrency=concurrency),
                           failed)
    except CheckpointError:
        raise  # its own cause kept (a failed abort's: the upload's error)
    except Exception as e:
        raise store_error(e, "uploading the checkpoint", u.url) from e


#: obstore's error of the abort it makes once a multipart upload failed: the DELETE of the upload.
_ABORT = re.compile(r"Error performing DELETE \S*?[?&]uploadId=([^\s&]+)")


def _noting(chunks: Iterator[Any], failed: list[BaseException]) -> Iterator[Any]:
    """`chunks`, noting in `failed` the error producing them raised (see `_multipart`)."""
    try:
        yield from chunks
    except BaseException as e:
        failed.append(e)
        raise


def _multipart(marker: UploadMarker, put: Any, failed: list[BaseException] | None = None) -> None:
    """Run `put`, a multipart upload under `marker`. obstore aborts a failed upload, and when
    the abort fails too it raises the abort's error instead of the upload's: the upload's own
    (what producing the bytes raised, noted in `failed`) is raised instead, saying that the
    abort failed and naming the upload left; its marker is left for the next writer of the
    key, who aborts it (`jckpt.storage.upload_markers`)."""
    try:
        put()
    except Exception as e:
        found = _ABORT.search(str(e))
        if found is None:
            raise
        marker.leave()
        first = failed[0] if failed else None
        raise abort_failed(e, marker.u, found[1], first, placed=marker.placed) from (first or e)


def abort_failed(abort: BaseException, u: ObjectURL, upload_id: str, first: BaseException | None,
                 *, placed: bool) -> CheckpointError:
    """The error of an upload of `u` that failed and whose abort failed too (`abort`): the
    upload's own error (`first`; `None` when the store's error replaced it), the abort's
    failure, and how the incomplete upload `upload_id` left in the bucket goes (`placed`: its
    marker is there, so the next multipart save of the key aborts it)."""
    said = store_error(abort, "aborting the upload", u.url)  # its fix: a network's, a permission's
    error = store_error(first, "uploading the checkpoint", u.url) if first is not None else \
        StorageError("uploading the checkpoint failed: sending a part or completing the upload "
                     "failed (the store's error was replaced by that of the failed abort)",
                     file=u.url, fix=said.fix)
    detail = str(abort).splitlines()[0][:200]
    if is_missing(abort):  # no such upload: completed (its answer lost on the way) or aborted
        error.message += ("; the upload is no longer there to abort: its completion may have been "
                          "made, its answer lost, so the object is the checkpoint saved, whole, or "
                          "the previous one")
        error.fix = (f"read {u.url} (jckpt.describe, or jckpt inspect) to see which, and save again "
                     "if it is the previous one; nothing is left in the bucket to abort")
        error.args = (str(error),)
        return error
    error.message += f"; aborting the incomplete upload failed too ({detail})"
    left = f"the incomplete multipart upload {upload_id} of key {u.key!r} is left in the bucket "
    how = [f"the next multipart save of {u.url} aborts it"] if placed else []
    if u.kind == 's3':
        how.append(f"abort it with `aws s3api abort-multipart-upload --bucket {u.bucket} "
                   f"--key {shlex.quote(u.key)} --upload-id {upload_id}`")
    how.append("a lifecycle rule that aborts incomplete uploads removes it (docs/object-storage.md)")
    error.fix = (f"{error.fix}; " if error.fix else '') + left + "(billed until aborted): " + \
        ', or '.join(how)
    error.args = (str(error),)
    return error


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


__all__ = ['ObjectStaging', 'abort_failed', 'upload', 'upload_stream']
