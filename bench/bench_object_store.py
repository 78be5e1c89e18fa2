"""Object storage: obstore against fsspec + s3fs, then jckpt against the library it uses.

    python -m bench.bench_object_store                   # the library choice, 1 GiB, 3 repetitions
    python -m bench.bench_object_store --quick           # 64 MiB, 1 repetition (seconds)
    python -m bench.bench_object_store --jckpt           # jckpt's save and restore against obstore
    python -m bench.bench_object_store --size-mib 256 --repeat 5

Everything runs against moto's standalone S3 server (``moto[server]``),
started on a free localhost port for the run and stopped after it, with a
fresh bucket. The server is a Python process: its throughput, not the
network, bounds every figure, so the figures compare clients with each other
on the same server rather than predict a cloud's speed.

The library choice (the default) times, for each client:

* ``upload``: one object of ``--size-mib`` from memory, as a multipart upload
  (obstore ``put`` with ``--part-mib`` chunks and ``--concurrency`` parts in
  flight; s3fs ``pipe`` with the same part size, which uploads its parts
  concurrently).
* ``download``: the whole object into memory by concurrent ranged GETs of
  ``--part-mib`` (obstore ``get_range`` from a thread pool, each part copied
  into one preallocated buffer; s3fs ``cat_ranges``, its own concurrency).
* ``small read``: one 4 KiB ranged GET from the middle of the object, the median of 20.

``--jckpt`` saves and restores a checkpoint of 8 float32 arrays of the same
total size with jckpt against obstore's own upload and concurrent download
of the same bytes (goals: within 1.3x each way), then restores one small
leaf and counts the bytes the server sent (the server's response sizes,
through a counting proxy in front of it): the goal is under 1% of the object.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

MIB = 1 << 20
BUCKET = 'bench'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on a free port, with the environment pointing at it: yields its endpoint."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, '-m', 'moto.server', '-H', '127.0.0.1', '-p', str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(('127.0.0.1', port), 0.2):
                break
            time.sleep(0.1)
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID='testing',
                          AWS_SECRET_ACCESS_KEY='testing', AWS_REGION='us-east-1', AWS_ALLOW_HTTP='true')
        import boto3
        boto3.client('s3', endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def median_ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:8.1f} ms"


def rate(size: int, samples: list[float]) -> str:
    med = statistics.median(samples)
    return f"{med:6.2f} s  {size / MIB / med:7.1f} MiB/s  (min {min(samples):.2f}, max {max(samples):.2f})"


# --- the two libraries ------------------------------------------------------------------------

class Obstore:
    name = 'obstore'

    def __init__(self, endpoint: str, part: int, concurrency: int) -> None:
        import obstore
        from obstore.store import S3Store
        self.obs = obstore
        self.store = S3Store(BUCKET, endpoint=endpoint, client_options={'allow_http': True})
        self.part, self.concurrency = part, concurrency
        self.pool = concurrent.futures.ThreadPoolExecutor(concurrency)

    def upload(self, key: str, data: memoryview) -> None:
        self.obs.put(self.store, key, data, chunk_size=self.part, max_concurrency=self.concurrency)

    def download(self, key: str, size: int) -> bytearray:
        out = bytearray(size)
        view = memoryview(out)

        def part(start: int) -> None:
            end = min(size, start + self.part)
            view[start:end] = self.obs.get_range(self.store, key, start=start, end=end)

        list(self.pool.map(part, range(0, size, self.part)))
        return out

    def small_read(self, key: str, offset: int) -> bytes:
        return bytes(self.obs.get_range(self.store, key, start=offset, length=4096))


class S3fs:
    name = 's3fs'

    def __init__(self, endpoint: str, part: int, concurrency: int) -> None:
        import s3fs
        self.fs = s3fs.S3FileSystem(endpoint_url=endpoint, key='testing', secret='testing',
                                    max_concurrency=concurrency, skip_instance_cache=True)
        self.part = part

    def upload(self, key: str, data: memoryview) -> None:
        self.fs.pipe_file(f"{BUCKET}/{key}", bytes(data), chunksize=self.part)

    def download(self, key: str, size: int) -> bytearray:
        starts = list(range(0, size, self.part))
        parts = self.fs.cat_ranges([f"{BUCKET}/{key}"] * len(starts), starts,
                                   [min(size, s + self.part) for s in starts])
        out = bytearray(size)
        for s, p in zip(starts, parts):
            out[s:s + len(p)] = p
        return out

    def small_read(self, key: str, offset: int) -> bytes:
        return self.fs.cat_file(f"{BUCKET}/{key}", start=offset, end=offset + 4096)


def _one_round(c, size: int, view: memoryview, times: dict, failures: dict) -> None:
    """Upload, download (checked) and small reads with client ``c``; a failure is recorded, not fatal."""
    key = f"lib/{c.name}.bin"
    for what, run in (('upload', functools.partial(c.upload, key, view)),
                      ('download', functools.partial(_checked_download, c, key, size, view))):
        try:
            times.setdefault((c.name, what), []).append(timed(run))
        except Exception as e:
            failures.setdefault((c.name, what), []).append(f"{type(e).__name__}: {str(e)[:120]}")
            return
    small = functools.partial(c.small_read, key, size // 2)
    times.setdefault((c.name, 'small read'), []).extend(timed(small) for _ in range(20))


def _checked_download(c, key: str, size: int, view: memoryview) -> None:
    if c.download(key, size) != view:
        raise AssertionError(f"{c.name} downloaded other bytes")


def compare_libraries(endpoint: str, size: int, repeat: int, part: int, concurrency: int) -> None:
    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    view = memoryview(data).cast('B')
    clients = [Obstore(endpoint, part, concurrency), S3fs(endpoint, part, concurrency)]
    times: dict[tuple[str, str], list[float]] = {}
    failures: dict[tuple[str, str], list[str]] = {}
    for r in range(repeat):
        for c in clients[r % 2:] + clients[:r % 2]:  # alternate who goes first
            _one_round(c, size, view, times, failures)
    print(f"\n{size // MIB} MiB object, parts of {part // MIB} MiB, {concurrency} in flight, "
          f"{repeat} repetition(s), moto {_moto_version()}")
    for c in clients:
        for what in ('upload', 'download', 'small read'):
            got = times.get((c.name, what), [])
            shown = 'no successful run' if not got else (
                median_ms(got) + f" (median of {len(got)})" if what == 'small read' else rate(size, got))
            print(f"  {c.name:8} {what:10} {shown}")
            for f in failures.get((c.name, what), []):
                print(f"  {c.name:8} {what:10} FAILED: {f}")


def _moto_version() -> str:
    from importlib.metadata import version
    return version('moto')


# --- jckpt against obstore ---------------------------------------------------------------------

class CountingProxy:
    """A TCP proxy in front of the server that counts the bytes the server sends back."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.sent = 0
        self._lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(('127.0.0.1', 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(('127.0.0.1', self.upstream))
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while chunk := src.recv(1 << 20):
                dst.sendall(chunk)
                if count:
                    with self._lock:
                        self.sent += len(chunk)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def reset(self) -> int:
        with self._lock:
            sent, self.sent = self.sent, 0
        return sent


def compare_jckpt(endpoint: str, size: int, repeat: int, part: int, concurrency: int) -> None:
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
    import jckpt
    n = 8
    rng = np.random.default_rng(1)
    tree = {f"w{i}": rng.standard_normal(size // n // 4, dtype=np.float32) for i in range(n)}
    tree['small'] = np.arange(256, dtype=np.float32)
    url = f"s3://{BUCKET}/jckpt/model.jckpt"
    ctx = jckpt.Context(host=True)
    lib = Obstore(endpoint, part, concurrency)
    with tempfile.TemporaryDirectory() as d:
        local = os.path.join(d, 'model.jckpt')
        jckpt.save(ctx, tree, local)
        raw = np.fromfile(local, np.uint8)
    view = memoryview(raw).cast('B')
    total = raw.nbytes
    times: dict[str, list[float]] = {}
    for _ in range(repeat):
        times.setdefault('library upload', []).append(timed(lambda: lib.upload('jckpt/raw.bin', view)))
        times.setdefault('jckpt save', []).append(timed(lambda: jckpt.save(ctx, tree, url)))
        times.setdefault('library download', []).append(timed(lambda: lib.download('jckpt/raw.bin', total)))
        times.setdefault('jckpt restore', []).append(timed(lambda: jckpt.restore(ctx, tree, url)))
    print(f"\njckpt against obstore: {total / MIB:.0f} MiB checkpoint ({n} arrays), {repeat} repetition(s)")
    for k, v in times.items():
        print(f"  {k:17} {rate(total, v)}")
    for a, b in (('jckpt save', 'library upload'), ('jckpt restore', 'library download')):
        print(f"  {a} / {b}: {statistics.median(times[a]) / statistics.median(times[b]):.2f}x (goal <= 1.3x)")
    proxy = CountingProxy(int(endpoint.rsplit(':', 1)[1]))
    os.environ['AWS_ENDPOINT_URL'] = f"http://127.0.0.1:{proxy.port}"
    try:
        import jckpt.storage.object_store as object_store
        object_store.forget_stores()  # the next URL builds a store for the proxy's endpoint
        proxy.reset()
        small = jckpt.restore(ctx, {'small': tree['small']}, url)
        sent = proxy.reset()
        np.testing.assert_array_equal(small['small'], tree['small'])
        print(f"  one small leaf restored: the server sent {sent} bytes, {100 * sent / total:.4f}% of the "
              f"object (goal < 1%)")
    finally:
        os.environ['AWS_ENDPOINT_URL'] = endpoint


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--size-mib', type=int, default=1024)
    p.add_argument('--repeat', type=int, default=3)
    p.add_argument('--part-mib', type=int, default=16)
    p.add_argument('--concurrency', type=int, default=8)
    p.add_argument('--quick', action='store_true', help='64 MiB, one repetition')
    p.add_argument('--jckpt', action='store_true', help="jckpt's save and restore against obstore")
    a = p.parse_args(argv)
    size, repeat = (64 * MIB, 1) if a.quick else (a.size_mib * MIB, a.repeat)
    with moto_server() as endpoint:
        print(f"moto server at {endpoint}", flush=True)
        if a.jckpt:
            compare_jckpt(endpoint, size, repeat, a.part_mib * MIB, a.concurrency)
        else:
            compare_libraries(endpoint, size, repeat, a.part_mib * MIB, a.concurrency)


if __name__ == '__main__':
    main()
