"""SIGKILL at random points of a save: the previous checkpoint always survives, bit for bit.

One driver process (``python -m tests.system.test_crash``) imports jckpt once and,
for each trial, forks a child that saves version after version of a
checkpoint in a loop (reporting each finished save through a pipe), kills it
with SIGKILL after a random delay, then checks:

* the checkpoint on disk is the last version the child reported, or the one
  it was writing (published just before the kill), complete: every checksum
  verifies and every array equals what that version holds, bit for bit;
* a new save (in a fresh child) succeeds and reclaims whatever the killed one
  left: afterwards the directory holds only the published files.

Kinds of save: single file, appending (kept payloads copied from the old
file), the step manager (background writer, retention), and a sharded
directory when ``jckpt.api.multiprocess`` is available. Saves are durable (fsync),
so many kills land while a staging file exists (the test requires one in
eight; about half did in recent runs).
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 1 << 18  # elements per array: 1 MiB of uint32


def values(k: int, n: int = N) -> np.ndarray:
    """Version ``k``'s array: distinct in every element from every other version's."""
    return (np.arange(n, dtype=np.uint32) * np.uint32(2654435761)) ^ np.uint32((k * 40503 + 1) % 2**32)


# --- what each kind of save writes and how it is checked -------------------------

def save_single(path: str, k: int) -> None:
    import jckpt

    jckpt.save(jckpt.Context(), {"w": values(k), "m": values(k + 7, 1000), "step": np.int64(k)},
               path)


def check_single(path: str) -> int:
    import jckpt
    from jckpt.storage.reader import CheckpointReader

    assert CheckpointReader(path).verify() == []
    _, tree = jckpt.load(jckpt.Context(host=True), path, mmap=False)
    t = tree["jckpt"]
    k = int(t["step"])
    assert t["w"].tobytes() == values(k).tobytes() and t["m"].tobytes() == values(k + 7, 1000).tobytes()
    return k


def save_appending(path: str, k: int) -> None:
    import jckpt

    ctx = jckpt.Context()
    if not os.path.exists(path):  # version 0: the entries later saves keep
        jckpt.save(ctx, {"kept": values(10**6), "other": values(10**6 + 1, 4096)}, path)
    jckpt.save(ctx, {"w": values(k, N // 2), "step": np.int64(k)}, path, appending=True)


def check_appending(path: str) -> int:
    import jckpt
    from jckpt.storage.reader import CheckpointReader

    assert CheckpointReader(path).verify() == []
    _, tree = jckpt.load(jckpt.Context(host=True), path, mmap=False)
    t = tree["jckpt"]
    k = int(t["step"])
    assert t["kept"].tobytes() == values(10**6).tobytes()
    assert t["other"].tobytes() == values(10**6 + 1, 4096).tobytes()
    assert t["w"].tobytes() == values(k, N // 2).tobytes()
    return k


class ManagerLoop:
    """Steps saved through one long-lived manager (the child keeps it open)."""

    mgr = None

    @classmethod
    def save(cls, directory: str, k: int) -> None:
        from jckpt.services.manager import CheckpointManager

        if cls.mgr is None:
            cls.mgr = CheckpointManager(directory, keep_last=2)
        cls.mgr.save(k, {"w": values(k), "step": np.int64(k)})
        assert cls.mgr.wait_durable(60)

    @classmethod
    def close(cls) -> None:
        if cls.mgr is not None:
            cls.mgr.close()
            cls.mgr = None


def check_manager(directory: str) -> int:
    """Every step file present is complete; return the latest step."""
    import jckpt
    from jckpt.format.names import STEP_RE as _STEP_RE
    from jckpt.storage.reader import CheckpointReader

    steps = []
    for name in os.listdir(directory):
        m = _STEP_RE.match(name)
        if m:
            path = os.path.join(directory, name)
            assert CheckpointReader(path).verify() == []
            _, tree = jckpt.load(jckpt.Context(host=True), path, mmap=False)
            k = int(tree["jckpt"]["step"])
            assert k == int(m.group(1)) and tree["jckpt"]["w"].tobytes() == values(k).tobytes()
            steps.append(k)
    return max(steps, default=-1)


def save_sharded(directory: str, k: int) -> None:
    import jckpt
    from jckpt.api.multiprocess import save_directory

    save_directory(jckpt.Context(), {"w": values(k), "step": np.int64(k)}, directory)


def check_sharded(directory: str) -> int:
    """Read the directory through its index, numpy only (the driver never starts JAX)."""
    from jckpt.storage.directory import DirectoryReader

    reader = DirectoryReader(directory)
    assert reader.verify() == []
    got = {}
    for e in reader.header.tensors:
        info = reader.arrays[e.identity]
        got[e.path[0][1]] = reader.read_box(info, tuple((0, d) for d in e.dims), verify=True)
    k = int(got["step"])
    assert got["w"].tobytes() == values(k).tobytes()
    return k


KINDS = {
    "single": (save_single, check_single, "file"),
    "appending": (save_appending, check_appending, "file"),
    "manager": (ManagerLoop.save, check_manager, "dir"),
    "sharded": (save_sharded, check_sharded, "dir"),
}


def available(kind: str) -> bool:
    if kind != "sharded":
        return True
    try:
        from jckpt.api.multiprocess import save_directory  # noqa: F401
        from jckpt.storage.directory import DirectoryReader  # noqa: F401
    except ImportError:
        return False
    return True


# --- the driver -------------------------------------------------------------------

def _fork_saver(kind: str, target: str, first: int, loop: bool) -> tuple[int, int]:
    """Fork a child that saves versions first, first+1, ... (one if not ``loop``)."""
    save = KINDS[kind][0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(r)
            k = first
            while True:
                save(target, k)
                os.write(w, struct.pack("<q", k))
                k += 1
                if not loop:
                    break
            if kind == "manager":
                ManagerLoop.close()
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _acks(r: int) -> list[int]:
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    return [k for (k,) in struct.iter_unpack("<q", data[:len(data) // 8 * 8])]


def _leftovers(kind: str, target: str) -> list[str]:
    """Names next to (or inside) the checkpoint that are not published checkpoint files."""
    from jckpt.storage.lease import LEASE_SUFFIX

    if KINDS[kind][2] == "file":
        directory = os.path.dirname(target)
        return sorted(n for n in os.listdir(directory)
                      if n != os.path.basename(target) and not n.endswith(LEASE_SUFFIX))
    if kind == "manager":
        from jckpt.format.names import STEP_RE as _STEP_RE

        return sorted(n for n in os.listdir(target) if not _STEP_RE.match(n) and n != LEASE_SUFFIX)
    from jckpt.format.names import INDEX_NAME, PIECE_RE

    parent = os.path.dirname(target)
    inside = [f"{os.path.basename(target)}/{n}" for n in os.listdir(target)
              if n != INDEX_NAME and not PIECE_RE.match(n)]
    return sorted(inside + [n for n in os.listdir(parent) if n != os.path.basename(target)
                            and not n.endswith(LEASE_SUFFIX)])


def run_trials(kind: str, trials: int, workdir: str, seed: int) -> dict:
    """Kill a looping saver ``trials`` times; check survival and reclaim after each kill."""
    rng = random.Random(seed)
    check = KINDS[kind][1]
    base = os.path.join(workdir, kind)
    os.makedirs(base)
    target = os.path.join(base, "ckpt.jckpt") if KINDS[kind][2] == "file" else \
        os.path.join(base, "ckpt")
    # Version 0, and how long one save takes, to spread the kills over whole saves.
    t0 = time.perf_counter()
    pid, r = _fork_saver(kind, target, 0, loop=False)
    _, status = os.waitpid(pid, 0)
    assert _acks(r) == [0] and status == 0, f"{kind}: the first save failed"
    one_save = time.perf_counter() - t0
    assert check(target) == 0
    version = 1
    stats = {"kind": kind, "trials": 0, "kills_mid_save": 0, "reclaimed_files": 0,
             "survived": 0, "one_save_s": round(one_save, 4)}
    for _ in range(trials):
        pid, r = _fork_saver(kind, target, version, loop=True)
        time.sleep(rng.uniform(0.0, 3.0 * one_save))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        acked = _acks(r)
        last = acked[-1] if acked else version - 1
        left = _leftovers(kind, target)
        stats["kills_mid_save"] += bool(left)
        found = check(target)  # raises if anything is torn or differs
        assert found in (last, last + 1), f"{kind}: found version {found}, last finished {last}"
        stats["survived"] += 1
        version = max(found, last) + 1
        # The next save reclaims what the killed one left.
        pid, r = _fork_saver(kind, target, version, loop=False)
        _, status = os.waitpid(pid, 0)
        assert _acks(r) == [version] and status == 0, f"{kind}: the save after a kill failed"
        assert check(target) == version
        after = _leftovers(kind, target)
        assert after == [], f"{kind}: left behind after the next save: {after}"
        stats["reclaimed_files"] += len(left)
        stats["trials"] += 1
        version += 1
    return stats


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="SIGKILL trials of jckpt saves")
    parser.add_argument("--trials", type=int, default=15, help="per kind")
    parser.add_argument("--kinds", default="single,appending,manager,sharded")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="jckpt-crash-")
    import importlib

    for module in ("jckpt.api.saving", "jckpt.services.manager"):  # imported once here
        importlib.import_module(module)
    results = []
    for kind in args.kinds.split(","):
        if not available(kind):
            results.append({"kind": kind, "skipped": "not available"})
            continue
        results.append(run_trials(kind, args.trials, workdir, args.seed))
    text = json.dumps(results, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    return 0


# --- the test ---------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_at_random_points(tmp_path):
    from tests.system.fuzz_reader import record

    out = tmp_path / "crash.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.system.test_crash", "--trials", "13",
                           "--seed", "1", "--workdir", str(tmp_path), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    results = [r for r in json.loads(out.read_text()) if "skipped" not in r]
    assert {r["kind"] for r in results} >= {"single", "appending", "manager"}
    total = sum(r["trials"] for r in results)
    assert total >= 39 + 13 * available("sharded")
    assert all(r["survived"] == r["trials"] for r in results)
    # The kills really land inside saves (leaving staging files to reclaim), not only between.
    assert sum(r["kills_mid_save"] for r in results) >= total // 8, results
    for r in results:
        record("crash", **r)


if __name__ == "__main__":
    sys.exit(main())


# --- contention: appending saves from several processes, loads in between ------------

def _appender(path: str, who: int, rounds: int, out) -> None:
    import jckpt as j

    replaced = 0
    for k in range(1, rounds + 1):
        try:
            j.save(j.Context(durable=False), {f"p{who}": np.full(20_000, k, np.int32),
                                              f"t{who}": np.int32(k)}, path, appending=True)
        except j.InUseError:  # the file was replaced while this save read it
            replaced += 1
    out.put(("w", replaced))


def _consistent_reader(path: str, stop, out) -> None:
    import jckpt as j
    from jckpt.storage.reader import CheckpointReader

    loads = 0
    while not stop.is_set() or loads == 0:
        reader = CheckpointReader(path)
        assert reader.verify() == [], "a published file failed its checksums"
        _, t = j.load(j.Context(host=True), path, mmap=False)
        for name, v in t["jckpt"].items():
            if name.startswith("p"):
                assert (v == t["jckpt"]["t" + name[1:]]).all(), "torn entry"
        loads += 1
    out.put(("r", loads))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_contention_appending_saves(tmp_path):
    """Appending saves racing each other and loads: every load is a complete, valid file."""
    import multiprocessing as mp

    import jckpt
    from jckpt.storage.reader import CheckpointReader
    from tests.system.fuzz_reader import record

    path = str(tmp_path / "c.jckpt")
    jckpt.save(jckpt.Context(), {"base": np.arange(10)}, path)
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    writers = [ctx.Process(target=_appender, args=(path, i, 25, out)) for i in range(3)]
    readers = [ctx.Process(target=_consistent_reader, args=(path, stop, out)) for _ in range(2)]
    for p in writers + readers:
        p.start()
    results = [out.get(timeout=300) for _ in writers]
    stop.set()
    results += [out.get(timeout=300) for _ in readers]
    for p in writers + readers:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert os.listdir(tmp_path) == ["c.jckpt"]

    assert CheckpointReader(path).verify() == []
    jckpt.load(jckpt.Context(host=True), path)
    loads = sum(n for kind, n in results if kind == "r")
    replaced = sum(n for kind, n in results if kind == "w")
    assert loads > 0
    record("contention_appending", writers=3, saves=75, refused_replaced=replaced, loads=loads,
           torn=0)


def test_appending_save_refuses_a_file_replaced_under_it(tmp_path, monkeypatch):
    """The kept payloads are copied from the very file whose header was read, or not at all."""
    import jckpt
    import jckpt.api.saving as api
    from jckpt.storage.reader import CheckpointReader

    path = tmp_path / "c.jckpt"
    jckpt.save(jckpt.Context(), {"kept": np.full(1000, 1.0), "w": np.zeros(3)}, path)
    real = api.CheckpointReader

    def read_then_replace(p):
        reader = real(p)  # another writer publishes a same-layout file right after the read
        jckpt.save(jckpt.Context(), {"kept": np.full(1000, 2.0), "w": np.zeros(3)}, path)
        return reader

    monkeypatch.setattr(api, "CheckpointReader", read_then_replace)
    with pytest.raises(jckpt.InUseError, match="replaced"):
        jckpt.save(jckpt.Context(), {"w": np.ones(3)}, path, appending=True)
    monkeypatch.undo()
    assert CheckpointReader(path).verify() == []
    _, t = jckpt.load(jckpt.Context(host=True), path)
    assert (t["jckpt"]["kept"] == 2.0).all() and (t["jckpt"]["w"] == 0).all()
    assert os.listdir(tmp_path) == ["c.jckpt"]


@pytest.mark.parametrize("contents", [[], ["index.jckpt", "process_00000.jckpt"]])
def test_next_directory_save_reclaims_a_lockless_stage(tmp_path, contents):
    if not available("sharded"):
        pytest.skip("no directory checkpoints")
    import jckpt
    from jckpt.api.multiprocess import save_directory
    from jckpt.format.names import STAGE_DIR_TAG

    target = tmp_path / "ck"
    save_directory(jckpt.Context(), {"w": np.ones(3)}, str(target))
    stage = tmp_path / f"ck{STAGE_DIR_TAG}0123456789abcdef"  # what a killed save leaves
    stage.mkdir()
    for name in contents:
        (stage / name).write_bytes((target / name).read_bytes())
    save_directory(jckpt.Context(), {"w": np.zeros(3)}, str(target))
    assert sorted(os.listdir(tmp_path)) == ["ck"]
