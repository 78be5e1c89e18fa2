"""Atomic publishing: staging files, reclaiming, failures, and contention between processes."""

import errno
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

import jckpt
from jckpt.errors import StorageError
from jckpt.storage import publish
from jckpt.storage.publish import StagingFile, reclaim_staging


def stage_name(target, pid=0x7FFFFFFE, n=1, nonce=2):
    return f"{target}.jckpt-stage.{pid:08x}.{n:08x}.{nonce:016x}"


def test_staging_is_exclusive_and_removed_on_failure(tmp_path):
    target = str(tmp_path / "t.jckpt")
    with pytest.raises(RuntimeError):
        with StagingFile(target) as s:
            assert os.path.basename(s.path).startswith("t.jckpt.jckpt-stage.")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_locked_staging_file_is_not_reclaimed(tmp_path):
    target = str(tmp_path / "t.jckpt")
    with StagingFile(target) as live:
        assert reclaim_staging(target, stale_after=0) == []
        assert os.path.exists(live.path)


def test_reclaim_only_this_targets_files(tmp_path):
    target = str(tmp_path / "t.jckpt")
    mine, other = stage_name(target), stage_name(str(tmp_path / "t.jckpt2"))
    odd = target + ".jckpt-stage.notours"
    for p in (mine, other, odd):
        open(p, "wb").close()
    assert reclaim_staging(target) == [mine]
    assert os.path.exists(other) and os.path.exists(odd)


def test_planted_symlink_cannot_redirect_a_write(tmp_path, monkeypatch):
    target = str(tmp_path / "t.jckpt")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    names = iter([stage_name(target, n=9), stage_name(target, n=10)])
    monkeypatch.setattr(publish, "_staging_name", lambda t: next(names))
    os.symlink(victim, stage_name(target, n=9))
    jckpt.save(jckpt.Context(), {"w": np.ones(3)}, target)
    assert victim.read_bytes() == b"precious"
    assert jckpt.restore(jckpt.Context(), {"w": np.zeros(3)}, target)["w"].sum() == 3


@pytest.mark.parametrize("step", ["write", "fsync", "rename"])
@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC, errno.EACCES])
def test_injected_faults_leave_previous_file(tmp_path, monkeypatch, step, code):
    target = tmp_path / "t.jckpt"
    jckpt.save(jckpt.Context(), {"w": np.full(100, 1.0)}, target)
    before = target.read_bytes()
    calls = {"n": 0}

    def failing(real):
        def call(*args):
            calls["n"] += 1
            if calls["n"] >= 2 or step != "write":  # a write fails after the first
                raise OSError(code, os.strerror(code))
            return real(*args)
        return call

    for name in ["write", "writev"] if step == "write" else [step]:  # payloads are gathered
        monkeypatch.setattr(os, name, failing(getattr(os, name)))
    with pytest.raises(StorageError) as info:
        jckpt.save(jckpt.Context(), {"w": np.full(100, 2.0)}, target)
    monkeypatch.undo()
    assert info.value.errno == code and str(target) in str(info.value)
    assert os.strerror(code) in str(info.value) and info.value.fix
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["t.jckpt"]


def _writer(path, value, rounds, out):
    import jckpt as j

    for _ in range(rounds):
        j.save(j.Context(durable=False), {"v": np.full(50_000, value, np.float64),
                                          "tag": np.float64(value)}, path)
    out.put(("w", value))


def _reader(path, rounds, out):
    import jckpt as j

    seen = set()
    for _ in range(rounds):
        try:
            _, t = j.load(j.Context(host=True), path, mmap=False)
        except j.FormatError as e:
            if "no such checkpoint" in str(e):
                continue
            raise
        v = t["jckpt"]["v"]
        assert (v == v[0]).all() and v[0] == t["jckpt"]["tag"], "torn read"
        seen.add(float(v[0]))
    out.put(("r", sorted(seen)))


