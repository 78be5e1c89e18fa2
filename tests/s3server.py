"""A real S3 API server for the tests: moto's standalone server on a free localhost port.

The tests of object storage run against it (moto's server is the one s3fs's own
test suite uses). `S3Server.start()` starts one; `server.bucket()` makes a fresh
bucket; `server.stop()` kills it (a fault test kills it mid-upload).
"""

import contextlib
import os
import socket
import subprocess
import sys
import time
import uuid

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
