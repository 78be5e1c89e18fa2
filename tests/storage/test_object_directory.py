"""Directory checkpoints replaced in an object store: the index is the commit.

Against moto's S3 server (and obstore's memory store configured for a
gs:// bucket): a directory checkpoint saved again at its URL is replaced at
the index's PUT, the replaced pieces are deleted after it, a save that fails
or is killed before its index leaves the previous checkpoint as it was, the
next save deletes what a killed one left, and a reader of the replaced index
gets an error rather than another checkpoint's values.
"""

import os
import re
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import jckpt
from jckpt.api import multiprocess
from jckpt.api.multiprocess import save_directory
from jckpt.format.names import piece_name, piece_tag, save_tag
from jckpt.storage import backend_for, object_directory, object_store
from jckpt.storage.checkpoint import open_checkpoint
from tests.s3server import CREDENTIALS

pytest.importorskip("obstore", reason="obstore is not installed (pip install 'jckpt[cloud]')")

HOST = jckpt.Context(host=True)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tree(version):
    return {"w": np.arange(40_000, dtype=np.float32).reshape(200, 200) + 1000 * version,
            "b": np.arange(7, dtype=np.int32) + version, "step": np.int64(version)}


def assert_is(url, version):
    back = jckpt.restore(HOST, tree(0), url)
    for k, v in tree(version).items():
        np.testing.assert_array_equal(back[k], v)
    assert jckpt.verify(url).ok


def objects(url):
    """Every object under the URL's prefix, with its bytes."""
    u = object_store.ObjectURL.parse(url)
    obs, store = object_store.obstore_module(), object_store.store_for(u)
    return {o["path"][len(u.prefix):]: bytes(obs.get(store, o["path"]).bytes())
            for chunk in obs.list(store, prefix=u.prefix) for o in chunk}


def tags(url):
    return {piece_tag(n) for n in backend_for(url).list(url) if piece_tag(n) is not None}


def test_replacing_a_directory_checkpoint_at_its_url(s3):
    url = f"{s3}/ckpt"
    save_directory(jckpt.Context(), tree(1), url)
    (first,) = tags(url)
    assert backend_for(url).list(url) == ["index.jckpt", piece_name(0, 0, first)]
    jckpt.save(jckpt.Context(), tree(2), url)  # a URL holding a directory checkpoint stays one
    (second,) = tags(url)
    assert second != first
    assert backend_for(url).list(url) == ["index.jckpt", piece_name(0, 0, second)]
    assert_is(url, 2)
    assert backend_for(s3).list(s3) == ["ckpt"]  # nothing beside it


def test_a_save_failing_before_its_index_keeps_the_previous_checkpoint(s3, monkeypatch):
    url = f"{s3}/ckpt"
    save_directory(jckpt.Context(), tree(1), url)
    before = objects(url)

    def fail(*args, **kwargs):
        raise jckpt.StorageError("injected: the store failed", file=url)

    with monkeypatch.context() as m:  # before the index's PUT: the save's pieces are deleted
        m.setattr(object_directory, "current_files", fail)
        with pytest.raises(jckpt.StorageError, match="injected"):
            jckpt.save(jckpt.Context(), tree(2), url)
    assert objects(url) == before
    assert_is(url, 1)
    with monkeypatch.context() as m:  # the index's PUT fails: it may be in, so the pieces stay
        m.setattr(multiprocess, "write_index_file", fail)
        with pytest.raises(jckpt.StorageError, match="injected"):
            jckpt.save(jckpt.Context(), tree(2), url)
    now = objects(url)
    assert {n: now[n] for n in before} == before and len(now) == len(before) + 1
    assert_is(url, 1)
    jckpt.save(jckpt.Context(), tree(3), url)  # that save has ended: the next one deletes its pieces
    (tag,) = tags(url)
    assert sorted(objects(url)) == ["index.jckpt", piece_name(0, 0, tag)]
    assert_is(url, 3)


KILLED_SAVE = """
import os, sys
import numpy as np
import jckpt
from jckpt.api import multiprocess

def die(*args, **kwargs):
    os._exit(17)  # killed after writing its pieces, before its index

multiprocess.write_index_file = die
tree = {"w": np.zeros((200, 200), np.float32), "b": np.zeros(7, np.int32), "step": np.int64(9)}
jckpt.save(jckpt.Context(), tree, sys.argv[1])
"""


