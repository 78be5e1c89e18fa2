"""Multi-process checkpoints: 2 processes x 2 CPU devices on 127.0.0.1 through jax.distributed.

Each test starts fresh worker processes (this file, run as a script) that
join one ``jax.distributed`` run with gloo CPU collectives.
"""

import functools
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.multiprocess

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
WORKER_TIMEOUT = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected(name, version):
    """The global value of each saved array (the same in every process)."""
    shapes = {"w": (8, 8), "b": (8,), "rep": (4, 4), "c": (8, 2), "loc": (4, 2)}
    if name == "step":
        return np.int32(100 + version)
    return (np.arange(int(np.prod(shapes[name])), dtype=np.float32).reshape(shapes[name])
            + 1000 * version)


def run_pair(phase, path, extra_env=None, timeout=WORKER_TIMEOUT, processes=2, devices=2):
    """Run the worker processes of one jax.distributed run (two, of two CPU devices each, unless
    told otherwise); return their (rc, output, seconds)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **(extra_env or {}))
    env.pop("XLA_FLAGS", None)  # the worker sets its own
    procs = [subprocess.Popen([sys.executable, HERE, phase, str(i), str(port), str(path),
                               str(processes), str(devices)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(processes)]
    out = []
    start = time.monotonic()
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append((p.returncode, text, time.monotonic() - start))
    return out


def results(out):
    """The JSON lines the workers printed (one per worker that got that far)."""
    found = {}
    for _, text, _ in out:
        for line in text.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                found[r["process"]] = r
    return found


def check(out, n=2):
    found = results(out)
    assert len(found) == n, "\n\n".join(text[-3000:] for _, text, _ in out)
    return found


def test_save_on_2x2_restore_on_4_processes_and_one(tmp_path):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jckpt
    from jckpt.storage.directory import DirectoryReader
    from jckpt.trees import sharding as sh
    from tests.helpers import cpu_mesh

    d = tmp_path / "ckpt"
    found = check(run_pair("save", d))
    assert all(r["ok"] for r in found.values())
    names = sorted(os.listdir(d))
    # c's shards are not one block in either process: each writes a second piece file
    assert names == ["index.jckpt", "process_00000.1.jckpt", "process_00000.jckpt",
                     "process_00001.1.jckpt", "process_00001.jckpt"], names
    assert not [n for n in os.listdir(tmp_path) if n != "ckpt"]
    # each process wrote only its own rows of w, and the replicated arrays once in total
    pieces = {n: jckpt.describe(d / n).tensors for n in names[1:]}
    w = {n: [e.slice for e in t if e.path == (("k", "w"),)] for n, t in pieces.items()}
    assert w == {"process_00000.jckpt": [((0, 4), (0, 8))], "process_00001.jckpt": [((4, 8), (0, 8))],
                 "process_00000.1.jckpt": [], "process_00001.1.jckpt": []}
    c = {n: [e.slice for e in t if e.path == (("k", "c"),)] for n, t in pieces.items()}
    assert c == {"process_00000.jckpt": [((0, 2), (0, 2))], "process_00000.1.jckpt": [((4, 6), (0, 2))],
                 "process_00001.jckpt": [((2, 4), (0, 2))], "process_00001.1.jckpt": [((6, 8), (0, 2))]}
    assert sum(e.path == (("k", "rep"),) for t in pieces.values() for e in t) == 1
    assert [n for n, t in pieces.items() for e in t if e.path == (("k", "loc"),)] == [
        "process_00000.jckpt"]

    # a new pair restores onto a (4,) mesh, each reading only the overlapping piece file
    found = check(run_pair("restore", d))
    files = DirectoryReader(d).files
    for r in found.values():
        assert r["ok"] and r["bytes_ok"], r
        assert [files[i] for i in r["files_opened"]] == [f"process_0000{r['process']}.jckpt"], r

    # one process with 4 devices, and consolidation into one file
    m = cpu_mesh((4,), ("x",))
    target = {"w": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(m, P(None, "x"))),
              "b": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(m, P("x"))),
              "rep": jax.ShapeDtypeStruct((4, 4), np.float32, sharding=NamedSharding(m, P())),
              "c": jax.ShapeDtypeStruct((8, 2), np.float32, sharding=NamedSharding(m, P("x"))),
              "loc": np.zeros((4, 2), np.float32), "step": 0}
    with sh.record_reads() as log:
        back = jckpt.restore(jckpt.Context(), target, d)
    assert all(n == 8 * 2 * 4 for b, n in log if len(b) == 2 and b[0] == (0, 8)), log
    for k in target:
        np.testing.assert_array_equal(np.asarray(back[k]), expected(k, 1))
    assert back["w"].sharding == target["w"].sharding
    jckpt.consolidate(d, tmp_path / "one.jckpt")
    _, flat = jckpt.load(jckpt.Context(), tmp_path / "one.jckpt")
    for k in target:
        np.testing.assert_array_equal(np.asarray(flat["jckpt"][k]), expected(k, 1))


def test_a_process_that_dies_before_the_barrier_publishes_nothing(tmp_path):
    import jckpt

    d = tmp_path / "ckpt"
    found = check(run_pair("save", d))
    assert all(r["ok"] for r in found.values())
    before = {n: (d / n).read_bytes() for n in os.listdir(d)}
    out = run_pair("die", d, {"JCKPT_BARRIER_TIMEOUT": "4"}, timeout=90)
    found = results(out)
    assert 0 in found and 1 not in found, "\n\n".join(text[-3000:] for _, text, _ in out)
    survivor = found[0]
    assert survivor["error_type"] == "DistributedError", survivor
    assert "of 4; process 1 did not come)" in survivor["error"], survivor
    assert "nothing was published" in survivor["error"]
    assert survivor["seconds"] < 30, survivor
    assert out[1][0] not in (0, None)
    # the previous checkpoint is intact and no staging directory is left behind
    assert {n: (d / n).read_bytes() for n in os.listdir(d)} == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    _, back = jckpt.load(jckpt.Context(), d)
    np.testing.assert_array_equal(np.asarray(back["jckpt"]["w"]), expected("w", 1))


def test_processes_passing_different_paths_fail_together_and_publish_nothing(tmp_path):
    found = check(run_pair("diffpath", tmp_path / "ckpt", {"JCKPT_BARRIER_TIMEOUT": "30"}))
    assert not found[0]["ok"] and not found[1]["ok"], found
    assert found[1]["error_type"] == "DistributedError"
    assert f"process 0 saves to {tmp_path / 'ckpt_0'}, this process to" in found[1]["error"]
    assert "failed in another process" in found[0]["error"]
    assert sorted(os.listdir(tmp_path)) == []  # neither published, no staging left behind


def test_processes_saving_different_trees_fail_at_once_each_with_the_real_error(tmp_path):
    """A failure at one phase (process 0 publishing) was seen by a peer still checking the phase
    before, which then never met process 0 at the last barrier: process 0 waited out its
    timeout and reported that instead of the error."""
    d = tmp_path / "ckpt"
    for _ in range(2):  # the race went either way
        found = check(run_pair("disagree", d, {"JCKPT_BARRIER_TIMEOUT": "60"}))
        assert not found[0]["ok"] and not found[1]["ok"], found
        for r in found.values():
            assert "not every process" not in r["error"] and r["seconds"] < 30, r
        for r in found.values():  # each names the entry, and says what each process has
            assert "entry jckpt/extra: processes disagree about the tree they save" in r["error"], r
        assert "this process saves it (float32[3]), process 0 does not" in found[1]["error"]
        assert "process 1 saves it (float32[3]), this process does not" in found[0]["error"]
    assert sorted(os.listdir(tmp_path)) == []


def test_a_save_that_fails_early_on_one_process_fails_at_once_on_all(tmp_path):
    """Process 1's save failed while planning, before its turn was taken: process 0 waited
    out its timeout, and from then on process 1's save k met process 0's save k-1, and a mix
    of two states was published as one checkpoint."""
    import jckpt

    d = tmp_path / "ckpt"
    found = check(run_pair("planfail", d, {"JCKPT_BARRIER_TIMEOUT": "60"}))
    (t0, m0, s0), (t0b, _, _) = found[0]["attempts"]
    (t1, _, _), (t1b, _, _) = found[1]["attempts"]
    assert (t0, t1) == ("DistributedError", "InputError") and "not an array" in m0, found
    assert s0 < 30 and (t0b, t1b) == (None, None), found  # at once; then both save version 2
    _, back = jckpt.load(jckpt.Context(host=True), d)
    np.testing.assert_array_equal(back["jckpt"]["w"], expected("w", 2))
    assert int(back["jckpt"]["step"]) == 102


def test_a_save_whose_metadata_one_process_gets_wrong_fails_at_once_on_all(tmp_path):
    """`jckpt.save` refused metadata that is no string in that process before its turn: the
    others waited out their timeout, and from then on each save met the other's previous one.
    Then the others failed with a DistributedError naming it: now with the same InputError."""
    import jckpt

    d = tmp_path / "ckpt"
    found = check(run_pair("metafail", d, {"JCKPT_BARRIER_TIMEOUT": "60"}))
    (t0, m0, s0), (t0b, _, _) = found[0]["attempts"]
    (t1, m1, _), (t1b, _, _) = found[1]["attempts"]
    assert (t0, t1) == ("InputError", "InputError") and m0 == m1 and "'note'" in m1, found
    assert "saving a checkpoint failed in 1 of the run's processes (process 1: " in m0 and s0 < 30
    assert (t0b, t1b) == (None, None), found  # then both save version 2
    assert dict(jckpt.describe(d).metadata)["note"] == "ok"


def test_an_alignment_one_process_gets_wrong_fails_the_save_in_all_alike_and_the_next_goes_on(
        tmp_path):
    """`jckpt.save` refused an `alignment` that is no power of two in that process before the
    save took its turn: the others waited out their timeout, and from then on each save met the
    other's previous one. Now it is refused once the save took its turn, in every process alike."""
    import jckpt

    d = tmp_path / "ckpt"
    found = check(run_pair("metafail", d, {"KIND": "alignment", "JCKPT_BARRIER_TIMEOUT": "60"}))
    (t0, m0, _), (t0b, _, _) = found[0]["attempts"]
    (t1, m1, _), (t1b, _, _) = found[1]["attempts"]
    assert (t0, t1) == ("InputError", "InputError") and m0 == m1 and "alignment" in m0, found
    assert "saving a checkpoint failed in 1 of the run's processes (process 1: " in m0, m0
    assert (t0b, t1b) == (None, None), found  # then both save version 2
    assert dict(jckpt.describe(d).metadata)["note"] == "ok"


