"""The directory form on disk (jckpt.storage.directory), without JAX: staging, index, publish, read."""

import dataclasses
import itertools
import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jckpt
from jckpt.errors import ChecksumError, DistributedError, FormatError
from jckpt.format.boxes import box_slices, intersect
from jckpt.format.header import Entry, Header
from jckpt.format.layout import lay_out
from jckpt.format.names import DIRECTORY_LOCK_NAME, INDEX_NAME, STAGE_DIR_TAG, piece_name
from jckpt.format.precs import prec_of
from jckpt.storage import directory as dr
from jckpt.storage.checkpoint import open_checkpoint
from jckpt.storage.lazy import LazyArray, record_reads
from jckpt.storage.reader import CheckpointReader
from jckpt.storage.writer import ArraySource, write_checkpoint
from tests.helpers import raw_file, write_directory
from tests.properties import PROPERTY

W = np.arange(32, dtype=np.float32).reshape(8, 4)
B = np.arange(4, dtype=np.int32)


def write_piece(stage, process, parts, layer=0):
    """A piece file holding ``(id, name, full array, box)`` parts, as a process writes it."""
    entries, sources = [], []
    for ident, name, full, box in parts:
        sub = np.ascontiguousarray(full[box_slices(box)])
        entries.append(Entry(id=ident, namespace="jckpt", prec=prec_of(sub.dtype), dims=sub.shape,
                             offset=0, byte_length=sub.nbytes, label=(name,), path=(("k", name),),
                             slice=box, global_dims=full.shape))
        sources.append(ArraySource(sub))
    write_checkpoint(os.path.join(stage, piece_name(process, layer)),
                     lay_out(Header(tensors=tuple(entries), alignment=32)), sources, durable=False)


def two_process_pieces(stage):
    write_piece(stage, 0, [(0, "w", W, ((0, 4), (0, 4))), (1, "b", B, ((0, 4),))])
    write_piece(stage, 1, [(0, "w", W, ((4, 8), (0, 4)))])


def save_by_hand(path, metadata=None):
    stage, lock = dr.make_stage(str(path))
    try:
        two_process_pieces(stage)
        dr.write_index(stage, 2, 32, metadata or {}, durable=False)
        dr.publish_directory(stage, str(path), durable=False)
        os.unlink(os.path.join(path, DIRECTORY_LOCK_NAME))
    finally:
        os.close(lock)


def test_publish_and_read_back(tmp_path):
    path = tmp_path / "ckpt"
    save_by_hand(path, {"step": "3"})
    assert sorted(os.listdir(path)) == [INDEX_NAME, "process_00000.jckpt", "process_00001.jckpt"]
    assert os.listdir(tmp_path) == ["ckpt"]  # no staging directory left
    reader = open_checkpoint(path)
    assert isinstance(reader, dr.DirectoryReader)
    assert dict(reader.header.metadata) == {"step": "3"}
    by_name = {e.name: e for e in reader.header.tensors}
    assert (by_name["jckpt/w"].dims, by_name["jckpt/b"].dims) == ((8, 4), (4,))
    lazy = reader.decode(by_name["jckpt/w"])
    assert isinstance(lazy, LazyArray)
    with record_reads() as log:
        np.testing.assert_array_equal(lazy[5:7, 1:3], W[5:7, 1:3])
    assert log == [(((5, 7), (1, 3)), 4 * 4)]
    assert sorted(reader._readers) == [1]  # only the file holding rows 4-8 was opened
    np.testing.assert_array_equal(np.asarray(lazy), W)
    np.testing.assert_array_equal(np.asarray(reader.decode(by_name["jckpt/b"])), B)
    assert reader.verify() == []
    assert isinstance(open_checkpoint(path / "process_00001.jckpt"), CheckpointReader)


