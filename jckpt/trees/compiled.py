"""Calls compiled on a background thread, used once ready: no snapshot waits for XLA's compiler.

A snapshot's device work (the copy into a slot's previous image,
`jckpt.trees.image`; the join of small arrays, `jckpt.trees.packing`) is one
jitted call per layout of the tree, and so is a restore's split of small arrays
on an accelerator. Compiling it can take seconds; `ready` starts that
compilation the first time a layout is asked for (or, with `after`, once it
was asked for that many times before: a restore made once never pays for a
compilation it would not use again) and answers None until it is done, so the
caller takes its slower path meanwhile. The compiled calls are shared by every
caller (two slots of a mirror compile a layout's copy once) and kept for the
last `MAX` layouts.

>>> import jax, numpy as np
>>> lower = lambda: jax.jit(lambda x: x + 1).lower(np.zeros(3, np.float32))
>>> ready('doctest', lambda: lower().compile()) is None  # started now
True
>>> wait_all()
>>> ready('doctest', lambda: lower().compile())(np.ones(3, np.float32)).tolist()
[2.0, 2.0, 2.0]
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Hashable
from typing import Any

#: How many layouts' compiled calls are kept (the oldest are dropped all at once beyond it).
MAX = 64

_CALLS: dict[Hashable, concurrent.futures.Future] = {}
_ASKED: dict[Hashable, int] = {}  # how often a key with `after` was asked for, not yet compiling
_ONE_AT_A_TIME = threading.Lock()  # compilations queue, as on one compiler thread


def ready(key: Hashable, compile: Callable[[], Any], *, after: int = 0) -> Any | None:
    """The compiled call for `key` once `compile()` has made it on the background thread; None
    while it compiles (started by the first call for `key`, or by the first once `key` was
    asked for `after` times before) or if compiling failed."""
    future = _CALLS.get(key)
    if future is None:
        asked = _ASKED.get(key, 0)
        if asked < after:
            if len(_ASKED) >= MAX * 16:
                _ASKED.clear()
            _ASKED[key] = asked + 1
            return None
        _ASKED.pop(key, None)
        if len(_CALLS) >= MAX:
            _CALLS.clear()
        future = _CALLS[key] = concurrent.futures.Future()
        # a thread per compilation, gone when it is done: none lingers after the writers close
        # not a daemon: the interpreter waits for a compilation under way at exit, as it waited
        # for the pool's (a daemon thread left inside XLA at exit can crash the process)
        threading.Thread(target=_compile, args=(future, compile), name='jckpt-compile').start()
        return None
    if not future.done() or future.exception() is not None:
        return None
    return future.result()


def _compile(future: concurrent.futures.Future, compile: Callable[[], Any]) -> None:
    with _ONE_AT_A_TIME:
        try:
            future.set_result(compile())
        except BaseException as e:  # kept for `ready` to see; the caller's slower path goes on
            future.set_exception(e)


def wait_all() -> None:
    """Wait until every compilation started so far has finished (or failed): for tests and
    benchmarks that time the compiled path."""
    concurrent.futures.wait(list(_CALLS.values()))


__all__ = ['MAX', 'ready', 'wait_all']