def test_a_save_made_by_one_process_alone_never_publishes_a_mix(tmp_path):
    """After a save only process 0 made, the next two saves of both paired process 0's
    version 1 with process 1's version 2, and both reported success."""
    import jckpt

    d = tmp_path / "ckpt"
    found = check(run_pair("alone", d, {"JCKPT_BARRIER_TIMEOUT": "10"}))
    errors = [m for r in found.values() for t, m, _ in r["attempts"] if t is not None]
    assert any("process 0 is at its save" in m or "process 0 saves to" in m for m in errors)
    if d.exists():  # whatever was published is one version, never a mix
        _, back = jckpt.load(jckpt.Context(host=True), d)
        step = int(back["jckpt"]["step"]) - 100
        np.testing.assert_array_equal(back["jckpt"]["w"], expected("w", step))


def test_a_save_of_the_same_path_by_one_process_alone_is_refused_not_mixed(tmp_path):
    """Process 0 saved the run's path alone (a dump the other process never made): its save paired
    with process 1's next one, and both published a checkpoint mixing two versions as a success."""
    import jckpt

    d = tmp_path / "ckpt"
    found = check(run_pair("lonesame", d))
    (lone, p0), (p1, p1b) = found[0]["attempts"], found[1]["attempts"]
    assert [t for t, _, _ in (lone, p0, p1, p1b)] == ["DistributedError"] * 4, found
    assert "process 0 makes this save from test_multiprocess.py:" in p1[1], p1
    assert "made by one process alone" in p1[1] and "(phase_lone_save_of_the_same_path)" in p1[1]
    assert "process 0 makes this save from" in lone[1], lone  # process 0 is told too
    assert "process 0 is at its save 1 of this path from test_multiprocess.py" in p1b[1], p1b
    assert "this process at its save 2" in p1b[1], p1b
    assert all(s < 15 for _, _, s in (lone, p0, p1, p1b)), found  # at once, not at a timeout
    if d.exists():  # whatever was published is one version, never a mix
        _, back = jckpt.load(jckpt.Context(host=True), d)
        step = int(back["jckpt"]["step"]) - 100
        np.testing.assert_array_equal(back["jckpt"]["w"], expected("w", step))
    assert sorted(os.listdir(tmp_path)) in ([], ["ckpt"])


def test_a_host_value_of_another_shape_in_one_process_is_refused(tmp_path):
    """Only process 0 writes a host value: process 1's of another shape and dtype was saved
    without a word, and the checkpoint held process 0's."""
    import jckpt

    d = tmp_path / "ckpt"
    found = check(run_pair("hostdiff", d, {"JCKPT_BARRIER_TIMEOUT": "60"}))
    first = [r["attempts"][0] for r in found.values()]
    assert all(t == "DistributedError" for t, _, _ in first), found
    assert any("disagree about the tree" in m for _, m, _ in first), found
    assert all(r["attempts"][1][0] is None for r in found.values()), found  # the next goes on
    _, back = jckpt.load(jckpt.Context(host=True), d)
    assert int(back["jckpt"]["step"]) == 102


def test_a_managers_processes_agree_on_its_steps_whatever_metrics_each_passes(tmp_path):
    """Each process pruned by the metrics it was given: process 0 kept steps [1, 5] and
    process 1 [5], and a restore of the best step mixed the two. The metrics a step records
    (process 0's) are the ones every process keeps."""
    found = check(run_pair("best", tmp_path / "run"))
    assert found[0]["steps"] == found[1]["steps"] == [1, 5], found
    assert found[0]["best"] == found[1]["best"] == 1, found
    # process 0's metrics come with the save: no process reads a step's index back for them
    assert [r["index_reads"] for r in found.values()] == [[], []], found


def test_a_manager_opened_beside_a_live_run_fails_at_open_in_every_process(tmp_path):
    """Four processes opened a manager on the directory of a live two-process run (which holds
    the leases of its processes 0 and 1): processes 0 and 1 were refused at open, 2 and 3
    opened and failed at their first save, after a barrier's timeout."""
    from jckpt.storage.lease import WriterLease

    d = tmp_path / "run"
    d.mkdir()
    live = [WriterLease(d / f".process{p:05d}") for p in range(2)]  # what the live run holds
    try:
        found = check(run_pair("openconflict", d, {"JCKPT_BARRIER_TIMEOUT": "15"}, processes=4),
                      n=4)
    finally:
        for lease in live:
            lease.release()
    assert {(r["error_type"], r["where"]) for r in found.values()} == {("InUseError", "open")}, found
    (error,) = {r["error"] for r in found.values()}  # the same error in every process
    assert "process 0: in use" in error and "process 1: in use" in error, error
    assert f"(pid {os.getpid()})" in error and "process 2" not in error, error
    assert all(r["seconds"] < 10 for r in found.values()), found
    assert not [n for n in os.listdir(d) if n.startswith("step_")]


def test_4_processes_save_on_a_2d_mesh_and_2_processes_restore_onto_another(tmp_path):
    """4 processes x 2 devices save on a (4, 2) mesh and restore onto its transpose; 2 processes
    x 3 devices restore onto a (3, 2) mesh, each device reading its own slice; one process
    loads it all."""
    import jckpt
    from tests.system.test_multiprocess import MESH_SHAPES, mesh_value

    d = tmp_path / "ckpt"
    assert all(r["ok"] for r in check(run_pair("meshsave", d, processes=4), n=4).values())
    assert sorted(os.listdir(d)) == ["index.jckpt", *(f"process_0000{p}.jckpt" for p in range(4))]
    assert all(r["ok"] for r in check(run_pair("meshrestore", d, devices=3)).values())
    _, back = jckpt.load(jckpt.Context(host=True), d)
    for name in (*MESH_SHAPES, "step"):
        np.testing.assert_array_equal(back["jckpt"][name], mesh_value(name, 1))


def test_a_process_killed_mid_save_fails_the_others_and_leaves_the_last_checkpoint(tmp_path):
    """Process 2 of 4 is killed while it writes its piece of the second save: the others get a
    DistributedError once the barrier's timeout passes (naming it where the service can tell),
    and the first save stays."""
    import jckpt
    from tests.system.test_multiprocess import MESH_SHAPES, mesh_value

    d = tmp_path / "ckpt"
    out = run_pair("killed", d, {"KILLED": "2", "JCKPT_BARRIER_TIMEOUT": "5"}, processes=4,
                   timeout=60)
    found = results(out)
    assert sorted(found) == [0, 1, 3] and out[2][0] == -9, "\n\n".join(t[-2000:] for _, t, _ in out)
    for r in found.values():
        assert r["error_type"] == "DistributedError" and r["seconds"] < 20, r
        assert "not every process wrote its pieces" in r["error"], r
        assert "nothing was published" in r["error"], r
        # who did not come is read from the coordination service, which may refuse to answer
        # once a peer has died; when it answers, it names process 2 alone
        assert "did not come" not in r["error"] or "; process 2 did not come" in r["error"], r
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # its half-written piece went with the stage
    _, back = jckpt.load(jckpt.Context(host=True), d)
    for name in (*MESH_SHAPES, "step"):
        np.testing.assert_array_equal(back["jckpt"][name], mesh_value(name, 1))


def test_a_preempted_managers_processes_stop_together_and_one_process_resumes(tmp_path):
    """SIGTERM reaches process 1 alone: both processes save the same step and stop; retention
    keeps the same steps in both; one process of 4 devices resumes from that step."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jckpt
    from tests.helpers import cpu_mesh

    d = tmp_path / "run"
    found = check(run_pair("preempted", d))
    stopped = found[0]["stopped"]
    assert stopped is not None and stopped >= 7 and found[1]["stopped"] == stopped, found
    assert found[0]["saved"] == found[1]["saved"] and found[0]["saved"][-1] == stopped, found
    saved = found[0]["saved"]
    kept = sorted(set(saved[-2:]) | {s for s in saved if s % 4 == 0})  # keep_last=2, keep_every=4
    assert found[0]["steps"] == found[1]["steps"] == kept, found
    assert sorted(os.listdir(d)) == [f"step_{s:08d}.jckpt" for s in kept]
    assert found[0]["restored"] == found[1]["restored"] == [stopped, stopped], found
    sharding = NamedSharding(cpu_mesh((4,), ("x",)), P("x"))
    with jckpt.CheckpointManager(d, keep_last=2, keep_every=4) as mgr:  # the same lineage, resumed
        back = mgr.restore(target={"x": jax.ShapeDtypeStruct((16,), np.float32, sharding=sharding)})
        assert back.step == stopped and back.tree["x"].sharding == sharding
        np.testing.assert_array_equal(np.asarray(back.tree["x"]), np.full(16, stopped, np.float32))
        mgr.save(stopped + 1, {"x": np.full(16, stopped + 1, np.float32)})
        mgr.wait_durable()
        assert mgr.all_steps() == sorted({kept[-1], stopped + 1} | {s for s in kept if s % 4 == 0})


def test_processes_opening_managers_on_different_directories_fail_at_open(tmp_path):
    found = check(run_pair("openconflict", tmp_path / "run", {"OWN_DIRECTORY": "1",
                                                              "JCKPT_BARRIER_TIMEOUT": "30"}))
    (error,) = {r["error"].split(": ", 1)[1] for r in found.values()}  # the same, but for the file
    assert {(r["error_type"], r["where"]) for r in found.values()} == {("DistributedError", "open")}
    assert error.startswith("opening the manager: the processes name different paths (process 0: "
                            f"{tmp_path / 'run-0'}; process 1: {tmp_path / 'run-1'})"), error
    assert all(r["seconds"] < 15 for r in found.values()), found


def test_pipeline_stages_on_other_processes_devices_are_saved_and_restored(tmp_path):
    """An array on process 1's devices only (a pipeline stage) was written by no process: process
    0, which saves what is whole in one process, holds none of it, and process 1 left it to
    process 0. The save published a checkpoint without it, and restoring it onto its sharding
    raised JAX's ValueError in process 0 (no shard of it there to infer the dtype from)."""
    import jckpt
    from tests.system.test_multiprocess import mesh_value

    d = tmp_path / "ckpt"
    found = check(run_pair("stages", d))
    for r in found.values():
        assert r["ok"], r
        kind, message, _ = r["unwritten"]  # a save that writes no piece of an array fails
        assert kind == "DistributedError" and "entry jckpt/stage1: no process wrote this array" \
            in message, r
    _, back = jckpt.load(jckpt.Context(host=True), d)
    for i in range(2):
        np.testing.assert_array_equal(back["jckpt"][f"stage{i}"], mesh_value("w", i))
    assert back["jckpt"]["empty"].shape == (0, 3)


