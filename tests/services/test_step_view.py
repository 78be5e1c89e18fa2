"""The steps a manager knows (jckpt.services.step_view): what its queries, retention and restores
read instead of the storage."""

import threading

from jckpt.services.retention import Retention
from jckpt.services.step_view import StepView


def view_of(**steps):
    view = StepView()
    for name, (metrics, folder) in steps.items():
        view.add(int(name[1:]), metrics, folder=folder)
    return view


def test_an_empty_view_knows_no_step():
    view = StepView()
    assert view.steps() == [] and view.latest() is None and view.best("loss", "min") is None
    assert view.metrics(1) is None and view.folder(1) is None
    assert view.doomed(Retention(keep_last=1)) == {}


def test_steps_are_known_with_their_metrics_and_kind():
    view = view_of(s3=({"loss": 0.3}, False), s1=({"loss": 0.1}, True), s2=({}, False))
    assert view.steps() == [1, 2, 3] and view.latest() == 3
    assert view.best("loss", "min") == 1 and view.best("loss", "max") == 3
    assert view.metrics(1) == {"loss": 0.1} and view.metrics(2) == {}
    assert (view.folder(1), view.folder(2), view.folder(4)) == (True, False, None)


def test_metrics_are_copies():
    view = view_of(s1=({"loss": 0.1}, False))
    view.metrics(1)["loss"] = 9.0
    assert view.metrics(1) == {"loss": 0.1}


def test_reset_replaces_what_was_known():
    view = view_of(s9=({}, True))
    view.reset({1: {"a": 1.0}, 2: {}}, frozenset({2}))
    assert view.steps() == [1, 2] and view.folder(2) is True and view.folder(9) is None


def test_a_step_saved_again_as_another_kind_is_known_as_that_kind():
    view = view_of(s1=({}, True))
    view.add(1, {}, folder=False)
    assert view.folder(1) is False


def test_directory_checkpoints_are_known_as_such_until_forgotten():
    view = StepView()
    view.reset({1: {}, 2: {}, 3: {}}, {1, 2}, {2})
    view.add(4, {}, folder=True, indexed=True)
    view.add(5, {}, folder=False, indexed=True)  # a file is no directory checkpoint
    assert [view.indexed(s) for s in (1, 2, 3, 4, 5)] == [False, True, False, True, False]
    view.forget([2])
    assert not view.indexed(2)


def test_a_forgotten_step_is_known_as_deleted():
    view = view_of(s1=({}, True), s2=({}, False))
    view.forget([1])
    assert view.deleted(1) and not view.deleted(2) and not view.deleted(3)
    assert view.folder(1) is None and view.steps() == [2]


def test_a_step_found_being_deleted_is_known_as_deleted_across_listings():
    """A reader's listing found step 1 being deleted (a prefix without its markers, below a
    published step): a restore of it says so, also after a later listing no longer finds it."""
    view = StepView()
    view.reset({2: {}}, [], deleted=[1])
    assert view.deleted(1) and view.steps() == [2]
    view.reset({2: {}, 3: {}}, [])
    assert view.deleted(1) and not view.deleted(2)


def test_doomed_names_each_step_with_its_kind_and_never_the_latest():
    view = view_of(s1=({}, True), s2=({}, False), s3=({}, True))
    assert view.doomed(Retention(keep_last=1)) == {1: True, 2: False}
    view.forget([1, 2])
    assert view.steps() == [3] and view.folder(1) is None
    assert view.doomed(Retention(keep_last=1)) == {}


def test_threads_adding_and_forgetting_leave_a_consistent_view():
    view = StepView()

    def work(base):
        for s in range(base, base + 200):
            view.add(s, {"x": float(s)}, folder=s % 2 == 0)
            view.forget([s - 1])
    threads = [threading.Thread(target=work, args=(b,)) for b in (0, 1000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert view.steps() == [199, 1199]
    assert view.folder(199) is False and view.metrics(1199) == {"x": 1199.0}
