"""The background engine alone, with a committer that writes nothing: order, slots, retries, close."""

import errno
import threading
import time

import numpy as np
import pytest

import jckpt
from jckpt.services.engine import Job, MirrorCounters, Pipeline, deadline_after, error_code

LINE = "memory mirror: committed {} durable {} generation {} pending {} error {}"


def leaves(value):
    return [("jckpt", (("k", "w"),), np.full(2, value, np.float32))]


def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


class Fake:
    """A committer that records what the pipeline asks of it; ``gate`` holds staging back."""

    def __init__(self):
        self.events = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_stage = None
        self.fail_publish = None
        self.staged_generation = self.published_generation = 0
        self.built = {}

    def stage(self, job):
        self.gate.wait(30)
        if self.fail_stage is not None:
            raise self.fail_stage
        self.built.setdefault(job.seq, set()).add(id(job.built))
        self.staged_generation += 1
        self.events.append(("stage", job.seq, float(job.items[0].array[0])))
        return job.seq, self.staged_generation

    def publish(self, staged):
        if self.fail_publish is not None:
            raise self.fail_publish
        self.events.append(("publish", staged[0]))
        self.published_generation = staged[1]
        return staged[1]

    def discard(self, staged):
        self.events.append(("discard", staged[0]))

    def rollback(self):
        self.events.append(("rollback",))
        self.staged_generation = self.published_generation

    def published(self):
        return [e[1] for e in self.events if e[0] == "publish"]


def writer_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("jckpt-")]


def test_jobs_are_published_in_order_and_close_flushes_them():
    fake = Fake()
    p = Pipeline("ordered", fake, slots=3)
    host = np.zeros(2, np.float32)
    for i in range(1, 21):
        host[:] = i
        assert p.admit([("jckpt", (("k", "w"),), host)], {"i": str(i)}) == i
        host[:] = -1                                   # the caller reuses its buffer at once
    p.close()                                          # no wait: close makes everything durable
    assert fake.published() == list(range(1, 21))
    assert [e[2] for e in fake.events if e[0] == "stage"] == [float(i) for i in range(1, 21)]
    assert str(p.counters()) == LINE.format(20, 20, 20, 0, 0)
    wait_for(lambda: not [n for n in writer_threads() if "ordered" in n])   # both threads end


def test_a_job_is_typed_and_frozen():
    fake = Fake()
    seen = []
    fake.stage = lambda job: seen.append(job) or (job.seq, job.seq)
    p = Pipeline("typed", fake)
    p.admit(leaves(1), {"note": "a"}, info=("step", 7))
    p.close()
    job = seen[0]
    assert isinstance(job, Job) and job.seq == 1 and job.info == ("step", 7)
    assert dict(job.metadata) == {"note": "a"}
    assert job.items[0].namespace == "jckpt" and job.items[0].array.dtype == np.float32
    entries, sources = job.built
    assert entries[0].name == "jckpt/w" and len(sources) == 1
    with pytest.raises(AttributeError):
        job.seq = 3


def test_slots_refuse_when_full():
    fake = Fake()
    fake.gate.clear()
    p = Pipeline("refuse", fake, slots=2, when_full="raise")
    p.admit(leaves(1), {})
    p.admit(leaves(2), {})
    with pytest.raises(jckpt.CapacityError, match="slots"):
        p.admit(leaves(3), {})
    assert p.counters().committed == 2 and p.counters().pending == 2
    fake.gate.set()
    p.close()
    assert fake.published() == [1, 2]


def test_slots_block_until_one_is_durable():
    fake = Fake()
    fake.gate.clear()
    p = Pipeline("block", fake, slots=1)
    p.admit(leaves(1), {})
    with pytest.raises(jckpt.CapacityError, match="timed out"):
        p.admit(leaves(2), {}, timeout=0.05)
    done = []
    t = threading.Thread(target=lambda: done.append(p.admit(leaves(3), {})))
    t.start()
    time.sleep(0.1)
    assert not done                                    # blocked: the only slot is not durable
    fake.gate.set()
    t.join(30)
    assert done == [2]
    p.close()
    assert p.counters().stalls == 2 and fake.published() == [1, 2]