def test_managers_of_file_steps_in_a_run_of_several_processes_are_each_processs_own(tmp_path):
    """With `directory_steps=False`, each process's manager writes its own steps: in one
    directory, both wrote the same step files (the last rename won, silently), and in
    directories of their own, only process 0 deleted old steps. Its restore onto arrays across
    processes did not meet: a target of another shape in process 1 alone failed there while
    process 0 returned."""
    import jckpt

    found = check(run_pair("filesteps", tmp_path))
    for p, r in found.items():
        assert r["steps"] == [2] and r["files"] == ["step_00000002.jckpt"], r
        _, back = jckpt.load(jckpt.Context(host=True), tmp_path / f"own{p}" / "step_00000002.jckpt")
        np.testing.assert_array_equal(back["jckpt"]["x"], np.full(4, 2 + 10 * p, np.float32))
    refused = [r["shared_error"] for r in found.values() if "shared_error" in r]
    # the holder's pid is named once it has written it (it locks the lease first)
    assert len(refused) == 1 and "in use: another writer" in refused[0], found
    for r in found.values():  # docs/mirror.md: a mirror refuses an array spanning processes
        assert "not fully addressable" in r["mirror_error"] and "CheckpointManager" in r["mirror_error"]
    for p, r in found.items():  # a restore onto arrays across processes met the others: it
        (failed, message), (ok, values) = r["restores"]  # failed in process 1 alone
        assert (failed, ok) == ("MismatchError", None), r
        assert "restoring a step failed in 1 of the run's processes (process 1: " in message, r
        assert values == [2.0 + 10 * p] * 2, r  # each process's own steps


def test_a_process_needing_half_of_each_of_4_pieces_asks_the_kernel_for_that_half(tmp_path):
    """A directory written by 4 processes (pieces of rows), restored by 2 splitting the columns:
    each process has the kernel read its half of every piece, planned from the index before
    any read; without the plan it advised nothing, and the kernel's read-ahead over the piece
    files read them whole (1,408 MiB for 720 in a benchmark)."""
    from tests.helpers import write_directory
    from tests.system.test_multiprocess import HALF

    d = write_directory(tmp_path / "ckpt", {"w": np.arange(int(np.prod(HALF)), dtype=np.float32)
                                            .reshape(HALF)}, processes=4)
    for r in check(run_pair("halfpieces", d)).values():
        assert r["ok"] and r["needed"] <= r["advised"] <= 1.1 * r["needed"], r


def test_typed_keys_restore_onto_a_sharding_over_both_processes(tmp_path):
    """Keys were put on one device, then moved onto the global sharding: JAX refused it with
    a ValueError outside jckpt's errors, for keys sharded and replicated alike."""
    check(run_pair("keys", tmp_path / "ckpt"))


def test_orbax_saves_replicated_state_from_two_processes(tmp_path):
    """A global array replicated over both processes (P()) was refused as "not fully
    addressable"; one sharded across them is refused naming what writes it instead."""
    pytest.importorskip("orbax.checkpoint")
    import jckpt
    d = tmp_path / "orbax_run"
    found = check(run_pair("orbax", d))
    for r in found.values():
        assert r["ok"] and r["error_type"] == "InputError", r
        assert "sharded across processes" in r["error"] and "jckpt.save" in r["error"]
    item = d / "1" / "state" / "checkpoint.jckpt"
    back = jckpt.load(jckpt.Context(host=True), item)[1]["jckpt"]
    np.testing.assert_array_equal(back["rep"], expected("rep", 1))
    assert back["step"] == 7


def test_orbax_checkpoints_sharded_across_two_processes_restore_onto_one_process_mesh(tmp_path):
    """orbax's OCDBT (one database per process, merged), zarr3 and per-array directories,
    written by two processes: restored by one process onto a mesh of another shape."""
    pytest.importorskip("orbax.checkpoint")
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jckpt
    from tests.helpers import cpu_mesh
    check(run_pair("orbax_sharded", tmp_path))
    mesh = cpu_mesh((4, 2), ("data", "model"))
    specs = {"w": P("model", "data"), "c": P("data"), "rep": P()}
    target = {k: jax.ShapeDtypeStruct(expected(k, 1).shape, np.float32,
                                      sharding=NamedSharding(mesh, spec)) for k, spec in specs.items()}
    for where, namespace in (("ocdbt", None), ("zarr3", None), ("plain", None),
                             (os.path.join("run", "3"), "state")):
        back = jckpt.restore(jckpt.Context(), target, tmp_path / where, namespace=namespace)
        for k in specs:
            assert back[k].sharding == target[k].sharding, (where, k)
            np.testing.assert_array_equal(np.asarray(back[k]), expected(k, 1), err_msg=where)
    jckpt.convert(tmp_path / "ocdbt", tmp_path / "c.jckpt")
    np.testing.assert_array_equal(jckpt.load(jckpt.Context(host=True), tmp_path / "c.jckpt")[1]
                                  ["jckpt"]["w"], expected("w", 1))


def test_the_processes_of_an_evaluation_job_restore_the_same_step(tmp_path):
    """Each process of a read-only manager listed the directory on its own: a step the
    writer published between process 0's listing and process 1's was the latest for process 1
    only, and a restore onto a sharding over both processes mixed two steps' shards."""
    import jckpt
    from tests.helpers import cpu_mesh

    run, side = tmp_path / "run", tmp_path / "side"
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    sharding = NamedSharding(cpu_mesh((4,), ("x",)), P("x"))
    import jax
    with jckpt.CheckpointManager(run, directory_steps=True) as mgr:
        for step in (1, 2):
            mgr.save(step, {"x": jax.device_put(np.full(8, step, np.float32), sharding)})
        mgr.wait_durable()
    side.mkdir()
    os.rename(run / "step_00000002.jckpt", side / "step_00000002.jckpt")  # published during the job
    found = check(run_pair("readers", run, {"JCKPT_BARRIER_TIMEOUT": "30"}))
    assert found[0]["steps"] == found[1]["steps"] == [[1], [1]], found
    assert found[0]["restored"] == found[1]["restored"] == 1 and all(
        r["ok"] for r in found.values()), found
    assert sorted(os.listdir(run)) == ["step_00000001.jckpt", "step_00000002.jckpt"]



def test_a_save_failing_in_one_process_with_another_error_than_jckpts_raises_a_checkpoint_error_in_all(
        tmp_path):
    """A ValueError of one process's writing (a tree's own code) was raised there as it was,
    past an `except jckpt.CheckpointError`, while the others got a DistributedError without the
    error's type: a run that skips a failed save went on in some processes only."""
    import jckpt

    d = tmp_path / "ckpt"
    found = check(run_pair("ownerror", d, {"KIND": "write", "JCKPT_BARRIER_TIMEOUT": "60"}))
    (t0, m0, s0), (t1, m1, s1) = (found[p]["attempts"][0] for p in (0, 1))
    assert (t0, t1) == ("DistributedError", "DistributedError") and s0 < 30 and s1 < 30, found
    assert "the save failed in this process: ValueError: the tree's code failed" in m1, m1
    assert found[1]["cause"] == "ValueError", found  # raised from it: its traceback is kept
    assert "the save failed in another process: process 1: ValueError: the tree's code failed" in m0
    assert found[0]["kept"] == found[1]["kept"] == 101, found  # the previous checkpoint
    assert [r["attempts"][1][0] for r in found.values()] == [None, None], found  # the next goes on
    _, back = jckpt.load(jckpt.Context(host=True), d)
    assert int(back["jckpt"]["step"]) == 103


def test_a_tree_one_process_cannot_flatten_fails_the_save_in_all_and_the_next_goes_on(tmp_path):
    """`jckpt.save` flattened the tree for its empty nodes before the save took its turn: a
    custom node failing to flatten in one process raised there at once, the others' save met
    that process's next one (refused as a save from another line), and so did every save after."""
    import jckpt

    d = tmp_path / "ckpt"
    found = check(run_pair("ownerror", d, {"KIND": "flatten", "JCKPT_BARRIER_TIMEOUT": "60"}))
    (t0, m0, s0), (t1, m1, s1) = (found[p]["attempts"][0] for p in (0, 1))
    assert (t0, t1) == ("DistributedError", "InputError") and s0 < 30 and s1 < 30, found
    assert "JAX cannot flatten the tree: flatten failed" in m1 and "process 1: " in m0, found
    assert [r["attempts"][1][0] for r in found.values()] == [None, None], found
    _, back = jckpt.load(jckpt.Context(host=True), d)
    assert int(back["jckpt"]["step"]) == 103


def test_a_read_only_managers_processes_restore_together_when_retention_removes_the_latest(tmp_path):
    """The writer's retention removed the latest step after process 0 had read its part and
    before process 1 read its own: process 0 returned step 2, process 1 raised FormatError, and
    the run went on with one process restored. A failure in one process only was raised there
    alone too."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jckpt
    from tests.helpers import cpu_mesh

    run = tmp_path / "run"
    sharding = NamedSharding(cpu_mesh((4,), ("x",)), P("x"))
    with jckpt.CheckpointManager(run, directory_steps=True) as mgr:
        for step in (1, 2):
            mgr.save(step, {"x": jax.device_put(np.full(8, step, np.float32), sharding)})
        mgr.wait_durable()
    found = check(run_pair("readerrace", run, {"JCKPT_BARRIER_TIMEOUT": "30"}))
    for r in found.values():  # both listed step 2 gone, then read step 1 together
        assert r["listed"] == [1, 2] and r["restored"] == 1 and r["ok"], found
        kind, message = r["failed"]  # one process failing fails them all, at once
        assert kind == "DistributedError" and "restoring a step failed in 1 of the run's " \
            "processes (process 1: ValueError: cannot read)" in message, r
        assert r["seconds"] < 20, r



def test_a_managers_step_whose_metrics_one_process_gets_wrong_fails_in_all_and_the_next_goes_on(
        tmp_path):
    """A metric one process could not store was refused there before the step's save took its
    turn: the others' save of step 2 met that process's save of step 3 (refused: another path),
    and then waited out the barrier's timeout at step 3, which no process saved."""
    found = check(run_pair("managerargs", tmp_path / "run", {"JCKPT_BARRIER_TIMEOUT": "60"}))
    (t0, m0, s0), (t1, m1, s1) = (found[p]["attempts"][1] for p in (0, 1))
    assert (t0, t1) == ("InputError", "InputError") and s0 < 30 and s1 < 30 and m0 == m1, found
    assert "metric 'loss' is not a number" in m1 and "process 1: " in m0 and "step_00000002" in m0
    for r in found.values():
        assert [t for t, _, _ in r["attempts"]] == [None, "InputError", None], r
        assert r["steps"] == [1, 3], r


