"""Where each process is: its meetings, counted per thing, and when none can move on."""

import collections

import jckpt
from jckpt.api import meetings
from jckpt.api.meetings import SAVING, Meeting, begun, meeting


def test_a_process_at_a_meeting_this_one_has_not_begun_is_stuck(monkeypatch):
    """Such a process waits there for this one, as this one waits at its own for it."""
    monkeypatch.setattr(meetings, "_MEETINGS", collections.Counter())
    here = meeting("restoring step 2", "run")
    assert here.stuck({1: Meeting(SAVING, "", 2)})  # a save this process never began
    assert here.stuck({1: Meeting("restoring step 2", "run", 1)})  # the next such: ahead of it
    assert here.stuck({1: Meeting("restoring step 2", "other", 0)})  # another path


def test_a_process_at_this_meeting_or_one_this_one_began_is_not_stuck(monkeypatch):
    """At this meeting it is only slow; at one this process began (passed), it is behind, or
    has not said yet where it is now: it may still come."""
    monkeypatch.setattr(meetings, "_MEETINGS", collections.Counter())
    for _ in range(3):
        meeting(SAVING, "")
    listing = meeting("listing the steps", "run")
    here = meeting("listing the steps", "run")
    assert not here.stuck({})  # no process said where it is
    assert not here.stuck({1: here, 2: listing, 3: Meeting(SAVING, "", 2)})
    assert here.stuck({1: here, 2: listing, 3: Meeting(SAVING, "", 3)})  # one is enough
    assert begun(listing) and begun(here) and not begun(Meeting(SAVING, "", 3))


def test_a_mismatch_names_where_each_process_that_did_not_come_is():
    here = Meeting("restoring the checkpoint", "", 1)
    timeout = jckpt.DistributedError("not every process reached restoring the checkpoint")
    e = here.mismatched(timeout, {1: here, 2: Meeting(SAVING, "", 0)}, 4, 0, "a.jckpt")
    assert e.message == ("not every process reached restoring the checkpoint; this process is at "
                         "restoring the checkpoint (its 2nd such meeting), process 2 is at saving a "
                         "checkpoint (its 1st such meeting); process 3 has been at no meeting: the "
                         "processes are at different meetings")
    assert "restart the run's processes together" in e.fix
    assert here.mismatched(timeout, {1: here}, 2, 0, "a.jckpt") is timeout  # all came
    assert Meeting.decode(here.encode()) == here


def test_what_a_process_was_told_is_shown_while_it_is_still_where_it_was_told_it(monkeypatch):
    """A process refusing a call alone (a save whose step is no step) posts what it was told,
    with the position it posted then; once it went on to another meeting, that is old news."""
    monkeypatch.setattr(meetings, "_MEETINGS", collections.Counter())
    gone = meetings.refused(SAVING, "")
    first = meetings.told_alone("InputError: no step", gone)
    assert meetings.told_since({1: first}, {1: gone}) == {1: "InputError: no step"}
    assert meetings.told_since({1: first}, {}) == {}  # its position is not known
    here = meeting(SAVING, "")  # it went on to that save after all
    again = meetings.refused(SAVING, "")
    posted = {1: meetings.told_alone("InputError: no step, again", again), 2: first, 3: "not json"}
    assert meetings.told_since(posted, {1: again, 2: here}) == {1: "InputError: no step, again"}


def test_a_process_that_refused_the_call_of_this_meeting_will_not_come(monkeypatch):
    """Process 1 refused a save alone (an argument it alone passed) and went on to other work:
    process 0, at that save, saw it still at the one before, which it may come from, and
    waited out its timeout. Now the refusal is its position: it left this very meeting."""
    monkeypatch.setattr(meetings, "_MEETINGS", collections.Counter())
    meeting(SAVING, "")
    gone = meetings.refused(SAVING, "")  # in process 1, its second save, refused: not counted
    assert gone == Meeting(SAVING, "", 1, left=True) and meetings.refused(SAVING, "") == gone
    here = meeting(SAVING, "")  # process 0's second save
    assert here.stuck({1: gone})
    assert not meeting(SAVING, "").stuck({1: gone})  # a later save: it may still come there
    e = here.mismatched(jckpt.DistributedError("timed out"), {1: gone}, 2, 0, "run",
                        {1: "InputError: step must be an integer"})
    assert ("process 1 left saving a checkpoint (its 2nd such meeting), failing, and was told "
            "since: InputError: step must be an integer") in e.message, e.message


def test_a_process_that_left_a_meeting_failing_is_at_none(monkeypatch):
    """Process 0 timed out at a restore process 1 never began, then went on to the manager's
    open both make: its old position made process 1, at that open, take it as stuck there."""
    monkeypatch.setattr(meetings, "_MEETINGS", collections.Counter())
    here = meeting("opening the manager", "run")
    gone = Meeting("restoring the checkpoint", "", 1).leaving(None)  # it timed out there
    assert not here.stuck({0: gone}) and Meeting.decode(gone.encode()) == gone
    e = here.mismatched(jckpt.DistributedError("timed out"), {0: gone}, 2, 1, "run")
    assert "process 0 left restoring the checkpoint (its 2nd such meeting), failing" in e.message


def test_a_process_that_left_finding_this_one_stuck_makes_it_fail_too(monkeypatch):
    """Process 1 found process 0 waiting for it at a meeting it had not begun, and left its own
    posting so: process 0, which had not looked yet, then saw it at no meeting and waited out
    its timeout. Now it fails too, as it would have."""
    monkeypatch.setattr(meetings, "_MEETINGS", collections.Counter())
    here = meeting("restoring step 2", "run")
    gone = Meeting(SAVING, "", 2).leaving(here)
    assert here.stuck({1: gone}) and Meeting.decode(gone.encode()) == gone
    assert not meeting("restoring step 2", "run").stuck({1: gone})  # found at another: not this


def test_a_call_meeting_the_others_while_another_thread_is_in_one_is_refused():
    """A save in one thread while another restored onto global arrays: the one position each
    process posts said the restore, and the peer waiting at the save took it as stuck (or the
    meetings paired in another order in each process). Now the second call is refused, naming
    the first; calls within a call (a restore's meeting) and one process's calls pass."""
    import threading

    import pytest

    inside, done = threading.Event(), threading.Event()

    def restore():
        with meetings.alone("restoring the checkpoint", "a", 2):
            inside.set()
            done.wait(10)
    t = threading.Thread(target=restore)
    t.start()
    try:
        assert inside.wait(10)
        with pytest.raises(jckpt.InputError) as e:
            with meetings.alone(SAVING, "run", 2):
                pass
        assert "saving a checkpoint meets the other processes while another thread of this " \
               "process is restoring the checkpoint" in e.value.message
        assert "from one thread" in e.value.fix and "jckpt.Mirror" in e.value.fix
        with meetings.alone(SAVING, "run", 1):  # one process: nothing meets
            pass
    finally:
        done.set()
        t.join()
    with meetings.alone(SAVING, "run", 2), meetings.alone("restoring a step", "run", 2):
        pass  # this thread alone, a call within a call
    assert meetings._CALLING == []
