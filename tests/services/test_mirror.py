"""The asynchronous durable mirror: snapshots, order, counters, slots, disk errors, lease, lineage."""

import errno
import os
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jckpt
from jckpt.storage import staging as staging_mod
from jckpt.storage import writer as writer_mod
from tests.helpers import cpu_mesh, run_python

LINE = "memory mirror: committed {} durable {} generation {} pending {} error {}"


def read(path, n=4):
    return jckpt.restore(jckpt.Context(), {"w": np.zeros(n, np.float32)}, path, verify=True)["w"]


def meta(path):
    return jckpt.describe(path).metadata_dict()


def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


class Gate:
    """Blocks (or fails) every payload write of the writer while set, from any thread."""

    def __init__(self, monkeypatch):
        self.open = threading.Event()
        self.open.set()
        self.fail: OSError | None = None
        self.attempts = 0
        original = writer_mod.Sink.write
        gate = self

        def write(sink, data):
            gate.attempts += 1
            if gate.fail is not None:
                raise gate.fail
            gate.open.wait(30)
            return original(sink, data)

        monkeypatch.setattr(writer_mod.Sink, "write", write)


def test_counters_line_and_content(tmp_path):
    path = str(tmp_path / "run.jckpt")
    with jckpt.Mirror(path) as m:
        assert str(m.counters) == LINE.format(0, 0, 0, 0, 0)
        for i in range(6):
            m.submit({"w": jnp.full(4, float(i))}, metadata={"step": str(i)})
        assert m.wait_durable(timeout=30)
        c = m.counters
        assert str(c) == LINE.format(6, 6, 6, 0, 0)
        assert (c.committed, c.durable, c.generation, c.pending, c.error) == (6, 6, 6, 0, 0)
    np.testing.assert_array_equal(read(path), np.full(4, 5.0))
    md = meta(path)
    assert md["step"] == "5" and md["jckpt.generation"] == "6" and md["jckpt.lineage"] == m.lineage


def test_equal_content_makes_no_generation(tmp_path):
    path = str(tmp_path / "run.jckpt")
    with jckpt.Mirror(path) as m:
        m.submit({"w": np.ones(4, np.float32)})
        m.wait_durable()
        mtime = os.stat(path).st_mtime_ns
        m.submit({"w": np.ones(4, np.float32)})        # same bytes
        m.submit({"w": jnp.ones(4, jnp.float32)})      # same bytes from a device array
        m.wait_durable()
        assert os.stat(path).st_mtime_ns == mtime
        assert str(m.counters) == LINE.format(3, 3, 1, 0, 0)
        m.submit({"w": np.ones(4, np.float32)}, metadata={"note": "x"})  # metadata differs
        m.submit({"w": np.ones(4, np.float64)})        # dtype differs
        m.wait_durable()
        assert m.counters.generation == 3


