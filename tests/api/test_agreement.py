"""Every process's outcome agreed on at one meeting (`agree`, `jointly`, `tell`), against a
stand-in for JAX's distributed client (the multi-process runs themselves are in
tests/system/test_multiprocess.py)."""

import json

import pytest

import jckpt
from jckpt.api import agreement as agreement_mod
from jckpt.api import meetings as meetings_mod
from jckpt.api import runtime as runtime_mod
from jckpt.api.agreement import agree, jointly
from tests.kv_client import FakeClient


def _peer_failure(message, kind="InUseError", fix="close the other one", path="run"):
    return json.dumps({"path": path, "type": kind, "message": message, "fix": fix})


def test_every_process_raises_the_error_another_met(monkeypatch):
    """Processes 0 and 1 could not take their leases: process 2, which could, learns of it at
    once and raises the same error, naming both."""
    client = FakeClient(peers={"said/0": _peer_failure("in use: another writer (pid 7)"),
                               "said/1": _peer_failure("in use: another writer (pid 8)"),
                               "said/3": _peer_failure(None, None, None)})
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: client)
    with pytest.raises(jckpt.InUseError) as e:
        agree("opening the manager", "run", None, process=2, processes=4, timeout=5)
    assert e.value.message == ("opening the manager failed in 2 of the run's processes (process 0: "
                               "in use: another writer (pid 7); process 1: in use: another writer "
                               "(pid 8))")
    assert e.value.file == "run" and e.value.fix == "close the other one"
    assert client.met == ["said"]


def test_a_failing_process_raises_what_the_others_raise(monkeypatch):
    client = FakeClient()
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: client)
    mine = jckpt.InUseError("in use: another writer (pid 7)", file="run/.process00001",
                            fix="close it")
    with pytest.raises(jckpt.InUseError, match=r"failed in 1 of the run's processes \(process 1: "
                                               r"in use: another writer \(pid 7\)\)"):
        agree("opening the manager", "run", mine, process=1, processes=2, timeout=5)
    other = jckpt.StorageError("disk full", errno=28)  # errors with fields of their own too
    with pytest.raises(jckpt.StorageError, match=r"process 1: disk full"):
        agree("opening the manager", "run", other, process=1, processes=2, timeout=5)
    with pytest.raises(jckpt.DistributedError, match=r"process 1: OSError: no"):
        agree("opening the manager", "run", OSError("no"), process=1, processes=2, timeout=5)


def test_no_failure_anywhere_passes_and_one_process_waits_for_nobody(monkeypatch):
    client = FakeClient()
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: client)
    agree("opening the manager", "run", None, process=0, processes=2, timeout=5)
    assert client.met == ["said"]
    agree("opening the manager", "run", None, process=0, processes=1)  # nothing to meet
    with pytest.raises(jckpt.InUseError, match="^in use$"):
        agree("opening the manager", "run", jckpt.InUseError("in use"), process=0, processes=1)
    assert client.met == ["said"]


def test_processes_naming_different_paths_all_fail_at_once(monkeypatch):
    """Each process's path comes with what it says: a run opening managers on different
    directories fails at open, in every process alike, instead of at its first save."""
    client = FakeClient(peers={"said/1": _peer_failure(None, None, None, path="run-b")})
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: client)
    with pytest.raises(jckpt.DistributedError) as e:
        agree("opening the manager", "run", None, process=0, processes=2, timeout=5)
    assert e.value.message == ("opening the manager: the processes name different paths "
                               "(process 0: run; process 1: run-b)")


def test_a_peer_that_never_comes_gives_this_processs_own_error_or_a_timeout(monkeypatch):
    client = FakeClient(blocked={"said"})
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: client)
    with pytest.raises(jckpt.InUseError, match="^in use$"):
        agree("opening the manager", "run", jckpt.InUseError("in use"), process=0, processes=2,
              timeout=0.3)
    with pytest.raises(jckpt.DistributedError, match="not every process reached opening the "
                                                      "manager"):
        agree("opening the manager", "run", None, process=0, processes=2, timeout=0.3)


