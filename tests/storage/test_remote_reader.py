"""The remote reader: a checkpoint read by ranges gives what the local reader gives, and reads little.

Its object is a `BytesSource` that logs each read, so each test sees exactly
which bytes were asked for.
"""

import threading

import numpy as np
import pytest

import jckpt
from jckpt.errors import ChecksumError, FormatError, StorageError
from jckpt.storage import remote_reader
from jckpt.storage.lazy import record_reads
from jckpt.storage.reader import CheckpointReader
from jckpt.storage.remote_reader import BytesSource, RemoteReader, box_runs
from tests.helpers import write_arrays


class Logged(BytesSource):
    def __init__(self, data):
        super().__init__(data)
        self.reads = []

    def head(self, length):
        self.reads.append((0, min(length, len(self.data))))
        return super().head(length)

    def read_into(self, dest, offset, version):
        self.reads.append((offset, len(dest)))
        super().read_into(dest, offset, version)

    @property
    def total(self):
        return sum(n for _, n in self.reads)


ARRAYS = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "c": np.array([1, 2, 3], np.int16),
          "big": np.arange(1 << 18, dtype=np.float64)}


@pytest.fixture
def stored(tmp_path):
    path = write_arrays(tmp_path / "m.jckpt", ARRAYS)
    return path, open(path, "rb").read()


def test_same_header_and_arrays_as_the_local_reader(stored):
    path, data = stored
    local, remote = CheckpointReader(path), RemoteReader(Logged(data), "memory://b/m.jckpt")
    assert remote.header == local.header and remote.data_start == local.data_start
    for e in local.header.tensors:
        np.testing.assert_array_equal(np.asarray(remote.decode(e, verify=True)), local.decode(e))
    assert remote.verify() == []
    assert bytes(remote.buffer) == data


def test_the_header_takes_one_read_or_two(stored, monkeypatch):
    _, data = stored
    src = Logged(data)
    RemoteReader(src, "memory://one-or-two/a/m.jckpt")
    assert len(src.reads) == 1
    monkeypatch.setattr(remote_reader, "HEAD_BYTES", 16)
    src = Logged(data)
    RemoteReader(src, "memory://one-or-two/b/m.jckpt")
    assert len(src.reads) == 2


def test_a_header_as_long_as_the_one_read_before_under_its_prefix_takes_one_read(stored, monkeypatch):
    """A header longer than the first read's took a second read, one after the other, for each
    step of a manager alike: the first read now asks for as much as the header read before
    under the same prefix, and 64 KiB more."""
    _, data = stored
    monkeypatch.setattr(remote_reader, "HEAD_BYTES", 16)
    reads = []
    for url in ("memory://guess/run/step_1.jckpt", "memory://guess/run/step_2.jckpt",
                "memory://guess/other/step_1.jckpt"):
        src = Logged(data)
        RemoteReader(src, url)
        reads.append(len(src.reads))
    assert reads == [2, 1, 2]


def test_a_checkpoint_within_the_first_read_is_read_by_it_alone(tmp_path):
    """The header's GET brought a small checkpoint whole, and each payload was asked again."""
    small = {"a": ARRAYS["a"], "c": ARRAYS["c"]}
    src = Logged(open(write_arrays(tmp_path / "s.jckpt", small), "rb").read())
    reader = RemoteReader(src, "memory://b/s.jckpt")
    arrays = {e.name: reader.decode(e, verify=True) for e in reader.header.tensors}
    assert bytes(reader.buffer) == src.data and reader.verify() == []
    assert len(src.reads) == 1
    arrays["jckpt/a"][0, 0] = 99  # a copy of its own, not a view of the shared first read
    np.testing.assert_array_equal(reader.decode(reader.header.tensors[0]), ARRAYS["a"])


def test_small_neighbours_come_in_one_read_and_a_big_payload_in_parts(stored):
    _, data = stored
    src = Logged(data)
    reader = RemoteReader(src, "memory://b/m.jckpt", part=512 << 10)
    entries = {e.name: e for e in reader.header.tensors}
    reader.decode(entries["jckpt/a"])
    reader.decode(entries["jckpt/c"])
    assert len(src.reads) == 1  # the header's read brought a and c, stored right after it
    reader.decode(entries["jckpt/big"], verify=True)
    assert len(src.reads) == 1 + 4  # 2 MiB in parts of 512 KiB


def test_a_box_reads_only_its_runs(stored):
    _, data = stored
    src = Logged(data)
    reader = RemoteReader(src, "memory://b/m.jckpt")
    big = next(e for e in reader.header.tensors if e.name == "jckpt/big")
    lazy = reader.decode(big)  # unverified and large: read box by box
    before = src.total
    with record_reads() as log:
        part = lazy[10000:12000]  # past the header's first read
    np.testing.assert_array_equal(part, ARRAYS["big"][10000:12000])
    assert src.total - before == 2000 * 8 and log == [(((10000, 12000),), 2000 * 8)]


