"""What the processes of a multi-process save compare before writing: pure functions, one process
(the runs of several processes are in tests/system/test_multiprocess.py)."""

import pytest

import jckpt
from jckpt.api import pairing
from jckpt.api.pairing import Claim, call_site, check_claims, difference, leaf_facts, next_save


def _site():
    return call_site()


def test_a_call_site_names_the_callers_lines_and_tells_two_lines_apart():
    here = _site()
    there = _site()
    assert here[0].startswith("test_pairing.py:") and here[0].endswith("(_site)")
    assert here[1].endswith("(test_a_call_site_names_the_callers_lines_and_tells_two_lines_apart)")
    assert here[0] == there[0] and here[1] != there[1]  # the same helper, called from two lines
    assert len(here) <= pairing.SITE_FRAMES
    assert not any("pytest" in f.split(":")[0] and f.startswith("python") for f in here)


def test_the_standard_library_and_jckpt_are_not_the_callers_code():
    assert not pairing._foreign(pairing.__file__)
    import json
    assert not pairing._foreign(json.__file__)  # how a process was started differs: runpy, threading
    assert pairing._foreign(pytest.__file__)  # an installed package is the caller's (site-packages)
    assert pairing._foreign(__file__) and pairing._foreign("<stdin>")
    assert not pairing._foreign("<frozen runpy>")


def test_places_count_the_saves_of_a_path_and_of_a_path_from_one_site():
    path = f"/ckpt/{id(object())}"
    a, b = ("t.py:1 (f)",), ("t.py:2 (f)",)
    (t1, *p1), (t2, *p2), (t3, *p3) = next_save(path, a), next_save(path, b), next_save(path, a)
    assert (p1, p2, p3) == ([0, 0], [1, 0], [2, 1])
    assert len({t1, t2, t3}) == 3  # each save meets the others under a tag of its own


def claim(**kw):
    base = dict(path="/ckpt", place=0, site=("t.py:10 (train)", "t.py:3 (main)"), site_place=0,
                plan="ab")
    return Claim(**{**base, **kw})


def test_a_claim_survives_its_encoding():
    c = claim(path="/with space/é", site=("a.py:1 (f)",))
    assert Claim.decode(c.encode()) == c


@pytest.mark.parametrize("theirs, says", [
    (claim(path="/other"), "process 0 saves to /other, this process to /ckpt"),
    (claim(site=("t.py:12 (train)", "t.py:3 (main)")),
     "process 0 makes this save from t.py:12 (train), this process from t.py:10 (train): a save "
     "of one path made by one process alone would pair with the others' next save"),
    (claim(site=("t.py:10 (train)", "t.py:4 (main)")),
     "process 0 makes this save from t.py:4 (main), this process from t.py:3 (main)"),
    (claim(place=1), "process 0 is at its save 2 of this path, this process at its save 1"),
    (claim(site_place=2), "process 0 is at its save 3 of this path from t.py:10 (train), this "
                          "process at its save 1"),
    (claim(plan="cd"), "processes disagree about the tree they save"),
])
def test_a_save_other_than_process_0s_is_refused_saying_how_it_differs(theirs, says):
    with pytest.raises(jckpt.DistributedError) as e:
        check_claims(theirs, claim())
    assert says in e.value.message and e.value.file == "/ckpt" and e.value.fix


def test_the_same_save_passes_and_a_failed_plan_is_left_to_its_own_error():
    check_claims(claim(), claim())
    check_claims(claim(plan="-"), claim())  # that process raises its own error at the barrier
    check_claims(claim(), claim(plan="-"))


def test_the_first_differing_leaf_is_named():
    w = leaf_facts(1, "params/w", "float32", (8, 8), None)
    b = leaf_facts(2, "params/b", "float32", (8,), None)
    assert difference([w, b], [w, b], "process 0") is None
    assert difference([w, b], [w], "process 0") == (
        "params/b", "this process saves it (float32[8]), process 0 does not")
    assert difference([w], [w, b], "process 3") == (
        "params/b", "process 3 saves it (float32[8]), this process does not")
    assert difference([leaf_facts(1, "params/w", "bfloat16", (8, 4), None)], [w], "process 0") == (
        "params/w", "bfloat16[8,4] here, float32[8,8] in process 0")
    assert difference([leaf_facts(5, "params/w", "float32", (8, 8), None)], [w], "process 0") == (
        "params/w", "float32[8,8] (id 5) here, float32[8,8] (id 1) in process 0")
    key = leaf_facts(1, "rng", "uint32", (2,), "threefry2x32")
    assert difference([key], [leaf_facts(1, "rng", "uint32", (2,), None)], "process 0") == (
        "rng", "uint32[2] of threefry2x32 keys here, uint32[2] in process 0")


def test_a_save_refused_before_its_turn_takes_it_all_the_same():
    """A save refused in one process before its turn (a context that is no Context) did not
    take it: that process's next save paired with the others' save of this turn, and could
    publish one checkpoint of two states. Now it takes its turn, and is posted as left."""
    import os

    from jckpt.api.meetings import SAVING, Meeting, begun

    path = f"ckpt-{id(object())}"
    gone = pairing.refused_save(path)
    assert gone.left and gone.what == SAVING and begun(gone.plain())
    tag, place, _ = next_save(os.path.abspath(path), call_site())
    assert place == 1  # the refused save was this path's first
    assert int(tag.rsplit("/", 1)[1]) >= 1
    assert pairing.refused_save("a\0b").left  # no path: a turn all the same
    assert isinstance(gone, Meeting)