@pytest.mark.slow
def test_a_restore_failing_in_one_process_fails_in_all_and_the_next_goes_on(tmp_path):
    """A writer manager's restore and plain `jckpt.restore` did not meet: a failure one process
    alone met (a target of another shape, a damaged piece only it reads, a missing file) was
    raised there while the others returned, and the run went on half restored. A restore onto
    host values stays one process's own. A manager's `verify=` that is no flag was refused
    before the meeting, in that process alone."""
    import jckpt

    jckpt.save(jckpt.Context(), {"x": np.full(8, 7, np.float32)}, tmp_path / "one.jckpt")
    found = check(run_pair("lonefailures", tmp_path, {"JCKPT_BARRIER_TIMEOUT": "20"}))
    (a0, a1) = (found[p]["attempts"] for p in (0, 1))
    assert [a[0] for a in a0] == [a[0] for a in a1] == [
        "MismatchError", None, "ChecksumError", None, "InputError", "FormatError", None,
        "ChecksumError"], found
    for failed in (0, 2, 4, 5, 7):  # the same error in both, naming process 1 and what it met
        for a in (a0, a1):
            assert "failed in 1 of the run's processes (process 1: " in a[failed][1], a[failed]
            assert a[failed][2] < 15, a[failed]  # at once, not at the barrier's timeout
    assert "shape" in a0[0][1] and "checksum mismatch" in a0[2][1], a0
    assert all(a[3] for a in a0 + a1 if a[0] is None), found  # the restores that went on
    assert found[0]["alone"][0] and found[0]["alone"][1] < 15, found


@pytest.mark.slow
def test_a_managers_step_whose_lease_one_process_lost_fails_in_all_and_the_next_goes_on(tmp_path):
    """The lease check of a directory step raised in the process whose lease was taken over
    before the save took its turn: the others' save of step 2 met that process's save of step 3
    and was refused, and their step 3 then waited out the barrier's timeout."""
    found = check(run_pair("managerargs", tmp_path / "run", {"KIND": "lease",
                                                             "JCKPT_BARRIER_TIMEOUT": "20"}))
    (t0, m0, s0), (t1, m1, s1) = (found[p]["attempts"][1] for p in (0, 1))
    assert (t0, t1) == ("DistributedError", "InUseError") and s0 < 15 and s1 < 15, found
    assert "lease was taken over" in m1 and "process 1: " in m0 and "step_00000002" in m0, found
    for r in found.values():
        assert [a[0] for a in r["attempts"]] == [None, t0 if r["process"] == 0 else t1, None], r
        assert r["steps"] == [1, 3], r


@pytest.mark.slow
def test_a_meeting_one_process_makes_alone_fails_by_name_and_other_meetings_go_on(tmp_path):
    """Meetings were paired by one counter per process: process 0's lone restore onto a global
    array paired with process 1's lone reader open (the restore returned, the open failed on
    "different paths"), and later meetings paired whatever came at the same count. Now each
    meeting pairs only with one about the same thing: the lone ones fail naming where the
    other process is, a restore both make after process 0's lone one fails in both, naming
    both meetings, and the meetings of the manager go on together. A manager's restore of
    another step in each process met, and returned one step here and another there: now it
    fails in both, naming each process's step."""
    import jckpt

    jckpt.save(jckpt.Context(), {"x": np.full(8, 7, np.float32)}, tmp_path / "one.jckpt")
    os.makedirs(tmp_path / "empty")
    found = check(run_pair("lonemeeting", tmp_path, {"JCKPT_BARRIER_TIMEOUT": "3"}))
    (a0, a1) = (found[p]["attempts"] for p in (0, 1))
    assert [a[0] for a in a0] == [a[0] for a in a1] == [
        "DistributedError", "DistributedError", None, None, "InputError"], found
    def placed(message, process, meeting):  # found waiting there, or having left it failing
        return f"process {process} is at {meeting}" in message or \
            f"process {process} left {meeting}" in message

    assert "this process is at restoring the checkpoint (its 1st such meeting), process 1 " in \
        a0[0][1] and placed(a0[0][1], 1, "listing the steps of "), a0
    assert "this process is at listing the steps of " in a1[0][1] and \
        placed(a1[0][1], 0, "restoring the checkpoint (its 1st such meeting)"), a1
    assert "restoring the checkpoint (its 2nd such meeting), process 1 left restoring the " \
           "checkpoint (its 1st such meeting)" in a0[1][1], a0  # at once, process 0 at its timeout
    assert "restoring the checkpoint (its 1st such meeting), process 0 is at restoring the " \
           "checkpoint (its 2nd such meeting)" in a1[1][1], a1
    assert all("restart the run's processes together" in a[1] for a in a0[:2] + a1[:2])
    assert all(a[3] for a in a0[2:4] + a1[2:4]), found  # the manager's save and restore went on
    assert "the processes restore different steps (process 0: 1; process 1: 2)" in a0[4][1] \
        and a0[4][1] == a1[4][1], found  # it returned each process's step


@pytest.mark.slow
def test_a_managers_save_whose_arguments_one_process_gets_wrong_fails_in_all_and_the_next_goes_on(
        tmp_path):
    """`items=` with directory steps (and any argument `save` refuses) was refused in that
    process before the save took its turn: the others' save of step 2 met that process's save
    of step 3 and was refused, and their step 3 then waited out the barrier's timeout."""
    found = check(run_pair("managerargs", tmp_path / "run", {"KIND": "items",
                                                             "JCKPT_BARRIER_TIMEOUT": "20"}))
    (t0, m0, s0), (t1, m1, s1) = (found[p]["attempts"][1] for p in (0, 1))
    assert (t0, t1) == ("InputError", "InputError") and s0 < 15 and s1 < 15 and m0 == m1, found
    assert "pass tree, not items" in m1 and "process 1: " in m0 and "pass tree, not items" in m0
    for r in found.values():
        assert [a[0] for a in r["attempts"]] == [None, t0 if r["process"] == 0 else t1, None], r
        assert r["steps"] == [1, 3], r


@pytest.mark.slow
def test_a_managers_lease_lost_while_a_step_saved_fails_that_step_in_all(tmp_path):
    """The lease check after a published step (before retention) raised in the process whose
    lease was taken over alone: the others went on (process 0 applying retention for a writer
    that was no longer one), and only the next save failed in all of them."""
    found = check(run_pair("managerargs", tmp_path / "run", {"KIND": "leaseafter",
                                                             "JCKPT_BARRIER_TIMEOUT": "20"}))
    (t0, m0, s0), (t1, m1, s1) = (found[p]["attempts"][1] for p in (0, 1))
    assert (t0, t1) == ("DistributedError", "InUseError") and s0 < 15 and s1 < 15, found
    assert "lease was taken over" in m1 and "the checkpoint is published, but failed after it " \
        "in another process: process 1: " in m0 and "lease was taken over" in m0, found
    for r in found.values():
        assert [a[0] for a in r["attempts"]] == [None, t0 if r["process"] == 0 else t1, None], r
        assert r["steps"] == [1, 3], r  # step 2 is published, but no process counts it
    assert sorted(os.listdir(tmp_path / "run" / "step_00000002.jckpt"))[0] == "index.jckpt"


@pytest.mark.slow
def test_processes_waiting_at_different_meetings_fail_at_once_in_all(tmp_path):
    """Process 0 restoring step 2 while process 1 saved step 3 waited each out the barrier's
    timeout (60 s here, 300 by default) to say so, though neither could ever move on. Now each
    sees where the other waits, a meeting it has not begun, and both fail in seconds, naming
    both meetings."""
    found = check(run_pair("stuck", tmp_path / "run", {"KIND": "mismatch",
                                                       "JCKPT_BARRIER_TIMEOUT": "60"}))
    (t0, m0, s0, _), (t1, m1, s1, _) = (found[p]["attempts"][0] for p in (0, 1))
    assert (t0, t1) == ("DistributedError", "DistributedError") and s0 < 15 and s1 < 15, found
    # whichever finds it first leaves its meeting, saying so: the other finds that
    stuck, gone = "no process can move on", "it left this meeting failing: it will not come"
    assert all(stuck in m or gone in m for m in (m0, m1)) and (stuck in m0 or stuck in m1), found
    assert "this process is at restoring a step of " in m0 and ("process 1 is at saving a "
           "checkpoint (its 3rd such meeting)" in m0 or "process 1 left saving a checkpoint (its "
           "3rd such meeting), failing" in m0), m0
    assert "this process is at saving a checkpoint (its 3rd such meeting), process 0 " in m1 and \
           "restoring a step of " in m1, m1


@pytest.mark.slow
def test_a_process_behind_or_slow_is_waited_for_not_taken_as_stuck(tmp_path):
    """Process 1 comes 3 s late to a restore (still at the save before it), then reads its part
    of the next one for 3 s: process 0 waits for it both times, and both restores return."""
    found = check(run_pair("stuck", tmp_path / "run", {"KIND": "slow",
                                                       "JCKPT_BARRIER_TIMEOUT": "60"}))
    for r in found.values():
        assert [a[0] for a in r["attempts"]] == [None, None] and all(
            a[3] for a in r["attempts"]), found
    assert all(a[2] > 2.5 for a in found[0]["attempts"]), found  # it did wait for process 1


@pytest.mark.slow
def test_a_managers_argument_refused_in_one_process_fails_in_all_at_once(tmp_path):
    """A step to `restore` that is no step, another step than the others', or a `force` that is no
    flag on a step due anyway were refused in process 1 alone (or each returned its own step),
    and process 0 waited out its timeout. Now each fails in both at once, and the next goes on."""
    found = check(run_pair("stuck", tmp_path / "run", {"KIND": "arguments",
                                                       "JCKPT_BARRIER_TIMEOUT": "60"}))
    a0, a1 = (found[p]["attempts"] for p in (0, 1))
    assert [a[0] for a in a0] == ["InputError", "InputError", "InputError", None, None], a0
    assert [a[0] for a in a1] == ["InputError", "InputError", "InputError", None, None], a1
    assert all(a[2] < 15 for a in a0 + a1), found
    assert a0[0][1] == a1[0][1] and "process 1: " in a0[0][1] and "not str 'two'" in a0[0][1]
    assert a0[1][1] == a1[1][1] and "the processes restore different steps (process 0: 2; " \
        "process 1: 1)" in a0[1][1], a0
    assert "force must be True or False" in a1[2][1] and "process 1: " in a0[2][1] and \
        a0[2][1] == a1[2][1], found  # the same refusal in every process
    assert all(a[3] for a in a0[3:] + a1[3:]), found