def test_load_and_consolidate_read_the_directory(tmp_path):
    path = tmp_path / "ckpt"
    save_by_hand(path)
    _, tree = jckpt.load(jckpt.Context(), path)
    np.testing.assert_array_equal(np.asarray(tree["jckpt"]["w"]), W)
    jckpt.consolidate(path, tmp_path / "one.jckpt")
    one = CheckpointReader(tmp_path / "one.jckpt")
    assert [e.dims for e in one.header.tensors] == [(8, 4), (4,)]
    np.testing.assert_array_equal(one.decode(one.header.tensors[0]), W)


def test_a_damaged_piece_fails_verification(tmp_path):
    path = tmp_path / "ckpt"
    save_by_hand(path)
    piece = path / "process_00001.jckpt"
    reader = CheckpointReader(piece)
    at = reader.data_start + reader.header.tensors[0].offset
    data = bytearray(piece.read_bytes())
    data[at] ^= 0xFF
    piece.write_bytes(bytes(data))
    bad = dr.DirectoryReader(path).verify()
    assert len(bad) == 1 and isinstance(bad[0], ChecksumError)
    with pytest.raises(ChecksumError):
        jckpt.consolidate(path, tmp_path / "one.jckpt")
    assert not (tmp_path / "one.jckpt").exists()


def test_a_directory_without_index_is_not_a_checkpoint(tmp_path):
    stage, lock = dr.make_stage(str(tmp_path / "ckpt"))
    os.close(lock)
    two_process_pieces(stage)
    with pytest.raises(FormatError, match=f"no {INDEX_NAME}"):
        dr.DirectoryReader(stage)


def test_write_index_refuses_a_missing_process(tmp_path):
    write_piece(tmp_path, 0, [(0, "w", W, ((0, 8), (0, 4)))])
    with pytest.raises(DistributedError, match="process 1 wrote no piece file"):
        dr.write_index(str(tmp_path), 2, 32, {}, durable=False)
    assert not (tmp_path / INDEX_NAME).exists()


def test_write_index_refuses_disagreeing_processes(tmp_path):
    write_piece(tmp_path, 0, [(0, "w", W, ((0, 4), (0, 4)))])
    write_piece(tmp_path, 1, [(0, "w", W[:, :2], ((4, 8), (0, 2)))])
    with pytest.raises(DistributedError, match=r"disagree about this array: its global dims "
                                               r"is \(8, 4\) and \(8, 2\) in process_00000.jckpt "
                                               r"and process_00001.jckpt") as e:
        dr.write_index(str(tmp_path), 2, 32, {}, durable=False)
    assert "Entry(" not in str(e.value) and "shifts the ids" in e.value.fix


def test_write_index_refuses_pieces_that_do_not_tile(tmp_path):
    write_piece(tmp_path, 0, [(0, "w", W, ((0, 4), (0, 4)))])
    write_piece(tmp_path, 1, [(0, "w", W, ((5, 8), (0, 4)))])
    with pytest.raises(DistributedError, match="do not tile") as info:
        dr.write_index(str(tmp_path), 2, 32, {}, durable=False)
    assert info.value.entry == "jckpt/w"


def test_write_index_keeps_every_layer(tmp_path):
    write_piece(tmp_path, 0, [(0, "w", W, ((0, 2), (0, 4)))])
    write_piece(tmp_path, 0, [(0, "w", W, ((4, 6), (0, 4)))], layer=1)
    write_piece(tmp_path, 1, [(0, "w", W, ((2, 4), (0, 4)))])
    write_piece(tmp_path, 1, [(0, "w", W, ((6, 8), (0, 4)))], layer=1)
    dr.write_index(str(tmp_path), 2, 32, {}, durable=False)
    reader = dr.DirectoryReader(tmp_path)
    assert len(reader.files) == 4
    [array] = reader.arrays.values()
    assert [box for _, box in array.pieces] == [((0, 2), (0, 4)), ((2, 4), (0, 4)),
                                                ((4, 6), (0, 4)), ((6, 8), (0, 4))]
    np.testing.assert_array_equal(np.asarray(reader.decode(array.entry)), W)


