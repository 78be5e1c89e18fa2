"""The storage backend seam: the local backend round-trips; object store URLs go to their backend;
URLs no backend serves are refused."""

import os

import numpy as np
import pytest

import jckpt
from jckpt.errors import InputError, InUseError
from jckpt.format.header import Entry, Header
from jckpt.format.layout import lay_out
from jckpt.storage import LOCAL, Backend, LocalBackend, backend_for, open_checkpoint
from jckpt.storage.backend import checked_path, url_scheme
from jckpt.storage.directory import DirectoryReader
from jckpt.storage.writer import ArraySource, write_checkpoint

URLS = ["ftp://bucket/model.jckpt", "hdfs://bucket/run/ckpt", "FTP://Bucket/x", "file:///tmp/x.jckpt"]


def test_plain_paths_are_local(tmp_path):
    for path in ["model.jckpt", str(tmp_path / "x.jckpt"), tmp_path / "x.jckpt", "dir/s3:x",
                 "./s3://not-a-url-here", b"bytes.jckpt"]:
        assert backend_for(path) is LOCAL, path
        assert url_scheme(path) is None
    assert isinstance(LOCAL, LocalBackend)
    assert isinstance(LOCAL, Backend)  # structurally: it has every method of the protocol


def test_local_backend_round_trip(tmp_path):
    target = str(tmp_path / "x.jckpt")
    data = np.arange(6, dtype=np.float32)
    header = lay_out(Header(tensors=(Entry(id=0, namespace="jckpt", prec="Single_prec", dims=(6,),
                                           offset=0, byte_length=24, label=("w",),
                                           path=(("k", "w"),)),)))
    with LOCAL.create(target, durable=False) as staged:  # nothing at target until published
        os.write(staged.fd, b"partial")
        assert not os.path.exists(target)
    assert LOCAL.list(str(tmp_path)) == []  # abandoned: the staging file is gone
    write_checkpoint(target, header, [ArraySource(data)], durable=False)
    reader = LOCAL.open(target)
    np.testing.assert_array_equal(reader.decode(reader.header.tensors[0]), data)
    assert LOCAL.list(str(tmp_path)) == ["x.jckpt"] and not LOCAL.isdir(target)
    with LOCAL.lease(target) as lease:
        assert lease.held
        with pytest.raises(InUseError, match="in use"):
            LOCAL.lease(target)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    assert LOCAL.isdir(str(tmp_path / "d"))
    LOCAL.remove(str(tmp_path / "d"))
    LOCAL.remove(target)
    LOCAL.remove(target)  # already gone: fine
    assert LOCAL.list(str(tmp_path)) == []


def test_sizes_of_files_and_directories(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "a").write_bytes(b"x" * 10)
    (tmp_path / "d" / "e" / "b").write_bytes(b"x" * 1000)
    (tmp_path / "d" / "link").symlink_to(tmp_path / "d" / "e" / "b")
    link = os.lstat(tmp_path / "d" / "link").st_size
    assert LOCAL.size(str(tmp_path / "d" / "a")) == 10
    assert LOCAL.size(str(tmp_path / "d")) == 1010 + link
    assert LOCAL.size(str(tmp_path / "d" / "link")) == link
    assert LOCAL.size(str(tmp_path / "missing")) == 0


def test_same_place_and_occupied(tmp_path):
    from jckpt.storage.backend import occupied, same_place
    (tmp_path / "a").write_bytes(b"x")
    os.symlink(tmp_path / "a", tmp_path / "link")
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    assert same_place(str(tmp_path / "a"), str(tmp_path / "link"))
    assert not same_place(str(tmp_path / "a"), str(tmp_path / "missing"))
    assert same_place("s3://b/run/x", "S3A://b//run/x") and not same_place("s3://b/x", "gs://b/x")
    assert not same_place("s3://b/x", str(tmp_path / "a"))
    assert occupied(str(tmp_path / "dangling")) and not occupied(str(tmp_path / "missing"))
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, "memory://occupied/run/x.jckpt")
    assert occupied("memory://occupied/run/x.jckpt") and occupied("memory://occupied/run")
    assert not occupied("memory://occupied/run/y")


