"""Uploads of killed writers: found and aborted by the next writer of the key, a live one never.

Against moto's S3 server: a writer process killed with SIGKILL mid multipart
upload leaves an incomplete upload and its marker; the next save of the key
aborts the one and deletes the other, and touches nothing else.
"""

import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import jckpt
from jckpt.format.names import UPLOAD_TAG
from jckpt.storage import object_store, upload_markers
from jckpt.storage.object_lease import STALE_SECONDS
from jckpt.storage.object_store import ObjectURL, store_for
from jckpt.storage.s3_api import api_for
from jckpt.storage.upload_markers import SLACK_SECONDS, UploadMarker, owned, reclaim
from tests.s3server import client, dead_pid, markers_of, plant_marker, start_upload, uploads_of

pytest.importorskip("obstore", reason="obstore is not installed (pip install 'jckpt[cloud]')")

BIG = {"w": np.arange(6 << 20, dtype=np.float32)}  # 24 MiB: a multipart upload of 16 MiB parts
HOST = jckpt.Context(host=True)

#: A writer that is killed mid-upload: it saves 40 MiB in 5 MiB parts and stops producing after
#: 12 MiB (its parts in flight), so that the test finds it with an upload started and kills it.
WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np, obstore
    import jckpt
    from jckpt.storage import object_store

    url = sys.argv[1]
    object_store.configure(url.rsplit("/", 1)[0], part_size=5 << 20, concurrency=2)
    put = obstore.put

    def stalling_put(store, key, data, **kw):
        if not key.endswith("model.jckpt"):
            return put(store, key, data, **kw)

        def parts():
            sent = 0
            for chunk in data:
                yield chunk
                sent += memoryview(chunk).nbytes
                if sent >= 12 << 20:
                    time.sleep(3600)
        return put(store, key, parts(), **kw)

    obstore.put = stalling_put
    jckpt.save(jckpt.Context(), {f"w{i}": np.full(10 << 20, i, np.uint8) for i in range(4)}, url)
""")


def kill_mid_upload(url):
    """Run `WRITER` on `url` and SIGKILL it once its multipart upload is started."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, url], cwd=os.getcwd(),
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        deadline = time.monotonic() + 120
        while not any(key == ObjectURL.parse(url).key for key, _ in uploads_of(url)):
            assert proc.poll() is None, "the writer exited before its upload started"
            assert time.monotonic() < deadline, "the writer's upload did not start within 120 s"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)


def test_a_killed_writers_upload_is_aborted_by_the_next_save(s3, caplog):
    url = f"{s3}/run/model.jckpt"
    other = start_upload(f"{s3}/run/model.jckpt2")  # another key with the same prefix
    kill_mid_upload(url)
    assert len(markers_of(url)) == 1 and len(uploads_of(url)) == 2
    with caplog.at_level(logging.INFO, logger="jckpt"):
        jckpt.save(jckpt.Context(), BIG, url)
    assert uploads_of(url) == [("run/model.jckpt2", other)]
    assert markers_of(url) == []
    np.testing.assert_array_equal(jckpt.restore(HOST, BIG, url)["w"], BIG["w"])
    assert any("aborted 1 incomplete upload(s)" in r.getMessage() and url in r.getMessage()
               for r in caplog.records)


def test_a_live_writers_upload_is_never_aborted(s3):
    """A fresh marker of a running process: its upload (and, to be safe, all of the key) is spared,
    and the dead writer's is aborted by the first save after the live one is done."""
    url = f"{s3}/model.jckpt"
    plant_marker(url, "dead", pid=dead_pid())
    dead = start_upload(url)
    plant_marker(url, "live")  # a process that runs
    live = start_upload(url)
    jckpt.save(jckpt.Context(), BIG, url)
    assert uploads_of(url) == sorted([("model.jckpt", dead), ("model.jckpt", live)])
    u = ObjectURL.parse(url)
    client(url).abort_multipart_upload(Bucket=u.bucket, Key=u.key, UploadId=live)  # it is done
    client(url).delete_object(Bucket=u.bucket, Key=u.key + UPLOAD_TAG + "live")
    jckpt.save(jckpt.Context(), BIG, url)
    assert uploads_of(url) == [] and markers_of(url) == []


def test_a_silent_writer_elsewhere_is_gone_a_fresh_one_is_not(s3):
    url = f"{s3}/model.jckpt"
    plant_marker(url, "elsewhere", host="another-host", pid=1)
    first = start_upload(url)
    jckpt.save(jckpt.Context(), BIG, url)
    assert uploads_of(url) == [("model.jckpt", first)]
    plant_marker(url, "elsewhere", host="another-host", pid=1,
                 time=time.time() - STALE_SECONDS - 1)
    jckpt.save(jckpt.Context(), BIG, url)
    assert uploads_of(url) == [] and markers_of(url) == []


def test_a_writer_that_starts_during_the_listing_is_spared(s3):
    """A marker that appears between the listing of uploads and the second listing of markers."""
    url = f"{s3}/model.jckpt"
    u = ObjectURL.parse(url)
    plant_marker(url, "dead", pid=dead_pid())
    start_upload(url)
    api = api_for(u, store_for(u))
    listed = api.uploads

    class Racing:
        keys, abort, bucket = api.keys, api.abort, api.bucket

        def uploads(self, key):
            found = listed(key)
            plant_marker(url, "newcomer")
            start_upload(url)
            return found

    assert reclaim(Racing(), u, "none") == 0
    assert len(uploads_of(url)) == 2 and len(markers_of(url)) == 2