def _grid_array(shape, cuts):
    """An indexed array of ``shape`` cut at ``cuts`` in each dimension, piece k in file k."""
    from jckpt.format.index import IndexedArray
    edges = [sorted({0, d, *c}) for d, c in zip(shape, cuts)]
    boxes = [()]
    for e in edges:
        boxes = [(*b, pair) for b in boxes for pair in itertools.pairwise(e)]
    entry = Entry(id=0, namespace="jckpt", prec="Single_prec", dims=tuple(shape), offset=0,
                  byte_length=4 * int(np.prod(shape)), path=(("k", "w"),))
    return IndexedArray(entry, tuple(enumerate(boxes)))


@pytest.mark.parametrize("box", [((0, 6), (0, 4)), ((1, 2), (1, 2)), ((2, 5), (0, 4)),
                                 ((3, 3), (0, 4)), ((5, 6), (3, 4)), ((0, 1), (0, 4))])
def test_overlapping_names_the_pieces_a_box_needs_and_only_those(box):
    from jckpt.format.boxes import box_size, intersect
    array = _grid_array((6, 4), [(2, 4), (1,)])
    expected = [(fi, pbox, common) for fi, pbox in array.pieces
                if (common := intersect(box, pbox)) is not None and box_size(common)]
    assert dr.overlapping(array, box) == expected
    assert all(type(x) is int for _, pbox, common in expected for pair in pbox + common for x in pair)


def test_overlapping_of_a_scalar_and_of_an_array_without_pieces():
    from jckpt.format.index import IndexedArray
    scalar = IndexedArray(Entry(id=1, namespace="jckpt", prec="Single_prec", dims=(), offset=0,
                                byte_length=4, path=(("k", "s"),)), ((0, ()),))
    assert dr.overlapping(scalar, ()) == [(0, (), ())]
    empty = _grid_array((0, 4), [(), ()])
    assert dr.overlapping(dataclasses.replace(empty, pieces=()), ((0, 0), (0, 4))) == []


def test_a_directory_of_many_pieces_reads_each_box_from_its_pieces(tmp_path):
    """16 processes, each holding a 2 x 2 block of a (8, 8) array and one element of a (16,)
    one: every box reads back what was saved, through the index read from disk."""
    w, v = np.arange(64, dtype=np.float32).reshape(8, 8), np.arange(16, dtype=np.int32)
    for p in range(16):
        i, j = divmod(p, 4)
        write_piece(tmp_path, p, [(0, "w", w, ((2 * i, 2 * i + 2), (2 * j, 2 * j + 2))),
                                  (1, "v", v, ((p, p + 1),))])
    dr.write_index(str(tmp_path), 16, 32, {}, durable=False)
    reader = dr.DirectoryReader(tmp_path)
    arrays = {a.entry.name: a for a in reader.arrays.values()}
    assert arrays["jckpt/w"].bounds.shape == (16, 2, 2) and arrays["jckpt/v"].bounds.shape == (16, 1, 2)
    for box in [((0, 8), (0, 8)), ((1, 7), (3, 4)), ((6, 8), (6, 8)), ((2, 2), (0, 8))]:
        np.testing.assert_array_equal(reader.read_box(arrays["jckpt/w"], box), w[box_slices(box)])
    np.testing.assert_array_equal(reader.read_box(arrays["jckpt/v"], ((3, 11),)), v[3:11])


@pytest.mark.parametrize("exchange", [True, False])
@pytest.mark.parametrize("old", ["directory", "file", None])
def test_publish_replaces_what_was_there(tmp_path, monkeypatch, exchange, old):
    if not exchange:  # a filesystem without renameat2(RENAME_EXCHANGE): renamed aside first
        monkeypatch.setattr(dr, "exchange", lambda a, b: False)
    path = tmp_path / "ckpt"
    if old == "directory":
        path.mkdir()
        (path / "stale").write_text("x")
    elif old == "file":
        path.write_text("an old single-file checkpoint")
    save_by_hand(path)
    assert sorted(os.listdir(path)) == [INDEX_NAME, "process_00000.jckpt", "process_00001.jckpt"]
    assert os.listdir(tmp_path) == ["ckpt"]


