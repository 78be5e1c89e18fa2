"""Disk faults during a save or a load: a clear error, the previous file intact, nothing left.

* A real size limit (``RLIMIT_FSIZE`` in a subprocess, ``SIGXFSZ`` ignored):
  the kernel answers ``EFBIG`` in the middle of a write or a
  ``copy_file_range``.
* A sweep of injected faults: every call a save makes to ``open``,
  ``write``, ``pwrite``, ``copy_file_range``, ``fsync`` and ``rename`` fails
  in turn, with ``EIO``, ``ENOSPC`` and ``EACCES``. ``tests/storage/test_publish.py``
  covers the first write, fsync and rename of a plain save; this covers every
  one, for plain and appending saves.
* Faults while reading, and a manager whose disk fails for a while.
* A bucket's faults, through a proxy in front of moto's server (``tests/s3server.py``): a
  store throttling (503 Slow Down) or resetting connections mid-answer, for a ranged GET and
  a multipart upload's part, transient (retried) and persistent (an error after the retries).
"""

from __future__ import annotations

import datetime
import errno
import os
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pytest

import jckpt
from jckpt.errors import StorageError
from jckpt.storage import publish
from jckpt.storage.reader import CheckpointReader
from tests.system.fuzz_reader import record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS = ("open", "write", "writev", "pwrite", "copy_file_range", "fsync", "rename")
CODES = (errno.EIO, errno.ENOSPC, errno.EACCES)


class Faults:
    """Wraps ``os`` calls: counts them, and fails call number ``at`` of ``op`` with ``code``."""

    def __init__(self, monkeypatch, op: str | None = None, at: int = 0, code: int = 0) -> None:
        self.op, self.at, self.code = op, at, code
        self.calls: Counter = Counter()
        self.fired = False
        self.fired_args: tuple = ()
        self.renamed = False
        for name in OPS:
            monkeypatch.setattr(os, name, self._wrap(name, getattr(os, name)))

    def _wrap(self, name, real):
        def call(*args, **kwargs):
            self.calls[name] += 1
            if name == self.op and self.calls[name] == self.at:
                self.fired, self.fired_args = True, args
                raise OSError(self.code, os.strerror(self.code))
            result = real(*args, **kwargs)
            if name == "rename":
                self.renamed = True
            return result
        return call


def _tree(k: int) -> dict:
    rng = np.random.default_rng(k)
    return {"a": rng.standard_normal(20_000).astype(np.float32), "b": np.arange(20_000) * k,
            "c": {"d": rng.integers(0, 9, (64, 64)).astype(np.int8)}, "step": np.int32(k)}


def _setup(kind: str, target) -> None:
    """The previous checkpoint: version 1 (appending: a kept entry, then version 1)."""
    if target.exists():
        target.unlink()
    if kind == "appending":
        # a small kept payload is gathered for one writev, flushed before the big one is copied
        jckpt.save(jckpt.Context(), {"early": np.arange(3, dtype=np.float32),
                                     "kept": np.arange(30_000, dtype=np.float64)}, target)
        jckpt.save(jckpt.Context(), _tree(1), target, appending=True)
    else:
        jckpt.save(jckpt.Context(), _tree(1), target)


def _save(kind: str, target) -> None:
    jckpt.save(jckpt.Context(), _tree(2), target, appending=kind == "appending")


def _is_version(target, k: int) -> bool:
    assert CheckpointReader(target).verify() == []
    _, t = jckpt.load(jckpt.Context(host=True), target, mmap=False)
    want = _tree(k)
    return all(np.asarray(t["jckpt"][n]).tobytes() == np.asarray(want[n]).tobytes()
               for n in ("a", "b", "step")) and t["jckpt"]["c"]["d"].tobytes() == \
        want["c"]["d"].tobytes()


def _points(calls: Counter, per_op: int = 6) -> list[tuple[str, int]]:
    """Which calls to fail: all of them, or ``per_op`` spread over each op's calls."""
    out = []
    for op in OPS:
        n = calls[op]
        picks = range(1, n + 1) if n <= per_op else sorted(
            {1, n, *np.linspace(1, n, per_op).round().astype(int).tolist()})
        out.extend((op, int(i)) for i in picks)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["single", "appending"])