def test_agree_returns_every_processs_value_by_process(monkeypatch):
    said = json.dumps({"path": "run", "value": [1, 2], "type": None, "message": None, "fix": None})
    client = FakeClient(peers={"said/1": said})
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: client)
    assert agree("listing the steps", "run", None, process=0, processes=2, timeout=5,
                 value=[1]) == [[1], [1, 2]]
    assert agree("listing the steps", "run", None, process=0, processes=1, value=[3]) == [[3]]
    blocked = FakeClient(blocked={"said"})
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: blocked)
    with pytest.raises(jckpt.DistributedError, match="not every process reached listing the steps") as e:
        agree("listing the steps", "run", None, process=0, processes=2, timeout=0.3)
    assert "nothing was written" in e.value.message and "published" not in e.value.message


def test_jointly_returns_the_value_once_every_process_has_or_raises_the_one_error(monkeypatch):
    """A restore of one process's own file meets the others: their paths may differ."""
    client = FakeClient(peers={"said/1": _peer_failure(None, None, None, path="b.jckpt")})
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: client)
    assert jointly("restoring the checkpoint", "a.jckpt", lambda: 7, process=0, processes=2,
                   same_path=False) == 7
    assert client.met == ["said"]
    failing = FakeClient(peers={"said/1": _peer_failure("checksum mismatch", "ChecksumError",
                                                              path="a.jckpt")})
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: failing)
    with pytest.raises(jckpt.ChecksumError, match=r"restoring the checkpoint failed in 1 of the "
                                                  r"run's processes \(process 1: checksum mismatch"):
        jointly("restoring the checkpoint", "a.jckpt", lambda: 7, process=0, processes=2)


def test_meetings_about_different_things_never_pair(monkeypatch):
    """Meetings were paired by one counter of the process: a restore one process made alone
    paired its next meeting (a manager's open) with the others' restore, and every later one
    with the wrong call. Now a barrier's name says what it is about, counted per thing."""
    import collections

    client = FakeClient()
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: client)
    monkeypatch.setattr(meetings_mod, "_MEETINGS", collections.Counter())
    for _ in range(2):
        jointly("restoring the checkpoint", "a.jckpt", lambda: 7, process=0, processes=2,
                same_path=False)
    agree("opening the manager", "run", None, process=0, processes=2, timeout=5)
    agree("listing the steps", "run", None, process=0, processes=2, timeout=5)
    agree("opening the manager", "run", None, process=0, processes=2, timeout=5)
    restore0, restore1, open0, _, _ = client.names
    assert len(set(client.names)) == 5, client.names
    assert restore0.rsplit("/", 2)[0] == restore1.rsplit("/", 2)[0] != open0.rsplit("/", 2)[0]
    assert [n.split("/")[-2] for n in client.names] == ["0", "1", "0", "0", "1"], client.names
    assert json.loads(client.kv["jckpt/meeting/0"]) == ["opening the manager", "run", 1]


def test_a_timeout_names_the_meeting_this_process_is_at_and_where_the_others_are(monkeypatch):
    """A process waiting for a partner at another meeting waited out the timeout to learn
    only that the other did not come, and then went on pairing the wrong calls."""
    import collections

    client = FakeClient(blocked={"said"})
    client.kv["jckpt/meeting/1"] = json.dumps(["listing the steps", "/runs/a", 0])
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: client)
    monkeypatch.setattr(meetings_mod, "_MEETINGS", collections.Counter({
        ("restoring the checkpoint", ""): 1}))
    with pytest.raises(jckpt.DistributedError) as e:
        jointly("restoring the checkpoint", "a.jckpt", lambda: 7, process=0, processes=3,
                same_path=False)
    assert ("this process is at restoring the checkpoint (its 2nd such meeting), process 1 is at "
            "listing the steps of /runs/a (its 1st such meeting); process 2 has been at no "
            "meeting: the processes are at different meetings") in e.value.message, e.value
    assert e.value.message.startswith("not every process reached restoring the checkpoint")
    assert "in the same order" in e.value.fix and "restart the run's processes" in e.value.fix