class Killed(BaseException):
    """What a SIGKILL leaves: nothing after this point runs, no OSError handler sees it."""


@pytest.mark.parametrize("old", ["directory", "file"])
def test_a_save_killed_between_setting_aside_and_renaming_in_loses_nothing(tmp_path, monkeypatch,
                                                                          old):
    """Without RENAME_EXCHANGE the old checkpoint is renamed aside, then the new one in: a kill
    between the two left no checkpoint at the path for good. Readers now find the one set
    aside, and the next save of the path puts it back before publishing."""
    path = tmp_path / "ckpt"
    ctx = jckpt.Context()
    if old == "directory":
        save_by_hand(path, {"step": "1"})
    else:
        jckpt.save(ctx, {"w": np.arange(4.0)}, path, metadata={"step": "1"})
    monkeypatch.setattr(dr, "exchange", lambda a, b: False)
    real_rename = os.rename

    def rename_then_die(a, b):
        real_rename(a, b)
        if dr.OLD_DIR_TAG in os.fspath(b):
            raise Killed

    monkeypatch.setattr(dr.os, "rename", rename_then_die)
    with pytest.raises(Killed):
        save_by_hand(path, {"step": "2"})
    monkeypatch.setattr(dr.os, "rename", real_rename)
    assert not path.exists() and len(dr.set_aside(str(path))) == 1
    assert dict(open_checkpoint(path).header.metadata)["step"] == "1"  # readers find it
    assert jckpt.describe(path).metadata and jckpt.load(ctx, path)[1]
    assert subprocess.run([sys.executable, "-m", "jckpt", "verify", str(path)],
                          capture_output=True).returncode == 0  # and so do the tools
    dr.reclaim_stage_dirs(str(path))  # what the next save of the path does first
    assert path.exists() and not dr.set_aside(str(path))
    assert dict(open_checkpoint(path).header.metadata)["step"] == "1"
    save_by_hand(path, {"step": "3"})
    assert dict(open_checkpoint(path).header.metadata)["step"] == "3"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_live_save_between_its_renames_keeps_what_it_set_aside(tmp_path, monkeypatch):
    """Another save's reclaim must not put the old checkpoint back while the save that set it
    aside is about to rename its replacement in: that save would fail ("not empty")."""
    path = tmp_path / "ckpt"
    save_by_hand(path, {"step": "1"})
    monkeypatch.setattr(dr, "exchange", lambda a, b: False)
    real_rename = os.rename

    def rename_then_race(a, b):
        real_rename(a, b)
        if dr.OLD_DIR_TAG in os.fspath(b):
            dr.reclaim_stage_dirs(str(path))  # a second save starts in the window
            assert os.path.exists(b) and not path.exists()

    monkeypatch.setattr(dr.os, "rename", rename_then_race)
    save_by_hand(path, {"step": "2"})  # succeeds
    assert dict(open_checkpoint(path).header.metadata)["step"] == "2"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_of_several_set_aside_the_newest_is_put_back(tmp_path):
    path = tmp_path / "ckpt"
    for step, token in (("1", "a" * 16), ("2", "b" * 16)):
        save_by_hand(path, {"step": step})
        os.rename(path, f"{path}{dr.OLD_DIR_TAG}{token}")
        os.utime(f"{path}{dr.OLD_DIR_TAG}{token}", ns=(int(step) * 10**9,) * 2)
    assert dict(open_checkpoint(path).header.metadata)["step"] == "2"  # readers: the newest
    dr.reclaim_stage_dirs(str(path))
    assert dict(open_checkpoint(path).header.metadata)["step"] == "2"  # and so does recovery
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_what_was_set_aside_beside_a_checkpoint_is_removed(tmp_path):
    path = tmp_path / "ckpt"
    save_by_hand(path)
    stray = tmp_path / f"ckpt{dr.OLD_DIR_TAG}{'a' * 16}"
    stray.mkdir()
    (tmp_path / f"other{dr.OLD_DIR_TAG}{'b' * 16}").mkdir()  # another path's: not ours
    dr.reclaim_stage_dirs(str(path))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", f"other{dr.OLD_DIR_TAG}{'b' * 16}"]


