"""Calls compiled in the background: started once per key, shared, None until ready or if failed."""

import jax
import numpy as np
import pytest

from jckpt.trees import compiled


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(compiled, "_CALLS", {})


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