def test_a_manager_opening_its_prefix_aborts_a_killed_writers_step_upload(s3):
    """As it removes the staging files of killed writers: the next writer of the step may never come."""
    step = f"{s3}/run/step_00000007.jckpt"
    plant_marker(step, "dead", pid=dead_pid())
    start_upload(step)
    kept = start_upload(f"{s3}/run/notes.txt")
    with jckpt.CheckpointManager(f"{s3}/run"):
        assert uploads_of(step) == [] and markers_of(step) == []
    assert uploads_of(f"{s3}/run/notes.txt") == [("run/notes.txt", kept)]


def test_removing_a_prefix_aborts_the_uploads_killed_writers_left_in_it(s3):
    """A directory checkpoint's pieces, say: once the prefix is gone no writer of them comes."""
    piece = f"{s3}/step/process_00001.jckpt"
    plant_marker(piece, "dead", pid=dead_pid())
    start_upload(piece)
    jckpt.storage.backend_for(s3).remove(f"{s3}/step")
    assert uploads_of(piece) == [] and markers_of(piece) == []


def test_uploads_started_after_a_dead_writer_stopped_are_not_its_own():
    t = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    late = t + datetime.timedelta(seconds=SLACK_SECONDS + 1)
    uploads = [("before", t - datetime.timedelta(hours=1)), ("at", t), ("late", late)]
    assert owned(uploads, [t]) == ["before", "at"]
    assert owned(uploads, [t, late]) == ["before", "at", "late"]
    assert owned(uploads, []) == []


def test_the_marker_is_kept_fresh_and_removed_at_the_end(s3, monkeypatch):
    monkeypatch.setattr(upload_markers, "REFRESH_SECONDS", 0.05)
    url = f"{s3}/model.jckpt"
    u = ObjectURL.parse(url)
    with UploadMarker(u) as marker:
        assert marker.placed and markers_of(url) == [marker.key]
        first = json.loads(client(url).get_object(Bucket=u.bucket, Key=marker.key)["Body"].read())["time"]
        deadline = time.monotonic() + 60
        while json.loads(client(url).get_object(Bucket=u.bucket, Key=marker.key)["Body"].read())["time"] \
                == first:
            assert time.monotonic() < deadline, "the marker was not rewritten"
            time.sleep(0.05)
    assert markers_of(url) == []


def test_no_marker_where_uploads_cannot_be_listed():
    """Outside S3 (here a memory store) nothing is put: the lifecycle rule is the way there."""
    object_store.configure("s3://not-s3-store", store=__import__("obstore").store.MemoryStore())
    try:
        with UploadMarker(ObjectURL.parse("s3://not-s3-store/a.jckpt")) as marker:
            assert not marker.placed
        with UploadMarker(ObjectURL.parse("memory://markers/a.jckpt")) as marker:
            assert not marker.placed
    finally:
        object_store.configure("s3://not-s3-store")


def test_a_marker_this_process_left_is_reclaimed_by_its_next_upload(s3):
    # a store that stopped answering mid-upload: the upload, created server-side, and its marker
    # outlived the failed save; the marker named this very process, which runs, so the retry of
    # the key (a manager retries a failed step) took it for a live writer's and left both
    url = f"{s3}/run/step_00000002.jckpt"
    plant_marker(url, "stalled", pid=os.getpid())
    stalled = start_upload(url)
    with UploadMarker(ObjectURL.parse(url)):
        assert (url.removeprefix(f"{s3}/"), stalled) not in uploads_of(url)
    assert markers_of(url) == []


@pytest.mark.slow
def test_a_live_writer_past_the_first_thousand_markers_is_seen(s3):
    """1,000 dead writers' markers and a live one after them (one LIST page holds 1,000 keys):
    the live writer's upload was aborted, its marker never listed."""
    import concurrent.futures

    url = f"{s3}/model.jckpt"
    pid = dead_pid()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: plant_marker(url, f"dead{i:04d}", pid=pid), range(1000)))
    plant_marker(url, "live")  # sorts after the dead ones
    upload = start_upload(url)
    u = ObjectURL.parse(url)
    assert reclaim(api_for(u, store_for(u)), u, "") == 0
    assert uploads_of(url) == [(u.key, upload)]
    assert len(api_for(u, store_for(u)).keys(u.key + UPLOAD_TAG)) == 1001  # none deleted


def test_the_markers_listing_goes_with_the_markers_put(slow_s3):
    """A multipart upload waits for one round trip before it starts, not two: the first
    listing of the key's markers is sent with the PUT of the upload's own."""
    s3, proxy = slow_s3
    u = ObjectURL.parse(f"{s3}/model.jckpt")
    api_for(u, store_for(u))  # its client built once a process, before: no request
    proxy.reset_counts()
    with UploadMarker(u) as marker:
        assert marker.placed
        before = proxy.rounds()
        methods = sorted(m for m, _ in proxy.seen)
    assert methods == ["GET", "PUT"] and before == 1
    assert markers_of(f"{s3}/model.jckpt") == []