def test_no_byte_the_headers_read_brought_is_fetched_again(stored):
    """A payload starting inside the first 64 KiB read was fetched whole: a 4 MiB array
    restored onto 8 devices read 1.016 times its bytes; now each byte once."""
    _, data = stored
    src = Logged(data)
    reader = RemoteReader(src, "memory://b/m.jckpt")
    big = next(e for e in reader.header.tensors if e.name == "jckpt/big")
    lazy = reader.decode(big)
    np.testing.assert_array_equal(lazy[0:20000], ARRAYS["big"][:20000])
    np.testing.assert_array_equal(reader.decode(big, verify=True), ARRAYS["big"])
    first = remote_reader.HEAD_BYTES
    assert src.reads[1] == (first, reader.data_start + big.offset + 20000 * 8 - first)
    assert src.reads[2] == (first, reader.data_start + big.offset + big.byte_length - first)


def test_column_boxes_fetch_their_rows_once(tmp_path):
    """A column sharding's boxes span every row in short runs: each device fetched the whole
    payload again (8 devices, 8 times its bytes)."""
    w = np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096)
    path = write_arrays(tmp_path / "w.jckpt", {"w": w})
    src = Logged(open(path, "rb").read())
    reader = RemoteReader(src, "memory://b/w.jckpt")
    lazy = reader.decode(reader.header.tensors[0])
    before = src.total
    for k in range(8):  # each device's columns, as restore asks them one after another
        part = lazy[:, k * 512:(k + 1) * 512]
        np.testing.assert_array_equal(part, w[:, k * 512:(k + 1) * 512])
    inside = remote_reader.HEAD_BYTES - reader.data_start  # the bytes the header's read brought
    assert src.total - before == w.nbytes - inside
    # a 2-D sharding whose devices alternate between row blocks (P('y', 'x') on a 2 x 4 mesh)
    for k in range(8):
        rows, cols = slice((k % 2) * 32, (k % 2 + 1) * 32), slice((k // 2) * 1024, (k // 2 + 1) * 1024)
        np.testing.assert_array_equal(lazy[rows, cols], w[rows, cols])
    assert src.total - before == 2 * (w.nbytes - inside)  # each row block fetched once
    np.testing.assert_array_equal(reader.decode(reader.header.tensors[0], verify=True), w)


def test_a_box_of_a_few_short_runs_gets_one_read_per_run_and_no_byte_between(tmp_path):
    """A block sharding's box of 16 runs or fewer, each under 1 MiB, is read run by run:
    the runs are not joined across the other devices' bytes between them, however close
    (docs/object-storage.md, "Requests per operation")."""
    w = np.arange(8 * 65536, dtype=np.float32).reshape(8, 65536)  # rows of 256 KiB
    path = write_arrays(tmp_path / "w.jckpt", {"w": w})
    src = Logged(open(path, "rb").read())
    reader = RemoteReader(src, "memory://b/w.jckpt")
    lazy = reader.decode(reader.header.tensors[0])
    before = len(src.reads)
    np.testing.assert_array_equal(lazy[:, 16384:32768], w[:, 16384:32768])  # 8 runs of 64 KiB
    start = reader.data_start + reader.header.tensors[0].offset
    assert src.reads[before:] == [(start + r * 262144 + 65536, 65536) for r in range(8)]


def test_box_runs_of_blocks():
    assert box_runs((4, 6), 4, ((0, 4), (0, 6))) == ([0], 96)
    assert box_runs((4, 6), 4, ((2, 4), (0, 6))) == ([48], 48)
    assert box_runs((2, 3, 4), 1, ((0, 2), (1, 2), (0, 4))) == ([4, 16], 4)


def test_damage_and_truncation(stored):
    _, data = stored
    damaged = bytearray(data)
    damaged[-3] ^= 0xFF
    reader = RemoteReader(BytesSource(bytes(damaged)), "memory://b/m.jckpt")
    last = max(reader.header.tensors, key=lambda e: e.offset)
    with pytest.raises(ChecksumError, match="checksum mismatch") as e:
        reader.decode(last, verify=True)
    assert e.value.file == "memory://b/m.jckpt"
    with pytest.raises(FormatError, match="extends past the end"):
        RemoteReader(BytesSource(data[:len(data) // 2]), "memory://b/m.jckpt")


class Together:
    """Reads that each wait (up to 10 s) for a second read to be in flight with it: `alone`
    counts the reads that found none, as a reader that reads one payload after another does."""

    def __init__(self, read_into):
        self.read_into, self.alone = read_into, 0
        self.barrier = threading.Barrier(2, timeout=10)

    def read(self, source, dest, offset, version):
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            self.alone += 1
            self.barrier.reset()
        self.read_into(source, dest, offset, version)


def _restored_together(monkeypatch, tree, url):
    """`tree` saved at `url` and restored, each payload read through a `Together`, which
    counts the reads made alone (none other in flight)."""
    from jckpt.storage.object_store import ObjectSource

    jckpt.save(jckpt.Context(), tree, url)
    together = Together(ObjectSource.read_into)
    monkeypatch.setattr(ObjectSource, "read_into",
                        lambda source, dest, offset, version: together.read(source, dest, offset, version))
    return jckpt.restore(jckpt.Context(host=True), tree, url), together


def test_a_restore_reads_the_payloads_of_many_entries_concurrently(monkeypatch):
    # two payloads of one GET each (below a part): a restore of a model of many such tensors was
    # one GET after another, latency-bound however many requests the store allows in flight
    tree = {"x": np.arange(1 << 17, dtype=np.float32), "y": np.ones(1 << 18, np.float32)}
    got, together = _restored_together(monkeypatch, tree, "memory://remote-reader-together/m.jckpt")
    for name, want in tree.items():
        np.testing.assert_array_equal(got[name], want)
    assert together.alone == 0


def _namespaces(path, count=10, leaves=50):
    """A file of `count` namespaces of `leaves` small arrays each (4,000 bytes apiece)."""
    trees = {f"ns{j}": {f"a{i:02d}": np.full(1000, j * 100 + i, np.float32) for i in range(leaves)}
             for j in range(count)}
    for j, (ns, tree) in enumerate(trees.items()):
        jckpt.save(jckpt.Context(namespace=ns), tree, path, appending=j > 0)
    return trees


def test_a_partial_restore_fetches_the_payloads_it_restores_not_their_neighbours(tmp_path):
    # one namespace of ten: the small payloads' GET reached 4 MiB past the first one asked, so
    # restoring 200 KB of small arrays fetched the 1.4 MB of the namespaces stored after it
    path = str(tmp_path / "ns.jckpt")
    trees = _namespaces(path)
    src = Logged(open(path, "rb").read())
    reader = RemoteReader(src, "memory://b/ns.jckpt")
    wanted = [e for e in reader.header.tensors if e.namespace == "ns3"]
    arrays = reader.decode_all(wanted, verify=True)
    for e, array in zip(wanted, arrays):
        np.testing.assert_array_equal(array, trees["ns3"][e.path[-1][1]])
    needed = sum(e.byte_length for e in wanted)
    payloads = [(offset, n) for offset, n in src.reads if offset >= reader.data_start]
    assert payloads == [(reader.data_start + wanted[0].offset, needed)]  # one GET, no byte more


def test_the_windows_of_small_payloads_are_fetched_concurrently(monkeypatch):
    # 2,000 arrays of 4,000 bytes: two windows of small payloads, read one after the other
    tree = {f"a{i:04d}": np.full(1000, i, np.float32) for i in range(2000)}
    got, together = _restored_together(monkeypatch, tree, "memory://remote-reader-windows/m.jckpt")
    np.testing.assert_array_equal(got["a1234"], tree["a1234"])
    assert together.alone == 1  # the header's rest, past its first GET; the windows were 2 more


class Failing(BytesSource):
    """Fails every read past the header's with a `StorageError`, as a store that went away."""

    def read_into(self, dest, offset, version):
        raise StorageError("reading the checkpoint failed: connection reset", file="memory://b/m.jckpt")


@pytest.mark.parametrize("lazy", [False, True])
def test_a_failed_read_names_the_entry_it_was_for(stored, lazy):
    # the error named the object alone: of a restore of many arrays, not which failed
    _, data = stored
    reader = RemoteReader(Failing(data), "memory://b/m.jckpt")
    name = "jckpt/big"
    entry = next(e for e in reader.header.tensors if e.name == name)
    with pytest.raises(StorageError, match="connection reset") as e:
        if lazy:
            reader.decode(entry)[100000:100010]
        else:
            reader.decode_all([entry], verify=True)
    assert e.value.entry == name and e.value.file == "memory://b/m.jckpt"


def test_concurrently_keeps_to_its_limit_keeps_order_and_runs_nested_calls_inline():
    """What many objects are asked (a manager's step headers) goes `limit` at a time on the
    pool of the reads of ranges; a call made from inside the pool runs there, never waiting on
    a pool whose threads all wait."""
    import time

    from jckpt.storage.remote_reader import concurrently

    lock, now, most = threading.Lock(), [0], [0]

    def call(n):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.01)
        inner = concurrently(lambda m: m + 1, range(3), 3)  # from a pool thread: inline
        with lock:
            now[0] -= 1
        return n, inner
    assert concurrently(call, range(9), 3) == [(n, [1, 2, 3]) for n in range(9)]
    assert 1 < most[0] <= 3
    with pytest.raises(ValueError, match="2"):
        concurrently(lambda n: 1 // 0 if n == 5 else int("x2") if n == 2 else n, range(8), 4)
    asked = []

    def refused(n):
        asked.append(n)
        raise PermissionError(n)
    with pytest.raises(PermissionError):  # once one failed, no more are sent
        concurrently(refused, range(100), 2)
    assert len(asked) < 100
