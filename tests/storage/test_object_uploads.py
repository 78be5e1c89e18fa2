"""Uploads to an object store: one PUT, or a multipart upload with its marker while it runs."""

import contextlib
from pathlib import Path

import numpy as np
import pytest

import jckpt
from jckpt.storage import backend_for
from jckpt.storage.object_store import ObjectURL
from jckpt.storage.object_uploads import ObjectStaging, upload, upload_stream
from tests.s3server import dead_pid, markers_of, plant_marker, start_upload, uploads_of

pytest.importorskip("obstore", reason="obstore is not installed (pip install 'jckpt[cloud]')")


def read(url):
    import obstore

    from jckpt.storage.object_store import store_for

    u = ObjectURL.parse(url)
    return bytes(obstore.get(store_for(u), u.key).bytes())


def test_a_streamed_multipart_upload_has_its_marker_until_it_is_complete(s3):
    url = f"{s3}/model.jckpt"
    seen = []

    def chunks():
        yield b"a" * (10 << 20)
        seen.append(markers_of(url))
        yield b"b" * (10 << 20)

    upload_stream(ObjectURL.parse(url), chunks(), 20 << 20)
    assert len(seen[0]) == 1 and ".jckpt-upload." in seen[0][0]
    assert markers_of(url) == [] and uploads_of(url) == []
    assert read(url) == b"a" * (10 << 20) + b"b" * (10 << 20)


def test_a_single_put_puts_no_marker(s3, monkeypatch):
    from jckpt.storage import object_uploads

    def no_marker(*args):
        raise AssertionError("a marker for a single PUT")

    monkeypatch.setattr(object_uploads, "UploadMarker", no_marker)
    upload_stream(ObjectURL.parse(f"{s3}/small.jckpt"), iter([b"x" * 100]), 100)
    assert read(f"{s3}/small.jckpt") == b"x" * 100


def test_staged_files_reclaim_a_killed_writers_upload_too(s3, tmp_path):
    """The mirror's and the manager's staged files go up through `upload`: the same reclaim."""
    url = f"{s3}/staged.jckpt"
    plant_marker(url, "dead", pid=dead_pid())
    start_upload(url)
    local = tmp_path / "staged"
    local.write_bytes(b"z" * (17 << 20))
    upload(str(local), ObjectURL.parse(url))
    assert uploads_of(url) == [] and markers_of(url) == []
    assert read(url) == b"z" * (17 << 20)
    with ObjectStaging(ObjectURL.parse(f"{s3}/spooled.jckpt")) as staging:
        import os

        os.write(staging.fd, b"y" * 10)
        staging.publish()
    assert read(f"{s3}/spooled.jckpt") == b"y" * 10


def test_a_mirror_generation_reclaims_what_a_killed_mirror_left(s3):
    url = f"{s3}/mirrored.jckpt"
    plant_marker(url, "dead", pid=dead_pid())
    start_upload(url)
    tree = {"w": np.arange(5 << 20, dtype=np.float32)}  # 20 MiB: multipart
    with jckpt.Mirror(url) as mirror:
        mirror.submit(tree)
    assert uploads_of(url) == [] and markers_of(url) == []
    assert backend_for(s3).list(s3) == ["mirrored.jckpt"]


def _abort_fails(monkeypatch, url):
    """obstore's put of `url`'s key as when the upload fails and its abort fails too: the
    upload is left in the bucket and the abort's error raised; its upload id."""
    import obstore

    put, u, started = obstore.put, ObjectURL.parse(url), []

    def failing(store, key, data, **kw):
        if key != u.key:
            return put(store, key, data, **kw)
        started.append(start_upload(url))
        with contextlib.suppress(OSError):  # the bytes are produced, until they fail
            for _ in [] if isinstance(data, Path) else data:
                pass
        raise RuntimeError(f"Generic S3 error: Error performing DELETE http://127.0.0.1:9/{u.bucket}/"
                           f"{u.key}?uploadId={started[0]} in 2ms - HTTP error: error sending request")
    monkeypatch.setattr(obstore, "put", failing)
    return started


def test_a_failed_abort_says_the_uploads_own_error_and_the_upload_left(s3, monkeypatch):
    """The abort's error was raised in place of the upload's, which was lost, and its marker
    was deleted: nothing said which upload was left, and no later writer aborted it."""
    import obstore

    url, put = f"{s3}/model.jckpt", obstore.put
    started = _abort_fails(monkeypatch, url)

    def chunks():
        yield b"a" * (10 << 20)
        raise OSError("the host array could not be read")

    with pytest.raises(jckpt.StorageError) as e:
        upload_stream(ObjectURL.parse(url), chunks(), 20 << 20)
    assert e.value.file == url and isinstance(e.value.__cause__, OSError)
    assert "the host array could not be read; aborting the incomplete upload failed too" in e.value.message
    assert f"--key model.jckpt --upload-id {started[0]}" in e.value.fix
    assert uploads_of(url) == [("model.jckpt", started[0])] and len(markers_of(url)) == 1
    monkeypatch.setattr(obstore, "put", put)
    upload_stream(ObjectURL.parse(url), iter([b"b" * (10 << 20)] * 2), 20 << 20)  # the next writer
    assert uploads_of(url) == [] and markers_of(url) == []


def test_a_failed_abort_of_a_staged_file_names_the_upload_left(s3, monkeypatch, tmp_path):
    url = f"{s3}/staged.jckpt"
    started = _abort_fails(monkeypatch, url)
    local = tmp_path / "staged"
    local.write_bytes(b"z" * (17 << 20))
    with pytest.raises(jckpt.StorageError) as e:
        upload(str(local), ObjectURL.parse(url))
    assert "aborting the incomplete upload failed too" in e.value.message
    assert started[0] in e.value.fix and "next multipart save" in e.value.fix


def test_a_failed_abort_against_a_server_that_died(monkeypatch):
    """The server dies while the bytes are produced: the producer's error, not the abort's."""
    from tests.storage.test_object_store import _own_server

    with _own_server(monkeypatch) as (server, url):
        def chunks():
            yield b"a" * (6 << 20)
            server.stop()
            raise OSError("the host array could not be read")

        with pytest.raises(jckpt.StorageError) as e:
            upload_stream(ObjectURL.parse(url), chunks(), 20 << 20)
    assert e.value.message.startswith("uploading the checkpoint failed: the host array could not be read")
    assert "aborting the incomplete upload failed too" in e.value.message
    assert "abort-multipart-upload" in e.value.fix


def test_the_abort_command_quotes_the_key_for_a_shell():
    from jckpt.storage.object_uploads import abort_failed

    u = ObjectURL.parse("s3://b/run/it's a $HOME.jckpt")
    e = abort_failed(RuntimeError("Error performing DELETE x?uploadId=U1"), u, "U1", None, placed=False)
    assert """--key 'run/it'"'"'s a $HOME.jckpt' --upload-id U1`""" in e.fix
    assert "next multipart save" not in e.fix and "replaced by that of the failed abort" in e.message
    denied = abort_failed(RuntimeError("AccessDenied: Error performing DELETE x?uploadId=U1"), u, "U1",
                          None, placed=True)
    assert denied.fix.startswith("allow s3:AbortMultipartUpload on arn:aws:s3:::b")