def test_listing_a_missing_directory_is_a_storage_error(tmp_path):
    with pytest.raises(jckpt.StorageError, match="listing the directory failed") as info:
        LOCAL.list(str(tmp_path / "missing"))
    assert info.value.file == str(tmp_path / "missing")


@pytest.mark.parametrize("url", URLS)
def test_backend_for_refuses_urls(url):
    with pytest.raises(InputError, match=f"no storage backend for URL scheme '{url_scheme(url)}'") \
            as info:
        backend_for(url)
    assert info.value.file == url
    assert "local filesystem path" in info.value.fix and "s3://" in info.value.fix


@pytest.mark.parametrize("url", ["s3://bucket/model.jckpt", "gs://bucket/run/ckpt", "S3://Bucket/x",
                                 "az://container/x", "memory://b/x"])
def test_object_store_urls_have_their_backend(url):
    pytest.importorskip("obstore")
    from jckpt.storage.object_backend import OBJECT_STORE

    assert backend_for(url) is OBJECT_STORE
    assert isinstance(OBJECT_STORE, Backend)


def test_a_missing_library_is_named(monkeypatch):
    from jckpt.storage import object_store

    monkeypatch.setattr(object_store, "available", lambda: False)
    with pytest.raises(InputError, match="need obstore") as info:
        backend_for("s3://bucket/x")
    assert info.value.fix == "pip install 'jckpt[cloud]'"


@pytest.fixture
def in_empty_dir(tmp_path, monkeypatch):
    """Run in an empty directory and check that nothing was created there (ftp: taken as a dir)."""
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    assert os.listdir(tmp_path) == []


URL = "ftp://bucket/model.jckpt"
NO_BACKEND = "no storage backend for URL scheme 'ftp'"


def test_save_refuses_a_url(in_empty_dir):
    with pytest.raises(InputError, match=NO_BACKEND):
        jckpt.save(jckpt.Context(), {"w": np.ones(3, np.float32)}, URL)
    with pytest.raises(InputError, match=NO_BACKEND):
        jckpt.save(jckpt.Context(), {"w": np.ones(3, np.float32)}, URL, appending=True)


def test_directory_save_refuses_a_url(in_empty_dir):
    from jckpt.api.multiprocess import save_directory

    with pytest.raises(InputError, match=NO_BACKEND):
        save_directory(jckpt.Context(), {"w": np.ones(3, np.float32)}, URL)


def test_reads_refuse_a_url(in_empty_dir):
    with pytest.raises(InputError, match=NO_BACKEND):
        jckpt.load(jckpt.Context(), URL)
    with pytest.raises(InputError, match=NO_BACKEND):
        jckpt.restore(jckpt.Context(), {"w": np.zeros(3, np.float32)}, URL)
    with pytest.raises(InputError, match=NO_BACKEND):
        jckpt.describe(URL)


def test_storage_calls_refuse_a_url(in_empty_dir):
    header = lay_out(Header())
    with pytest.raises(InputError, match=NO_BACKEND):
        write_checkpoint(URL, header, [], durable=False)
    with pytest.raises(InputError, match=NO_BACKEND):
        open_checkpoint(URL)
    with pytest.raises(InputError, match=NO_BACKEND):
        DirectoryReader(URL)
    with pytest.raises(InputError, match=NO_BACKEND):
        jckpt.consolidate(URL, "one.jckpt")


def test_checked_path_takes_str_bytes_and_pathlike_and_refuses_the_rest(tmp_path):
    assert checked_path("a/b.jckpt") == "a/b.jckpt"
    assert checked_path(b"a/b.jckpt") == "a/b.jckpt"
    assert checked_path(tmp_path / "x") == str(tmp_path / "x")
    for bad in (5, None, 1.5, ["a"]):
        with pytest.raises(InputError, match="a path must be a str or os.PathLike") as err:
            checked_path(bad)
        assert err.value.fix and isinstance(err.value, TypeError)
    with pytest.raises(InputError, match="a path must be"):
        backend_for(5)