@pytest.mark.slow
def test_a_step_to_save_refused_in_one_process_fails_the_others_at_once_naming_it(tmp_path):
    """A `save` whose step is no step cannot meet the others' (where it would save is not known):
    process 0 waited out its timeout (60 s here, 300 by default), naming only where process 1
    was before. Now process 1 posts that it left that save, and process 0 fails at once, saying
    what process 1 was told."""
    found = check(run_pair("stuck", tmp_path / "run", {"KIND": "told",
                                                       "JCKPT_BARRIER_TIMEOUT": "60"}))
    (t0, m0, _, _), (t1, m1, _, _) = (found[p]["attempts"][0] for p in (0, 1))
    assert (t0, t1) == ("DistributedError", "InputError") and "not int -3" in m1, found
    assert "(it left this meeting failing: it will not come)" in m0 and "timed out" not in m0, m0
    assert "process 1 left saving a checkpoint (its 3rd such meeting), failing, and was told " \
           "since: InputError: step must be a non-negative integer, not int -3: " in m0, m0


@pytest.mark.slow
def test_a_save_one_process_refused_before_its_turn_fails_the_others_at_once_naming_it(tmp_path):
    """Process 1's `jckpt.save` refused its context (a tree) before the save took its turn, and
    process 1 went on to other work: process 0 waited out its timeout at that save, naming only
    the save process 1 made before, and each next save of process 1 met the others' previous
    one. Now process 1 posts that it left it, taking its turn: process 0 fails at once, and the
    next save goes on together."""
    import jckpt

    found = check(run_pair("refusals", tmp_path / "ckpt", {"KIND": "save",
                                                           "JCKPT_BARRIER_TIMEOUT": "60"}))
    (t0, m0), (t1, m1) = (found[p]["attempts"][1] for p in (0, 1))
    assert (t0, t1) == ("DistributedError", "InputError") and "ctx must be a jckpt.Context" in m1, found
    assert "(it left this meeting failing: it will not come)" in m0 and "timed out" not in m0, m0
    assert "process 1 left saving a checkpoint (its 2nd such meeting), failing, and was told " \
           "since: InputError: ctx must be a jckpt.Context" in m0, m0
    assert [a[0] for r in found.values() for a in r["attempts"][::2]] == [None] * 4, found
    _, back = jckpt.load(jckpt.Context(host=True), tmp_path / "ckpt")
    np.testing.assert_array_equal(back["jckpt"]["x"], np.full(4, 3, np.float32))


@pytest.mark.slow
def test_a_managers_argument_one_process_refuses_at_construction_fails_all_at_once_alike(tmp_path):
    """`CheckpointManager(..., directory_steps=True)` with options for another format in process
    1 alone raised there at construction, before the open every process meets at: process 0
    waited out its timeout there. Now every process raises the same InputError, at once."""
    found = check(run_pair("refusals", tmp_path / "run", {"KIND": "open",
                                                          "JCKPT_BARRIER_TIMEOUT": "60"}))
    (t0, m0), (t1, m1) = (found[p]["attempts"][0] for p in (0, 1))
    assert (t0, t1) == ("InputError", "InputError") and m0 == m1, found
    assert "opening the manager failed in 1 of the run's processes (process 1: multi-process " \
           "directory steps are jckpt only" in m0, m0
    for r in found.values():
        assert [a[0] for a in r["attempts"]] == ["InputError", None], found  # then both open


@pytest.mark.slow
def test_one_process_of_8_at_another_meeting_makes_all_fail_at_once(tmp_path):
    """Early failure was checked with 4 processes at most: with 8, process 1 saving while the 7
    others restore, every process fails at once (none at its timeout), naming the meetings."""
    found = check(run_pair("stuck", tmp_path / "run", {"KIND": "mismatch",
                                                       "JCKPT_BARRIER_TIMEOUT": "60"},
                           processes=8, devices=1), n=8)
    for p, r in found.items():
        kind, message, _, _ = r["attempts"][0]
        assert kind == "DistributedError" and "timed out" not in message, (p, message)
        assert "no process can move on" in message or "it will not come" in message, (p, message)
        assert "the processes are at different meetings" in message, (p, message)


# --- the worker ------------------------------------------------------------------------------

def _attempt(jckpt, tree, path, timeout=None, metadata=None, alignment=None):
    """One save from this process: `[error type or None, message, seconds]` (with `metadata`,
    through `jckpt.save`)."""
    from jckpt.api.multiprocess import save_directory
    start = time.monotonic()
    try:
        if metadata is not None:
            jckpt.save(jckpt.Context(), tree, path, metadata=metadata, alignment=alignment)
        else:
            save_directory(jckpt.Context(), tree, path, timeout=timeout)
        return [None, "", time.monotonic() - start]
    except jckpt.CheckpointError as e:
        return [type(e).__name__, str(e), time.monotonic() - start]


def global_array(jax, name, sharding, version):
    """`expected(name, version)` as a global array on `sharding`, each process putting its part."""
    full = expected(name, version)
    return jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])


def phase_lone_save_of_the_same_path(jax, jckpt, result, path):
    """Process 0 dumps the state alone to the path the run saves to, then both save twice."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    m = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices("cpu"))

    def tree(version):
        return {"w": global_array(jax, "w", NamedSharding(m, P("a", "b")), version),
                "step": expected("step", version)}

    attempts = []
    if jax.process_index() == 0:  # a mistake: a save the other process does not make
        attempts.append(_attempt(jckpt, tree(1), path, timeout=20))
    for version in (2,) if jax.process_index() == 0 else (2, 3):  # process 1 saves once more
        attempts.append(_attempt(jckpt, tree(version), path, timeout=20))
    result.update(ok=True, attempts=attempts)


def phase_open_beside_a_live_run(jax, jckpt, result, path):
    """A manager opened in every process of this run, on a directory another run writes."""
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    start, where = time.monotonic(), "open"
    if os.environ.get("OWN_DIRECTORY"):  # a mistake: each process its own directory
        path = f"{path}-{jax.process_index()}"
    try:
        with jckpt.CheckpointManager(path, keep_last=2) as mgr:
            where = "save"
            mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",))
            x = jax.make_array_from_callback((8,), NamedSharding(mesh, P("x")),
                                             lambda i: np.arange(8, dtype=np.float32)[i])
            mgr.save(1, {"x": x})
        result["ok"] = True
    except jckpt.CheckpointError as e:
        result.update(error_type=type(e).__name__, error=str(e), where=where)
    result["seconds"] = time.monotonic() - start


MESH_SHAPES = {"w": (24, 12), "b": (12,), "rep": (4, 4)}


def mesh_value(name, version):
    """The global value of each array of the mesh phases."""
    if name == "step":
        return np.int32(100 + version)
    shape = MESH_SHAPES[name]
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1000 * version


def mesh_tree(jax, mesh, version):
    """A state on a 2-d mesh `("data", "model")` of every process's devices."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    specs = {"w": P("data", "model"), "b": P("model"), "rep": P()}
    tree = {}
    for name, spec in specs.items():
        full = mesh_value(name, version)
        tree[name] = jax.make_array_from_callback(full.shape, NamedSharding(mesh, spec),
                                                  lambda idx, full=full: full[idx])
    tree["step"] = mesh_value("step", version)
    return tree


def mesh_of(jax, shape):
    import numpy as np
    return jax.sharding.Mesh(np.array(jax.devices("cpu")).reshape(shape), ("data", "model"))


def check_mesh_tree(back, version):
    """Every shard this process holds has the value saved; the step too."""
    ok = int(back["step"]) == int(mesh_value("step", version))
    for name in MESH_SHAPES:
        full = mesh_value(name, version)
        for shard in back[name].addressable_shards:
            ok &= bool(np.array_equal(np.asarray(shard.data), full[shard.index]))
    return ok


def phase_mesh_save(jax, jckpt, result, path):
    """Save on a `(processes, devices)` mesh, restore onto its transpose in the same run."""
    n, k = jax.process_count(), jax.local_device_count("cpu")
    jckpt.save(jckpt.Context(), mesh_tree(jax, mesh_of(jax, (n, k)), 1), path)
    result["ok"] = check_mesh_tree(_mesh_restore(jax, jckpt, path, (k, n)), 1)


def _mesh_restore(jax, jckpt, path, shape):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = mesh_of(jax, shape)
    specs = {"w": P("model", "data"), "b": P("data"), "rep": P(None, "model")}
    target = {name: jax.ShapeDtypeStruct(MESH_SHAPES[name], np.float32,
                                         sharding=NamedSharding(mesh, spec))
              for name, spec in specs.items()}
    target["step"] = 0
    return jckpt.restore(jckpt.Context(), target, path)


def phase_mesh_restore(jax, jckpt, result, path):
    """Restore what another process count saved onto this run's `(devices, processes)` mesh."""
    back = _mesh_restore(jax, jckpt, path, (jax.local_device_count("cpu"), jax.process_count()))
    result["ok"] = check_mesh_tree(back, 1)


def phase_killed_mid_save(jax, jckpt, result, path):
    """Every process saves version 1, then version 2, in which process KILLED dies writing."""
    import signal

    n, k = jax.process_count(), jax.local_device_count("cpu")
    mesh = mesh_of(jax, (n, k))
    jckpt.save(jckpt.Context(), mesh_tree(jax, mesh, 1), path)
    if jax.process_index() == int(os.environ["KILLED"]):
        from jckpt.api import multiprocess

        def dying(stage, *args, **kwargs):  # killed with a piece half written into the stage
            with open(os.path.join(stage, f".process_{jax.process_index():05d}.jckpt.partial"),
                      "wb") as f:
                f.write(b"jckpt half a piece")
            os.kill(os.getpid(), signal.SIGKILL)

        multiprocess._write_pieces = dying
    result.update(ok=True, **dict(zip(("error_type", "error", "seconds"),
                                      _attempt(jckpt, mesh_tree(jax, mesh, 2), path))))
    print("RESULT " + json.dumps(result), flush=True)
    _wait_for_the_others(jax, path, int(os.environ["KILLED"]))
    os._exit(0)  # a peer is gone: skip jax.distributed's shutdown barrier


