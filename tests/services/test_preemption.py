"""Preemption (jckpt.services.preemption): SIGTERM as the signal to save, without a distributed client."""

import signal
import threading

import pytest

from jckpt.errors import InputError
from jckpt.services.preemption import Preemption


@pytest.fixture
def sigterm():
    """Put back whatever SIGTERM handler the test process had, whatever the test did."""
    before = signal.getsignal(signal.SIGTERM)
    yield before
    signal.signal(signal.SIGTERM, before)


def test_without_sigterm_handling_nothing_is_installed_and_never_reached(sigterm):
    p = Preemption()
    assert signal.getsignal(signal.SIGTERM) is sigterm
    assert not p.reached(0) and not p.reached(100)
    p.close()
    assert signal.getsignal(signal.SIGTERM) is sigterm


def test_sigterm_is_caught_and_reached_stays_true(sigterm):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the test process must survive a mistake
    p = Preemption(handle_sigterm=True)
    try:
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # its handler is in place
        assert not p.reached(1)
        signal.raise_signal(signal.SIGTERM)
        assert p.reached(1) and p.reached(2) and p.reached(1000)  # from now on, at every step
    finally:
        p.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_close_puts_the_previous_handler_back_and_is_idempotent(sigterm):
    def previous(signum, frame):
        pass

    signal.signal(signal.SIGTERM, previous)
    p = Preemption(handle_sigterm=True)
    assert signal.getsignal(signal.SIGTERM) is not previous
    p.close()
    assert signal.getsignal(signal.SIGTERM) is previous
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    p.close()  # a second close does not put the old handler back again
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_the_previous_python_handler_is_still_called(sigterm):
    calls = []

    def previous(signum, frame):
        calls.append(signum)

    signal.signal(signal.SIGTERM, previous)
    p = Preemption(handle_sigterm=True)
    try:
        signal.raise_signal(signal.SIGTERM)
        assert p.reached(5) and calls == [signal.SIGTERM]
    finally:
        p.close()