def test_every_injected_fault_leaves_previous_file(tmp_path, monkeypatch, kind):
    target = tmp_path / "t.jckpt"
    _setup(kind, target)
    with monkeypatch.context() as m:  # a clean save: how many calls of each kind it makes
        counting = Faults(m)
        _save(kind, target)
    assert counting.calls["write"] >= 2 and counting.calls["fsync"] >= 2
    if kind == "appending":
        assert counting.calls["copy_file_range"] >= 1
    stats = Counter()
    for op, at in _points(counting.calls):
        for code in CODES:
            _setup(kind, target)
            before = target.read_bytes()
            with monkeypatch.context() as m:
                faults = Faults(m, op, at, code)
                try:
                    _save(kind, target)
                    error = None
                except StorageError as e:
                    error = e
            assert faults.fired, (op, at)
            stats["injected"] += 1
            where = f"{os.strerror(code)} at {op} #{at}"
            if error is None:
                # Only copy_file_range has a fallback (plain reads and writes) that can succeed,
                # and the open that holds the old file through the rename is optional.
                held = op == "open" and faults.fired_args[1:2] == (publish.HOLD_FLAGS,)
                assert op == "copy_file_range" or held, f"{where}: the save reported success"
                assert _is_version(target, 2), where
                stats["recovered"] += 1
            else:
                assert error.errno == code, where
                assert str(target) in str(error) and os.strerror(code) in str(error), where
                assert error.fix, where
                if faults.renamed:  # failed after publishing (fsync of the directory)
                    assert _is_version(target, 2), where
                    stats["failed_after_publish"] += 1
                else:
                    assert target.read_bytes() == before, f"{where}: previous file changed"
                    stats["previous_intact"] += 1
            assert sorted(os.listdir(tmp_path)) == ["t.jckpt"], f"{where}: staging file left"
    assert stats["previous_intact"] > 0
    record("faults_injected", kind=kind, **stats)


def test_read_faults_are_storage_errors(tmp_path, monkeypatch):
    target = tmp_path / "t.jckpt"
    jckpt.save(jckpt.Context(), _tree(1), target)
    for name in ("pread", "open"):
        with monkeypatch.context() as m:
            def fail(*args, **kwargs):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            m.setattr(os, name, fail)
            with pytest.raises(StorageError) as info:
                jckpt.load(jckpt.Context(host=True), target)
        assert info.value.errno == errno.EIO and str(target) in str(info.value)
    import mmap as mmap_mod

    with monkeypatch.context() as m:
        def no_map(*args, **kwargs):
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        m.setattr(mmap_mod, "mmap", no_map)
        with pytest.raises(StorageError) as info:
            jckpt.load(jckpt.Context(host=True), target)
    assert info.value.errno == errno.ENOMEM


def test_manager_survives_a_failing_disk(tmp_path, monkeypatch):
    """Failed writes are retried; after ``patience`` failures the error reaches the caller."""
    from jckpt.services.manager import CheckpointManager

    directory = tmp_path / "run"
    with CheckpointManager(directory, retry_after=0.01, patience=2) as mgr:
        mgr.save(1, _tree(1))
        assert mgr.wait_durable(60)
        first = (directory / "step_00000001.jckpt").read_bytes()
        with monkeypatch.context() as m:  # one transient failure: retried, then durable
            Faults(m, "fsync", 1, errno.EIO)
            mgr.save(2, _tree(2))
            assert mgr.wait_durable(60)
        assert 2 in mgr.all_steps()
        with monkeypatch.context() as m:  # a dead disk: every fsync fails
            real = os.fsync

            def fail(fd):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            m.setattr(os, "fsync", fail)
            mgr.save(3, _tree(3))
            with pytest.raises(StorageError) as info:
                mgr.wait_durable(60)
            m.setattr(os, "fsync", real)
        assert info.value.errno == errno.ENOSPC
        assert (directory / "step_00000001.jckpt").read_bytes() == first
        assert not [n for n in os.listdir(directory) if ".jckpt-stage." in n]
        deadline = time.monotonic() + 60  # the disk is back: the kept snapshot gets written
        while True:  # (until the retry succeeds, waiting reports the last failure)
            try:
                if mgr.wait_durable(1):
                    break
            except StorageError:
                assert time.monotonic() < deadline
                time.sleep(0.02)
    assert sorted(n for n in os.listdir(directory) if n.startswith("step_")) == [
        "step_00000001.jckpt", "step_00000002.jckpt", "step_00000003.jckpt"]
    assert not [n for n in os.listdir(directory) if ".jckpt-stage." in n]