def test_a_killed_save_leaves_the_previous_checkpoint_and_the_next_save_cleans_up(s3, s3_server):
    url = f"{s3}/ckpt"
    save_directory(jckpt.Context(), tree(1), url)
    before = objects(url)
    env = dict(os.environ, **CREDENTIALS, AWS_ENDPOINT_URL=s3_server.endpoint,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_SAVE), url], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 17, done.stderr[-3000:]
    now = objects(url)
    orphans = sorted(set(now) - set(before))
    assert len(orphans) == 1 and re.fullmatch(r"process_00000\.s[0-9a-f]{24}\.jckpt", orphans[0])
    assert {n: now[n] for n in before} == before  # the previous checkpoint, bit for bit
    assert_is(url, 1)
    # the writer of the orphan was a process of this host that is gone: the next save deletes it
    jckpt.save(jckpt.Context(), tree(3), url)
    (tag,) = tags(url)
    assert sorted(objects(url)) == ["index.jckpt", piece_name(0, 0, tag)]
    assert_is(url, 3)


def test_orphans_of_a_writer_elsewhere_are_kept_until_old(s3, monkeypatch):
    url = f"{s3}/ckpt"
    save_directory(jckpt.Context(), tree(1), url)
    # a save running on another host: its pieces are not this save's to delete, until they are old
    elsewhere = piece_name(1, 0, save_tag(0x1234, 42, 7))
    backend_for(url).stream(f"{url}/{elsewhere}", iter([b"x"]), 1)
    jckpt.save(jckpt.Context(), tree(2), url)
    assert elsewhere in backend_for(url).list(url)
    monkeypatch.setattr(object_directory, "STALE_AFTER", -1.0)  # everything is old
    jckpt.save(jckpt.Context(), tree(3), url)
    (tag,) = tags(url)
    assert backend_for(url).list(url) == ["index.jckpt", piece_name(0, 0, tag)]
    assert_is(url, 3)


def test_a_save_still_running_keeps_its_pieces_through_another_save(s3, monkeypatch):
    """Two saves of one URL at once: the one that commits first leaves the other's pieces alone,
    and the one that commits last is the checkpoint."""
    url = f"{s3}/ckpt"
    save_directory(jckpt.Context(), tree(1), url)
    real, reached, gate = multiprocess.indexed_pieces, threading.Event(), threading.Event()

    def held(*args, **kwargs):  # the slow save waits after its pieces, before its index
        if threading.current_thread().name == "slow":
            reached.set()
            assert gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(multiprocess, "indexed_pieces", held)
    errors = []
    slow = threading.Thread(name="slow", target=lambda: _save_catching(tree(2), url, errors))
    slow.start()
    assert reached.wait(60)
    (slow_tag,) = tags(url) - {piece_tag(n) for n in open_checkpoint(url).files}
    jckpt.save(jckpt.Context(), tree(3), url)  # commits first: the slow save is running here
    assert_is(url, 3)
    assert piece_name(0, 0, slow_tag) in backend_for(url).list(url)
    gate.set()
    slow.join(60)
    assert not errors
    assert backend_for(url).list(url) == ["index.jckpt", piece_name(0, 0, slow_tag)]
    assert_is(url, 2)


def _save_catching(value, url, errors):
    try:
        jckpt.save(jckpt.Context(), value, url)
    except Exception as e:
        errors.append(e)


def test_uploads_that_killed_writers_left_for_pieces_are_aborted(s3):
    """A piece name is used by one save only, so no later writer of its key would abort what a
    killed writer of it left: the next save of the checkpoint does, sparing a live writer's."""
    from tests.s3server import dead_pid, markers_of, plant_marker, start_upload, uploads_of

    url = f"{s3}/ckpt"
    save_directory(jckpt.Context(), tree(1), url)
    dead = f"{url}/{piece_name(1, 0, save_tag(object_directory._host(), dead_pid(), 1))}"
    plant_marker(dead, "dead", pid=dead_pid())
    start_upload(dead)
    live = f"{url}/{piece_name(1, 0, save_tag(0x1234, 42, 7))}"  # another host's save, running
    plant_marker(live, "live")
    kept = start_upload(live)
    jckpt.save(jckpt.Context(), tree(2), url)
    assert uploads_of(dead) == [] and markers_of(dead) == []
    assert [i for _, i in uploads_of(live)] == [kept] and len(markers_of(live)) == 1
    assert_is(url, 2)


def test_a_reader_of_the_replaced_index_gets_an_error_not_a_mix(s3):
    url = f"{s3}/ckpt"
    big = {"w": np.arange(1_500_000, dtype=np.float32), "b": np.arange(7, dtype=np.int32)}
    save_directory(jckpt.Context(), big, url)  # w: 6 MB, more than one read of neighbours
    reader = open_checkpoint(url)  # the index is read; the pieces not yet
    early = open_checkpoint(url)
    entries = {e.path: e for e in early.header.tensors}
    np.testing.assert_array_equal(np.asarray(early.decode(entries[(("k", "b"),)])[:]), big["b"])
    jckpt.save(jckpt.Context(), tree(2), url)
    w = next(e for e in reader.header.tensors if e.path == (("k", "w"),))
    with pytest.raises(jckpt.FormatError, match="is gone: the checkpoint was replaced") as err:
        reader.decode(w)[:]
    assert "open the checkpoint again" in str(err.value)
    with pytest.raises(jckpt.FormatError, match="is gone: the checkpoint was replaced"):
        early.decode(entries[(("k", "w"),)], verify=True)[:]  # its piece's header was read
    assert_is(url, 2)