def test_snapshot_is_isolated_from_later_updates(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    path = str(tmp_path / "run.jckpt")
    host = np.arange(4, dtype=np.float32)
    dev = jnp.arange(4, dtype=jnp.float32) * 10
    with jckpt.Mirror(path) as m:
        gate.open.clear()
        m.submit({"h": host, "d": dev})
        host[:] = -1                                     # the caller reuses its buffer
        dev = jax.jit(lambda x: x * 0, donate_argnums=0)(dev)  # and donates the device one
        gate.open.set()
        m.wait_durable()
    out = jckpt.restore(jckpt.Context(), {"h": np.zeros(4, np.float32), "d": np.zeros(4, np.float32)},
                        path)
    np.testing.assert_array_equal(out["h"], np.arange(4))
    np.testing.assert_array_equal(out["d"], np.arange(4) * 10)


def test_slot_copies_shared_leaves_into_reused_buffers_and_images_jax_arrays():
    from jckpt.services import snapshot

    slot = snapshot.Slot(0)
    host = np.arange(4, dtype=np.float32)
    key = jax.random.key(1)
    first = slot.fill([("a", (("k", "h"),), host), ("a", (("k", "n"),), 3),
                       ("a", (("k", "key"),), key)])
    assert not np.shares_memory(first[0].array, host)          # the caller's buffer is copied
    assert first[1].array.shape == () and first[1].array.item() == 3
    assert first[2].key_impl == "threefry2x32" and first[2].array.shape == (2,)
    buffer = first[0].array
    host[:] = 5
    second = slot.fill([("a", (("k", "h"),), host)])
    assert second[0].array is buffer and buffer.tolist() == [5] * 4  # the slot's buffer, reused

    dev = jnp.arange(4.0)  # a small CPU array: copied into the slot's buffer as well
    third = slot.fill([("a", (("k", "h"),), dev)])
    assert third[0].array is buffer and buffer.tolist() == [0, 1, 2, 3]
    big = jnp.arange(float(1 << 15))  # a large one: its image, drained
    fourth = slot.fill([("a", (("k", "h"),), big)])
    assert not np.shares_memory(fourth[0].array, buffer) and fourth[0].array[-1] == (1 << 15) - 1


def test_slots_block_or_refuse_and_are_not_reused_before_durable(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    path = str(tmp_path / "run.jckpt")
    with jckpt.Mirror(path, slots=2, when_full="raise") as m:
        gate.open.clear()
        m.submit({"w": np.full(4, 1, np.float32)})
        m.submit({"w": np.full(4, 2, np.float32)})
        assert m.counters.pending == 2
        with pytest.raises(jckpt.CapacityError, match="slots") as info:
            m.submit({"w": np.full(4, 3, np.float32)})
        assert info.value.fix.startswith("submit less often")  # the mirror's call, not save
        assert m.counters.committed == 2            # the refused one was not admitted
        gate.open.set()
        m.wait_durable()
        assert str(m.counters) == LINE.format(2, 2, 2, 0, 0)
    np.testing.assert_array_equal(read(path), np.full(4, 2))

    with jckpt.Mirror(path, slots=1, when_full="block") as m:
        gate.open.clear()
        m.submit({"w": np.full(4, 4, np.float32)})
        with pytest.raises(jckpt.CapacityError, match="timed out"):
            m.submit({"w": np.full(4, 5, np.float32)}, timeout=0.1)
        done = []
        t = threading.Thread(target=lambda: done.append(m.submit({"w": np.full(4, 6, np.float32)})))
        t.start()
        time.sleep(0.2)
        assert not done and m.counters.pending == 1   # blocked: the only slot is not durable
        gate.open.set()
        t.join(30)
        assert done == [2]
        assert m.counters.stalls == 2               # the timed-out submit and the blocked one
        m.wait_durable()
    np.testing.assert_array_equal(read(path), np.full(4, 6))


def test_many_snapshots_publish_in_order_and_close_loses_nothing(tmp_path):
    path = str(tmp_path / "run.jckpt")
    seen, torn = [], []
    stop = threading.Event()

    def reader():  # a concurrent reader always sees a complete generation
        while not stop.is_set():
            if os.path.exists(path):
                try:
                    w = read(path)
                except Exception as e:
                    torn.append(e)
                    continue
                if not np.all(w == w[0]):
                    torn.append(w)
                seen.append(int(w[0]))

    t = threading.Thread(target=reader)
    t.start()
    try:
        m = jckpt.Mirror(path, slots=3, ctx=jckpt.Context(durable=False))
        for i in range(40):
            m.submit({"w": np.full(4, i, np.float32)})
        m.close()                                   # no wait_durable: close must flush
    finally:
        stop.set()
        t.join(30)
    np.testing.assert_array_equal(read(path), np.full(4, 39))
    assert meta(path)["jckpt.generation"] == "40"
    assert not torn
    assert seen and seen == sorted(seen)            # generations appear in submit order
    assert str(m.counters) == LINE.format(40, 40, 40, 0, 0)


def test_trees_of_all_kinds(tmp_path):
    path = str(tmp_path / "run.jckpt")
    mesh = cpu_mesh((8,), ("x",))
    sharded = jax.device_put(jnp.arange(64.0).reshape(8, 8),
                             jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
    tree = {"s": sharded, "k": jax.random.key(3), "n": 7, "b": np.array([True, False]),
            "bf": jnp.ones(3, jnp.bfloat16)}
    with jckpt.Mirror(path) as m:
        m.submit(tree)
    out = jckpt.restore(jckpt.Context(), tree, path)
    np.testing.assert_array_equal(out["s"], sharded)
    assert out["s"].sharding == sharded.sharding
    assert np.array_equal(jax.random.key_data(out["k"]), jax.random.key_data(tree["k"]))
    assert out["n"] == 7 and out["bf"].dtype == jnp.bfloat16


def test_bad_input_is_refused_before_admission(tmp_path):
    path = str(tmp_path / "run.jckpt")
    with jckpt.Mirror(path) as m:
        with pytest.raises(jckpt.InputError, match="reserved"):
            m.submit({"w": np.ones(2)}, metadata={"jckpt.generation": "9"})
        with pytest.raises(jckpt.InputError, match="not an array"):
            m.submit({"w": "text"})
        assert str(m.counters) == LINE.format(0, 0, 0, 0, 0)
    with pytest.raises(jckpt.InputError, match="when_full"):
        jckpt.Mirror(path, when_full="drop")


def test_a_mirror_on_a_directory_is_refused_when_opened(tmp_path):
    """An empty directory was refused as "no index.jckpt ... restore from a complete
    checkpoint", nothing a writer can act on; a directory checkpoint opened, and every
    snapshot then failed to publish ("Is a directory"), in the background."""
    from jckpt.api.multiprocess import save_directory
    save_directory(jckpt.Context(), {"w": np.ones(2, np.float32)}, tmp_path / "ckpt")
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "ckpt"):
        with pytest.raises(jckpt.InputError, match="is a directory: a mirror keeps one") as e:
            jckpt.Mirror(path, new_lineage=True)
        assert e.value.file == str(path) and "CheckpointManager" in e.value.fix
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["index.jckpt", "process_00000.jckpt"]
    with jckpt.Mirror(tmp_path / "empty" / "state.jckpt") as mirror:  # what the fix says
        mirror.submit({"w": np.ones(2, np.float32)})


def test_injected_oserror_is_counted_and_retried(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    path = str(tmp_path / "run.jckpt")
    with jckpt.Mirror(path, retry_after=0.02, patience=10**6) as m:
        m.submit({"w": np.full(4, 1, np.float32)})
        m.wait_durable()
        gate.fail = OSError(errno.ENOSPC, "No space left on device")
        m.submit({"w": np.full(4, 2, np.float32)})
        wait_for(lambda: m.counters.failures >= 3)
        c = m.counters
        assert str(c) == LINE.format(2, 1, 1, 1, "ENOSPC")
        assert "No space left" in c.last_error
        np.testing.assert_array_equal(read(path), np.full(4, 1))   # the previous generation
        assert not [n for n in os.listdir(tmp_path) if ".jckpt-stage." in n]
        gate.fail = None                                            # the fault goes away
        assert m.wait_durable(timeout=30)
        assert str(m.counters) == LINE.format(2, 2, 2, 0, 0)
        assert m.counters.failures >= 3
    np.testing.assert_array_equal(read(path), np.full(4, 2))


def test_unrecovered_error_is_raised_on_wait_and_close(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    path = str(tmp_path / "run.jckpt")
    m = jckpt.Mirror(path, retry_after=0.01, patience=3)
    m.submit({"w": np.full(4, 1, np.float32)})
    m.wait_durable()
    gate.fail = OSError(errno.EIO, "Input/output error")
    m.submit({"w": np.full(4, 2, np.float32)})
    with pytest.raises(jckpt.StorageError, match="Input/output") as info:
        m.wait_durable()
    assert info.value.errno == errno.EIO and info.value.file == path
    with pytest.raises(jckpt.StorageError):
        m.close()
    np.testing.assert_array_equal(read(path), np.full(4, 1))
    with jckpt.Mirror(path) as again:            # the lease was released despite the error
        assert again.counters.generation == 1


EFBIG_CHILD = textwrap.dedent("""
    import os, resource, signal, sys, time
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    import numpy as np
    import jckpt
    path = sys.argv[1]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    m = jckpt.Mirror(path, retry_after=0.05, patience=10**6)
    m.submit({"w": np.full(1000, 1, np.float32)})
    m.wait_durable()
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    m.submit({"w": np.full(100_000, 2, np.float32)})          # 400 kB: over the limit
    deadline = time.monotonic() + 60
    while m.counters.error == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    print("during:", m.counters, flush=True)
    w = jckpt.restore(jckpt.Context(), {"w": np.zeros(1000, np.float32)}, path, verify=True)["w"]
    print("previous loads:", float(w.sum()), flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))   # the fault goes away
    print("recovered:", m.wait_durable(timeout=60), flush=True)
    print("after:", m.counters, flush=True)
    m.close()
    w = jckpt.restore(jckpt.Context(), {"w": np.zeros(100_000, np.float32)}, path, verify=True)["w"]
    print("new loads:", float(w.sum()), flush=True)
""")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_real_efbig_from_a_file_size_limit(tmp_path):
    path = str(tmp_path / "run.jckpt")
    out = run_python(EFBIG_CHILD, path, timeout=180)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines())
    assert lines["during"] == LINE.format(2, 1, 1, 1, "EFBIG")
    assert lines["previous loads"] == "1000.0"
    assert lines["recovered"] == "True"
    assert lines["after"] == LINE.format(2, 2, 2, 0, 0)
    assert lines["new loads"] == "200000.0"


def test_second_mirror_in_another_thread_is_refused(tmp_path):
    path = str(tmp_path / "run.jckpt")
    errors = []
    with jckpt.Mirror(path) as m:
        m.submit({"w": np.ones(4, np.float32)})

        def second():
            try:
                jckpt.Mirror(path)
            except jckpt.InUseError as e:
                errors.append(e)

        t = threading.Thread(target=second)
        t.start()
        t.join(30)
        assert len(errors) == 1 and "in use" in str(errors[0]) and str(os.getpid()) in str(errors[0])
    with jckpt.Mirror(path) as again:              # free once the first is closed
        assert again.counters.generation == 1
    assert not os.path.exists(path + ".jckpt-lease")


LEASE_CHILD = textwrap.dedent("""
    import sys
    import jckpt
    try:
        jckpt.Mirror(sys.argv[1]).close()
        print("opened")
    except jckpt.InUseError as e:
        print("refused:", e)
""")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_second_mirror_in_another_process_is_refused(tmp_path):
    path = str(tmp_path / "run.jckpt")

    def child():
        return run_python(LEASE_CHILD, path)

    with jckpt.Mirror(path) as m:
        m.submit({"w": np.ones(4, np.float32)})
        out = child()
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("refused:") and "in use" in out.stdout
        assert f"pid {os.getpid()}" in out.stdout
    out = child()
    assert out.stdout.strip() == "opened", out.stderr


def test_lineage_is_recorded_refused_and_continued(tmp_path):
    path = str(tmp_path / "run.jckpt")
    with jckpt.Mirror(path, lineage="run-a") as m:
        m.submit({"w": np.full(4, 1, np.float32)})
        m.submit({"w": np.full(4, 2, np.float32)})
    assert meta(path)["jckpt.lineage"] == "run-a" and meta(path)["jckpt.generation"] == "2"

    with pytest.raises(jckpt.LineageError, match="run-a") as info:
        jckpt.Mirror(path, lineage="run-b")
    assert "new_lineage=True" in str(info.value) and info.value.file == path
    with jckpt.Mirror(path) as m:                    # no lineage given: continue the file's
        assert m.lineage == "run-a" and m.counters.generation == 2
        m.submit({"w": np.full(4, 2, np.float32)})   # equal to the file: no new generation
        m.wait_durable()
        assert m.counters.generation == 2
        m.submit({"w": np.full(4, 3, np.float32)})
    assert meta(path)["jckpt.generation"] == "3"
    with jckpt.Mirror(path, lineage="run-b", new_lineage=True) as m:
        assert m.counters.generation == 0
        np.testing.assert_array_equal(read(path), np.full(4, 3))   # untouched until a submit
        m.submit({"w": np.full(4, 3, np.float32)})   # a new lineage always writes
    assert meta(path)["jckpt.lineage"] == "run-b" and meta(path)["jckpt.generation"] == "1"

    plain = str(tmp_path / "plain.jckpt")
    jckpt.save(jckpt.Context(), {"w": np.ones(4, np.float32)}, plain)
    with pytest.raises(jckpt.LineageError, match="not written by a mirror"):
        jckpt.Mirror(plain)
    with jckpt.Mirror(plain, new_lineage=True) as m:
        m.submit({"w": np.zeros(4, np.float32)})
    np.testing.assert_array_equal(read(plain), np.zeros(4))


def test_failed_publish_discards_what_was_staged_after_it_and_retries(tmp_path, monkeypatch):
    path = str(tmp_path / "run.jckpt")
    original = staging_mod.finish_staged
    broken = {"on": False, "calls": 0}

    def finish(temporary, target, *, durable):
        broken["calls"] += 1
        if broken["on"]:
            raise jckpt.StorageError("publishing the checkpoint failed: Input/output error",
                                     errno=errno.EIO, file=target)
        return original(temporary, target, durable=durable)

    monkeypatch.setattr(staging_mod, "finish_staged", finish)
    with jckpt.Mirror(path, retry_after=0.02, patience=10**6) as m:
        m.submit({"w": np.full(4, 1, np.float32)})
        m.wait_durable()
        broken["on"] = True
        m.submit({"w": np.full(4, 2, np.float32)})
        m.submit({"w": np.full(4, 1, np.float32)})   # staged behind the failing one
        wait_for(lambda: m.counters.failures >= 3)
        assert str(m.counters) == LINE.format(3, 1, 1, 2, "EIO")
        np.testing.assert_array_equal(read(path), np.full(4, 1))
        broken["on"] = False
        assert m.wait_durable(timeout=30)
        assert str(m.counters) == LINE.format(3, 3, 3, 0, 0)
    np.testing.assert_array_equal(read(path), np.full(4, 1))
    assert meta(path)["jckpt.generation"] == "3"
    assert sorted(os.listdir(tmp_path)) == ["run.jckpt"]   # nothing staged is left behind


def test_generations_staged_by_a_dead_writer_are_removed(tmp_path):
    path = str(tmp_path / "run.jckpt")
    with jckpt.Mirror(path) as m:
        m.submit({"w": np.full(4, 1, np.float32)})
    (tmp_path / "run.jckpt.jckpt-next.7").write_bytes(b"half")
    (tmp_path / "run.jckpt.jckpt-next.8.jckpt-stage.00000001.00000002.0123456789abcdef").write_bytes(
        b"its staging file")
    (tmp_path / "other.jckpt.jckpt-next.7").write_bytes(b"not ours")
    with jckpt.Mirror(path) as m:
        assert m.counters.generation == 1
    assert sorted(os.listdir(tmp_path)) == ["other.jckpt.jckpt-next.7", "run.jckpt"]


def test_reopening_a_mirror_in_a_bucket_reads_its_checkpoint_once(s3, s3_server):
    """It asked whether the object was there (HEAD), then read its header: one GET does both;
    a snapshot equal to it is still not written again."""
    url = f"{s3}/mirror.jckpt"
    state = {"w": np.arange(4, dtype=np.float32)}
    with jckpt.Mirror(url) as m:
        m.submit(state)
    before = len(s3_server.requests(s3))
    with jckpt.Mirror(url) as m:
        assert s3_server.requests(s3)[before:] == ["PUT /mirror.jckpt.jckpt-lease", "GET /mirror.jckpt"]
        m.submit(state)
        m.wait_durable()
        assert "PUT /mirror.jckpt" not in s3_server.requests(s3)[before:]  # equal: not written
    with jckpt.Mirror(f"{s3}/fresh.jckpt") as m:  # nothing there yet: the failed GET alone
        m.submit(state)
    np.testing.assert_array_equal(jckpt.restore(jckpt.Context(host=True), state, f"{s3}/fresh.jckpt")["w"],
                                  state["w"])


def test_a_generation_replaces_a_link_and_leaves_its_target_alone(tmp_path):
    """docs/reliability.md: a mirror's generation is renamed over a path that is a symlink;
    the file the link pointed at stays as it was."""
    real = tmp_path / "real.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.zeros(4, np.float32)}, real)
    before = real.read_bytes()
    link = tmp_path / "run.jckpt"
    os.symlink(real, link)
    with jckpt.Mirror(link, new_lineage=True) as mirror:
        mirror.submit({"w": np.ones(4, np.float32)})
        mirror.wait_durable()
    assert not os.path.islink(link) and real.read_bytes() == before
    assert read(link).tolist() == [1.0] * 4


def test_a_given_up_write_says_its_snapshot_is_kept_and_close_that_it_is_lost(tmp_path, monkeypatch):
    """wait_durable's error said "free disk space, then save again": a manager's user who did
    so was refused (step 2 is not above the last saved step 2), the writer keeping it anyway."""
    gate = Gate(monkeypatch)
    with jckpt.CheckpointManager(str(tmp_path / "run"), retry_after=0.01, patience=2) as mgr:
        mgr.save(1, {"w": np.ones(4, np.float32)}, force=True)
        mgr.wait_durable()
        gate.fail = OSError(errno.ENOSPC, "No space left on device")
        mgr.save(2, {"w": np.full(4, 2, np.float32)}, force=True)
        with pytest.raises(jckpt.StorageError) as info:
            mgr.wait_durable()
        assert info.value.errno == errno.ENOSPC and "save again" not in info.value.fix
        assert "kept and retried" in info.value.fix and "wait_durable()" in info.value.fix
        gate.fail = None  # room is made: the fix's wait_durable writes step 2
        assert mgr.wait_durable() and mgr.all_steps() == [1, 2]
    m = jckpt.Mirror(str(tmp_path / "m.jckpt"), retry_after=0.01, patience=2)
    gate.fail = OSError(errno.ENOSPC, "No space left on device")
    m.submit({"w": np.ones(4, np.float32)})
    with pytest.raises(jckpt.StorageError) as info:
        m.close()  # its last attempt: the snapshot is not kept after it
    assert info.value.fix == "free disk space, then save again"


def test_a_lone_surrogate_in_metadata_is_refused_at_submit(tmp_path):
    """It was accepted, and the background write failed later with no key named."""
    path = str(tmp_path / 'm.jckpt')
    with jckpt.Mirror(path) as m:
        with pytest.raises(jckpt.InputError, match="the value of metadata key 'src'") as e:
            m.submit({'a': np.ones(2)}, metadata={'src': os.fsdecode(b'data\xff')})
        assert e.value.file == path
        m.submit({'a': np.ones(2)}, metadata={'src': 'data'})
    assert jckpt.restore(jckpt.Context(), {'a': np.zeros(2)}, path)['a'].tolist() == [1.0, 1.0]


def test_a_lone_surrogate_in_a_tree_key_is_refused_at_submit(tmp_path):
    path = str(tmp_path / 'm.jckpt')
    with jckpt.Mirror(path) as m:
        with pytest.raises(jckpt.InputError, match='lone surrogate') as e:
            m.submit({'a': {os.fsdecode(b'b\xff'): np.ones(2)}})
        assert e.value.file == path and e.value.entry.startswith('jckpt/a')
        m.submit({'a': np.ones(2)})


def test_a_close_that_times_out_keeps_the_path_and_the_next_close_writes_the_rest(tmp_path, monkeypatch):
    """The mirror released its lease and stopped writing: a second close returned at once and
    the file kept an older snapshot."""
    from jckpt.services import base
    path = str(tmp_path / "m.jckpt")
    gate = threading.Event()
    write = base.BackgroundWriter._write_staged

    def slow(self, *args, **kwargs):
        gate.wait(30)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(base.BackgroundWriter, "_write_staged", slow)
    m = jckpt.Mirror(path)
    m.submit({"w": np.ones(3, np.float32)})
    m.submit({"w": np.full(3, 2, np.float32)})
    with pytest.raises(jckpt.CheckpointError, match="writer is still open"):
        m.close(timeout=0.05)
    with pytest.raises(jckpt.InUseError):
        jckpt.Mirror(path)                             # still its writer's
    gate.set()
    m.close()
    assert m.counters.durable == 2
    np.testing.assert_array_equal(jckpt.load(jckpt.Context(), path)[1]["jckpt"]["w"], [2, 2, 2])
    jckpt.Mirror(path).close()                         # released now


def test_a_managers_step_is_not_continued_as_a_mirrors_file(tmp_path):
    """A mirror opened on a manager's step continued its lineage and rewrote the step: its
    metrics gone, and the manager's retention deleting what the mirror kept."""
    with jckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(3, {"w": np.ones(2, np.float32)}, metrics={"loss": 0.5}, force=True)
    step = str(tmp_path / "run" / "step_00000003.jckpt")
    before = open(step, "rb").read()
    with pytest.raises(jckpt.LineageError, match="step 3 of a checkpoint manager") as e:
        jckpt.Mirror(step)
    assert e.value.file == step and "outside the manager's directory" in e.value.fix
    assert open(step, "rb").read() == before
    with jckpt.CheckpointManager(tmp_path / "run") as mgr:   # its lease was given back
        assert mgr.metrics(3) == {"loss": 0.5}


def test_a_mirror_on_a_bucket_prefix_holding_objects_is_refused_as_a_directory_is(s3):
    """`Mirror('s3://b/run')` over a manager's run was accepted, where a local directory is
    refused: a prefix holding objects is refused alike, its objects and no lease left behind,
    and the file the fix names opens."""
    pytest.importorskip("obstore")
    with jckpt.CheckpointManager(f"{s3}/run") as mgr:
        mgr.save(1, {"w": np.ones(2)})
    before = sorted(jckpt.storage.backend.backend_for(s3).list(f"{s3}/run"))
    with pytest.raises(jckpt.InputError, match="is a prefix holding objects: a mirror keeps one") as e:
        jckpt.Mirror(f"{s3}/run", new_lineage=True)
    assert e.value.file == f"{s3}/run" and "CheckpointManager" in e.value.fix
    assert sorted(jckpt.storage.backend.backend_for(s3).list(f"{s3}/run")) == before
    assert "run.jckpt-lease" not in jckpt.storage.backend.backend_for(s3).list(s3)  # given back
    with jckpt.Mirror(f"{s3}/run/state.jckpt", new_lineage=True) as mirror:  # what the fix says
        mirror.submit({"w": np.ones(2, np.float32)})