def test_errors_are_counted_and_retried_from_the_last_published_state():
    fake = Fake()
    p = Pipeline("retry", fake, retry_after=0.01, patience=10**6)
    p.admit(leaves(1), {})
    assert p.wait(timeout=30)
    fake.fail_publish = OSError(errno.ENOSPC, "No space left on device")
    p.admit(leaves(2), {})
    p.admit(leaves(3), {})
    wait_for(lambda: p.counters().failures >= 3)
    c = p.counters()
    assert (c.committed, c.durable, c.generation, c.error) == (3, 1, 1, "ENOSPC")
    assert "No space left" in c.last_error
    assert ("discard", 2) in fake.events and ("rollback",) in fake.events
    fake.fail_publish = None
    assert p.wait(timeout=30)
    p.close()
    assert fake.published() == [1, 2, 3]
    assert str(p.counters()) == LINE.format(3, 3, 3, 0, 0)   # no generation lost to the retries
    assert p.counters().failures >= 3 and p.counters().last_error is not None
    assert all(len(ids) == 1 for ids in fake.built.values())  # entries built once per job


def test_a_failed_stage_is_retried():
    fake = Fake()
    fake.fail_stage = OSError(errno.EIO, "Input/output error")
    p = Pipeline("stage", fake, retry_after=0.01, patience=10**6)
    p.admit(leaves(1), {})
    wait_for(lambda: p.counters().failures >= 2)
    assert p.counters().error == "EIO" and p.counters().durable == 0
    fake.fail_stage = None
    p.close()
    assert fake.published() == [1] and p.counters().error == 0


def test_the_error_is_raised_once_patience_runs_out():
    fake = Fake()
    fake.fail_publish = OSError(errno.EIO, "Input/output error")
    p = Pipeline("patience", fake, slots=1, retry_after=0.01, patience=3)
    p.admit(leaves(1), {})
    with pytest.raises(OSError, match="Input/output"):
        p.wait()
    assert p.counters().failures >= 3
    with pytest.raises(OSError, match="Input/output"):  # a blocked admit gets it too
        p.admit(leaves(2), {})
    with pytest.raises(OSError, match="Input/output"):
        p.close()
    wait_for(lambda: not [n for n in writer_threads() if "patience" in n])
    with pytest.raises(jckpt.CheckpointError, match="closed"):
        p.admit(leaves(3), {})
    p.close()                                          # closing again does nothing


class FailsOn(Fake):
    """Staging the snapshots whose value is in ``bad`` raises ``error``."""

    def __init__(self, bad, error):
        super().__init__()
        self.bad, self.error = bad, error

    def stage(self, job):
        if float(job.items[0].array[0]) in self.bad:
            raise self.error
        return super().stage(job)


def test_a_snapshot_that_can_never_be_written_is_dropped_and_the_rest_go_on():
    """An InputError (the tree, not the disk) is not retried: it would hold every later
    snapshot behind it forever. The jobs behind it are written; `wait` raises it once."""
    fake = FailsOn({2.0}, jckpt.InputError("dtype int4 has no safetensors equivalent"))
    p = Pipeline("drop", fake, slots=1, retry_after=30, patience=1)  # a retry would hang here
    for value in (1, 2, 3, 4):
        p.admit(leaves(value), {}, timeout=20)  # one slot: each waits for the one before it
    with pytest.raises(jckpt.InputError, match="int4"):
        p.wait(timeout=20)
    assert fake.published() == [1, 3, 4]
    c = p.counters()
    assert (c.committed, c.durable, c.pending, c.failures) == (4, 4, 0, 1) and c.error == 0
    assert p.wait(timeout=20)  # raised once
    p.admit(leaves(2), {})     # the same tree again: dropped again, and said again
    with pytest.raises(jckpt.InputError):
        p.close()
    assert fake.published() == [1, 3, 4] and p.counters().failures == 2