def test_a_default_previous_handler_is_not_called(sigterm):
    """SIG_DFL would end the process: the signal only marks the preemption."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    p = Preemption(handle_sigterm=True)
    try:
        signal.raise_signal(signal.SIGTERM)
        assert p.reached(1)  # still running
    finally:
        p.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_two_preemptions_chain_and_unwind(sigterm):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    first = Preemption(handle_sigterm=True)
    second = Preemption(handle_sigterm=True)
    try:
        signal.raise_signal(signal.SIGTERM)
        assert first.reached(1) and second.reached(1)
    finally:
        second.close()
        first.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_each_preemption_has_its_own_flag(sigterm):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    caught = Preemption(handle_sigterm=True)
    caught.close()
    plain = Preemption(handle_sigterm=True)
    try:
        signal.raise_signal(signal.SIGTERM)
        assert plain.reached(1)
        assert not caught.reached(1)  # closed before the signal: its handler was gone
    finally:
        plain.close()


def test_handling_sigterm_needs_the_main_thread(sigterm):
    errors = []

    def make():
        try:
            Preemption(handle_sigterm=True)
        except InputError as e:
            errors.append(e)

    t = threading.Thread(target=make)
    t.start()
    t.join()
    assert len(errors) == 1 and 'needs the main thread' in errors[0].message
    assert errors[0].fix == 'create the manager in the main thread'
    assert signal.getsignal(signal.SIGTERM) is sigterm


def test_a_preemption_is_usable_from_another_thread_once_made(sigterm):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    p = Preemption(handle_sigterm=True)
    try:
        seen = []
        signal.raise_signal(signal.SIGTERM)
        t = threading.Thread(target=lambda: seen.append(p.reached(3)))
        t.start()
        t.join()
        assert seen == [True]
    finally:
        p.close()


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_handle_sigterm_must_be_a_bool(sigterm, bad):
    with pytest.raises(InputError, match="handle_sigterm must be True or False"):
        Preemption(handle_sigterm=bad)
    assert signal.getsignal(signal.SIGTERM) is sigterm  # nothing was installed


def test_under_jax_distributed_sigterm_is_left_to_jax(sigterm, monkeypatch):
    """JAX's preemption service handles SIGTERM in C++ (Python cannot chain to it) and makes
    the processes agree on the step: a handler of ours would swallow the signal."""
    from jckpt.services import preemption
    monkeypatch.setattr(preemption, "_preemption_client_ready", lambda: True)
    p = Preemption(handle_sigterm=True)
    assert signal.getsignal(signal.SIGTERM) is sigterm
    p.close()


def test_a_save_is_due_only_at_the_step_preemption_is_first_noticed(sigterm):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    p = Preemption(handle_sigterm=True)
    try:
        assert not p.due(3)
        signal.raise_signal(signal.SIGTERM)
        assert p.due(4) and p.due(4) and not p.due(5) and p.reached(5)
    finally:
        p.close()


def test_closing_out_of_order_keeps_the_later_handler(sigterm):
    """Closing the first of two put back the handler from before both: the second's
    SIGTERM handling was gone, and the signal killed the process."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent('''
        import signal
        from jckpt.services.preemption import Preemption
        first, second = Preemption(handle_sigterm=True), Preemption(handle_sigterm=True)
        first.close()
        signal.raise_signal(signal.SIGTERM)  # caught by the second, which is still open
        print(second.reached(1), first.reached(1), flush=True)
        second.close()  # nothing open now: SIGTERM terminates, as before either
        signal.raise_signal(signal.SIGTERM)
        print('survived', flush=True)
    ''')
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ['True', 'False'] and out.returncode == -signal.SIGTERM, out


def test_a_sigterm_after_the_steps_save_was_decided_is_reached_at_the_next(sigterm):
    """The loop `save(step); if reached_preemption(step): break` stopped without saving
    when the signal fell between the two calls."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    p = Preemption(handle_sigterm=True)
    try:
        assert not p.due(7)  # save(7) decided not to write
        signal.raise_signal(signal.SIGTERM)
        assert not p.reached(7)  # so the loop goes on to step 8...
        assert p.due(8) and p.reached(8)  # ...whose save writes, and then it stops
        assert p.reached(9)  # and it stays reached
    finally:
        p.close()


@pytest.mark.parametrize('order', ['abc', 'acb', 'bac', 'bca', 'cab', 'cba'])
def test_three_closed_in_any_order_leave_sigterm_as_it_was(order):
    """With one handler per preemption chained, some close orders (abc, bac, bca) left a
    closed handler that swallowed SIGTERM: the process lived on."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent(f'''
        import signal
        from jckpt.services.preemption import Preemption
        p = {{name: Preemption(handle_sigterm=True) for name in 'abc'}}
        for name in {order!r}[:2]:
            p[name].close()
        signal.raise_signal(signal.SIGTERM)  # caught by the one still open
        print([p[n].reached(1) for n in 'abc'], flush=True)
        p[{order!r}[2]].close()
        print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
        signal.raise_signal(signal.SIGTERM)
        print('survived', flush=True)
    ''')
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                         timeout=60)
    open_one = order[2]
    assert out.stdout.split('\n')[0] == str([n == open_one for n in 'abc']), out
    assert out.stdout.split('\n')[1] == 'True' and out.returncode == -signal.SIGTERM, out


def test_closing_from_another_thread_stops_catching(sigterm):
    """Closed off the main thread, a preemption kept being told of SIGTERM for good (the
    handler cannot be put back there, but the flag can leave)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    p, other = Preemption(handle_sigterm=True), Preemption(handle_sigterm=True)
    try:
        t = threading.Thread(target=p.close)
        t.start()
        t.join()
        signal.raise_signal(signal.SIGTERM)
        assert other.reached(1) and not p.reached(1)
    finally:
        other.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