def test_a_directory_replaces_a_file_checkpoint_at_the_same_url(s3):
    url = f"{s3}/ckpt"
    jckpt.save(jckpt.Context(), tree(1), url)
    save_directory(jckpt.Context(), tree(2), url)
    assert not backend_for(url).exists(url)  # the file, which readers would see first, is gone
    assert_is(url, 2)


def test_the_same_in_a_gs_bucket_through_a_memory_store():
    from obstore.store import MemoryStore

    object_store.configure("gs://dirs", store=MemoryStore())
    try:
        url = "gs://dirs/run/ckpt"
        save_directory(jckpt.Context(), tree(1), url)
        jckpt.save(jckpt.Context(), tree(2), url)
        (tag,) = tags(url)
        assert backend_for(url).list(url) == ["index.jckpt", piece_name(0, 0, tag)]
        assert_is(url, 2)
    finally:
        object_store.configure("gs://dirs")


def test_whose_orphans_are_surely_gone():
    host = object_directory._host()
    mine = object_directory.new_tag()
    assert object_directory.writer_gone(mine)  # a save of this process that is not running
    with object_directory.saving(mine):
        assert not object_directory.writer_gone(mine)
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    assert object_directory.writer_gone(save_tag(host, int(child.stdout), 1))  # exited
    assert not object_directory.writer_gone(save_tag(host, os.getppid(), 1))  # running
    assert not object_directory.writer_gone(save_tag(host ^ 1, 999_999_999, 1))  # another host
    assert not object_directory.writer_gone("not-a-tag")


def test_a_verified_restore_onto_a_mesh_fetches_each_piece_once(monkeypatch):
    """Each device's box fetched and verified every piece it overlaps again: 8 devices, the
    pieces' bytes 4 to 8 times over."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from tests.helpers import cpu_mesh
    w = np.arange(256 * 512, dtype=np.float32).reshape(256, 512)
    mesh = cpu_mesh((2, 4), ("a", "b"))
    url = "memory://dir-reads/ckpt"
    save_directory(jckpt.Context(), {"w": jax.device_put(w, NamedSharding(mesh, PartitionSpec("a", "b")))},
                   url)
    fetched = []
    real, head = object_store.ObjectSource.read_into, object_store.ObjectSource.head
    monkeypatch.setattr(object_store.ObjectSource, "read_into",
                        lambda self, dest, offset, version: (fetched.append(len(dest)),
                                                             real(self, dest, offset, version))[1])
    monkeypatch.setattr(object_store.ObjectSource, "head",  # a piece's first GET brings payload too
                        lambda self, n: (got := head(self, n), fetched.append(len(got[0])))[0])
    rows = cpu_mesh((8,), ("d",))
    for spec in (PartitionSpec("d"), PartitionSpec(None, "d")):
        fetched.clear()
        target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(rows, spec))}
        back = jckpt.restore(jckpt.Context(), target, url)  # verified: a URL
        np.testing.assert_array_equal(np.asarray(back["w"]), w)
        assert w.nbytes <= sum(fetched) < 1.1 * w.nbytes, (spec, sum(fetched) / w.nbytes)


@pytest.mark.parametrize("verify", [True, False])
def test_a_piece_removed_while_it_is_read_says_the_checkpoint_was_replaced(verify):
    """Its header read, its payload gone: a StorageError said "removed while it was read",
    where the docs promise the FormatError of a replaced checkpoint."""
    from jckpt.storage.directory import DirectoryReader
    url = f"memory://removed-{verify}/ckpt"
    save_directory(jckpt.Context(), {"w": np.arange(1 << 17, dtype=np.float32)}, url)
    reader = DirectoryReader(url)
    array = next(iter(reader.arrays.values()))
    (fi, _), = array.pieces
    reader._reader(fi)  # its header read, as a restore reads it
    backend_for(url).remove(f"{url}/{reader.files[fi]}")
    with pytest.raises(jckpt.FormatError, match="is gone: the checkpoint was replaced") as e:
        np.asarray(reader.decode(array.entry, verify=verify)[-10:])
    assert "open the checkpoint again" in e.value.fix