def test_a_process_says_where_it_is_before_its_part_of_a_meeting(monkeypatch):
    """A process still reading its part of a restore (slow, on a loaded host) showed, to a
    partner that timed out meanwhile, the meeting it had made before: when that was the same
    kind of meeting (a restore it made alone), the partner took it as having come, and named
    no mismatch. Its position is posted before its part begins."""
    import collections

    client = FakeClient()
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: client)
    monkeypatch.setattr(meetings_mod, "_MEETINGS", collections.Counter({
        ("restoring the checkpoint", ""): 1}))
    seen = []
    jointly("restoring the checkpoint", "a.jckpt", lambda: seen.append(client.kv["jckpt/meeting/0"]),
            process=0, processes=2, same_path=False)
    assert json.loads(seen[0]) == ["restoring the checkpoint", "", 1]
    assert len(client.names) == 1  # still one barrier


def test_jointly_in_one_process_raises_its_own_error_as_it_is(monkeypatch):
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: pytest.fail("met"))
    mine = jckpt.FormatError("no such file")
    with pytest.raises(jckpt.FormatError) as e:
        jointly("restoring the checkpoint", "a.jckpt", lambda: (_ for _ in ()).throw(mine),
                process=0, processes=1)
    assert e.value is mine


def _at(monkeypatch, client, mine, theirs):
    """This process has begun the meetings `mine` counts; process 1 said it is at `theirs`."""
    import collections

    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: client)
    monkeypatch.setattr(agreement_mod, "client", lambda processes, path: client)
    monkeypatch.setattr(meetings_mod, "_MEETINGS", collections.Counter(mine))
    client.kv["jckpt/meeting/1"] = json.dumps(theirs)
    monkeypatch.setattr(runtime_mod, "POLL", 0.01)


def test_processes_waiting_at_different_meetings_fail_at_once_not_at_the_timeout(monkeypatch):
    """Process 0 restoring step 2 while process 1 saves step 3 waited out the barrier's timeout
    (5 minutes by default) to say so: neither could ever move on. Now the first look at where
    process 1 is tells, and the error is the timeout's, naming both meetings."""
    client = FakeClient(blocked={"said"})
    _at(monkeypatch, client, {}, ["saving", "/run/step_00000003.jckpt", 0])
    with pytest.raises(jckpt.DistributedError) as e:
        agree("restoring step 2", "/run", None, process=0, processes=2, timeout=300)
    assert client.waits == 1, client.waits  # one look, not 300 s of them
    assert e.value.message.startswith("not every process reached restoring step 2 (waited ")
    assert ("process 1 did not come); the processes only meet there: nothing was written (it "
            "waits at another meeting, for this process: no process can move on)") in e.value.message
    assert ("this process is at restoring step 2 of /run (its 1st such meeting), process 1 is at "
            "saving of /run/step_00000003.jckpt (its 1st such meeting): the processes are at "
            "different meetings") in e.value.message, e.value
    assert "restart the run's processes together" in e.value.fix


def test_a_process_behind_by_a_meeting_is_waited_for_not_taken_as_stuck(monkeypatch):
    """Process 1 still at the listing before this one (which this process passed), or at the
    open before it: it may yet come, so this process waits (here, out its timeout)."""
    for theirs in (["listing the steps", "run", 0], ["opening the manager", "run", 0]):
        client = FakeClient(blocked={"said"})
        _at(monkeypatch, client, {("listing the steps", "run"): 1, ("opening the manager", "run"): 1},
            theirs)
        with pytest.raises(jckpt.DistributedError) as e:
            agree("listing the steps", "run", None, process=0, processes=2, timeout=0.2)
        assert client.waits > 1 and "no process can move on" not in e.value.message, e.value
        assert "(the barrier timed out)" in e.value.message, e.value


def test_a_slow_process_is_waited_for(monkeypatch):
    """Process 1 comes after several looks (still at the meeting before, which this process
    passed): the meeting goes on, with what it said."""
    client = FakeClient(late=5, peers={"said/1": json.dumps({"path": "run", "value": 7, "type": None,
                                                               "message": None, "fix": None})})
    _at(monkeypatch, client, {("listing the steps", "run"): 1}, ["listing the steps", "run", 0])
    assert agree("listing the steps", "run", None, process=0, processes=2, timeout=300,
                 value=6) == [6, 7]
    assert client.waits == 5