def test_close_that_raises_a_disk_error_says_which_snapshots_were_dropped_too():
    """A dropped snapshot's error waits for the next `wait`; a `close` that raised the disk's
    error instead left it unsaid for good (but for a log line)."""
    fake = FailsOn({1.0}, jckpt.InputError("dtype int4 has no safetensors equivalent"))
    p = Pipeline("drop-then-full", fake, retry_after=600, patience=1)
    p.admit(leaves(1), {})
    wait_for(lambda: p.counters().failures == 1)       # dropped
    fake.fail_publish = OSError(errno.ENOSPC, "No space left on device")
    p.admit(leaves(2), {})
    with pytest.raises(OSError, match="No space") as e:
        p.close(timeout=30)
    assert any("1 snapshot(s) were dropped" in n and "int4" in n for n in e.value.__notes__)


class SlowPublish(FailsOn):
    def publish(self, staged):
        time.sleep(0.05)  # the writer stages the next job while this one publishes
        return super().publish(staged)


def test_drops_among_overlapped_jobs_keep_order_and_the_first_error_is_raised():
    """With several slots the job at index 1 is staged (and dropped) while another publishes."""
    bad = {float(v) for v in range(2, 31, 3)}
    fake = SlowPublish(bad, jckpt.InputError("cannot hold"))
    p = Pipeline("overlap", fake, slots=3, retry_after=30)
    for value in range(1, 31):
        p.admit(leaves(value), {}, timeout=20)
    with pytest.raises(jckpt.InputError, match="cannot hold") as e:
        p.wait(timeout=60)
    assert "9 later snapshot(s) were dropped too" in e.value.__notes__[0]
    assert fake.published() == [v for v in range(1, 31) if float(v) not in bad]
    assert p.counters().failures == 10 and p.counters().pending == 0
    p.close()


def test_a_dropped_last_snapshot_does_not_leave_wait_waiting():
    fake = FailsOn({1.0}, jckpt.InputError("no"))
    p = Pipeline("drop-last", fake)
    p.admit(leaves(1), {})
    with pytest.raises(jckpt.InputError):
        p.wait(timeout=20)
    assert p.counters().pending == 0
    p.close()


def test_a_dropped_snapshot_is_no_standing_error_in_the_counters():
    """A snapshot dropped for what it holds showed `error InputError` until the next snapshot
    was written (for good, if none came), though the storage worked and the writer went on:
    `error` names a failing write; the drop counts in `failures` and `last_error`."""
    fake = FailsOn({2.0}, jckpt.InputError("dtype int4 has no safetensors equivalent"))
    p = Pipeline("drop-count", fake, retry_after=30)
    p.admit(leaves(1), {})
    assert p.wait(timeout=20)
    p.admit(leaves(2), {})
    wait_for(lambda: p.counters().failures == 1)
    c = p.counters()
    assert str(c) == LINE.format(2, 1, 1, 0, 0) and "int4" in c.last_error
    with pytest.raises(jckpt.InputError):
        p.wait(timeout=20)
    assert p.counters().error == 0
    p.close()


def test_close_tries_once_more_at_once_before_giving_up():
    """The disk filled, the writer gave up, then room was made: close writes what was
    admitted (at once, not after retry_after) instead of raising the stale error."""
    fake = Fake()
    fake.fail_publish = OSError(errno.ENOSPC, "No space left on device")
    p = Pipeline("last-try", fake, retry_after=600, patience=1)  # the writer sleeps 600 s
    p.admit(leaves(1), {})
    with pytest.raises(OSError, match="No space"):
        p.wait()
    fake.fail_publish = None
    start = time.monotonic()
    p.close(timeout=60)
    assert fake.published() == [1] and time.monotonic() - start < 30
    assert p.counters().durable == 1 and p.counters().error == 0