# --- a real size limit -------------------------------------------------------------

FSIZE_CHILD = r"""
import errno, os, resource, signal, sys
import numpy as np
import jckpt
from jckpt.storage.reader import CheckpointReader

kind, directory, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
target = os.path.join(directory, "t.jckpt")
ctx = jckpt.Context()
kept = np.arange(200_000, dtype=np.float32)          # 800 KB
if kind == "appending":
    jckpt.save(ctx, {"kept": kept, "w": np.zeros(10)}, target)
else:
    jckpt.save(ctx, {"w": np.zeros(10)}, target)
before = open(target, "rb").read()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    jckpt.save(ctx, {"w": np.ones(250_000)}, target, appending=kind == "appending")
except jckpt.StorageError as e:
    assert e.errno == errno.EFBIG, e
    assert target in str(e) and e.fix and "limit" in e.fix, e
    print("refused:", e)
else:
    sys.exit("the save succeeded past the size limit")
assert open(target, "rb").read() == before, "the previous file changed"
assert CheckpointReader(target).verify() == []
left = sorted(os.listdir(directory))
assert left == ["t.jckpt"], left
print("ok")
"""


@pytest.mark.parametrize("kind, limit", [("single", 1 << 20), ("appending", 1 << 20),
                                         ("appending", 600_000)])
