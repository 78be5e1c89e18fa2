"""The S3 calls obstore lacks, through botocore configured as obstore is; without botocore, a log line."""

import logging
import sys

import numpy as np
import pytest

import jckpt
from jckpt.storage import object_store, s3_api
from jckpt.storage.object_store import ObjectURL, store_for
from jckpt.storage.s3_api import S3Settings, api_for, settings_of
from tests.s3server import dead_pid, markers_of, plant_marker, start_upload, uploads_of

pytest.importorskip("obstore", reason="obstore is not installed (pip install 'jckpt[cloud]')")


def test_settings_come_from_the_store_options_over_the_environment():
    env = {"AWS_ENDPOINT_URL": "http://env:1", "AWS_ACCESS_KEY_ID": "env-key", "AWS_SECRET_ACCESS_KEY": "env",
           "AWS_SESSION_TOKEN": "env-token", "AWS_REGION": "eu-west-1"}
    assert settings_of({}, env) == S3Settings("http://env:1", "eu-west-1", "env-key", "env", "env-token",
                                              False, False)
    given = {"endpoint": "http://given:2", "access_key_id": "k", "secret_access_key": "s",
             "region": "ap-south-1", "virtual_hosted_style_request": "true"}
    assert settings_of(given, env) == S3Settings("http://given:2", "ap-south-1", "k", "s", "env-token",
                                                 True, False)
    assert settings_of({}, {"AWS_ENDPOINT_URL_S3": "http://s3:3", "AWS_ENDPOINT_URL": "http://all:4"}) \
        == S3Settings("http://s3:3", "us-east-1", None, None, None, False, False)


def test_only_s3_stores_have_the_calls():
    for url in ("memory://api/a.jckpt", "gs://api/a.jckpt"):
        u = ObjectURL.parse(url)
        object_store.configure(f"{u.scheme}://{u.bucket}", store=__import__("obstore").store.MemoryStore())
        try:
            assert api_for(u, store_for(u)) is None
        finally:
            object_store.configure(f"{u.scheme}://{u.bucket}")


def test_the_client_uses_the_options_given_to_configure(s3, s3_server, monkeypatch):
    """The bucket's endpoint and keys set by `configure` (obstore's aliases), the environment wrong."""
    u = ObjectURL.parse(f"{s3}/model.jckpt")
    upload = start_upload(u.url)
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "http://127.0.0.1:1" if name == "AWS_ENDPOINT_URL" else "wrong")
    object_store.configure(f"s3://{u.bucket}", aws_endpoint=s3_server.endpoint, aws_access_key_id="testing",
                           aws_secret_access_key="testing", client_options={"allow_http": True})
    try:
        api = api_for(u, store_for(u))
        assert api.uploads(u.key) == [(upload, api.uploads(u.key)[0][1])]
        assert api.abort(u.key, upload) and not api.abort(u.key, upload)
        assert api.uploads(u.key) == []
    finally:
        object_store.configure(f"s3://{u.bucket}")