def test_reclaim_removes_only_abandoned_stages_of_the_path(tmp_path):
    path = str(tmp_path / "ckpt")
    dead, dead_lock = dr.make_stage(path)
    os.close(dead_lock)  # its writer is gone: the lock is free
    live, live_lock = dr.make_stage(path)
    unlocked = f"{path}{STAGE_DIR_TAG}{'0' * 16}"
    os.mkdir(unlocked)  # a writer that died before creating its lock
    other, other_lock = dr.make_stage(str(tmp_path / "other"))
    os.close(other_lock)
    try:
        assert sorted(dr.reclaim_stage_dirs(path)) == sorted([dead, unlocked])
        assert os.path.isdir(live) and os.path.isdir(other)
        assert dr.reclaim_stage_dirs(path, stale_after=-1) == [live]  # past its age: taken anyway
    finally:
        os.close(live_lock)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(other)]


def test_storage_directory_imports_without_jax():
    code = ("import sys, jckpt.storage.directory, jckpt.storage.checkpoint, jckpt.tools.consolidate; "
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_restore_refuses_a_directory_missing_a_piece_even_one_it_would_not_read(tmp_path):
    """Every process of a restore then fails alike at open, none goes on to a collective."""
    import jckpt
    from tests.helpers import write_directory
    d = write_directory(tmp_path / "ckpt", {"jckpt/w": np.arange(8.0).reshape(4, 2)})
    os.unlink(os.path.join(d, "process_00001.jckpt"))  # rows 2-3
    for read in (lambda: jckpt.load(jckpt.Context(host=True), d),
                 lambda: jckpt.restore(jckpt.Context(), {"w": np.zeros((4, 2))}, d)):
        with pytest.raises(jckpt.FormatError, match="piece file process_00001.jckpt, which the "
                                                    "index names, is missing") as e:
            read()
        assert e.value.file == os.path.join(d, "process_00001.jckpt")
    assert jckpt.verify(d).errors  # verify still opens it, to report every problem


def test_a_piece_file_from_another_save_is_refused(tmp_path):
    """The index and its pieces record the save they belong to; a piece copied in is caught."""
    import shutil

    from jckpt.api.multiprocess import save_directory
    ctx = jckpt.Context()
    save_directory(ctx, {"w": np.arange(4.0)}, tmp_path / "a")
    save_directory(ctx, {"w": -np.arange(4.0)}, tmp_path / "b")
    shutil.copy(tmp_path / "b" / "process_00000.jckpt", tmp_path / "a" / "process_00000.jckpt")
    with pytest.raises(FormatError, match="belongs to another save than the index") as e:
        jckpt.load(jckpt.Context(host=True), tmp_path / "a")
    assert e.value.file == str(tmp_path / "a" / "process_00000.jckpt")
    report = jckpt.verify(tmp_path / "a")
    assert not report.ok and any("another save" in p.message for p in report.errors)
    _, back = jckpt.load(jckpt.Context(host=True), tmp_path / "b")  # its own pieces: fine
    assert back["jckpt"]["w"].tolist() == [0, -1, -2, -3]


def test_loading_a_manager_or_one_of_its_steps_says_how_to_read_it(tmp_path):
    """load, restore and describe of a manager's directory (or a foreign-format step) said
    "not a checkpoint, or one whose save did not finish": true, but no help."""
    with jckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"w": np.ones(2)})
        mgr.save(2, {"w": np.ones(2)}, options=jckpt.CheckpointOptions(format="npz"))
    run = tmp_path / "run"
    for path, fix in ((run, f"jckpt.CheckpointManager({str(run)!r}).restore()"),
                      (run / "step_00000002.jckpt", f"CheckpointManager({str(run)!r}).restore(2)")):
        for call in (lambda p: jckpt.load(jckpt.Context(), p), jckpt.describe,
                     lambda p: jckpt.restore(jckpt.Context(), {"w": np.ones(2)}, p)):
            with pytest.raises(FormatError) as e:
                call(path)
            assert fix in e.value.fix