def test_real_size_limit_efbig(tmp_path, kind, limit):
    """The kernel refuses a write (or, appending below the kept data, a copy) past RLIMIT_FSIZE."""
    proc = subprocess.run([sys.executable, "-c", FSIZE_CHILD, kind, str(tmp_path), str(limit)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    assert "File too large" in proc.stdout
    record("faults_real_efbig", kind=kind, limit=limit, injected=1, previous_intact=1)


# --- a bucket's faults ---------------------------------------------------------------------------

#: obstore's retries for these tests: 2 (3 attempts a request), with short waits between.
RETRIES = {"max_retries": 2, "retry_timeout": datetime.timedelta(seconds=20),
           "backoff": {"init_backoff": datetime.timedelta(milliseconds=10),
                       "max_backoff": datetime.timedelta(milliseconds=100), "base": 2}}


@pytest.fixture
def faulty(s3, s3_server):
    """`(bucket URL, proxy)`: the bucket reached through a `FaultProxy` that fails what its
    `pick` (method, path, headers -> None, "503" or "reset") says, with `RETRIES`."""
    from jckpt.storage import object_store
    from tests.s3server import FaultProxy

    rule = {"pick": lambda method, path, headers: None}
    proxy = FaultProxy(s3_server.endpoint, lambda *a: rule["pick"](*a))
    proxy.rule = rule
    object_store.configure(s3, endpoint=proxy.endpoint, retry_config=RETRIES)
    try:
        yield s3, proxy
    finally:
        object_store.configure(s3)
        proxy.close()


def _payload_gets(kind, times=None):
    """A rule failing the ranged GETs past the header's (`times` of them, else all) with `kind`."""
    left = [times]

    def pick(method, path, headers):
        if method != "GET" or "bytes=0-" in headers.get("Range", "bytes=0-") or left[0] == 0:
            return None
        left[0] = None if left[0] is None else left[0] - 1
        return kind
    return pick


def _part(number, kind):
    return lambda method, path, headers: kind if method == "PUT" and f"partNumber={number}&" in path else None


BIG = {"w": np.arange(1 << 18, dtype=np.float32)}  # 1 MiB past the header's 64 KiB: one GET


@pytest.mark.parametrize("kind", ["503", "reset"])
def test_a_transient_fault_of_a_ranged_get_is_retried(faulty, kind):
    url, proxy = faulty
    jckpt.save(jckpt.Context(), BIG, f"{url}/m.jckpt")
    proxy.rule["pick"] = _payload_gets(kind, times=1)
    back = jckpt.restore(jckpt.Context(host=True), BIG, f"{url}/m.jckpt")
    np.testing.assert_array_equal(back["w"], BIG["w"])
    assert [f[0] for f in proxy.faults] == [kind]


def test_a_store_that_keeps_throttling_a_restore_is_said_to_throttle(faulty):
    """A 503 Slow Down through every retry said "check the endpoint and the network": the
    store is there, and asks for fewer requests."""
    url, proxy = faulty
    jckpt.save(jckpt.Context(), BIG, f"{url}/m.jckpt")
    proxy.rule["pick"] = _payload_gets("503")
    with pytest.raises(StorageError) as e:
        jckpt.restore(jckpt.Context(host=True), BIG, f"{url}/m.jckpt")
    assert e.value.file == f"{url}/m.jckpt" and e.value.entry == "jckpt/w"
    assert "answered 503 (it is throttling requests: Slow Down) after 2 retries" in e.value.message
    assert "concurrency" in e.value.fix and "retry_config" in e.value.fix
    assert len(proxy.faults) == 3  # one GET: its attempt and 2 retries, then the error


def test_connections_reset_through_every_retry_are_a_storage_error(faulty):
    url, proxy = faulty
    jckpt.save(jckpt.Context(), BIG, f"{url}/m.jckpt")
    proxy.rule["pick"] = _payload_gets("reset")
    with pytest.raises(StorageError, match="reading the checkpoint failed") as e:
        jckpt.restore(jckpt.Context(host=True), BIG, f"{url}/m.jckpt")
    assert e.value.file == f"{url}/m.jckpt" and e.value.entry == "jckpt/w" and "network" in e.value.fix
    assert len(proxy.faults) == 3


@pytest.mark.parametrize("kind", ["503", "drop"])
def test_a_failed_part_leaves_the_managers_previous_step(faulty, kind):
    from jckpt.storage import object_store

    url, proxy = faulty
    object_store.configure(url, endpoint=proxy.endpoint, retry_config=RETRIES, part_size=5 << 20)
    big = {"w": np.arange(3 << 20, dtype=np.float32)}  # 12 MiB: 3 parts
    with pytest.raises(StorageError, match="uploading") as e:
        with jckpt.CheckpointManager(f"{url}/run") as mgr:
            mgr.save(1, big)
            mgr.wait_durable()
            proxy.rule["pick"] = _part(2, kind)
            mgr.save(2, {"w": big["w"] + 1})
            mgr.wait_durable()
    assert "run/step_00000002.jckpt" in e.value.file
    assert kind == "drop" or "throttling" in e.value.message
    proxy.rule["pick"] = lambda *a: None
    with jckpt.CheckpointManager(f"{url}/run", read_only=True) as reader:
        assert reader.all_steps() == [1]
        np.testing.assert_array_equal(reader.restore(1, big).tree["w"], big["w"])


def test_a_completion_whose_answer_is_lost_says_the_object_may_be_the_new_one(faulty):
    """The store completed the upload and the connection was reset before its answer: the
    retried completion and the abort found no upload, and the error said the upload was left
    in the bucket, billed, with the command to abort it, though the object was published."""
    from jckpt.storage import object_store
    from tests.s3server import uploads_of

    url, proxy = faulty
    object_store.configure(url, endpoint=proxy.endpoint, retry_config=RETRIES, part_size=5 << 20)
    old = {"w": np.arange(3 << 20, dtype=np.float32)}  # 12 MiB: 3 parts
    jckpt.save(jckpt.Context(), old, f"{url}/m.jckpt")
    proxy.rule["pick"] = lambda method, path, headers: (
        "reset" if method == "POST" and "uploadId=" in path and "partNumber" not in path else None)
    with pytest.raises(StorageError, match="the upload is no longer there to abort") as e:
        jckpt.save(jckpt.Context(), {"w": old["w"] + 1}, f"{url}/m.jckpt")
    assert "nothing is left in the bucket" in e.value.fix and "abort-multipart-upload" not in e.value.fix
    proxy.rule["pick"] = lambda *a: None
    assert uploads_of(f"{url}/m.jckpt") == []
    back = jckpt.restore(jckpt.Context(host=True), old, f"{url}/m.jckpt")["w"]
    assert np.array_equal(back, old["w"]) or np.array_equal(back, old["w"] + 1)  # whole, one of them
