"""A real S3 API server for the tests: moto's standalone server on a free localhost port.

The tests of object storage run against it (moto's server is the one s3fs's own
test suite uses). `S3Server.start()` starts one; `server.bucket()` makes a fresh
bucket; `server.stop()` kills it (a fault test kills it mid-upload). The
functions below look at a URL's incomplete uploads and upload markers as
another client would (boto3, the environment pointing at the server).
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid

from jckpt.format.names import UPLOAD_TAG
from jckpt.storage.object_store import ObjectURL, store_for

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """A running moto server: its `endpoint` URL, `bucket()` to make buckets, `stop()`."""

    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc, self.port = proc, port
        self.endpoint = f"http://127.0.0.1:{port}"

    @classmethod
    def start(cls, *, env: dict[str, str] | None = None) -> "S3Server":
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("moto's server exited at start")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return cls(proc, port)
            time.sleep(0.1)
        proc.kill()
        raise RuntimeError("moto's server did not start within 60 s")

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def bucket(self) -> str:
        """A new empty bucket's name."""
        name = f"b{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# --- incomplete uploads and their markers, seen through boto3 ------------------------------------

def client(url: str):
    """boto3's client of the test server (the environment points at it)."""
    import boto3

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")


def uploads_of(url: str) -> list[tuple[str, str]]:
    """The incomplete multipart uploads of the keys that start with `url`'s: `(key, upload id)`."""
    u = ObjectURL.parse(url)
    found = client(url).list_multipart_uploads(Bucket=u.bucket, Prefix=u.key).get("Uploads", [])
    return sorted((o["Key"], o["UploadId"]) for o in found)


def markers_of(url: str) -> list[str]:
    """The keys of the upload markers of `url`'s key."""
    u = ObjectURL.parse(url)
    found = client(url).list_objects_v2(Bucket=u.bucket, Prefix=u.key + UPLOAD_TAG).get("Contents", [])
    return [o["Key"] for o in found]


def plant_marker(url: str, token: str, **holder) -> None:
    """A marker as another writer of `url` would have put it (this host, this pid, now, unless given)."""
    import obstore

    u = ObjectURL.parse(url)
    record = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), **holder}
    obstore.put(store_for(u), f"{u.key}{UPLOAD_TAG}{token}", json.dumps(record).encode())


def start_upload(url: str) -> str:
    """Start a multipart upload of `url`'s key as another client would; its upload id."""
    u = ObjectURL.parse(url)
    return client(url).create_multipart_upload(Bucket=u.bucket, Key=u.key)["UploadId"]


def dead_pid() -> int:
    """The pid of a process that has exited."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(done.stdout)