def test_a_directory_holding_an_orbax_checkpoint_names_it_rather_than_calling_itself_one(
        tmp_path):
    """A run's folder with an orbax step in it (`final/`, a name orbax's steps do not take):
    its error said "this is an orbax checkpoint: convert it", and converting it failed, since
    no format reads that folder. It names the checkpoint inside instead."""
    runs = tmp_path / "runs"
    (runs / "final" / "state").mkdir(parents=True)
    (runs / "final" / "_CHECKPOINT_METADATA").write_text("{}")
    (runs / "notes.txt").write_text("lr 1e-3")
    with pytest.raises(FormatError, match=f"no {INDEX_NAME}") as e:
        jckpt.restore(jckpt.Context(), {"w": np.ones(2)}, runs)
    assert e.value.fix == (f"{str(runs / 'final')!r} in it is an orbax checkpoint: restore that "
                           "path (or convert it to a jckpt file)")
    with pytest.raises(FormatError, match="no format jckpt recognises"):
        jckpt.convert(runs, tmp_path / "state.jckpt")  # what the old fix said to do


def test_an_array_of_four_word_elements_reads_whole_and_by_box(tmp_path):
    """A `Uint4x32_prec` array's lazy view has the element's trailing dim of 4, which no
    piece splits: a box over that shape (`np.asarray` asks the whole of it) was searched
    among the pieces' boxes of one dim fewer and escaped as a numpy ValueError (found by
    the reader fuzzer, seed 41: an index whose prec was changed to Uint4x32_prec)."""
    keys = np.arange(3 * 4, dtype=np.uint32).reshape(3, 4)
    for p, (lo, hi) in enumerate([(0, 2), (2, 3)]):
        entry = Entry(id=0, namespace="jckpt", prec="Uint4x32_prec", dims=(hi - lo,), offset=0,
                      byte_length=(hi - lo) * 16, label=("k",), path=(("k", "k"),),
                      slice=((lo, hi),), global_dims=(3,))
        write_checkpoint(os.path.join(tmp_path, piece_name(p)),
                         lay_out(Header(tensors=(entry,), alignment=32)),
                         [ArraySource(keys[lo:hi])], durable=False)
    dr.write_index(str(tmp_path), 2, 32, {}, durable=False)
    reader = dr.DirectoryReader(tmp_path)
    lazy = reader.decode(reader.header.tensors[0])
    assert lazy.shape == (3, 4)
    np.testing.assert_array_equal(np.asarray(lazy), keys)
    np.testing.assert_array_equal(lazy[1:3, 2:4], keys[1:3, 2:4])
    loaded = jckpt.load(jckpt.Context(host=True), tmp_path)[1]["jckpt"]["k"]
    np.testing.assert_array_equal(loaded, keys)


def test_an_index_that_says_four_word_elements_of_one_word_pieces_is_refused(tmp_path):
    """The fuzzer's case: the index's prec says `Uint4x32_prec`, its pieces hold `float32`."""
    save_by_hand(tmp_path / "ck")
    index = tmp_path / "ck" / INDEX_NAME
    raw = index.read_bytes()
    text = raw[4:4 + int.from_bytes(raw[:4], "big")].decode().rstrip()
    index.write_bytes(raw_file(text.replace("(prec Single_prec)", "(prec Uint4x32_prec)"), align=32))
    with pytest.raises(FormatError, match="as the index says") as info:
        jckpt.load(jckpt.Context(host=True), tmp_path / "ck")
    assert str(tmp_path / "ck") in str(info.value)


