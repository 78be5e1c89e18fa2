"""A real S3 API server for the tests: moto's standalone server on a free localhost port.

The tests of object storage run against it (moto's server is the one s3fs's own
test suite uses). `S3Server.start()` starts one; `server.bucket()` makes a fresh
bucket; `server.requests(bucket)` lists the requests the server answered for a
bucket, from its request log (how the tests count a call's requests);
`server.stop()` kills it (a fault test kills it mid-upload); a `FaultProxy` in front of it
fails the requests a test picks (503 Slow Down, a connection reset mid-answer), or delays
each by a fixed time (a real bucket's latency) and records how many were in flight at once. The
functions below look at a URL's incomplete uploads and upload markers as
another client would (boto3, the environment pointing at the server).
"""

import bisect
import contextlib
import http.client
import http.server
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
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

    def __init__(self, proc: subprocess.Popen, port: int, log) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.endpoint = f"http://127.0.0.1:{port}"

    @classmethod
    def start(cls, *, env: dict[str, str] | None = None) -> "S3Server":
        port = free_port()
        log = tempfile.TemporaryFile("w+")  # the server's request log (werkzeug's, on stderr)
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=log,
                                env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.close()
                raise RuntimeError("moto's server exited at start")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return cls(proc, port, log)
            time.sleep(0.1)
        proc.kill()
        log.close()
        raise RuntimeError("moto's server did not start within 60 s")

    def requests(self, bucket: str) -> list[str]:
        """The requests the server answered for `bucket` so far, oldest first, each as
        `"METHOD path?query"` with the bucket left out (`"GET /run/step_00000001.jckpt"`,
        `"GET ?list-type=2&prefix=run/"`). The server logs a request as it starts its
        answer, so every request a call has returned from is there."""
        bucket = bucket.removeprefix("s3://")
        self.log.seek(0)
        found = []
        for line in self.log.read().splitlines():
            m = _REQUEST.search(_ANSI.sub("", line))
            if m:
                path, sep, query = m.group(2).partition("?")
                head, _, rest = urllib.parse.unquote(path).lstrip("/").partition("/")
                if head == bucket:
                    found.append(f"{m.group(1)} /{rest}{sep}{urllib.parse.unquote(query)}".replace(
                        " /?", " ?"))
        return found

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
        self.log.close()


#: A request line of werkzeug's log: `... "GET /bucket/key?query HTTP/1.1" 200 -`.
_REQUEST = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+" \d{3}')
#: The terminal colours werkzeug may put around a line whose status is not 200 (a 206, a 404).
_ANSI = re.compile(r'\x1b\[[0-9;]*m')


# --- faults: a proxy in front of the server -----------------------------------------------------

#: What S3 answers a client it throttles.
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message></Error>')


class FaultProxy:
    """An HTTP proxy in front of the S3 server that fails the requests `fault` picks: `fault(method,
    path, headers)` gives None (pass it on), "503" (SlowDown), "reset" (the answer's headers
    and half its body, then the connection reset) or "drop" (the request read, not passed on,
    and the connection reset: a part upload cut off).

    With `delay` (seconds), each request is answered that much later (a real bucket's 10-50 ms
    a request, where sequential requests cost more than bytes). `in_flight` is how many
    requests are being answered now, `most_in_flight` the most at once since `reset_counts()`,
    `seen` the requests since, as `(method, path)`, `rounds()` the longest chain among them of
    requests each sent after the previous one's answer (the sequential round trips)."""

    def __init__(self, upstream, fault=None, *, delay: float = 0.0):
        self.fault, self.faults, self.delay = fault or (lambda *a: None), [], delay
        self.in_flight = self.most_in_flight = 0
        self.seen: list[tuple[str, str]] = []
        self._spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        host, port = urllib.parse.urlsplit(upstream).netloc.split(":")
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                start = proxy._begin(self.command, self.path)
                try:
                    self._answer(body)
                finally:
                    proxy._end(start)

            def _answer(self, body):
                if proxy.delay:
                    time.sleep(proxy.delay)
                what = proxy.fault(self.command, self.path, self.headers)
                if what:
                    proxy.faults.append((what, self.command, self.path))
                if what == "503":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN)
                    return
                if what == "drop":
                    self._reset()
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = f"{host}:{port}"
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if what == "reset":
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self._reset()
                    return
                self.wfile.write(data)

            def _reset(self):
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _begin(self, method: str, path: str) -> float:
        with self._lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.seen.append((method, urllib.parse.unquote(path)))
            return time.monotonic()

    def _end(self, start: float) -> None:
        with self._lock:
            self.in_flight -= 1
            self._spans.append((start, time.monotonic()))

    def reset_counts(self) -> None:
        with self._lock:
            self.most_in_flight, self.seen, self._spans = self.in_flight, [], []

    def rounds(self) -> int:
        """The longest chain of requests since `reset_counts()` each received after the previous
        one was answered: the round trips a caller waited for one after another. (A request
        is over for the caller a moment before it is for the proxy: waits for that.)"""
        deadline = time.monotonic() + 5
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.001)
        with self._lock:
            spans = sorted(self._spans, key=lambda s: s[1])
        ends: list[float] = []
        depth: list[int] = []
        for start, end in spans:
            before = bisect.bisect_left(ends, start)
            depth.append(1 + max(depth[:before], default=0))
            ends.append(end)
        return max(depth, default=0)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


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
    """A marker as another writer of `url` would have put it (this host, a running process: this
    one's parent, now, unless given; this process's own markers are its uploads')."""
    import obstore

    u = ObjectURL.parse(url)
    record = {"host": socket.gethostname(), "pid": os.getppid(), "time": time.time(), **holder}
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