@pytest.mark.multiprocess
def test_contention_every_read_is_a_complete_version(tmp_path):
    path = str(tmp_path / "c.jckpt")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(path, float(i), 30, out)) for i in range(1, 4)]
    procs += [ctx.Process(target=_reader, args=(path, 60, out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    reads = [r for kind, r in results if kind == "r"]
    assert all(set(r) <= {1.0, 2.0, 3.0} for r in reads)
    assert os.listdir(tmp_path) == ["c.jckpt"]


def test_reclaim_after_killed_writer(tmp_path):
    """A writer killed mid-save leaves a staging file that the next save removes at once."""
    import signal
    import subprocess
    import sys

    target = str(tmp_path / "t.jckpt")
    code = f"""
import os, sys, time
from jckpt.storage.publish import StagingFile
s = StagingFile({target!r})
os.write(s.fd, b"partial")
print("ready", flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    assert len(os.listdir(tmp_path)) == 1
    assert reclaim_staging(target) == []  # still locked by a live writer
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(0.05)
    jckpt.save(jckpt.Context(), {"w": np.ones(1)}, target)
    assert os.listdir(tmp_path) == ["t.jckpt"]


# --- replacing and removing, the old pages freed on another thread --------------------------

def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settled(baseline: int) -> bool:
    """Whether the releaser has closed what it was handed (within a second)."""
    deadline = time.monotonic() + 1.0
    while _open_fds() > baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    return _open_fds() <= baseline


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_replace_and_remove_hold_the_old_file_and_release_it(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.write_bytes(b"old" * 1000)
    new.write_bytes(b"new")
    publish.release_later(None)
    baseline = _open_fds()
    publish.replace(str(new), str(old))
    assert old.read_bytes() == b"new" and not new.exists()
    assert _settled(baseline)
    publish.remove_file(str(old))
    assert not old.exists() and _settled(baseline)
    with pytest.raises(FileNotFoundError):
        publish.remove_file(str(old))


def test_replace_never_opens_through_a_link_or_waits_on_a_fifo(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"kept")
    link, fifo = tmp_path / "link", tmp_path / "fifo"
    link.symlink_to(elsewhere)
    os.mkfifo(fifo)
    for target in (link, fifo):
        source = tmp_path / "source"
        source.write_bytes(b"new")
        publish.replace(str(source), str(target))  # a FIFO opened for reading would block
        assert target.read_bytes() == b"new" and not target.is_symlink()
    assert elsewhere.read_bytes() == b"kept"


def test_a_path_through_a_file_or_onto_a_directory_says_what_to_do(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(StorageError, match="Not a directory") as e:
        jckpt.save(jckpt.Context(), {"w": np.ones(2)}, tmp_path / "afile" / "x.jckpt")
    assert e.value.fix == "a part of the path is a file, not a directory; fix the path"
    assert "afile" in e.value.file
    err = publish.storage_error(IsADirectoryError(21, "Is a directory"), "publishing", "ckpt")
    assert err.fix == "a directory is in the way at that path; remove it or save elsewhere"


def test_a_file_gone_from_its_directory_is_not_told_to_create_the_directory(tmp_path):
    """A staging file another process removed before it was published, in a directory that is
    there, was "the directory does not exist; create it first"."""
    from jckpt.storage.staging import finish_staged, next_name
    target = str(tmp_path / "run.jckpt")
    staged = next_name(target, 7)
    with pytest.raises(StorageError, match="publishing the checkpoint failed") as e:
        finish_staged(staged, target, durable=False)
    assert e.value.errno == errno.ENOENT and "create it" not in e.value.fix
    assert f"{os.path.basename(staged)} was not found in {tmp_path}" in e.value.message
    assert "removed by another process?" in e.value.message
    assert "no other process writes or cleans the directory" in e.value.fix


def test_a_file_gone_while_read_says_to_read_again(tmp_path):
    path = str(tmp_path / "m.jckpt")
    e = publish.storage_error(FileNotFoundError(errno.ENOENT, "No such file", path), "reading", path)
    assert "m.jckpt was not found" in e.message and e.fix.startswith("open it again")


def test_a_directory_that_is_not_there_is_named_with_its_fix(tmp_path):
    path = tmp_path / "missing" / "m.jckpt"
    with pytest.raises(StorageError) as e:
        jckpt.save(jckpt.Context(), {"w": np.ones(2)}, path)
    assert e.value.errno == errno.ENOENT and e.value.fix == "create it first, or fix the path"
    assert f"the directory {tmp_path / 'missing'} does not exist" in e.value.message


def test_a_fifo_target_is_refused_before_anything_is_written(tmp_path):
    import stat

    from jckpt.errors import InputError
    from jckpt.storage.publish import StagingFile, refuse_special
    fifo = tmp_path / 'pipe'
    os.mkfifo(fifo)
    with pytest.raises(InputError, match='is a FIFO'):
        StagingFile(fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.listdir(tmp_path) == ['pipe']
    for fine in (tmp_path / 'none', tmp_path):
        refuse_special(str(fine))


def test_a_file_is_never_staged_for_a_directory(tmp_path):
    """No rename puts a file over a directory: a merge, relayout or conversion onto a directory
    (a directory checkpoint, or an empty folder) wrote every payload, then failed to publish."""
    from jckpt.api.multiprocess import save_directory
    from jckpt.errors import InputError
    ckpt, empty = tmp_path / 'd.jckpt', tmp_path / 'empty'
    save_directory(jckpt.Context(), {'w': np.ones(2)}, ckpt)
    empty.mkdir()
    for target, held in ((ckpt, 'a directory checkpoint'), (empty, 'a directory')):
        with pytest.raises(InputError, match=f'^.*: is {held}: a checkpoint file cannot') as e:
            StagingFile(target)
        assert e.value.file == str(target) and 'remove the directory' in e.value.fix
    assert sorted(os.listdir(tmp_path)) == ['d.jckpt', 'empty'] and not os.listdir(empty)
    os.symlink(empty, tmp_path / 'link')  # a link is replaced, never followed
    with StagingFile(tmp_path / 'link') as s:
        s.publish()
    assert os.path.isfile(tmp_path / 'link') and os.path.isdir(empty)