def test_list_kinds_tells_files_from_directories(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"x")
    assert LOCAL.list_kinds(str(tmp_path)) == (["f"], ["d"])
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, "memory://kinds/run/a.jckpt")
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, "memory://kinds/run/b/c.jckpt")
    assert backend_for("memory://kinds/run").list_kinds("memory://kinds/run") == (["a.jckpt"], ["b"])


def test_a_local_remove_all_removes_each_path_as_remove_does(tmp_path):
    from jckpt.storage.backend import LOCAL

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x")
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"x")
    LOCAL.remove_all([str(tmp_path / "a"), str(tmp_path / "d"), str(tmp_path / "gone")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_foreign_at_says_what_replacing_a_path_would_lose(tmp_path):
    """The one test behind every refusal to replace what jckpt did not write."""
    from jckpt.format.names import INDEX_NAME
    from jckpt.storage.backend import foreign_at, refuse_foreign

    assert foreign_at(str(tmp_path / "none")) is None
    assert foreign_at(str(tmp_path)) is None  # an empty directory
    step = tmp_path / "step"
    step.mkdir()
    for name in (INDEX_NAME, "process_00000.jckpt", "model.safetensors"):
        (step / name).write_bytes(b"")
    assert foreign_at(str(step)) is None  # only what a directory checkpoint or a step holds
    (step / "notes.txt").write_text("mine")
    held = "a directory holding 1 entry that is no part of a checkpoint (notes.txt)"
    assert foreign_at(str(step), lambda p: True) == held  # a jckpt index: its names decide
    other = tmp_path / "other"
    other.mkdir()
    for i in range(5):
        (other / f"f{i}").write_text("x")
    assert foreign_at(str(other), lambda p: True) is None  # another format's, as claimed
    assert foreign_at(str(other), kind="an orbax checkpoint") == (
        "a directory holding 5 entries that are no part of an orbax checkpoint (f0, f1, f2, ...)")
    text = tmp_path / "notes.txt"
    text.write_text("precious")
    assert foreign_at(str(text)) == "a file that is not a checkpoint (8 bytes)"
    assert foreign_at(str(text), lambda p: True) is None
    mine = write_checkpoint(str(tmp_path / "m.jckpt"), lay_out(Header(tensors=())), [], durable=False)
    assert mine is not None and foreign_at(str(tmp_path / "m.jckpt")) is None
    os.symlink(text, tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    assert foreign_at(str(tmp_path / "link")) is None  # the link is replaced, never followed
    assert foreign_at(str(tmp_path / "fifo")) is None  # publish.refuse_special, never opened
    with pytest.raises(InputError, match=r"merging would replace a file that is not") as e:
        refuse_foreign(str(text), "merging")
    assert e.value.file == str(text) and "never deletes" in e.value.fix


def test_foreign_at_in_a_bucket():
    """A prefix of other objects, or another object, is named as locally; a bucket's own
    checkpoint file is not."""
    pytest.importorskip("obstore", reason="obstore is not installed (pip install 'jckpt[cloud]')")
    from jckpt.storage.backend import foreign_at

    root = "memory://foreign-at/run"
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, f"{root}/m.jckpt")
    assert foreign_at(f"{root}/m.jckpt") is None and foreign_at(f"{root}/none") is None
    with backend_for(f"{root}/notes.txt").create(f"{root}/notes.txt") as staged:
        os.write(staged.fd, b"precious")
        staged.publish()
    assert foreign_at(f"{root}/notes.txt") == "a file that is not a checkpoint (8 bytes)"
    assert foreign_at(root) == ("a directory holding 2 entries that are no part of a checkpoint "
                                "(m.jckpt, notes.txt)")