def _wait_for_the_others(jax, path, killed):
    """Process 0 hosts the coordination service: once it exits, JAX terminates a process
    still waiting on it (a loaded machine's process whose barrier had not yet timed out),
    so it waits until the survivors have said they are done (30 s at most)."""
    import tempfile
    import zlib

    def done(i):  # named after the checkpoint: alike in every process, unlike hash()
        return os.path.join(tempfile.gettempdir(), f"jckpt-done-{zlib.crc32(str(path).encode())}-{i}")

    open(done(jax.process_index()), "w").close()
    if jax.process_index() == 0:
        others = [i for i in range(1, jax.process_count()) if i != killed]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(os.path.exists(done(i)) for i in others):
            time.sleep(0.05)
        for i in (0, *others):
            if os.path.exists(done(i)):
                os.remove(done(i))


def phase_preempted(jax, jckpt, result, path):
    """A manager saving every 3rd step, keeping the last 2 and every 4th; process 1 gets
    SIGTERM at step 7 (a preemption notice) and every process saves and stops together."""
    import signal

    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    size = 16
    saved, stopped = [], None
    with jckpt.CheckpointManager(path, keep_last=2, keep_every=4, save_interval_steps=3) as mgr:
        for step in range(1, 100):
            x = jax.make_array_from_callback((size,), sharding,
                                             lambda i, s=step: np.full(size, s, np.float32)[i])
            if step == 7 and jax.process_index() == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if mgr.save(step, {"x": x}):
                saved.append(step)
            if mgr.reached_preemption(step):
                stopped = step
                break
            time.sleep(0.05)  # a training step
        mgr.wait_durable()
        back = mgr.restore(target={"x": x})
        result.update(ok=True, saved=saved, stopped=stopped, steps=mgr.all_steps(),
                      restored=[back.step, float(np.asarray(back.tree["x"].addressable_shards[0].data)[0])])


def phase_stages(jax, jckpt, result, path):
    """Pipeline stages: each array on the devices of half the processes only (one process of
    two: none on process 0's devices), beside empty arrays. A first save, in which the
    processes holding what process 0 does not leave it unwritten (as they did), is refused."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jckpt.api import multiprocess

    half = jax.process_count() // 2
    everywhere = jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",))
    tree = {"empty": np.zeros((0, 3), np.float32),
            "empty_rep": jax.make_array_from_callback(
                (0, 4), NamedSharding(everywhere, P()), lambda idx: np.zeros((0, 4), np.float32)[idx])}
    for i in range(2):
        mesh = jax.sharding.Mesh(np.array([d for d in jax.devices("cpu")
                                           if (d.process_index < half) == (i == 0)]), ("x",))
        full = mesh_value("w", i)
        tree[f"stage{i}"] = jax.make_array_from_callback(
            full.shape, NamedSharding(mesh, P("x")), lambda idx, full=full: full[idx],
            dtype=full.dtype)  # a process holding none of it calls nothing: JAX needs the dtype
    adopt = getattr(multiprocess, "_adopt", None)
    multiprocess._adopt = lambda *args: None
    result["unwritten"] = _attempt(jckpt, tree, path, timeout=30)
    multiprocess._adopt = adopt
    try:
        jckpt.save(jckpt.Context(), tree, path)
        back = jckpt.restore(jckpt.Context(), tree, path)
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        return
    ok = back["empty"].shape == (0, 3) and back["empty_rep"].shape == (0, 4)
    for i in range(2):
        for shard in back[f"stage{i}"].addressable_shards:
            ok &= bool(np.array_equal(np.asarray(shard.data), mesh_value("w", i)[shard.index]))
    result["ok"] = bool(ok)


def phase_file_steps(jax, jckpt, result, path):
    """Managers of file steps (`directory_steps=False`) in a run of several processes: each
    process's in a directory of its own, then both in one directory."""
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    own = os.path.join(path, f"own{jax.process_index()}")
    across = NamedSharding(jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",)), P("x"))
    with jckpt.CheckpointManager(own, directory_steps=False, keep_last=1) as mgr:
        for step in (1, 2):
            mgr.save(step, {"x": np.full(4, step + 10 * jax.process_index(), np.float32)})
        mgr.wait_durable()
        result["steps"] = mgr.all_steps()
        result["restores"] = []
        for size in (8 if jax.process_index() else 4, 4):  # onto arrays across processes
            target = {"x": jax.ShapeDtypeStruct((size,), np.float32, sharding=across)}
            try:
                back = mgr.restore(target=target).tree["x"]
                result["restores"].append([None, [float(s.data[0]) for s in back.addressable_shards]])
            except jckpt.CheckpointError as e:
                result["restores"].append([type(e).__name__, str(e)])
    result["files"] = sorted(os.listdir(own))
    shared = None
    try:
        shared = jckpt.CheckpointManager(os.path.join(path, "shared"), directory_steps=False)
    except jckpt.InUseError as e:
        result["shared_error"] = str(e)
    multihost_utils.sync_global_devices("both tried")  # while the other holds it
    if shared is not None:
        shared.close()
    spread = global_array(jax, "b", NamedSharding(jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",)),
                                                  P("x")), 0)
    with jckpt.Mirror(os.path.join(path, f"mirror{jax.process_index()}.jckpt")) as mirror:
        try:  # one writer of one file from one process: an array it cannot hold whole
            mirror.submit({"b": spread})
        except jckpt.InputError as e:
            result["mirror_error"] = str(e)
    result["ok"] = True


def phase_readers(jax, jckpt, result, path):
    """An evaluation job's read-only managers, one per process: process 1 publishes step 2
    (the writer's rename) once process 0 has listed the directory, then reloads."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jckpt.services import steps

    listed = os.path.join(os.path.dirname(path), "listed")
    if jax.process_index() == 0:
        recover = steps.recover

        def recover_then_say(*args, **kwargs):
            found = recover(*args, **kwargs)
            with open(listed, "a") as f:  # one line per listing: the open's, the reload's
                f.write("listed\n")
            return found
        steps.recover = recover_then_say
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",))
    target = {"x": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P("x")))}
    with jckpt.CheckpointManager(path, read_only=True) as mgr:
        seen = [mgr.all_steps()]
        if jax.process_index() == 1:
            while not os.path.exists(listed) or open(listed).read().count("\n") < 2:
                time.sleep(0.01)
            os.rename(os.path.join(os.path.dirname(path), "side", "step_00000002.jckpt"),
                      os.path.join(path, "step_00000002.jckpt"))
        seen.append(mgr.reload())
        back = mgr.restore(target=target)
    ok = all(bool(np.array_equal(np.asarray(s.data), np.full(8, back.step, np.float32)[s.index]))
             for s in back.tree["x"].addressable_shards)
    result.update(steps=seen, restored=back.step, ok=ok)


def phase_own_error(jax, jckpt, result, path):
    """Every process saves version 1; process 1's version 2 fails with an error not jckpt's
    (`KIND`: while writing its pieces, or flattening a custom node), then both save version 3."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jckpt.api import multiprocess

    m = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices("cpu"))

    def tree(version):
        return {"w": global_array(jax, "w", NamedSharding(m, P("a", "b")), version),
                "step": expected("step", version)}

    class Unflattenable:
        pass

    jax.tree_util.register_pytree_node(
        Unflattenable, lambda _: (_ for _ in ()).throw(ValueError("flatten failed")),
        lambda aux, children: Unflattenable())
    jckpt.save(jckpt.Context(), tree(1), path)
    attempts, write = [], multiprocess._write_pieces
    for version in (2, 3):
        state = tree(version)
        if jax.process_index() == 1 and version == 2:
            if os.environ["KIND"] == "write":
                def failing(*args, **kwargs):
                    raise ValueError("the tree's code failed")
                multiprocess._write_pieces = failing
            else:
                state["node"] = Unflattenable()
        start = time.monotonic()
        try:
            jckpt.save(jckpt.Context(), state, path)
            attempts.append([None, "", time.monotonic() - start])
        except jckpt.CheckpointError as e:
            attempts.append([type(e).__name__, str(e), time.monotonic() - start])
            result["cause"] = type(e.__cause__).__name__ if e.__cause__ is not None else None
        multiprocess._write_pieces = write
        if version == 2:
            result["kept"] = int(jckpt.load(jckpt.Context(host=True), path)[1]["jckpt"]["step"])
    result.update(ok=True, attempts=attempts)


def phase_reader_race(jax, jckpt, result, path):
    """A read-only manager's processes restore the latest step, which the writer's retention
    removes once process 0 has read its part; then one in which process 1 alone fails."""
    import shutil

    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jckpt.services import restoring

    read, flag = restoring.read_step, os.path.join(os.path.dirname(path), "read")
    if jax.process_index() == 0:
        def read_then_say(*args, **kwargs):
            back = read(*args, **kwargs)
            open(flag, "w").close()
            return back
        restoring.read_step = read_then_say
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",))
    target = {"x": jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P("x")))}
    with jckpt.CheckpointManager(path, read_only=True) as mgr:
        result["listed"] = mgr.all_steps()
        if jax.process_index() == 1:
            while not os.path.exists(flag):
                time.sleep(0.01)
            shutil.rmtree(os.path.join(path, "step_00000002.jckpt"))  # the writer's retention
        back = mgr.restore(target=target)
        restoring.read_step = read
        result["ok"] = all(bool(np.array_equal(np.asarray(s.data), np.full(8, back.step, np.float32)[
            s.index])) for s in back.tree["x"].addressable_shards)
        result["restored"] = back.step
        if jax.process_index() == 1:
            def failing(*args, **kwargs):
                raise ValueError("cannot read")
            restoring.read_step = failing
        start = time.monotonic()
        try:
            mgr.restore(target=target)
        except jckpt.CheckpointError as e:
            result["failed"] = [type(e).__name__, str(e)]
        result["seconds"] = time.monotonic() - start
        restoring.read_step = read


