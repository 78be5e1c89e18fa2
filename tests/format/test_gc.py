"""``jckpt.format._gc``: the cyclic collector paused around allocation-heavy work, and restored."""

import gc

import pytest

from jckpt.format._gc import gc_paused, paused


@pytest.fixture(autouse=True)
def collector_restored():
    """Each test starts with the collector on and leaves it as it found it, whatever happens."""
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_paused_inside_and_on_again_after():
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_restored_when_the_block_raises():
    with pytest.raises(KeyError, match='boom'):
        with gc_paused():
            raise KeyError('boom')
    assert gc.isenabled()


def test_nested_blocks_resume_only_at_the_outermost():
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block found it off and leaves it off
        with pytest.raises(ValueError):
            with gc_paused():
                raise ValueError
        assert not gc.isenabled()
    assert gc.isenabled()


def test_decorator_pauses_during_the_call_and_passes_everything_through():
    seen = []

    @paused
    def work(a, *, b):
        """Adds."""
        seen.append(gc.isenabled())
        return a + b

    assert work(1, b=2) == 3
    assert seen == [False] and gc.isenabled()
    assert work.__name__ == 'work' and work.__doc__ == 'Adds.'  # functools.wraps


def test_decorator_restores_when_the_function_raises():
    @paused
    def fail():
        raise RuntimeError('no')

    with pytest.raises(RuntimeError, match='no'):
        fail()
    assert gc.isenabled()


def test_decorated_calls_nest():
    @paused
    def inner():
        return gc.isenabled()

    @paused
    def outer():
        return inner(), gc.isenabled()

    assert outer() == (False, False)
    assert gc.isenabled()