def test_without_botocore_a_log_line_and_the_save_goes_on(s3, monkeypatch, caplog):
    for name in ("botocore", "botocore.session", "botocore.config"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails
    monkeypatch.setattr(s3_api, "_CLIENTS", {})
    monkeypatch.setattr(s3_api, "_WARNED", [])
    url = f"{s3}/model.jckpt"
    plant_marker(url, "dead", pid=dead_pid())
    left = start_upload(url)
    tree = {"w": np.arange(6 << 20, dtype=np.float32)}  # multipart
    with caplog.at_level(logging.WARNING, logger="jckpt"):
        jckpt.save(jckpt.Context(), tree, url)
        jckpt.save(jckpt.Context(), tree, url)
    said = [r.getMessage() for r in caplog.records if "botocore is not installed" in r.getMessage()]
    assert len(said) == 1 and "lifecycle rule" in said[0]
    np.testing.assert_array_equal(jckpt.restore(jckpt.Context(host=True), tree, url)["w"], tree["w"])
    assert uploads_of(url) == [("model.jckpt", left)]  # nothing found, nothing aborted
    assert markers_of(url) == [ObjectURL.parse(url).key + ".jckpt-upload.dead"]  # its own is gone


def test_botocore_is_bounded_as_the_store_is():
    """configure's timeouts and retries bounded obstore's calls only: botocore's listing of
    uploads kept its own 30 s and 3 attempts (a stalled server held a save for 2 minutes)."""
    pytest.importorskip("botocore")
    from datetime import timedelta

    from obstore.store import S3Store

    from jckpt.storage.object_store import ObjectURL
    store = S3Store("bounded", endpoint="http://127.0.0.1:9", skip_signature=True,
                    client_options={"timeout": "2s", "connect_timeout": "500ms"},
                    retry_config={"max_retries": 1, "retry_timeout": timedelta(seconds=5)})
    api = api_for(ObjectURL.parse("s3://bounded/x"), store)
    config = api.client.meta.config
    assert (config.connect_timeout, config.read_timeout) == (0.5, 2.0)
    assert config.retries["total_max_attempts"] == 2  # one retry
    plain = api_for(ObjectURL.parse("s3://bounded/x"), S3Store("bounded", endpoint="http://127.0.0.1:9",
                                                                skip_signature=True))
    assert (plain.client.meta.config.read_timeout,
            plain.client.meta.config.retries["total_max_attempts"]) == (30.0, 4)


class PagingClient:
    """botocore's two listings as a store that pages them answers: `page` entries a request."""

    def __init__(self, keys, uploads, page):
        self.listed_keys, self.listed_uploads, self.page, self.calls = keys, uploads, page, []

    def list_objects_v2(self, Bucket, Prefix, MaxKeys, ContinuationToken="0"):
        self.calls.append("LIST")
        keys = [k for k in self.listed_keys if k.startswith(Prefix)]
        start = int(ContinuationToken)
        more = start + self.page < len(keys)
        return {"Contents": [{"Key": k, "LastModified": start} for k in keys[start:start + self.page]],
                "IsTruncated": more, **({"NextContinuationToken": str(start + self.page)} if more else {})}

    def list_multipart_uploads(self, Bucket, Prefix, MaxUploads, KeyMarker="", UploadIdMarker=""):
        self.calls.append("UPLOADS")
        listed = sorted(u for u in self.listed_uploads if u[0].startswith(Prefix))
        after = [u for u in listed if u > (KeyMarker, UploadIdMarker)] if KeyMarker else listed
        page, more = after[:self.page], len(after) > self.page
        return {"Uploads": [{"Key": k, "UploadId": i, "Initiated": 0} for k, i in page],
                "IsTruncated": more, "NextKeyMarker": page[-1][0] if page else "",
                "NextUploadIdMarker": page[-1][1] if page else ""}


def test_both_listings_page_through_everything(monkeypatch):
    """They read the first page only (1,000): a key with more incomplete uploads kept the rest,
    and a live writer's marker past the first page went unseen."""
    monkeypatch.setattr(s3_api, "PAGE", 3)
    uploads = [("m.jckpt", f"u{i}") for i in range(7)] + [("m.jckpt2", "other"), ("a.jckpt", "x")]
    fake = PagingClient([f"m.jckpt.jckpt-upload.{i}" for i in range(8)] + ["n"], uploads, 3)
    api = s3_api.S3Api(fake, "b")
    assert [i for i, _ in api.uploads("m.jckpt")] == [f"u{i}" for i in range(7)]
    assert fake.calls == ["UPLOADS"] * 3  # the third page is past the key: no fourth asked for
    markers = [f"m.jckpt.jckpt-upload.{i}" for i in range(8)]
    assert [k for k, _ in api.keys("m.jckpt.jckpt-upload.")] == markers


def test_the_key_listing_pages_through_the_server(s3, monkeypatch):
    """Against the server's own paging (a page of 2 here; S3's is 1,000)."""
    monkeypatch.setattr(s3_api, "PAGE", 2)
    url = f"{s3}/model.jckpt"
    for token in "abcde":
        plant_marker(url, token)
    u = ObjectURL.parse(url)
    assert [k.rsplit(".", 1)[1] for k, _ in api_for(u, store_for(u)).keys(u.key + ".jckpt-upload.")] \
        == list("abcde")