def phase_manager_arguments(jax, jckpt, result, path):
    """A manager saves steps 1 to 3; at step 2, process 1's metrics hold a value that is no
    number, or (`KIND` "lease") process 1 finds its lease taken over by another writer (or,
    "leaseafter", while it saves), or ("items") process 1 passes `items=`."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    class TakenOver:  # an object store's lease, taken over by another writer
        def __init__(self, checks=0):
            self.checks = checks  # those that pass first (`KIND` "leaseafter": while it saves)

        def check(self):
            self.checks -= 1
            if self.checks < 0:
                raise jckpt.InUseError("the writer lease was taken over", file=str(path))

    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",))
    attempts = []
    with jckpt.CheckpointManager(path) as mgr:
        lease = mgr._lease
        for step in (1, 2, 3):
            x = jax.make_array_from_callback((8,), NamedSharding(mesh, P("x")),
                                             lambda i, s=step: np.full(8, s, np.float32)[i])
            lone = step == 2 and jax.process_index() == 1
            kind = os.environ.get("KIND")
            loss = "nan?" if lone and kind is None else float(step)
            lost = lone and kind in ("lease", "leaseafter")
            mgr._lease = TakenOver(1 if kind == "leaseafter" else 0) if lost else lease
            start = time.monotonic()
            try:
                items = lone and kind == "items"  # refused with directory steps
                mgr.save(step, None if items else {"x": x}, items={"jckpt": {"x": x}} if items
                         else None, metrics={"loss": loss})  # one line: the same save's site
                attempts.append([None, "", time.monotonic() - start])
            except jckpt.CheckpointError as e:
                attempts.append([type(e).__name__, str(e), time.monotonic() - start])
        mgr._lease = lease
        result.update(ok=True, attempts=attempts, steps=mgr.all_steps())


def _restore_attempt(jckpt, call, value):
    """`[error type or None, message, seconds, whether what came back holds value]` of a
    restore (`call`) whose tree (or a manager's restored step's) holds a global array `x`."""
    start = time.monotonic()
    try:
        back = call()
    except jckpt.CheckpointError as e:
        return [type(e).__name__, str(e), time.monotonic() - start, False]
    tree = getattr(back, "tree", back)
    return [None, "", time.monotonic() - start, all(bool(np.all(np.asarray(s.data) == value))
                                                    for s in tree["x"].addressable_shards)]


def phase_lone_failures(jax, jckpt, result, path):
    """A writer manager's restores, then plain `jckpt.restore`s, each failing in process 1
    alone: a target of another shape, its piece of step 2 damaged, a `verify=` that is no
    flag, a file missing for it alone; each followed by one that fails in none (but the flag)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",)), P("x"))
    lone = jax.process_index() == 1
    run = os.path.join(path, "run")

    def target(size=8):
        return {"x": jax.ShapeDtypeStruct((size,), np.float32, sharding=sharding)}

    attempt = functools.partial(_restore_attempt, jckpt)

    attempts = []
    with jckpt.CheckpointManager(run) as mgr:
        for step in (1, 2):
            mgr.save(step, {"x": jax.make_array_from_callback(
                (8,), sharding, lambda i, s=step: np.full(8, s, np.float32)[i])})
        attempts.append(attempt(lambda: mgr.restore(target=target(16 if lone else 8)), 2))
        attempts.append(attempt(lambda: mgr.restore(target=target()), 2))
        piece = os.path.join(run, "step_00000002.jckpt", "process_00001.jckpt")
        if lone:  # the damage is in the piece process 1 alone reads
            data = bytearray(open(piece, "rb").read())
            data[-1] ^= 0xFF
            with open(piece, "wb") as f:
                f.write(data)
        attempts.append(attempt(lambda: mgr.restore(target=target()), 2))
        attempts.append(attempt(lambda: mgr.restore(1, target=target()), 1))
        attempts.append(attempt(lambda: mgr.restore(1, target=target(), verify="yes" if lone
                                                    else True), 1))  # refused before the read
    one = os.path.join(path, "missing.jckpt" if lone else "one.jckpt")
    attempts.append(attempt(lambda: jckpt.restore(jckpt.Context(), target(), one), 7))
    one = os.path.join(path, "one.jckpt")
    attempts.append(attempt(lambda: jckpt.restore(jckpt.Context(), target(), one), 7))
    if not lone:  # onto host values: this process's own restore, which meets no other
        start = time.monotonic()
        back = jckpt.restore(jckpt.Context(), {"x": np.zeros(8, np.float32)}, one)
        result["alone"] = [bool(np.all(back["x"] == 7)), time.monotonic() - start]
    step2 = os.path.join(run, "step_00000002.jckpt")
    attempts.append(attempt(lambda: jckpt.restore(jckpt.Context(), target(), step2, verify=True), 2))
    result.update(ok=True, attempts=attempts)


HALF = (64, 32768)  # rows of 128 KiB: half of each is 64 KiB, no shorter than a gap read through


def phase_half_of_each_piece(jax, jckpt, result, path):
    """Restore a directory written as 4 pieces of rows onto a mesh whose `data` axis (across
    the processes) splits the columns: each process needs half of every piece. The bytes the
    kernel is asked to read ahead of their use are counted."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jckpt.storage import reader as reader_mod
    advise, advised = reader_mod._advise, []
    reader_mod._advise = lambda m, start, n: (advised.append(n), advise(m, start, n))
    sharding = NamedSharding(mesh_of(jax, (jax.process_count(), len(jax.local_devices(backend="cpu")))),
                             P(None, "data"))
    back = jckpt.restore(jckpt.Context(), {"w": jax.ShapeDtypeStruct(HALF, np.float32,
                                                                     sharding=sharding)}, path)
    full = np.arange(int(np.prod(HALF)), dtype=np.float32).reshape(HALF)
    result["advised"], result["needed"] = sum(advised), full.nbytes // 2
    result["ok"] = all(np.array_equal(np.asarray(s.data), full[s.index])
                       for s in back["w"].addressable_shards)


def phase_lone_meeting(jax, jckpt, result, path):
    """Process 0 restores onto a global array alone while process 1 opens a reader alone;
    then both restore onto a global array, and a manager of both saves and restores a step."""
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",)), P("x"))
    target = {"x": jax.ShapeDtypeStruct((8,), np.float32, sharding=sharding)}
    one = os.path.join(path, "one.jckpt")

    attempt = functools.partial(_restore_attempt, jckpt)

    def read_alone():
        with jckpt.CheckpointManager(os.path.join(path, "empty"), read_only=True):
            return {"x": jax.numpy.zeros(8)}

    attempts = [attempt(lambda: jckpt.restore(jckpt.Context(), target, one), 7)
                if jax.process_index() == 0 else attempt(read_alone, 7)]
    multihost_utils.sync_global_devices("both alone")
    attempts.append(attempt(lambda: jckpt.restore(jckpt.Context(), target, one), 7))
    multihost_utils.sync_global_devices("both timed out")  # however far apart they did
    with jckpt.CheckpointManager(os.path.join(path, "run")) as mgr:
        x = jax.make_array_from_callback((8,), sharding, lambda i: np.full(8, 1, np.float32)[i])
        attempts.append(attempt(lambda: (mgr.save(1, {"x": x}), {"x": x})[1], 1))
        attempts.append(attempt(lambda: mgr.restore(target=target), 1))
        y = jax.make_array_from_callback((8,), sharding, lambda i: np.full(8, 2, np.float32)[i])
        mgr.save(2, {"x": y})
        asked = 1 + jax.process_index()  # each process another step: never one array of both
        attempts.append(attempt(lambda: mgr.restore(asked, target=target), asked))
    result.update(ok=True, attempts=attempts)


def phase_stuck(jax, jckpt, result, path):
    """A manager of both processes saves steps 1 and 2. `KIND` "mismatch": process 0 then
    restores step 2 while process 1 saves step 3 (a mistake). "slow": process 1 comes late to
    a restore both make (still at the save before), then reads its part slowly. "arguments":
    process 1 passes a `restore` or `save` argument that is refused; "told": a step to `save`
    that is no step."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices("cpu")), ("x",)), P("x"))
    target = {"x": jax.ShapeDtypeStruct((8,), np.float32, sharding=sharding)}
    attempt = functools.partial(_restore_attempt, jckpt)
    lone = jax.process_index() == 1

    def x(step):
        return {"x": jax.make_array_from_callback((8,), sharding,
                                                  lambda i: np.full(8, step, np.float32)[i])}

    attempts = []
    with jckpt.CheckpointManager(path) as mgr:
        for step in (1, 2):
            mgr.save(step, x(step))
        kind = os.environ.get("KIND")
        if kind == "mismatch":
            attempts.append(attempt(lambda: (mgr.save(3, x(3)), x(3))[1] if lone
                                    else mgr.restore(2, target=target), 3 if lone else 2))
        elif kind == "arguments":  # each refused in process 1 alone, then one refused in none
            attempts.append(attempt(lambda: mgr.restore("two" if lone else 2, target=target), 2))
            attempts.append(attempt(lambda: mgr.restore(1 if lone else 2, target=target), 2))
            for step, force in ((3, "yes" if lone else False), (4, False)):
                attempts.append(attempt(lambda s=step, f=force: (mgr.save(s, x(s), force=f),
                                                                 x(s))[1], step))
            attempts.append(attempt(lambda: mgr.restore(target=target), 4))
        elif kind == "told":  # process 1 saves a step that is no step: it cannot meet the others
            attempts.append(attempt(lambda: (mgr.save(-3 if lone else 3, x(3)), x(3))[1], 3))
            _other_work(jax, "process 0 failed")
        else:
            if lone:
                time.sleep(3)  # behind: still at the save before, as the others see it
            attempts.append(attempt(lambda: mgr.restore(2, target=target), 2))
            read = mgr._read
            if lone:  # slow: at the restore, reading its part
                mgr._read = lambda *a, **k: (time.sleep(3), read(*a, **k))[1]
            attempts.append(attempt(lambda: mgr.restore(1, target=target), 1))
            mgr._read = read
    result.update(ok=True, attempts=attempts)


def phase_refusals(jax, jckpt, result, path):
    """`KIND` "save": both processes save, then process 1 passes a context `jckpt.save` refuses
    before the save takes its turn, and goes on to other work; then both save again. "open": process 1 passes
    `CheckpointManager` options refused with directory steps, then every process opens it."""
    lone = jax.process_index() == 1
    attempts = []

    def attempt(call):
        try:
            call()
            attempts.append([None, ""])
        except jckpt.CheckpointError as e:
            attempts.append([type(e).__name__, str(e)])
    if os.environ.get("KIND") == "save":
        for version in (1, 2, 3):
            tree = {"x": np.full(4, version, dtype=np.float32)}
            ctx = tree if lone and version == 2 else jckpt.Context()  # a tree: no context
            attempt(functools.partial(jckpt.save, ctx, tree, path))
            if version == 2:
                _other_work(jax, "the refusal is over")
    else:
        foreign = jckpt.CheckpointOptions(format="safetensors") if lone else None
        attempt(lambda: jckpt.CheckpointManager(path, directory_steps=True, options=foreign).close())
        attempt(lambda: jckpt.CheckpointManager(path, directory_steps=True).close())
        _other_work(jax, "the refusals are over")
    result.update(ok=True, attempts=attempts)


