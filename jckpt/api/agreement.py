"""One outcome in every process: the calls of a `jax.distributed` run that meet the others.

A manager's open, a restore, a multi-process save: each process does its part, then says
at one meeting (`agree`, built on the barriers of `jckpt.api.runtime`) whether it failed,
and every process raises the same error when one did, so that no process goes on alone
(`jointly`: a call, then that meeting). A process refusing such a call before it meets the
others tells them at once (`tell`, `refusing`), rather than leaving them to their timeout.
With one process nothing is waited for and an error is raised as it is.

>>> agree("listing the steps", "run", None, process=0, processes=1, value=[3])
[[3]]
>>> jointly("restoring the checkpoint", "a.jckpt", lambda: 7, process=0, processes=1)
7
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from jckpt.api.meetings import MEETING, TOLD, Meeting, alone, meeting, told_alone
from jckpt.api.outcomes import common, described, told
from jckpt.api.runtime import Runtime, barrier_timeout, client
from jckpt.errors import CheckpointError, DistributedError

T = TypeVar('T')


def agree(what: str, path: str, failure: BaseException | None, *, process: int, processes: int,
          timeout: float | None = None, value: Any = None, same_path: bool = True,
          here: Meeting | None = None) -> list[Any]:
    """Meet every process, each saying whether its part of `what` failed; raise the same
    error in every process when one did, else return every process's `value` (JSON), by
    process (what each found: a reader's processes keep the steps they all list).

    Each process reports its `failure` (or none) and waits at a barrier (up to
    `timeout` seconds, default `barrier_timeout`), so the processes that
    succeeded learn at once of those that did not, rather than at their first
    save, after a barrier's timeout. The error raised everywhere has the type of
    the first process's failure and names every failing process. With one
    process, `failure` is raised as it is. Processes naming different paths fail
    together, unless `same_path` is false (each process restoring a file of its own).

    Example:
        ```python
        agree("opening the manager", "ckpts", lease_error, process=2, processes=4)
        ```
    """
    if processes == 1:
        if failure is not None:
            raise failure
        return [value]
    with alone(what, os.fspath(path), processes):  # one thread of this process at a time
        arrived = here is not None  # `arrive` counted and posted it
        here = here or meeting(what, os.fspath(path) if same_path else '')
        rt = Runtime(here.tag, path, barrier_timeout() if timeout is None else float(timeout),
                     processes, process, announce=None, here=here)
        if not arrived:
            rt.post()
        said_here = json.dumps({'path': os.fspath(path), 'value': value, **described(failure)})
        try:
            listed = rt.gather('said', said_here, f"reached {what}", 'said')
        except DistributedError:
            if failure is not None:
                raise failure from None
            raise
        said = sorted((int(k), json.loads(v)) for k, v in listed)
        paths = {d['path'] for _, d in said}
        if same_path and len(paths) > 1:
            raise DistributedError(f"{what}: the processes name different paths (" + '; '.join(
                f"process {k}: {d['path']}" for k, d in said[:8]) + ')', file=path,
                fix="pass every process the same path, on a filesystem (or object store) every "
                    "process sees") from failure
        failed = [(k, d) for k, d in said if d['type'] is not None]
        if failed:
            raise common(what, path, failed) from failure
        return [d.get('value') for _, d in said]


def jointly(what: str, path: str, call: Callable[[], T], *, process: int, processes: int,
            same_path: bool = True) -> T:
    """`call()` in this process, then every process meets (`agree`: one barrier): its value
    once it returned in every process, else, in every process, the error `agree` raises (in
    a failing process, raised from its own), so that no process goes on alone.

    Example:
        ```python
        tree = jointly("restoring the checkpoint", path, read, process=1, processes=2)
        ```
    """
    with alone(what, os.fspath(path), processes):  # one thread of this process at a time
        # where this process is, said before its part (a slow read): a process that times out
        # meanwhile names this meeting, not the one this process made before
        here = arrive(what, path, process=process, processes=processes, same_path=same_path)
        try:
            value = call()
        except Exception as e:  # KeyboardInterrupt and SystemExit pass as they are
            agree(what, path, e, process=process, processes=processes, same_path=same_path, here=here)
            raise  # agree raised already: `e` is this process's own failure
        agree(what, path, None, process=process, processes=processes, same_path=same_path, here=here)
        return value


def arrive(what: str, path: str, *, process: int, processes: int,
           same_path: bool = True) -> Meeting | None:
    """This process's next meeting about `what` (`meeting`), posted now as where this process
    is, for the errors of processes that wait for it (None with one process)."""
    if processes == 1:
        return None
    here = meeting(what, os.fspath(path) if same_path else '')
    Runtime(here.tag, path, 1.0, processes, process, announce=None, here=here).post()
    return here


def tell(error: BaseException, gone: Meeting, *, process: int, processes: int) -> None:
    """Post `error`, raised in this process alone for a call that meets the others (a
    manager's save whose step is no step, an argument refused before the meeting), and this
    process's position `gone`: the meeting of that call, left (`meetings.refused`). The others
    waiting for it there fail at once, saying what it was told, not at their timeout (best
    effort: what it is for is their error).

    Example:
        ```python
        tell(refusal, refused(SAVING, ''), process=1, processes=2)  # then raise refusal
        ```
    """
    if processes > 1:
        with contextlib.suppress(Exception):
            said = (f"{type(error).__name__}: {error.message}" if isinstance(error, CheckpointError)
                    else told(error))
            store = client(processes, '')
            store.key_value_set(f"{TOLD}/{process}", told_alone(said, gone), allow_overwrite=True)
            store.key_value_set(f"{MEETING}/{process}", gone.encode(), allow_overwrite=True)


@contextlib.contextmanager
def refusing(gone: Callable[[], Meeting], *, process: int, processes: int) -> Iterator[None]:
    """The checks of a call meeting the others, made before it takes its turn: an error they
    raise is posted (`tell`), with this process's position `gone()` (the meeting of that call,
    left: this process will not come), then raised, so that the others fail at once rather
    than at their timeout.

    Example:
        ```python
        with refusing(lambda: refused(SAVING, ''), process=1, processes=2):
            path = checked_path(path)
        ```
    """
    try:
        yield
    except Exception as e:
        if processes > 1:
            tell(e, gone(), process=process, processes=processes)
        raise


__all__ = ['agree', 'arrive', 'jointly', 'refusing', 'tell']
