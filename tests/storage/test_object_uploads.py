"""Uploads to an object store: one PUT, or a multipart upload with its marker while it runs."""

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
