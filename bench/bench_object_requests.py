"""Requests a bucket is asked, and time against local disk, for the everyday operations.

    python bench/bench_object_requests.py              # the figures of bench/notes.md
    python bench/bench_object_requests.py --steps 50   # a smaller manager directory

Against moto's S3 server (the tests' `tests.s3server.S3Server`, whose request log
counts each request), one process, medians of `--repeat` runs:

* a save and a restore of 2,000 float32 arrays of 1,000 elements, and of 100,000 of 4
  (100 subtrees of 1,000), the same checkpoint saved and restored on local disk beside;
* a partial restore (one subtree of ten, 200 arrays of 4,000 bytes): bytes asked of the
  store against the bytes of the arrays restored;
* a `CheckpointManager` over a prefix of `--steps` steps: the requests to open it, to
  restore the latest step, to apply retention (`keep_last` half the steps, one more step
  saved), and a read-only manager's open and `reload()` (nothing new; one new step);
* the same manager at `--latency` seconds a request (the tests' `FaultProxy` answering each
  request that much late, as a real bucket's 10-50 ms): its open, the restore of its latest
  step and a save, for steps of one array and of 1,200 (a header past the first GET's 64
  KiB): the requests, how many of them were sent one after another (the longest chain of
  requests each sent once the one before was answered) and the wall time, medians.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

import jckpt
from jckpt.storage import object_store, remote_reader
from tests.s3server import CREDENTIALS, FaultProxy, S3Server

HOST = jckpt.Context(host=True)


def _kinds(requests: list[str]) -> str:
    """`requests` as counts per method, e.g. `1 PUT, 2 GET`."""
    counts = collections.Counter(r.split()[0] for r in requests)
    return ", ".join(f"{n} {m}" for m, n in sorted(counts.items())) or "none"


def _timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def save_restore(server: S3Server, name: str, tree: dict, repeat: int) -> None:
    bucket = server.bucket()
    url, local = f"s3://{bucket}/m.jckpt", os.path.join(tempfile.mkdtemp(), "m.jckpt")
    times: dict[str, list[float]] = collections.defaultdict(list)
    for i in range(repeat):
        before = len(server.requests(bucket))
        times["save s3"].append(_timed(lambda: jckpt.save(jckpt.Context(), tree, url)))
        saved = len(server.requests(bucket))
        times["restore s3"].append(_timed(lambda: jckpt.restore(HOST, tree, url)))
        log = server.requests(bucket)
        times["save local"].append(_timed(lambda: jckpt.save(jckpt.Context(), tree, local)))
        times["restore local"].append(_timed(lambda: jckpt.restore(HOST, tree, local)))
        if i == 0:
            counts = (_kinds(log[before:saved]), _kinds(log[saved:]))
    m = {k: statistics.median(v) for k, v in times.items()}
    print(f"| {name} | save: {counts[0]} | {m['save s3']:.2f} s / {m['save local']:.2f} s = "
          f"{m['save s3'] / m['save local']:.1f}x |")
    print(f"| | restore: {counts[1]} | {m['restore s3']:.2f} s / {m['restore local']:.2f} s = "
          f"{m['restore s3'] / m['restore local']:.1f}x |")


def partial(server: S3Server) -> None:
    tree = {f"g{j}": {f"a{i:03d}": np.full(1000, i, np.float32) for i in range(200)} for j in range(10)}
    bucket = server.bucket()
    url = f"s3://{bucket}/p.jckpt"
    jckpt.save(jckpt.Context(), tree, url)
    asked: list[int] = []
    head, read_into = object_store.ObjectSource.head, object_store.ObjectSource.read_into

    def counted_head(src: Any, length: int) -> Any:
        got = head(src, length)
        asked.append(len(got[0]))
        return got

    def counted_read(src: Any, dest: memoryview, offset: int, version: str | None) -> None:
        asked.append(len(dest))
        read_into(src, dest, offset, version)

    object_store.ObjectSource.head, object_store.ObjectSource.read_into = counted_head, counted_read
    try:
        before = len(server.requests(bucket))
        jckpt.restore(HOST, {"g3": tree["g3"]}, url)
    finally:
        object_store.ObjectSource.head, object_store.ObjectSource.read_into = head, read_into
    needed = sum(a.nbytes for a in tree["g3"].values())
    print(f"| partial restore, 1 subtree of 10 | {_kinds(server.requests(bucket)[before:])} | "
          f"{sum(asked):,} bytes asked ({asked[0]:,} + {asked[1]:,} of header), {needed:,} needed |")


def manager(server: S3Server, steps: int) -> None:
    bucket = server.bucket()
    url, state = f"s3://{bucket}/run", {"w": np.ones(100, np.float32)}
    with jckpt.CheckpointManager(url) as mgr:
        for step in range(1, steps + 1):
            mgr.save(step, state, metrics={"loss": 1.0 / step})
    mark = [len(server.requests(bucket))]

    def row(what: str) -> None:
        log = server.requests(bucket)
        print(f"| manager of {steps} steps: {what} | {_kinds(log[mark[0]:])} |")
        mark[0] = len(log)

    mgr = jckpt.CheckpointManager(url)
    row("open")
    mgr.restore(steps, state)
    row("restore the latest")
    mgr.close()
    mark[0] = len(server.requests(bucket))
    with jckpt.CheckpointManager(url, keep_last=steps // 2) as mgr:
        mark[0] = len(server.requests(bucket))
        mgr.save(steps + 1, state)
        mgr.wait_durable()
        row(f"save a step, retention removing {steps // 2 + 1} (keep_last={steps // 2})")
    reader = jckpt.CheckpointManager(url, read_only=True)
    mark[0] = len(server.requests(bucket))
    reader.reload()
    row("read-only reload(), nothing new")
    with jckpt.CheckpointManager(url) as mgr:
        mgr.save(steps + 2, state)
    mark[0] = len(server.requests(bucket))
    reader.reload()
    row("read-only reload(), 1 new step")
    reader.close()


def _measured(proxy: FaultProxy, runs: list[tuple[int, int, float]], call: Callable[..., Any],
              *args: Any) -> Any:
    """`call(*args)`, its requests, those of them in turn and its wall time added to `runs`."""
    proxy.reset_counts()
    start = time.perf_counter()
    got = call(*args)
    wall = time.perf_counter() - start
    runs.append((len(proxy.seen), proxy.rounds(), wall))
    return got


def _saved_now(mgr: Any, step: int, state: Any) -> None:
    mgr.save(step, state)
    mgr.wait_durable()


def at_latency(server: S3Server, steps: int, delay: float, repeat: int, concurrency: int) -> None:
    for name, state in (("1 array", {"w": np.ones(100, np.float32)}),
                        ("1,200 arrays", {f"k{i:04d}": np.float32(i) for i in range(1200)})):
        bucket = server.bucket()
        url = f"s3://{bucket}/run"
        with jckpt.CheckpointManager(url) as mgr:
            for step in range(1, steps + 1):
                mgr.save(step, state, metrics={"loss": 1.0 / step})
        proxy = FaultProxy(server.endpoint, delay=delay)
        object_store.configure(f"s3://{bucket}", endpoint=proxy.endpoint, concurrency=concurrency)
        seen: dict[str, list[tuple[int, int, float]]] = collections.defaultdict(list)
        try:
            for i in range(repeat):
                remote_reader._SEEN.clear()  # a job resuming: no header read before in the process
                mgr = _measured(proxy, seen["open"], jckpt.CheckpointManager, url)
                _measured(proxy, seen["restore the latest"], mgr.restore, mgr.latest_step(), state)
                _measured(proxy, seen["save a step"], _saved_now, mgr, steps + 1 + i, state)
                mgr.close()
        finally:
            object_store.configure(f"s3://{bucket}")
            proxy.close()
        for what, runs in seen.items():
            requests, rounds, wall = (statistics.median(r[k] for r in runs) for k in range(3))
            print(f"| {delay * 1000:.0f} ms a request, {concurrency} at once, manager of {steps} steps of "
                  f"{name}: {what} | "
                  f"{requests:.0f} requests, {rounds:.0f} in turn | {wall:.2f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.02, help="seconds a request, for the last rows")
    parser.add_argument("--only-latency", action="store_true", help="the rows at --latency alone")
    parser.add_argument("--concurrency", type=int, default=8, help="the bucket's, for the rows at --latency")
    args = parser.parse_args()
    server = S3Server.start()
    os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": server.endpoint})
    try:
        if args.only_latency:
            at_latency(server, args.steps, args.latency, args.repeat, args.concurrency)
            return
        print("| operation | requests | bucket / local disk (medians) |\n|---|---|---|")
        save_restore(server, "2,000 arrays of 1,000 float32",
                     {f"a{i:04d}": np.random.rand(1000).astype(np.float32) for i in range(2000)}, args.repeat)
        save_restore(server, "100,000 arrays of 4 float32",
                     {f"g{j:02d}": {f"a{i:03d}": np.random.rand(4).astype(np.float32) for i in range(1000)}
                      for j in range(100)}, args.repeat)
        partial(server)
        manager(server, args.steps)
        at_latency(server, args.steps, args.latency, args.repeat, args.concurrency)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