def _other_work(jax, name):
    """Every process meets at a barrier of JAX's own, not jckpt's (waiting up to 2 minutes: a
    process waiting out jckpt's timeout meanwhile still comes)."""
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(name, 120_000)


PHASES = {"lonesame": phase_lone_save_of_the_same_path, "openconflict": phase_open_beside_a_live_run,
          "meshsave": phase_mesh_save, "meshrestore": phase_mesh_restore,
          "killed": phase_killed_mid_save, "preempted": phase_preempted,
          "stages": phase_stages,
          "filesteps": phase_file_steps, "readers": phase_readers,
          "ownerror": phase_own_error, "readerrace": phase_reader_race,
          "managerargs": phase_manager_arguments, "lonefailures": phase_lone_failures,
          "halfpieces": phase_half_of_each_piece, "lonemeeting": phase_lone_meeting,
          "stuck": phase_stuck, "refusals": phase_refusals}


def worker(phase, process, port, path, processes=2, devices=2):
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=processes,
                               process_id=process, initialization_timeout=60)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jckpt
    from jckpt.api import multiprocess
    from jckpt.storage.directory import DirectoryReader
    from jckpt.trees import sharding as sh

    assert jax.process_count() == processes and jax.device_count() == processes * devices
    result = {"process": process, "ok": False}
    if phase in PHASES:  # the phases of several process counts
        PHASES[phase](jax, jckpt, result, path)
        print("RESULT " + json.dumps(result), flush=True)
        return

    def make(name, sharding, version):
        full = expected(name, version)
        return jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])

    if phase in ("save", "die", "diffpath", "disagree"):
        m = jax.make_mesh((2, 2), ("a", "b"))
        version = 2 if phase == "die" else 1
        if phase == "diffpath":
            path = f"{path}_{process}"  # a mistake: each process its own path
        mine, peer = ([dv for dv in jax.devices() if dv.process_index == p] for p in (0, 1))
        m_mixed = jax.sharding.Mesh(np.array([mine[0], peer[0], mine[1], peer[1]]), ("x",))
        tree = {"w": make("w", NamedSharding(m, P("a", "b")), version),
                "c": make("c", NamedSharding(m_mixed, P("x")), version),
                "b": make("b", NamedSharding(m, P("b")), version),
                "rep": make("rep", NamedSharding(m, P()), version),
                # on this process's two devices only: process 0's copy is the one saved
                "loc": jax.device_put(expected("loc", version), NamedSharding(
                    jax.sharding.Mesh(np.array(jax.local_devices()), ("l",)), P("l"))),
                "step": expected("step", version)}
        if phase == "disagree" and process == 1:
            tree["extra"] = np.ones(3, np.float32)  # a mistake: the trees differ
        if phase == "die" and process == 1:
            def die(*args, **kwargs):
                os._exit(17)  # killed after writing its pieces, before the barrier
            multiprocess._Runtime.barrier = die
        start = time.monotonic()
        try:
            jckpt.save(jckpt.Context(), tree, path)
            result["ok"] = True
        except jckpt.CheckpointError as e:
            result.update(error_type=type(e).__name__, error=str(e))
        result["seconds"] = time.monotonic() - start
        print("RESULT " + json.dumps(result), flush=True)
        if phase == "die":
            os._exit(0)  # the peer is gone: skip jax.distributed's shutdown barrier
        return

    if phase == "best":  # a manager keeping the best step, told each process's own loss
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
        sh = NamedSharding(mesh, P("x"))
        reads = []  # the steps' indexes this process opens once the manager is open
        sys.addaudithook(lambda event, args: reads.append(args[0]) if event == "open" and str(
            args[0]).endswith("index.jckpt") and "jckpt-stage" not in str(args[0]) else None)
        with jckpt.CheckpointManager(path, keep_best=1, keep_last=1, best_metric="loss") as mgr:
            reads.clear()
            for step in range(1, 6):
                x = jax.make_array_from_callback(
                    (4,), sh, lambda i, s=step: np.full(4, s, np.float32)[i])
                mgr.save(step, {"x": x}, metrics={"loss": float(step if process == 0 else 10 - step)})
            mgr.wait_durable()
            result.update(ok=True, steps=mgr.all_steps(), best=mgr.best_step(),
                          index_reads=[str(r) for r in reads])
        print("RESULT " + json.dumps(result), flush=True)
        return

    if phase == "keys":  # typed PRNG keys sharded over both processes, and one replicated
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
        def global_keys(keys, spec):  # each process puts only its own devices' part
            data = np.asarray(jax.random.key_data(keys))
            return jax.random.wrap_key_data(jax.make_array_from_callback(
                data.shape, NamedSharding(mesh, spec), lambda idx: data[idx]))

        tree = {"k": global_keys(jax.random.split(jax.random.key(7), 8), P("x", None)),
                "one": global_keys(jax.random.key(3), P(None))}
        jckpt.save(jckpt.Context(), tree, path)
        back = jckpt.restore(jckpt.Context(), tree, path)
        for name in ("k", "one"):
            got, want = back[name], tree[name]
            assert got.sharding.is_equivalent_to(want.sharding, got.ndim), name
            assert jax.random.key_impl(got) == jax.random.key_impl(want), name
            for a, b in zip(got.addressable_shards, want.addressable_shards):
                assert (jax.random.key_data(a.data) == jax.random.key_data(b.data)).all(), name
        result.update(ok=True)
        print("RESULT " + json.dumps(result), flush=True)
        return

    if phase in ("planfail", "alone", "hostdiff", "metafail"):  # one process's save fails, or differs
        m = jax.make_mesh((2, 2), ("a", "b"))
        results_ = []
        if phase == "alone" and process == 0:  # a debug dump only this process saves
            results_.append(_attempt(jckpt, {"d": np.ones(2)}, path + "-debug", timeout=3))
        for version in (1, 2):
            tree = {"w": make("w", NamedSharding(m, P("a", "b")), version),
                    "step": expected("step", version)}
            if phase == "planfail" and process == 1 and version == 1:
                tree["step"] = "not an array"  # refused while this process plans its pieces
            if phase == "hostdiff" and process == 1 and version == 1:
                tree["step"] = np.zeros(9, np.int64)  # process 0's is a scalar int32
            lone = process == 1 and version == 1
            aligned = os.environ.get("KIND") == "alignment"  # 3: no power of two
            metadata = {"note": 3 if lone and not aligned else "ok"}  # 3: no string
            results_.append(_attempt(jckpt, tree, path, metadata=metadata if phase == "metafail"
                                     else None, alignment=3 if lone and aligned else None))
        result.update(ok=True, attempts=results_)
        print("RESULT " + json.dumps(result), flush=True)
        return

    if phase == "orbax":  # orbax's CheckpointManager in every process, jckpt's handler
        import orbax.checkpoint as ocp

        from jckpt.adapters.orbax_handler import JckptSave
        m = jax.make_mesh((2, 2), ("a", "b"))
        state = {"rep": make("rep", NamedSharding(m, P()), 1), "step": jax.device_put(
            np.int32(7), NamedSharding(m, P()))}
        with ocp.CheckpointManager(path) as manager:
            manager.save(1, args=ocp.args.Composite(state=JckptSave(state)))
            manager.wait_until_finished()
            sharded = {"w": make("w", NamedSharding(m, P("a", "b")), 1)}
            try:
                manager.save(2, args=ocp.args.Composite(state=JckptSave(sharded)))
                manager.wait_until_finished()
            except jckpt.CheckpointError as e:
                result.update(error_type=type(e).__name__, error=str(e))
        result["ok"] = True
        print("RESULT " + json.dumps(result), flush=True)
        return

    if phase == "orbax_sharded":  # orbax's own save of arrays sharded across both processes
        import orbax.checkpoint as ocp

        m = jax.make_mesh((2, 2), ("a", "b"))
        state = {"w": make("w", NamedSharding(m, P("a", "b")), 1),
                 "c": make("c", NamedSharding(m, P("a")), 1),
                 "rep": make("rep", NamedSharding(m, P()), 1)}
        for name, handler in (("ocdbt", ocp.PyTreeCheckpointHandler()),
                              ("zarr3", ocp.PyTreeCheckpointHandler(use_zarr3=True)),
                              ("plain", ocp.PyTreeCheckpointHandler(use_ocdbt=False))):
            with ocp.Checkpointer(handler) as checkpointer:
                checkpointer.save(os.path.join(path, name), args=ocp.args.PyTreeSave(state))
        with ocp.CheckpointManager(os.path.join(path, "run")) as manager:
            manager.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
            manager.wait_until_finished()
        result["ok"] = True
        print("RESULT " + json.dumps(result), flush=True)
        return

    if phase == "restore":
        m = jax.make_mesh((4,), ("x",))
        shardings = {"w": NamedSharding(m, P("x")), "b": NamedSharding(m, P("x")),
                     "rep": NamedSharding(m, P(None, "x")), "c": NamedSharding(m, P("x"))}
        target = {k: jax.ShapeDtypeStruct(expected(k, 1).shape, np.float32, sharding=s)
                  for k, s in shardings.items()}
        target["step"] = 0
        with sh.record_reads() as log:
            back = jckpt.restore(jckpt.Context(), target, path)
        ok = back["step"] == expected("step", 1)
        for k, s in shardings.items():
            full = expected(k, 1)
            assert back[k].sharding == s
            for shard in back[k].addressable_shards:
                ok &= bool(np.array_equal(np.asarray(shard.data), full[shard.index]))
        # each device's callback read its shard's bytes (the step scalar is read whole, 4 bytes)
        want = sorted([4] + [int(np.prod(s.shard_shape(expected(k, 1).shape))) * 4
                             for k, s in shardings.items() for _ in range(2)])
        result["bytes_ok"] = sorted(n for _, n in log) == want
        result["log"] = [[list(map(list, b)), n] for b, n in log]
        reader = DirectoryReader(path)
        info = reader.arrays[("jckpt", (("k", "w"),))]
        lazy = reader.decode(info.entry)
        for shard in back["w"].addressable_shards:
            lazy[shard.index]
        result["files_opened"] = sorted(reader._readers)
        _, loaded = jckpt.load(jckpt.Context(), path)  # every process can read everything too
        for k in shardings:
            ok &= bool(np.array_equal(np.asarray(loaded["jckpt"][k]), expected(k, 1)))
        result["ok"] = bool(ok)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]),
           int(sys.argv[6]))
