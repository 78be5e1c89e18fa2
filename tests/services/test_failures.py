"""A writer's failed attempts, without a writer: when a caller is told, once, and of what.

The same rules through a running pipeline are in tests/services/test_engine.py."""

import pytest

import jckpt
from jckpt.services.failures import Failures


def full(fix="free disk space, then save again"):
    return jckpt.StorageError("writing failed", errno=28, fix=fix)


def test_the_error_is_raised_once_then_only_for_an_attempt_begun_since():
    woken = []
    f = Failures(patience=2, wake=lambda: woken.append(1))
    f.retried(full(), begun=0)
    assert f.raise_given_up(0) == 0  # one failure of 2: not yet given up
    f.retried(full(), begun=0)
    with pytest.raises(jckpt.StorageError) as e:
        f.raise_given_up(0)
    assert "kept and retried" in e.value.fix  # the writer keeps the snapshot
    asked = f.raise_given_up(0)  # told: asks for an attempt instead, and wakes the writer
    assert asked == 1 and woken == [1]
    f.retried(full(), begun=0)  # a retry begun before the request: not its answer
    assert f.raise_given_up(asked) == asked
    f.retried(full(), begun=asked)  # the attempt asked for failed: raised to that caller
    with pytest.raises(jckpt.StorageError):
        f.raise_given_up(asked)
    assert f.count == 4 and f.last_error.startswith("writing failed")


def test_a_success_ends_the_streak_and_close_raises_the_error_as_it_is():
    f = Failures(patience=1, wake=lambda: None)
    f.retried(full(), begun=0)
    f.succeeded()
    assert f.given_up() is None and f.error is None and f.count == 1
    f.retried(full(), begun=0)
    f.last_attempt()  # close: a writer that gave up tries once more, now
    asked = f.raise_given_up(0)
    assert asked == 1
    error = full()
    f.retried(error, begun=asked)  # that attempt failed: raised as it is, not retried after it
    with pytest.raises(jckpt.StorageError) as e:
        f.raise_given_up(asked)
    assert e.value is error
    f.last_attempt(False)  # a close that timed out: the writer goes on retrying
    with pytest.raises(jckpt.StorageError) as e:
        f.raise_given_up(asked)
    assert e.value is not error and "kept and retried" in e.value.fix


def test_dropped_jobs_are_raised_once_each_wait_those_up_to_its_goal():
    f = Failures(patience=3, wake=lambda: None)
    for seq in (2, 3, 5):
        f.drop(seq, jckpt.InputError(f"job {seq} cannot be written"))
    assert f.error is None and f.count == 3  # the storage did not fail
    with pytest.raises(jckpt.InputError, match="job 2") as e:
        f.raise_dropped(4)
    assert e.value.__notes__ == ["1 later snapshot(s) were dropped too (the log names each)"]
    f.raise_dropped(4)  # raised once
    closing = jckpt.CheckpointError("close failed")
    f.note_dropped(closing)
    assert closing.__notes__ == ["1 snapshot(s) were dropped too, not written (the first, 5: "
                                 "job 5 cannot be written)"]
    f.raise_dropped(9)  # none left
