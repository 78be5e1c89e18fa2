"""The background writers open in this process, closed when the interpreter exits.

A mirror or a manager left open (no `close`, no `with`) still has snapshots admitted
but not yet durable: at the interpreter's exit each writer given to `keep` is closed,
which makes them durable and releases its path. A forked child forgets its parent's
writers: it has copies of them but not their threads, and closing them at its exit would
publish and release what the parent is writing. A writer its owner closed is given to
`forget`.

>>> class Writer:
...     def close(self) -> None: print("closed")
>>> w = Writer()
>>> keep(w)
>>> forget(w)     # closed by its owner: not closed again at exit
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from typing import Protocol

log = logging.getLogger('jckpt')


class Closable(Protocol):
    """What is closed at exit: a background writer, or what owns one."""

    def close(self) -> None: ...


_OPEN: weakref.WeakSet[Closable] = weakref.WeakSet()


def keep(writer: Closable) -> None:
    """Close `writer` at the interpreter's exit, unless it is given to `forget` before."""
    _OPEN.add(writer)


def forget(writer: Closable) -> None:
    """`writer` was closed: nothing to do for it at exit."""
    _OPEN.discard(writer)


@atexit.register
def _flush_at_exit() -> None:  # pragma: no cover - exercised by interpreter shutdown
    for writer in list(_OPEN):  # this process's own: a forked child forgets its parent's
        try:
            writer.close()
        except Exception as e:
            log.error("snapshots not made durable at exit: %s", e)


if hasattr(os, 'register_at_fork'):
    # a forked child has copies of the parent's writers but not their threads: closing them
    # at its exit would publish and release what the parent is writing
    os.register_at_fork(after_in_child=_OPEN.clear)


__all__ = ['Closable', 'forget', 'keep']