def test_an_error_is_raised_once_and_a_later_wait_tries_again_at_once():
    """The writer gave up and `wait` raised its error; room was made. The next `wait` raised the
    same, stale error again until the retry `retry_after` later succeeded, even for snapshots
    admitted since; it now makes the writer try at once and returns once all is durable."""
    fake = Fake()
    fake.fail_publish = OSError(errno.ENOSPC, "No space left on device")
    p = Pipeline("once", fake, slots=2, retry_after=600, patience=1)  # the writer sleeps 600 s
    p.admit(leaves(1), {})
    with pytest.raises(OSError, match="No space"):
        p.wait(timeout=30)
    fake.fail_publish = None                        # the disk has room again
    p.admit(leaves(2), {})
    assert p.wait(timeout=30)                       # not the stale error, not 600 s later
    assert fake.published() == [1, 2] and p.counters().error == 0
    p.close()


def test_retries_that_failed_before_a_wait_are_not_raised_by_it():
    """Once the error was raised, the writer's own retries went on failing while the disk was
    full; each made a "new" error that the next `wait`, after room was made, raised though
    the snapshot could be written at once. A wait raises only an attempt begun after it."""
    fake = Fake()
    fake.fail_publish = OSError(errno.ENOSPC, "No space left on device")
    p = Pipeline("stale", fake, retry_after=0.001, patience=1)
    p.admit(leaves(1), {})
    with pytest.raises(OSError, match="No space"):
        p.wait(timeout=30)
    failures = p.counters().failures
    wait_for(lambda: p.counters().failures >= failures + 5)  # retries that failed meanwhile
    fake.fail_publish = None
    assert p.wait(timeout=30) and fake.published() == [1]
    p.close()


def test_a_wait_after_the_error_was_raised_raises_only_a_new_failure():
    """Still failing: each later `wait` is one more attempt, whose own error it raises."""
    fake = Fake()
    fake.fail_publish = OSError(errno.EIO, "Input/output error")
    p = Pipeline("again", fake, retry_after=600, patience=1)
    p.admit(leaves(1), {})
    with pytest.raises(OSError) as first:
        p.wait(timeout=30)
    failures = p.counters().failures
    fake.fail_publish = OSError(errno.EIO, "Input/output error, again")
    with pytest.raises(OSError, match="again") as second:
        p.wait(timeout=30)
    assert second.value is not first.value and p.counters().failures == failures + 1
    fake.fail_publish = None
    p.close(timeout=30)
    assert fake.published() == [1]


def test_run_now_waits_for_what_was_admitted_and_counts():
    fake = Fake()
    fake.staged_generation = fake.published_generation = 5   # generation 5 is on disk
    p = Pipeline("now", fake, generation=5)
    p.admit(leaves(1), {})
    written = []
    assert p.run_now(lambda generation: written.append((generation, fake.published()))) == 2
    assert written == [(7, [1])]                       # after job 1 (generation 6) was durable

    def fails(generation):
        raise RuntimeError("barrier failed")

    with pytest.raises(RuntimeError, match="barrier"):
        p.run_now(fails)
    c = p.counters()
    assert (c.committed, c.durable, c.generation, c.failures) == (2, 2, 7, 1)
    p.close()


def test_a_failed_run_now_stands_in_the_counters_until_a_write_succeeds():
    """A save run in the caller's thread (a directory step) that failed counted in `failures`
    but showed `error 0`; it now shows as a failed snapshot does, is raised once (by the call
    itself, not again by `wait`) and clears once a write succeeds."""
    p = Pipeline("now-fails", Fake())

    def full(generation):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        p.run_now(full)
    assert str(p.counters()) == LINE.format(0, 0, 0, 0, "ENOSPC")
    assert p.wait(timeout=20) and p.counters().failures == 1
    p.run_now(lambda generation: None)
    assert str(p.counters()) == LINE.format(1, 1, 1, 0, 0)
    with pytest.raises(jckpt.InputError):              # bad input: the storage did not fail
        p.run_now(lambda generation: (_ for _ in ()).throw(jckpt.InputError("no")))
    assert p.counters().error == 0 and p.counters().failures == 2
    p.close()


