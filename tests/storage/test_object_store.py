"""Checkpoints in object stores, against a real S3 API server (moto's) and obstore's memory store.

What a user does: save to ``s3://bucket/...`` and read it back with every
reader, partially, after faults; what they must never see: a partial
object, another checkpoint's bytes, an error without the URL and a fix.
"""

import contextlib
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import jckpt
from jckpt.storage import backend_for, object_store
from jckpt.storage.object_backend import OBJECT_STORE
from jckpt.storage.object_store import ObjectURL
from tests.helpers import cpu_mesh

pytest.importorskip("obstore", reason="obstore is not installed (pip install 'jckpt[cloud]')")

TREE = {"w": np.arange(300_000, dtype=np.float32).reshape(600, 500), "b": np.arange(7, dtype=np.int32),
        "nested": {"s": np.float32(2.5), "m": np.ones((3, 4), np.float64)}}
HOST = jckpt.Context(host=True)


def assert_tree_equal(a, b):
    for x, y in zip(jax_leaves(a), jax_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def jax_leaves(tree):
    import jax
    return jax.tree_util.tree_leaves(tree)


class ByteCount:
    """Counts the bytes and requests the object store backend reads (header and payload GETs)."""

    def __init__(self, monkeypatch):
        self.bytes = self.requests = 0
        head, read_into = object_store.ObjectSource.head, object_store.ObjectSource.read_into
        lock = threading.Lock()

        def counted_head(src, length):
            data, size, version = head(src, length)
            with lock:
                self.bytes += len(data)
                self.requests += 1
            return data, size, version

        def counted_read(src, dest, offset, version):
            read_into(src, dest, offset, version)
            with lock:
                self.bytes += len(dest)
                self.requests += 1

        monkeypatch.setattr(object_store.ObjectSource, "head", counted_head)
        monkeypatch.setattr(object_store.ObjectSource, "read_into", counted_read)


# --- round trips against the server -------------------------------------------------------------

def test_save_load_restore_describe_verify(s3):
    url = f"{s3}/run/model.jckpt"
    jckpt.save(jckpt.Context(), TREE, url)
    _, loaded = jckpt.load(HOST, url)
    assert_tree_equal(loaded["jckpt"], TREE)
    assert_tree_equal(jckpt.restore(HOST, TREE, url), TREE)
    assert [e.name for e in jckpt.describe(url).tensors] == ["jckpt/b", "jckpt/nested/m",
                                                               "jckpt/nested/s", "jckpt/w"]
    report = jckpt.verify(url)
    assert report.ok and report.checked == 4
    assert "4 entries" in str(jckpt.info(url))


def test_restore_to_devices_and_a_replaced_checkpoint(s3):
    """A second save replaces the object whole; restore onto JAX arrays reads the new one."""
    url = f"{s3}/model.jckpt"
    jckpt.save(jckpt.Context(), TREE, url)
    newer = {**TREE, "w": TREE["w"] + 1}
    jckpt.save(jckpt.Context(), newer, url)
    restored = jckpt.restore(jckpt.Context(), newer, url)
    np.testing.assert_array_equal(np.asarray(restored["w"]), newer["w"])


def test_restoring_one_small_leaf_reads_only_its_bytes(s3, monkeypatch):
    url = f"{s3}/big.jckpt"
    big = {f"w{i}": np.full(1 << 20, i, np.float32) for i in range(4)}  # 16 MiB
    jckpt.save(jckpt.Context(), {**big, "small": np.arange(64, dtype=np.float32)}, url)
    count = ByteCount(monkeypatch)
    out = jckpt.restore(HOST, {"small": np.zeros(64, np.float32)}, url)
    np.testing.assert_array_equal(out["small"], np.arange(64))
    assert count.bytes < 0.01 * 16 * (1 << 20), count.bytes
    assert count.requests == 1  # the header's GET brings the small leaf stored right after it


def test_each_device_reads_only_its_shard(s3, monkeypatch):
    """Restored onto 8 devices without verification, the object is read once in all, not 8 times."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    url = f"{s3}/sharded.jckpt"
    w = np.arange(2048 * 256, dtype=np.float32).reshape(2048, 256)  # 2 MiB
    mesh = cpu_mesh((8,), ("x",))
    rows = NamedSharding(mesh, PartitionSpec("x"))
    jckpt.save(jckpt.Context(), {"w": jax.device_put(w, rows)}, url)  # shards written in place, then uploaded
    target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=rows)}
    count = ByteCount(monkeypatch)
    out = jckpt.restore(jckpt.Context(), target, url, verify=False)
    np.testing.assert_array_equal(np.asarray(out["w"]), w)
    assert w.nbytes <= count.bytes < w.nbytes + (300 << 10)
    assert count.requests >= 9  # the header, then each device's rows


def test_many_small_leaves_are_read_together(s3, monkeypatch):
    url = f"{s3}/small.jckpt"
    tree = {f"p{i:03d}": np.full(100, i, np.float32) for i in range(200)}
    jckpt.save(jckpt.Context(), tree, url)
    count = ByteCount(monkeypatch)
    _, loaded = jckpt.load(HOST, url)
    assert_tree_equal(loaded["jckpt"], tree)
    assert count.requests <= 3


def test_tools_convert_merge_and_the_command_line(s3, tmp_path, capsys):
    from jckpt.tools import rewrite
    from jckpt.tools.cli import main

    url = f"{s3}/a.jckpt"
    jckpt.save(jckpt.Context(), TREE, url)
    jckpt.convert(url, f"{s3}/a.safetensors")
    assert jckpt.detect_format(f"{s3}/a.safetensors") == "safetensors"
    jckpt.convert(f"{s3}/a.safetensors", str(tmp_path / "back.jckpt"))
    jckpt.convert(str(tmp_path / "back.jckpt"), f"{s3}/a.npz")
    jckpt.convert(f"{s3}/a.npz", f"{s3}/b.jckpt")
    rewrite.merge(f"{s3}/merged.jckpt", [url, f"{s3}/b.jckpt"], prefixes=["x", "y"])
    names = {e.name for e in jckpt.describe(f"{s3}/merged.jckpt").tensors}
    assert "x__jckpt/w" in names and "y__jckpt/w" in names
    capsys.readouterr()
    assert main(["inspect", url]) == 0
    assert main(["verify", f"{s3}/merged.jckpt"]) == 0
    out = capsys.readouterr().out
    assert url in out and "OK" in out


def test_the_command_line_reads_its_credentials_from_the_environment(s3, s3_server, tmp_path):
    """`jckpt` as a command: the endpoint and the keys come from the AWS_* variables."""
    import os
    import subprocess
    import sys

    from tests.s3server import CREDENTIALS

    url = f"{s3}/cli.jckpt"
    jckpt.save(jckpt.Context(), TREE, url)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": s3_server.endpoint, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for args, expect in ((["inspect", url], "4 entries"), (["verify", url], "OK"),
                         (["convert", url, str(tmp_path / "x.safetensors")], "")):
        done = subprocess.run([sys.executable, "-m", "jckpt", *args], capture_output=True, text=True,
                              timeout=120, env=env)
        assert done.returncode == 0 and expect in done.stdout, (args, done.stdout, done.stderr)
    assert (tmp_path / "x.safetensors").exists()


# --- what a user gets wrong, and faults ------------------------------------------------------------

def test_a_missing_object_and_a_missing_bucket(s3):
    with pytest.raises(jckpt.FormatError, match="no such checkpoint") as e:
        jckpt.load(HOST, f"{s3}/nothing.jckpt")
    assert e.value.file == f"{s3}/nothing.jckpt"
    gone = "s3://no-such-bucket-here/x.jckpt"
    with pytest.raises(jckpt.StorageError, match="the bucket 'no-such-bucket-here' does not exist") as e:
        jckpt.save(jckpt.Context(), TREE, gone)
    assert e.value.file == gone and "create the bucket" in e.value.fix
    with pytest.raises(jckpt.StorageError, match="the bucket 'no-such-bucket-here' does not exist"):
        jckpt.load(HOST, gone)


def test_a_truncated_object_and_a_damaged_one(s3):
    import obstore

    url = f"{s3}/t.jckpt"
    jckpt.save(jckpt.Context(), TREE, url)
    u = ObjectURL.parse(url)
    store = object_store.store_for(u)
    whole = bytes(obstore.get(store, u.key).bytes())
    obstore.put(store, u.key, whole[:len(whole) // 2])
    with pytest.raises(jckpt.FormatError, match="past the end") as e:
        jckpt.load(HOST, url)
    assert e.value.file == url
    damaged = bytearray(whole)
    damaged[-100] ^= 0xFF
    obstore.put(store, u.key, bytes(damaged))
    with pytest.raises(jckpt.ChecksumError, match="checksum mismatch") as e:
        jckpt.load(HOST, url)  # verified by default: an object is never mapped
    assert e.value.file == url and e.value.entry == "jckpt/w"
    assert not jckpt.verify(url).ok


def test_denied_credentials():
    """A server that checks signatures refuses unknown keys: access denied, and what to set."""
    pytest.importorskip("moto.server")
    from tests.s3server import S3Server

    server = S3Server.start(env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        object_store.configure("s3://guarded", endpoint=server.endpoint, access_key_id="nobody",
                               secret_access_key="wrong", region="us-east-1")
        with pytest.raises(jckpt.StorageError, match="access denied") as e:
            jckpt.save(jckpt.Context(), TREE, "s3://guarded/x.jckpt")
        assert e.value.file == "s3://guarded/x.jckpt" and "AWS_ACCESS_KEY_ID" in e.value.fix
        with pytest.raises(jckpt.StorageError, match="access denied"):
            jckpt.load(HOST, "s3://guarded/x.jckpt")
    finally:
        object_store.configure("s3://guarded")
        server.stop()


def test_a_denied_request_names_the_iam_actions_it_needs():
    """Known credentials that a policy does not allow to write: the fix said only to check the
    credentials, as for unknown keys, not which permission was missing."""
    import json

    import boto3

    from tests.s3server import S3Server

    server = S3Server.start(env={"INITIAL_NO_AUTH_ACTION_COUNT": "4"})  # then policies apply
    try:
        def client(service):
            return boto3.client(service, endpoint_url=server.endpoint, aws_access_key_id="testing",
                                aws_secret_access_key="testing", region_name="us-east-1")
        iam = client("iam")
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}]}))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        client("s3").create_bucket(Bucket="readonly")
        object_store.configure("s3://readonly", endpoint=server.endpoint, region="us-east-1",
                               access_key_id=key["AccessKeyId"], secret_access_key=key["SecretAccessKey"])
        with pytest.raises(jckpt.StorageError, match="access denied") as e:
            jckpt.save(jckpt.Context(), TREE, "s3://readonly/x.jckpt")
        assert e.value.fix.startswith("allow s3:PutObject ") and "arn:aws:s3:::readonly/*" in e.value.fix
        assert "s3:AbortMultipartUpload" in e.value.fix and "AWS_ACCESS_KEY_ID" in e.value.fix
    finally:
        object_store.configure("s3://readonly")
        server.stop()


@pytest.mark.parametrize("action, needed", [
    ("reading the checkpoint", "s3:GetObject"), ("listing", "s3:ListBucket"),
    ("deleting run/a.jckpt", "s3:DeleteObject"), ("taking the writer lease (x)", "s3:PutObject")])
def test_each_denied_request_names_its_own_actions(action, needed):
    e = object_store.store_error(RuntimeError("AccessDenied: Access Denied"), action, "s3://b/run")
    assert e.fix.startswith(f"allow {needed}") and "arn:aws:s3:::b" in e.fix
    from obstore.exceptions import PermissionDeniedError

    gs = object_store.store_error(PermissionDeniedError("denied"), action, "gs://b/run")
    assert gs.fix.startswith("grant roles/storage.objectViewer") and "credentials" in gs.fix


@contextlib.contextmanager
def _own_server(monkeypatch):
    """A server of the test's own (it is stopped mid-test), its bucket set to small parts and
    one quick retry; yields `(server, url of an object in it)`."""
    from datetime import timedelta

    from tests.s3server import CREDENTIALS, S3Server

    server = S3Server.start()
    bucket = server.bucket()
    try:
        for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": server.endpoint}.items():
            monkeypatch.setenv(name, value)
        object_store.configure(f"s3://{bucket}", part_size=5 << 20, concurrency=2,
                               retry_config={"max_retries": 1, "retry_timeout": timedelta(seconds=2)})
        yield server, f"s3://{bucket}/model.jckpt"
    finally:
        object_store.configure(f"s3://{bucket}")
        server.stop()


def test_server_killed_mid_upload_leaves_nothing_half_written(monkeypatch):
    """The server dies while a large save uploads: a StorageError naming the URL; no partial object."""
    with _own_server(monkeypatch) as (server, url):
        jckpt.save(jckpt.Context(), TREE, url)
        big = {"w": np.ones(40 << 20, np.uint8)}
        killer = threading.Thread(target=lambda: (time.sleep(0.3), server.stop()))
        killer.start()
        with pytest.raises(jckpt.StorageError) as e:
            jckpt.save(jckpt.Context(), big, url)
        killer.join()
        assert e.value.file == url and e.value.fix
        with pytest.raises(jckpt.StorageError) as e:  # and reading from a server that is gone
            jckpt.load(HOST, url)
        assert e.value.file == url and "endpoint" in e.value.fix


def test_server_killed_mid_read(monkeypatch):
    """The server dies while a restore reads: a StorageError naming the URL and what to check."""
    with _own_server(monkeypatch) as (server, url):
        big = {f"w{i}": np.full(6 << 20, i, np.uint8) for i in range(4)}
        jckpt.save(jckpt.Context(), big, url)
        reader = jckpt.storage.open_checkpoint(url)
        first = reader.header.tensors[0]
        reader.decode(first, verify=True)  # reads while the server is up
        server.stop()
        with pytest.raises(jckpt.StorageError) as e:
            for entry in reader.header.tensors[1:]:
                reader.decode(entry, verify=True)
        assert e.value.file == url and "endpoint" in e.value.fix


def test_a_failed_upload_keeps_the_previous_checkpoint(s3, monkeypatch):
    """An upload that fails (here: after its parts were sent) is aborted; the old object stays."""
    import obstore

    url = f"{s3}/model.jckpt"
    jckpt.save(jckpt.Context(), TREE, url)
    put = obstore.put

    def failing_put(store, key, file, **kw):
        if key != "model.jckpt":  # the upload's marker
            return put(store, key, file, **kw)

        def parts():  # the connection drops once 6 MiB are sent
            sent = 0
            for chunk in [file.read_bytes()] if isinstance(file, Path) else file:
                yield chunk
                sent += memoryview(chunk).nbytes
                if sent > 6 << 20:
                    raise OSError("connection reset by peer")
        return put(store, key, parts(), **{k: v for k, v in kw.items() if k != "use_multipart"})

    monkeypatch.setattr(obstore, "put", failing_put)
    with pytest.raises(jckpt.StorageError, match="uploading the checkpoint failed") as e:
        jckpt.save(jckpt.Context(), {"w": np.zeros(4 << 20, np.float32)}, url)
    assert e.value.file == url
    monkeypatch.setattr(obstore, "put", put)
    assert_tree_equal(jckpt.restore(HOST, TREE, url), TREE)
    assert backend_for(s3).list(s3) == ["model.jckpt"]


def test_saves_stream_without_a_spool_file(s3, monkeypatch):
    """Host arrays and device shards are hashed first and streamed into the upload: no local file."""
    import tempfile

    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    def no_spool(*args, **kwargs):
        raise AssertionError("a spool file was created")

    monkeypatch.setattr(tempfile, "mkstemp", no_spool)
    url = f"{s3}/streamed.jckpt"
    big = {"w": np.arange(6 << 20, dtype=np.float32), "b": np.arange(5, dtype=np.int8)}  # 24 MiB: multipart
    jckpt.save(jckpt.Context(), big, url)
    jckpt.save(jckpt.Context(), TREE, f"{s3}/small.jckpt")  # one PUT
    assert_tree_equal(jckpt.restore(HOST, big, url), big)
    assert jckpt.verify(url).ok and jckpt.verify(f"{s3}/small.jckpt").ok
    w = np.arange(4096 * 1024, dtype=np.float32).reshape(4096, 1024)  # 16 MiB in 8 shards
    sharded = jax.device_put(w, NamedSharding(cpu_mesh((4, 2), ("a", "b")), PartitionSpec("a", "b")))
    jckpt.save(jckpt.Context(), {"w": sharded}, f"{s3}/sharded.jckpt")
    np.testing.assert_array_equal(jckpt.restore(HOST, {"w": w}, f"{s3}/sharded.jckpt")["w"], w)


# --- configuration, without a server -----------------------------------------------------------------

def test_memory_urls_make_fast_round_trips():
    url = "memory://unit/model.jckpt"
    jckpt.save(jckpt.Context(), TREE, url)
    assert_tree_equal(jckpt.restore(HOST, TREE, url), TREE)


def test_gs_urls_through_a_configured_store():
    """gs:// has no local server here: its URLs go through obstore's memory store, configured for it."""
    from obstore.store import MemoryStore

    object_store.configure("gs://ckpts", store=MemoryStore())
    try:
        url = "gs://ckpts/run/model.jckpt"
        jckpt.save(jckpt.Context(), TREE, url)
        assert_tree_equal(jckpt.restore(HOST, TREE, url), TREE)
        assert backend_for("gs://ckpts/run").list("gs://ckpts/run") == ["model.jckpt"]
    finally:
        object_store.configure("gs://ckpts")


def test_unknown_options_and_schemes_are_input_errors():
    with pytest.raises(jckpt.InputError, match="no_such_option") as e:  # refused when given
        object_store.configure("s3://typo", no_such_option=1)
    assert e.value.file == "s3://typo"
    with pytest.raises(jckpt.InputError, match="no storage backend for URL scheme 'ftp'"):
        object_store.configure("ftp", endpoint="x")
    with pytest.raises(jckpt.InputError, match="part_size must be an integer of at least 5242880"):
        object_store.configure("s3", part_size=1 << 20)
    with pytest.raises(jckpt.InputError, match="concurrency must be a positive integer"):
        object_store.configure("s3", concurrency=0)
    with pytest.raises(jckpt.InputError, match="names no bucket"):
        jckpt.save(jckpt.Context(), TREE, "s3:///x.jckpt")


@pytest.mark.parametrize("url", ["memory://bkt", "memory://bkt/", "memory://bkt//"])
def test_a_url_must_name_a_checkpoint_inside_its_bucket(url, tmp_path):
    """A bucket's root would be the key '' (S3 refuses it, memory:// takes it) and its lease
    would land in another bucket: every entry point refuses it before anything is written."""
    for call in (lambda: jckpt.save(jckpt.Context(), TREE, url), lambda: jckpt.Mirror(url),
                 lambda: jckpt.CheckpointManager(url), lambda: jckpt.convert(url, tmp_path / "x.npz")):
        with pytest.raises(jckpt.InputError, match="names a bucket, not a checkpoint inside it") as e:
            call()
        assert e.value.fix.startswith("add a path: memory://bkt/")


@pytest.mark.parametrize("secret", ["hunter2", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"])
def test_credentials_in_a_url_are_refused_and_not_repeated(secret):
    """A secret may hold '/', which splits it between the bucket and the key."""
    for call in (lambda: jckpt.save(jckpt.Context(), TREE, f"s3://AKIA:{secret}@bkt/run/x.jckpt"),
                 lambda: jckpt.save(jckpt.Context(), TREE, f"memory://AKIA:{secret}@bkt/x.jckpt"),
                 lambda: object_store.configure(f"s3://AKIA:{secret}@bkt", region="x")):
        with pytest.raises(jckpt.InputError, match="must not carry credentials") as e:
            call()
        for part in ["AKIA", *secret.split("/")]:
            assert part not in str(e.value)
        assert "bkt" in e.value.file and "configure" in e.value.fix


def test_an_endpoint_in_a_url_is_refused():
    with pytest.raises(jckpt.InputError, match="bucket's name cannot hold ':'") as e:
        jckpt.save(jckpt.Context(), TREE, "s3://localhost:9000/bkt/x.jckpt")
    assert "AWS_ENDPOINT_URL" in e.value.fix


def test_an_at_sign_in_a_key_is_a_key():
    u = ObjectURL.parse("s3://bkt/users/a@b.com/x.jckpt")
    assert (u.bucket, u.key) == ("bkt", "users/a@b.com/x.jckpt")


@pytest.mark.parametrize("url", ["memory://dots/a/../b.jckpt", "memory://dots/./b.jckpt", "s3://dots/.."])
def test_dot_segments_in_a_url_are_refused(url):
    """A store keeps `a/../b` as three literal segments (or refuses it late); no entry point takes it."""
    with pytest.raises(jckpt.InputError, match="cannot hold '.' or '..' segments"):
        jckpt.save(jckpt.Context(), TREE, url)
    assert not OBJECT_STORE.list("memory://dots/")


def test_gcs_credentials_come_from_the_environment_or_configure(monkeypatch):
    """No GCS server here: what is checked is that the credentials reach the store, and their errors."""
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/key.json")
    object_store.forget_stores()
    with pytest.raises(jckpt.StorageError, match="credentials could not be loaded") as e:
        jckpt.load(HOST, "gs://env-bucket/x.jckpt")
    assert e.value.file == "gs://env-bucket/x.jckpt" and "GOOGLE_APPLICATION_CREDENTIALS" in e.value.fix
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS")
    object_store.configure("gs://opts-bucket", service_account_path="/nonexistent/other.json")
    try:
        with pytest.raises(jckpt.StorageError, match="other.json"):
            jckpt.save(jckpt.Context(), TREE, "gs://opts-bucket/x.jckpt")
        with pytest.raises(jckpt.InputError, match="bogus_option"):
            object_store.configure("gs://opts-bucket", bogus_option=1)
    finally:
        object_store.configure("gs://opts-bucket")
        object_store.forget_stores()


def test_appending_to_an_object_keeps_its_entries(s3):
    """An appending save to a URL writes a new object with the kept payloads copied by range."""
    url = f"{s3}/appended.jckpt"
    jckpt.save(jckpt.Context(namespace="model"), TREE, url, appending=True)  # nothing there yet
    jckpt.save(jckpt.Context(namespace="opt"), {"mu": np.ones(3)}, url, appending=True)
    _, tree = jckpt.load(HOST, url)
    assert_tree_equal(tree["model"], TREE)
    np.testing.assert_array_equal(tree["opt"]["mu"], np.ones(3))
    assert jckpt.verify(url).ok


def test_urls_parse_into_bucket_and_key():
    u = ObjectURL.parse("S3://bucket//run//x.jckpt")
    assert (u.kind, u.bucket, u.key) == ("s3", "bucket", "run/x.jckpt")
    assert ObjectURL.parse("s3:/bucket/x").key == "x"  # what pathlib makes of s3://bucket/x
    assert ObjectURL.parse("gs://b").prefix == ""
    assert ObjectURL.parse("az://c/d/").child("e").url == "az://c/d/e"


# --- the mirror and the manager in a bucket -------------------------------------------------------

def test_requests_of_a_file_are_those_the_docs_count(s3, s3_server):
    """docs/object-storage.md, "Requests per operation": a save, a read, a long header, a
    URL with no object, a multipart save and its upload marker."""
    def sent(call):
        before = len(s3_server.requests(s3))
        call()
        return [r.partition("?uploadId=")[0].partition("&uploadId=")[0]
                for r in s3_server.requests(s3)[before:]]

    url = f"{s3}/small.jckpt"
    assert sent(lambda: jckpt.save(jckpt.Context(), {"b": TREE["b"]}, url)) == [
        "HEAD /small.jckpt/index.jckpt", "PUT /small.jckpt"]
    for read in (lambda: jckpt.load(HOST, url), lambda: jckpt.describe(url),
                 lambda: jckpt.restore(HOST, {"b": TREE["b"]}, url)):
        assert sent(read) == ["GET /small.jckpt"]
    long = f"{s3}/long.jckpt"  # a header past the first 64 KiB GET
    jckpt.save(jckpt.Context(), {f"k{i}": np.float32(i) for i in range(1200)}, long)
    assert sent(lambda: jckpt.describe(long)) == ["GET /long.jckpt"] * 2
    jckpt.save(jckpt.Context(), {f"k{i}": np.float32(i) for i in range(1201)}, f"{s3}/long2.jckpt")
    assert sent(lambda: jckpt.describe(f"{s3}/long2.jckpt")) == ["GET /long2.jckpt"]  # as long as before
    with pytest.raises(jckpt.FormatError, match="no such checkpoint object"):
        sent(lambda: jckpt.load(HOST, f"{s3}/none.jckpt"))
    assert s3_server.requests(s3)[-2:] == ["GET /none.jckpt", "GET ?list-type=2&prefix=none.jckpt/"]
    object_store.configure(s3, part_size=5 << 20)
    big = f"{s3}/big.jckpt"
    try:
        got = sent(lambda: jckpt.save(jckpt.Context(), {"w": np.ones(6 << 20 >> 2, np.float32)}, big))
    finally:
        object_store.configure(s3)
    marker = next(r for r in got if r.startswith("PUT ") and ".jckpt-upload." in r)  # not the LIST
    assert got[0] == "HEAD /big.jckpt/index.jckpt" and got[3] == "POST /big.jckpt?uploads="
    assert sorted(got[1:3]) == sorted([marker, "GET ?list-type=2&prefix=big.jckpt.jckpt-upload."
                                               "&max-keys=1000&encoding-type=url"])  # at once
    assert sorted(got[4:6]) == ["PUT /big.jckpt?partNumber=1", "PUT /big.jckpt?partNumber=2"]
    assert got[6:] == ["POST /big.jckpt", "POST ?delete"]  # complete; the marker deleted


@pytest.mark.parametrize("how", ["saved", "truncated"])
@pytest.mark.parametrize("read", ["load", "restore", "restore_unverified", "append"])
def test_an_object_replaced_while_it_is_read_is_an_error_not_a_mix(s3, monkeypatch, read, how):
    """Every GET after the header's is conditional on the version the header was read with;
    the error names the entry being read (it named the object alone)."""
    import obstore

    url = f"{s3}/model.jckpt"
    jckpt.save(jckpt.Context(), TREE, url)
    read_into = object_store.ObjectSource.read_into

    def replaced_first(src, dest, offset, version):
        monkeypatch.setattr(object_store.ObjectSource, "read_into", read_into)
        if how == "saved":  # between header and payload
            jckpt.save(jckpt.Context(), {**TREE, "w": TREE["w"] + 1}, url)
        else:  # cut short by another tool: the same bytes, fewer of them
            whole = bytes(obstore.get(src.store, src.u.key).bytes())
            obstore.put(src.store, src.u.key, whole[:offset + 8])
        read_into(src, dest, offset, version)

    monkeypatch.setattr(object_store.ObjectSource, "read_into", replaced_first)
    calls = {"load": lambda: jckpt.load(HOST, url),
             "restore": lambda: jckpt.restore(HOST, TREE, url),
             "restore_unverified": lambda: jckpt.restore(HOST, TREE, url, verify=False),
             "append": lambda: jckpt.save(jckpt.Context(namespace="o"), {"x": np.float32(1)}, url,
                                          appending=True)}
    with pytest.raises(jckpt.StorageError, match="the object changed while it was read") as info:
        calls[read]()
    assert info.value.file == url and info.value.entry.startswith("jckpt/")


def test_an_appending_save_asks_for_the_object_by_its_header_get_alone(s3, s3_server):
    """The header's GET says whether an object is there to append to: no HEAD of it first
    (docs/object-storage.md, "Requests per operation")."""
    url = f"{s3}/appended.jckpt"
    small = {"b": np.arange(7, dtype=np.int32)}
    before = len(s3_server.requests(s3))
    jckpt.save(jckpt.Context(), small, url, appending=True)  # nothing there yet
    assert s3_server.requests(s3)[before:] == [
        "HEAD /appended.jckpt/index.jckpt", "GET /appended.jckpt", "PUT /appended.jckpt"]
    before = len(s3_server.requests(s3))
    jckpt.save(jckpt.Context(namespace="opt"), {"mu": np.ones(3)}, url, appending=True)
    assert s3_server.requests(s3)[before:] == [
        "HEAD /appended.jckpt/index.jckpt", "GET /appended.jckpt", "PUT /appended.jckpt"]
    _, tree = jckpt.load(HOST, url)
    np.testing.assert_array_equal(tree["jckpt"]["b"], small["b"])
    np.testing.assert_array_equal(tree["opt"]["mu"], np.ones(3))


def test_mirror_publishes_whole_generations_and_holds_the_lease(s3):
    url = f"{s3}/run/mirror.jckpt"
    with jckpt.Mirror(url) as mirror:
        with pytest.raises(jckpt.InUseError, match="in use"):
            jckpt.Mirror(url)
        for step in range(3):
            mirror.submit({**TREE, "w": TREE["w"] + step})
        mirror.wait_durable()
        np.testing.assert_array_equal(jckpt.restore(HOST, TREE, url)["w"], TREE["w"] + 2)
    assert backend_for(s3).list(f"{s3}/run") == ["mirror.jckpt"]  # the lease is gone, nothing staged
    with jckpt.Mirror(url) as mirror:  # the same lineage continues
        assert mirror.counters.generation == 3


def test_manager_keeps_steps_in_a_prefix(s3):
    run = f"{s3}/run"
    with jckpt.CheckpointManager(run, keep_last=2, asynchronous=False) as mgr:
        for step in range(5):
            mgr.save(step, {**TREE, "w": TREE["w"] + step}, metrics={"loss": 5 - step})
    assert backend_for(run).list(run) == ["step_00000003.jckpt", "step_00000004.jckpt"]
    with jckpt.CheckpointManager(run, keep_last=2) as mgr:
        assert mgr.all_steps() == [3, 4]
        restored = mgr.restore(target=TREE)
        assert restored.step == 4 and restored.metrics == {"loss": 1.0}
        np.testing.assert_array_equal(restored.tree["w"], TREE["w"] + 4)
    assert "2 steps" in str(jckpt.info(run)) and jckpt.verify(run).ok


def test_manager_directory_steps_in_a_prefix(s3):
    """Directory steps (what several processes write) in a bucket: pieces first, the index last."""
    import jax
    import jax.numpy as jnp

    mesh = cpu_mesh((8,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    run = f"{s3}/mp"
    with jckpt.CheckpointManager(run, directory_steps=True, keep_last=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": jax.device_put(jnp.full((8, 2), float(step)), sharding)},
                     metrics={"loss": 1.0 / step})
        assert mgr.all_steps() == [2, 3]
        target = {"w": jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=sharding)}
        r = mgr.restore(target=target)
        assert r.step == 3 and r.tree["w"].sharding == sharding
        np.testing.assert_array_equal(r.tree["w"], np.full((8, 2), 3.0))
    backend = backend_for(run)
    index, piece = backend.list(f"{run}/step_00000003.jckpt")  # the piece carries its save's tag
    assert index == "index.jckpt" and re.fullmatch(r"process_00000\.s[0-9a-f]{24}\.jckpt", piece)
    # a save that died after its pieces, before its index: removed by the next manager
    from jckpt.api.multiprocess import save_directory
    save_directory(jckpt.Context(), {"w": np.zeros(2)}, f"{run}/step_00000009.jckpt")
    backend.remove(f"{run}/step_00000009.jckpt/index.jckpt")
    with jckpt.CheckpointManager(run, directory_steps=True) as mgr:
        assert mgr.all_steps() == [2, 3]
    assert backend.list(run) == ["step_00000002.jckpt", "step_00000003.jckpt"]


def test_manager_steps_in_a_foreign_format_in_a_prefix(s3):
    """The model as safetensors and the rest as optimizer.jckpt, uploaded with trainer_state.json last."""
    pytest.importorskip("safetensors")
    run = f"{s3}/st"
    tree = {"model": {"w": np.arange(6, dtype=np.float32)}, "opt": {"mu": np.zeros(6, np.float32)}}
    options = jckpt.CheckpointOptions(format="safetensors", model_namespace="model")
    with jckpt.CheckpointManager(run, keep_last=2, options=options) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, items={"model": {"w": tree["model"]["w"] + step}, "opt": tree["opt"]},
                     metrics={"loss": 1.0 / step})
    backend = backend_for(run)
    assert backend.list(run) == ["step_00000002.jckpt", "step_00000003.jckpt"]
    assert backend.list(f"{run}/step_00000003.jckpt") == ["model.safetensors", "optimizer.jckpt",
                                                          "trainer_state.json"]
    with jckpt.CheckpointManager(run, options=options) as mgr:
        assert mgr.all_steps() == [2, 3]
        r = mgr.restore()
        np.testing.assert_array_equal(r.tree["model"]["w"], tree["model"]["w"] + 3)
        assert r.metrics == {"loss": pytest.approx(1 / 3)}


@pytest.mark.parametrize("options, match", [
    (dict(endpnt="http://x"), "'endpnt' is not valid"),
    (dict(client_options={"timeout": "nonsense"}), "as Duration"),
    (dict(region=5), "not an instance of 'str'"),
    (dict(client_options="fast"), "not an instance of 'dict'"),
])
def test_configure_refuses_options_the_store_refuses_at_once(options, match):
    """They were taken, then failed every later use of the scheme, in every bucket, with the
    fix of a network error."""
    for prefix in ("s3", "s3://one-bucket"):
        with pytest.raises(jckpt.InputError, match=match) as e:
            object_store.configure(prefix, **options)
        assert e.value.file == prefix and "S3Store" in e.value.fix
    object_store.configure("s3", region="us-east-1")  # good options are taken
    object_store.configure("s3")


def test_no_credentials_at_all_is_said_as_such():
    """Without keys, the S3 store asks the instance metadata service, whose refusal was shown
    as a network error ("check the endpoint ... and the network")."""
    failure = RuntimeError("Generic S3 error: Error performing PUT "
                           "http://169.254.169.254/latest/api/token in 1.2s - Server returned 403")
    e = object_store.store_error(failure, "saving", "s3://b/x.jckpt")
    assert "credentials could not be loaded" in e.message and "AWS_ACCESS_KEY_ID" in e.fix
    assert e.file == "s3://b/x.jckpt"


@pytest.mark.parametrize("url, names, other", [
    ("s3://b/x.jckpt", "AWS_ACCESS_KEY_ID", "AZURE"), ("az://c/x.jckpt", "AZURE_STORAGE_ACCOUNT_NAME", "AWS"),
    ("gs://b/x.jckpt", "GOOGLE_APPLICATION_CREDENTIALS", "AWS")])
def test_each_stores_fix_names_its_own_settings(url, names, other):
    """An az:// URL without an account was told to check AWS_ENDPOINT_URL."""
    azure = RuntimeError("Generic MicrosoftAzure error: Account must be specified")
    denied = RuntimeError("AccessDenied")
    for failure in (azure, denied):
        e = object_store.store_error(failure, "saving", url)
        assert "credentials" in e.fix and names in e.fix and other not in e.fix, e.fix
    network = object_store.store_error(RuntimeError("connection refused"), "saving", url)
    assert "network" in network.fix and other not in network.fix


def test_a_bucket_alone_is_refused_before_any_request(monkeypatch):
    """s3://bucket reached the store first: a lookup retried for seconds, then a network or
    credentials error instead of the refusal."""
    def no_store(u):
        raise AssertionError(f"a request for {u.url}")

    monkeypatch.setattr(object_store, "store_for", no_store)
    for url in ("s3://bucket", "gs://bucket/", "az://container"):
        with pytest.raises(jckpt.InputError, match="names a bucket, not a checkpoint inside it"):
            jckpt.save(jckpt.Context(), TREE, url)


@pytest.mark.parametrize("url", ["s3://b/run/a\nb.jckpt", "memory://b/x\t.jckpt", "gs://b/\x7f"])
def test_control_characters_in_a_url_are_refused(url):
    """A newline reached the store, which refused the path with a network error's fix."""
    with pytest.raises(jckpt.InputError, match="cannot hold control characters") as e:
        ObjectURL.parse(url)
    assert "\n" not in e.value.file and "\t" not in e.value.file


@pytest.mark.parametrize("url, text, create", [
    ("s3://b1/run", "NoSuchBucket: The specified bucket does not exist", "aws s3 mb s3://b1"),
    ("gs://b2/run", "404 Not Found: The specified bucket does not exist.",
     "gcloud storage buckets create gs://b2"),
    ("az://b3/run", "ContainerNotFound: The specified container does not exist.",
     "az storage container create --name b3")])
def test_a_missing_bucket_is_named_with_how_to_create_it(url, text, create):
    from jckpt.storage.object_store import is_missing, store_error

    error = FileNotFoundError(text)
    e = store_error(error, "taking the writer lease", url)
    assert not is_missing(error)
    assert isinstance(e, jckpt.StorageError) and e.file == url
    assert f"the bucket {url[5:7]!r} does not exist" in e.message
    assert create in e.fix and "credentials" in e.fix


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_trailing_slash_names_a_directory_locally_and_in_a_bucket(where, tmp_path, request):
    """`s3://b/m.jckpt/` saved to `m.jckpt` and read it silently, while `m.jckpt/` locally
    failed with "the directory ... does not exist" and "not a directory": both now refuse a
    checkpoint file named as a directory, saying so and the path without the '/'; directory
    checkpoints and managers' directories keep working with one."""
    from jckpt.api.multiprocess import save_directory

    root = str(tmp_path) if where == "local" else request.getfixturevalue("s3")
    backend = backend_for(root)
    with pytest.raises(jckpt.InputError, match="file's path cannot end with '/'") as e:
        jckpt.save(jckpt.Context(), TREE, f"{root}/m.jckpt/")
    assert e.value.file == f"{root}/m.jckpt/" and f"save to '{root}/m.jckpt'" in e.value.fix
    assert backend.list(root) == []
    with pytest.raises(jckpt.InputError, match="file's path cannot end with '/'"):
        jckpt.Mirror(f"{root}/m.jckpt/")
    jckpt.save(jckpt.Context(), TREE, f"{root}/m.jckpt")
    for read in (lambda p: jckpt.load(HOST, p), jckpt.describe,
                 lambda p: jckpt.restore(HOST, TREE, p)):
        with pytest.raises(jckpt.InputError, match="'m.jckpt' is a checkpoint file") as e:
            read(f"{root}/m.jckpt/")
        assert e.value.fix == f"read '{root}/m.jckpt', without the trailing '/'"
    with pytest.raises(jckpt.FormatError, match="no such checkpoint"):
        jckpt.load(HOST, f"{root}/none/")
    save_directory(jckpt.Context(), TREE, f"{root}/d/")  # the directory form keeps its '/'
    jckpt.save(jckpt.Context(), TREE, f"{root}/d/")
    assert_tree_equal(jckpt.restore(HOST, TREE, f"{root}/d/"), TREE)
    with jckpt.CheckpointManager(f"{root}/run/") as mgr:
        mgr.save(1, TREE)
    with jckpt.CheckpointManager(f"{root}/run/", read_only=True) as reader:
        assert reader.all_steps() == [1] and reader.restore(target=TREE).step == 1


def test_a_bucket_in_another_region_says_to_set_its_region(monkeypatch):
    """S3 redirects a request sent to another region than the bucket's (a 301, without a
    Location): the error's fix said to check the endpoint and the network."""
    import http.server

    class Redirecting(http.server.BaseHTTPRequestHandler):
        def answer(self):
            self.send_response(301)
            self.send_header("x-amz-bucket-region", "eu-west-1")
            self.send_header("Content-Length", "0")
            self.end_headers()
        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    object_store.configure("s3://far", endpoint=f"http://127.0.0.1:{server.server_address[1]}",
                           region="us-east-1", access_key_id="k", secret_access_key="s")
    try:
        for call in (lambda: jckpt.load(HOST, "s3://far/x.jckpt"),
                     lambda: jckpt.save(jckpt.Context(), TREE, "s3://far/x.jckpt")):
            with pytest.raises(jckpt.StorageError, match="'far' is in another region") as e:
                call()
            assert e.value.file == "s3://far/x.jckpt" and "network" not in e.value.fix
            assert "get-bucket-location --bucket far" in e.value.fix
            assert "jckpt.storage.configure('s3://far', region=" in e.value.fix
    finally:
        object_store.configure("s3://far")
        server.shutdown()
    said = RuntimeError("AuthorizationHeaderMalformed: the region 'us-east-1' is wrong; "
                        "expecting 'eu-west-1'")
    fix = object_store.store_error(said, "reading", "s3://far/x.jckpt").fix
    assert fix.startswith("set the bucket's region (it is eu-west-1): AWS_REGION=eu-west-1")


@pytest.mark.parametrize("endpoint", ["localhost:9000", "htp://host", "http://", "https://a b"])
def test_an_endpoint_that_is_no_url_is_refused(endpoint, monkeypatch):
    """obstore's client panicked on it at the first request (a PanicException, which no
    `except Exception` catches), from configure or from the environment alike."""
    with pytest.raises(jckpt.InputError, match="is no http:// or https:// URL") as e:
        object_store.configure("s3://elsewhere", endpoint=endpoint)
    assert e.value.file == "s3://elsewhere" and "http://HOST:PORT" in e.value.fix
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    object_store.forget_stores()
    try:
        with pytest.raises(jckpt.InputError, match="is no http:// or https:// URL") as e:
            jckpt.load(HOST, "s3://elsewhere/x.jckpt")
        assert e.value.file == "s3://elsewhere/x.jckpt"
    finally:
        object_store.forget_stores()


@pytest.mark.parametrize("code, said", [("503", "throttling"), ("429", "throttling"),
                                        ("500", "a server error"), ("502", "a server error")])
def test_a_server_answering_5xx_or_429_through_the_retries_says_so(code, said):
    # the fix was "check the endpoint and the network", with the code cut off the message
    from jckpt.storage.object_store import store_error

    text = ("Generic S3 error: Error performing PUT http://host/b/run/m.jckpt?partNumber=2&uploadId="
            + "x" * 120 + f" in 44ms, after 10 retries, max_retries: 10 - Server returned non-2xx "
            f"status code: {code} ")
    e = store_error(OSError(text), "uploading the checkpoint", "s3://b/run/m.jckpt")
    assert isinstance(e, jckpt.StorageError) and e.file == "s3://b/run/m.jckpt"
    assert f"answered {code} (" in e.message and said in e.message and "after 10 retries" in e.message
    assert "retry_config" in e.fix and "configure('s3://b'" in e.fix
