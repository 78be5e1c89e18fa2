"""Whether a run is being preempted and should save now.

Under `jax.distributed` this is JAX's preemption sync point; without a
distributed client, a `Preemption` made with `handle_sigterm=True`
turns a SIGTERM into the signal instead (and puts the previous handler back
when closed).

>>> p = Preemption(handle_sigterm=False)
>>> p.reached(100)
False
>>> p.close()
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from jckpt.api.context import check_flag
from jckpt.errors import InputError

log = logging.getLogger('jckpt')


def _preemption_client_ready() -> bool:
    try:
        from jax._src import distributed as jax_distributed

        return jax_distributed.global_state.client is not None
    except Exception:
        return False


class Preemption:
    """Answers "is this run being preempted?" at each step.

    Args:
      handle_sigterm: treat SIGTERM as preemption where no JAX distributed
        client runs (needs the main thread). Under `jax.distributed` (initialized
        before this is made) JAX's preemption service handles SIGTERM, and this
        installs nothing.
    """

    def __init__(self, handle_sigterm: bool = False) -> None:
        check_flag(handle_sigterm, 'handle_sigterm', optional=False)
        self._sigterm = threading.Event()
        self._first: int | None = None  # the step at which preemption was first reached
        self._asked: tuple[int, bool] | None = None  # the last step `due` was asked, and its answer
        self._catching = False  # whether `_on_sigterm` sets `_sigterm`
        if handle_sigterm and _preemption_client_ready():
            # JAX's preemption service has the signal (in C++, where Python cannot chain to
            # it) and makes every process agree on the step: a handler here would swallow it
            log.info("handle_sigterm left to JAX's distributed preemption service")
        elif handle_sigterm:
            self._install_sigterm()

    def reached(self, step: int) -> bool:
        """Whether the run is being preempted and should save `step` now.

        With a JAX distributed client this is JAX's preemption sync point (every
        process must call it at every step); otherwise it reports a SIGTERM
        caught with `handle_sigterm=True`, and False without one.
        """
        if _preemption_client_ready():
            try:
                from jax.experimental import multihost_utils

                return bool(multihost_utils.reached_preemption_sync_point(step))
            except Exception as e:  # no preemption service in this client
                log.debug("preemption sync point unavailable: %s", e)
        # a SIGTERM that came after this step's save was decided: the next step's save
        # writes the state, and its `reached` says stop (a loop that broke now lost it)
        return self._sigterm.is_set() and self._asked != (step, False)

    def _noticed(self, step: int) -> bool:
        """Whether preemption is noticed at `step`, whatever `due` said of it before."""
        if self._asked == (step, False):
            self._asked = None
        return self.reached(step)

    def due(self, step: int) -> bool:
        """Whether preemption asks for a save of `step`: the step at which it was first
        reached. A caught SIGTERM stays reached (a loop that does not stop is still told
        to), but one save of the state at preemption is enough: later steps are not due.

        >>> p = Preemption()
        >>> p._sigterm.set()
        >>> [p.due(s) for s in (7, 7, 8)], p.reached(8)
        ([True, True, False], True)

        A SIGTERM caught after `due(step)` said False is not `reached` at that
        step: the save it asks for comes with the next.

        >>> q = Preemption()
        >>> q.due(3), q._sigterm.set(), q.reached(3), q.due(4), q.reached(4)
        (False, None, False, True, True)
        """
        seen = self._noticed(step)
        self._asked = (step, seen)
        if not seen:
            return False
        if self._first is None:
            self._first = step
        return step == self._first

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise InputError("handle_sigterm=True needs the main thread",
                             fix="create the manager in the main thread")
        if not _PREVIOUS:  # one handler for every open preemption, installed once
            _PREVIOUS.append(signal.getsignal(signal.SIGTERM))
            signal.signal(signal.SIGTERM, _on_sigterm)
        _FLAGS.add(self._sigterm)
        self._catching = True

    def close(self) -> None:
        """Stop catching SIGTERM for this preemption; the last one open puts back the handler
        that was there before (unless another was installed over it since) (idempotent)."""
        if self._catching:
            self._catching = False
            _release(self._sigterm)


#: The flags of the preemptions that catch SIGTERM now, and the handler `_on_sigterm`
#: replaced (while it is installed). One handler serves them all: a chain of one handler
#: per manager, closed in another order than opened, swallowed SIGTERM or dropped a catcher.
_FLAGS: set[threading.Event] = set()
_PREVIOUS: list[Any] = []


def _on_sigterm(signum: int, frame: Any) -> None:
    for flag in list(_FLAGS):
        flag.set()
    previous = _PREVIOUS[0] if _PREVIOUS else signal.SIG_DFL
    if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
        previous(signum, frame)
    elif not _FLAGS and previous == signal.SIG_DFL:  # none open (a handler installed over
        signal.signal(signum, signal.SIG_DFL)       # this one kept it): what SIGTERM would do
        os.kill(os.getpid(), signum)


def _release(flag: threading.Event) -> None:
    """Stop setting `flag`; the last one out puts the old handler back (signals can be set in
    the main thread only: from another, `_on_sigterm` stays and does what it would do)."""
    _FLAGS.discard(flag)
    if (not _FLAGS and _PREVIOUS and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _on_sigterm):
        signal.signal(signal.SIGTERM, _PREVIOUS.pop())


__all__ = ['Preemption']