def test_a_reader_of_part_of_a_piece_file_asks_the_kernel_for_the_rows_it_reads_alone(tmp_path,
                                                                                      monkeypatch):
    """Reading one array of a piece file holding two advises the kernel of the rows of the
    box read alone (the read-around about it read the other array too); reading every
    array of it advises nothing, and the kernel's read-ahead streams the file."""
    from jckpt.storage import reader as reader_mod
    w, v = (np.full((1000, 300), i, np.float32) for i in range(2))  # 1.2 MB each
    path = tmp_path / "ckpt"
    stage, lock = dr.make_stage(str(path))
    write_piece(stage, 0, [(0, "w", w, ((0, 1000), (0, 300))), (1, "v", v, ((0, 1000), (0, 300)))])
    dr.write_index(stage, 1, 32, {}, durable=False)
    dr.publish_directory(stage, str(path), durable=False)
    os.close(lock)
    advised = []
    monkeypatch.setattr(reader_mod, '_advise', lambda m, start, n: advised.append((start, n)))
    reader = open_checkpoint(path)
    by_name = {e.name: e for e in reader.header.tensors}
    reader.advise([(by_name["jckpt/w"], [((500, 750), (0, 300))])])  # as a restore plans it
    np.testing.assert_array_equal(reader.decode(by_name["jckpt/w"])[500:750], w[500:750])
    piece = reader._reader(0)
    e = next(p for p in piece.header.tensors if p.name == "jckpt/w")
    page = reader_mod.mmap_mod.PAGESIZE
    lo = (piece.data_start + e.offset + 500 * 1200) // page * page
    hi = -(-(piece.data_start + e.offset + 750 * 1200) // page) * page
    assert advised and advised[0][0] == lo and sum(n for _, n in advised) == hi - lo, advised
    advised.clear()
    reader = open_checkpoint(path)
    reader.advise([(entry, None) for entry in reader.header.tensors])
    for lazy in [reader.decode(entry) for entry in reader.header.tensors]:
        np.asarray(lazy)
    assert advised == []


def _four_piece_directory(tmp_path, monkeypatch):
    """A directory of one (64, 32768) float32 array written as 4 pieces of 16 rows (4 piece
    files), and the `(start, length)` of every range the kernel is then asked to read."""
    from jckpt.storage import reader as reader_mod
    from tests.helpers import write_directory
    w = np.arange(64 * 32768, dtype=np.float32).reshape(64, 32768)  # rows of 128 KiB
    path = write_directory(tmp_path / "ck", {"w": w}, processes=4)
    advised = []
    monkeypatch.setattr(reader_mod, '_advise', lambda m, start, n: advised.append((start, n, m)))
    return w, path, advised


def test_a_restore_needing_half_of_each_of_four_pieces_asks_for_that_half_alone(tmp_path,
                                                                                monkeypatch):
    """A process whose devices need the left half of every row (a directory written by 4
    processes, restored by 2 along the other axis) has the kernel read that half of each
    piece: planned from the index before any read, not the whole piece files (the kernel's
    read-ahead over every array of the file read twice the bytes needed)."""
    from jckpt.storage import reader as reader_mod
    w, path, advised = _four_piece_directory(tmp_path, monkeypatch)
    reader = open_checkpoint(path)
    (e,) = reader.header.tensors
    left = ((0, 64), (0, 16384))
    reader.advise([(e, [left])])
    needed = w.nbytes // 2
    assert needed <= sum(n for _, n, _ in advised) <= 1.1 * needed, advised
    for fi in range(4):  # each piece file: the left half of each of its rows
        piece = reader._readers[fi]
        start = piece.data_start + piece.header.tensors[0].offset
        page = reader_mod.mmap_mod.PAGESIZE
        mine = [s for s, _, m in advised if m is piece.buffer]
        assert mine == [(start + r * 131072) // page * page for r in range(16)], (fi, mine)
    np.testing.assert_array_equal(reader.decode(e)[:, :16384], w[:, :16384])


def test_a_verified_restore_plans_the_whole_pieces_it_reads(tmp_path, monkeypatch):
    """A checksum covers a piece whole, so a verified read of half of each piece of an array
    asks the kernel for those pieces whole (and checks them): not for the other array's."""
    from jckpt.storage import reader as reader_mod
    from tests.helpers import write_directory
    w = np.ones((64, 32768), np.float32)
    path = write_directory(tmp_path / "ck", {"w": w, "v": w}, processes=4)
    advised = []
    monkeypatch.setattr(reader_mod, '_advise', lambda m, start, n: advised.append(n))
    reader = open_checkpoint(path)
    e = next(e for e in reader.header.tensors if e.name == "jckpt/w")
    reader.advise([(e, [((0, 64), (0, 16384))])], verify=True)
    assert w.nbytes <= sum(advised) <= w.nbytes + 8 * 4096, advised
    advised.clear()
    reader.advise([(e, [((0, 64), (0, 16384))])])
    assert w.nbytes // 2 <= sum(advised) <= 1.1 * w.nbytes // 2, advised


@st.composite
def _plan_case(draw):
    """An array (2 or 3 dims, 1 to 8 bytes an element) split into row pieces over 1 to 4 piece
    files, and 1 to 3 boxes of it a process's devices need."""
    shape = (draw(st.integers(4, 16)), draw(st.integers(1, 16)) * 2048,
             *draw(st.sampled_from([(), (1,), (3,)])))
    boxes = []
    for _ in range(draw(st.integers(1, 3))):
        box = []
        for i, d in enumerate(shape):  # narrow across the rows: ranges of their own
            lo = draw(st.integers(0, d - 1))
            box.append((lo, min(d, lo + draw(st.integers(1, d if i == 0 else max(1, d // 3))))))
        boxes.append(tuple(box))
    return shape, draw(st.sampled_from(["u1", "<f2", "<f4", "<i8"])), draw(st.integers(1, 4)), boxes


@PROPERTY
@given(case=_plan_case())
def test_the_planned_ranges_cover_exactly_the_boxes_needed(tmp_path_factory, case):
    """For random arrays, piece files and boxes, the ranges a restore asks the kernel for hold
    every byte of the boxes, and nothing more than the pages about them and gaps under
    `MERGE_GAP` between them; none where a piece file is needed (nearly) whole."""
    from jckpt.storage import reader as reader_mod
    shape, dtype, processes, boxes = case
    path = tmp_path_factory.mktemp("plan") / "ck"
    a = np.zeros(shape, dtype)
    write_directory(path, {"a": a}, processes=processes)
    advised = []
    with mock.patch.object(reader_mod, '_advise', lambda m, s, n: advised.append((m, s, n))):
        reader = open_checkpoint(path)
        (e,) = reader.header.tensors
        reader.advise([(e, boxes)])
    page = reader_mod.mmap_mod.PAGESIZE
    for fi in range(processes):
        piece = reader._readers.get(fi)
        if piece is None:  # a file none of the boxes overlaps is not even opened
            assert all(intersect(b, reader.arrays[e.identity].pieces[fi][1]) is None for b in boxes)
            continue
        (p,) = piece.header.tensors
        byte = np.arange(p.byte_length).reshape(*p.dims, a.itemsize)  # each element's bytes
        needed = sorted({piece.data_start + p.offset + int(x) for b in boxes
                         if (common := intersect(b, p.slice)) is not None
                         for x in byte[box_slices(common, p.slice)].ravel()})
        ranges = [(s, s + n) for m, s, n in advised if m is piece.buffer]
        if not ranges:  # the file's payload nearly whole: left to the kernel's read-ahead
            assert needed[0] - piece.data_start < reader_mod.MERGE_GAP + page
            assert piece.size - needed[-1] <= reader_mod.MERGE_GAP + page
            continue
        starts, ends = np.array([r[0] for r in ranges]), np.array([r[1] for r in ranges])
        inside = np.searchsorted(starts, needed, side="right") - 1
        assert (inside >= 0).all() and (np.asarray(needed) < ends[inside]).all()  # all covered
        for s, t in ranges:  # each range starts and ends within a page of a needed byte
            k = np.searchsorted(needed, s)
            assert k < len(needed) and needed[k] < s + page and needed[k] < t
