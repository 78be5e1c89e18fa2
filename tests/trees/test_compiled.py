"""Calls compiled in the background: started once per key, shared, None until ready or if failed."""

import jax
import numpy as np
import pytest

from jckpt.trees import compiled


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(compiled, "_CALLS", {})
    monkeypatch.setattr(compiled, "_ASKED", {})


def counting(calls):
    def compile():
        calls.append(1)
        return jax.jit(lambda x: x * 2).lower(np.zeros(2, np.float32)).compile()
    return compile


def test_a_key_compiles_once_in_the_background_and_is_shared():
    calls = []
    assert compiled.ready("k", counting(calls)) is None  # started, not waited for
    compiled.wait_all()
    first = compiled.ready("k", counting(calls))
    assert compiled.ready("k", counting(calls)) is first  # every caller gets the same call
    assert calls == [1] and first(np.ones(2, np.float32)).tolist() == [2.0, 2.0]


def test_with_after_a_key_compiles_only_once_asked_for_that_many_times_before():
    calls = []
    assert compiled.ready("k", counting(calls), after=2) is None
    assert compiled.ready("k", counting(calls), after=2) is None
    compiled.wait_all()
    assert calls == [] and "k" not in compiled._CALLS  # asked twice: nothing compiled
    assert compiled.ready("k", counting(calls), after=2) is None  # the third: started
    compiled.wait_all()
    assert compiled.ready("k", counting(calls), after=2)(np.ones(2, np.float32)).tolist() == [2.0, 2.0]
    assert calls == [1] and compiled._ASKED == {}


def test_a_compilation_that_fails_answers_none_and_is_not_retried():
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("no such layout")
    assert compiled.ready("bad", broken) is None
    compiled.wait_all()
    assert compiled.ready("bad", broken) is None and calls == [1]


def test_beyond_max_layouts_the_kept_calls_are_dropped(monkeypatch):
    monkeypatch.setattr(compiled, "MAX", 2)
    for key in ("a", "b", "c"):
        compiled.ready(key, lambda key=key: key)
    compiled.wait_all()
    assert set(compiled._CALLS) == {"c"}


def test_no_compiler_thread_outlives_its_compilations():
    """A pool's idle worker stayed alive after every writer had closed."""
    import threading
    import time
    order = []

    def slow(name):
        def compile():
            order.append(f"{name} start")
            time.sleep(0.05)
            order.append(f"{name} end")
            return name
        return compile
    assert compiled.ready("x", slow("x")) is None and compiled.ready("y", slow("y")) is None
    compiled.wait_all()
    first, second = order[0].split()[0], order[2].split()[0]
    assert order == [f"{first} start", f"{first} end", f"{second} start", f"{second} end"]
    assert {first, second} == {"x", "y"}  # one at a time
    deadline = time.monotonic() + 10
    while any(t.name == "jckpt-compile" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert compiled.ready("x", slow("x")) == "x"