def test_a_timeout_says_what_a_process_refusing_a_call_alone_was_told(monkeypatch):
    """Process 1's save of a step that is no step cannot meet the others (where it would save is
    not known): process 0's timeout named only where process 1 was before it."""
    client = FakeClient(blocked={"said"})
    _at(monkeypatch, client, {("listing the steps", "run"): 1}, ["listing the steps", "run", 0])
    refusal = jckpt.InputError("step must be a non-negative integer, not int -3", file="run")
    agreement_mod.tell(refusal, meetings_mod.refused(meetings_mod.SAVING, ""), process=1, processes=2)
    with pytest.raises(jckpt.DistributedError) as e:
        agree("opening the manager", "run", None, process=0, processes=2, timeout=0.2)
    assert client.waits > 1 and "(the barrier timed out)" in e.value.message, e.value  # elsewhere
    assert ("process 1 left saving a checkpoint (its 1st such meeting), failing, and was told "
            "since: InputError: step must be a non-negative integer, not int -3: the processes "
            "are at different meetings") in e.value.message, e.value


def test_a_process_that_refused_the_call_alone_fails_the_others_there_at_once(monkeypatch):
    """Process 1 refused the manager's open alone (an argument it alone passed) and went on to
    other work: process 0, waiting for it there, waited out its timeout (300 s by default)."""
    client = FakeClient(blocked={"said"})
    _at(monkeypatch, client, {}, ["listing the steps", "run", 0])
    refusal = jckpt.InputError("save_interval_steps must be a positive integer, not 0", file="run")
    agreement_mod.tell(refusal, meetings_mod.refused("opening the manager", "run"), process=1,
                     processes=2)
    with pytest.raises(jckpt.DistributedError) as e:
        agree("opening the manager", "run", None, process=0, processes=2, timeout=300)
    assert client.waits == 1, client.waits  # one look, not 300 s of them
    assert "(it left this meeting failing: it will not come)" in e.value.message, e.value
    assert ("process 1 left opening the manager of run (its 1st such meeting), failing, and was "
            "told since: InputError: save_interval_steps must be a positive integer, not 0") \
        in e.value.message, e.value


def test_a_process_coming_to_a_meeting_another_left_failing_fails_too(monkeypatch):
    """Process 0 left its lone restore at its timeout; process 1's restore, made later, found
    process 0's word there and passed alone (a barrier that timed out fails a latecomer)."""
    import collections

    client = FakeClient()
    monkeypatch.setattr(runtime_mod, "client", lambda processes, path: client)
    monkeypatch.setattr(meetings_mod, "_MEETINGS", collections.Counter())
    tag = meetings_mod.Meeting("restoring the checkpoint", "", 0).tag
    client.kv[f"{tag}/said/0"] = _peer_failure(None, None, None, path="a.jckpt")
    client.kv[f"{tag}/said-outcome"] = "failed"  # as process 0 settled it, leaving
    with pytest.raises(jckpt.DistributedError, match="another process left this meeting failing"):
        jointly("restoring the checkpoint", "a.jckpt", lambda: 7, process=1, processes=2,
                same_path=False)
    assert client.kv[f"{tag}/said-outcome"] == "failed" and client.names == []  # no wait


def test_agree_and_jointly_refuse_a_call_while_another_thread_makes_one(monkeypatch):
    """Two threads of one process meeting the others at once confused where it is (one position
    per process): the second call is refused before it meets anyone."""
    import threading

    inside, done = threading.Event(), threading.Event()

    def save():
        with meetings_mod.alone(meetings_mod.SAVING, "run", 2):
            inside.set()
            done.wait(10)
    t = threading.Thread(target=save)
    t.start()
    try:
        assert inside.wait(10)
        for call in (lambda: agree("opening the manager", "run", None, process=0, processes=2),
                     lambda: jointly("restoring a step", "run", lambda: 1, process=0, processes=2)):
            with pytest.raises(jckpt.InputError, match="while another thread of this process is "
                                                       "saving a checkpoint"):
                call()
    finally:
        done.set()
        t.join()