class Dying(BaseException):
    """What no `except Exception` catches: it ends the thread it is raised in."""


def test_a_writer_that_died_refuses_new_snapshots_and_says_why():
    """Once the writer thread had died, `admit` still took the free slots for snapshots that
    would never be written (and then waited forever for one), the counters said `error 0`, and
    `wait` raised "the background writer stopped" without the cause or a fix."""
    fake = Fake()
    fake.fail_publish = OSError(errno.EIO, "Input/output error")

    def rollback():
        raise Dying("the rollback died")
    fake.rollback = rollback
    p = Pipeline("dies", fake, slots=2, retry_after=0)
    p.admit(leaves(1), {})
    wait_for(lambda: "jckpt-writer dies" not in writer_threads())
    with pytest.raises(jckpt.CheckpointError, match=r"writer stopped \(Dying: the rollback died\)") as e:
        p.admit(leaves(2), {})
    assert "open a new one" in e.value.fix and e.value.file == "dies"
    assert p.counters().error == "Dying" and p.counters().committed == 1
    for call in (p.wait, p.close):
        with pytest.raises(jckpt.CheckpointError, match="writer stopped") as e:
            call()
        assert e.value.fix


def test_a_failed_copy_gives_the_slot_back():
    p = Pipeline("copy", Fake(), slots=1, when_full="raise")
    with pytest.raises(jckpt.InputError):
        p.admit([("jckpt", (("k", "w"),), "not an array")], {})
    assert p.admit(leaves(1), {}) == 1
    p.close()


@pytest.mark.parametrize("options, match", [
    ({"slots": 0}, "slots"), ({"when_full": "drop"}, "when_full"),
    ({"retry_after": -1}, "retry_after"), ({"patience": 0}, "patience"),
    ({"retry_after": "1"}, "retry_after"), ({"retry_after": True}, "retry_after"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(jckpt.InputError, match=match):
        Pipeline("bad", Fake(), **options)


def test_counters_and_error_codes():
    assert str(MirrorCounters()) == LINE.format(0, 0, 0, 0, 0)
    assert error_code(OSError(errno.ENOSPC, "full")) == "ENOSPC"
    assert error_code(ValueError("x")) == "ValueError"


def test_deadline_after_refuses_a_timeout_that_is_not_a_number():
    assert deadline_after(None) is None
    assert deadline_after(0) <= time.monotonic()
    for bad in ("1", True, float("nan"), [1]):
        with pytest.raises(jckpt.InputError, match="timeout must be a number of seconds"):
            deadline_after(bad)
    for negative in (-1, -0.5, float("-inf")):
        with pytest.raises(jckpt.InputError, match="timeout must be >= 0 seconds") as e:
            deadline_after(negative)
        assert "timeout=0" in e.value.fix
    assert deadline_after(float("inf")) is None  # waits as long as None does


@pytest.mark.parametrize("option", [{"slots": True}, {"patience": True}])
def test_a_flag_is_no_count_of_slots_or_attempts(tmp_path, option):
    """slots=True or patience=True was taken as 1, as retention's counts are not."""
    with pytest.raises(jckpt.InputError, match="must be a positive integer"):
        jckpt.Mirror(str(tmp_path / "m.jckpt"), **option)


def test_a_close_that_times_out_leaves_the_writer_writing_for_the_next_close():
    """It stopped the writer: the next close returned at once, and the snapshots it had not
    written were lost without a word, though its error said to close with a longer timeout."""
    fake = Fake()
    fake.gate.clear()                                  # staging waits
    p = Pipeline("slow", fake, slots=2)
    p.admit(leaves(1), {})
    p.admit(leaves(2), {})
    with pytest.raises(jckpt.CheckpointError, match="close timed out with 2 snapshot"):
        p.close(timeout=0.05)
    assert not p.closed and p.counters().pending == 2
    fake.gate.set()
    p.close(timeout=30)
    assert p.closed and fake.published() == [1, 2]
    assert p.counters().durable == 2
    wait_for(lambda: not [n for n in writer_threads() if "slow" in n])
