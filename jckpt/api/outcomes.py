"""What a process of a `jax.distributed` run tells the others of its failure, and the one
error every process raises from what they all said (`jckpt.api.agreement.agree`).

A jckpt error travels whole (its class, message and fix) and is raised again on the other
side as the same class; another error travels as its type and first line, and is raised
there as a `DistributedError` naming it.

>>> from jckpt.errors import InputError
>>> common("saving", "run", [(1, described(InputError("bad step")))]).message
"saving failed in 1 of the run's processes (process 1: bad step)"
"""

from __future__ import annotations

import json
from typing import Any

from jckpt import errors
from jckpt.errors import CheckpointError, DistributedError


def first_line(e: BaseException) -> str:
    """`e`'s first line (its type's name where it says nothing)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def told(e: BaseException) -> str:
    """What the other processes are told of `e`: its first line, after its type where it is
    not jckpt's (whose message names the file, the entry and the fix).

    >>> told(ValueError("bad shape"))
    'ValueError: bad shape'
    """
    return first_line(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {first_line(e)}"


def described(e: BaseException | None) -> dict[str, str | None]:
    """`e` as the others are told it (JSON): its class, message and fix where it is jckpt's,
    else a `DistributedError` naming it; all None where nothing failed."""
    if e is None:
        return {'type': None, 'message': None, 'fix': None}
    if isinstance(e, CheckpointError):
        return {'type': type(e).__name__, 'message': e.message, 'fix': e.fix}
    return {'type': 'DistributedError', 'message': told(e), 'fix': None}


def common(what: str, path: str, failed: list[tuple[int, dict[str, Any]]]) -> CheckpointError:
    """The one error every process raises: the first failure's type, every failure named."""
    kind = getattr(errors, failed[0][1]['type'], None)
    if not (isinstance(kind, type) and issubclass(kind, CheckpointError)):
        kind = DistributedError
    said = '; '.join(f"process {k}: {d['message']}" for k, d in failed)
    return kind(f"{what} failed in {len(failed)} of the run's processes ({said})", file=path,
                fix=failed[0][1]['fix'])


def own_error(e: BaseException, path: str, count: int) -> BaseException:
    """The error this process raises for its own failure `e`: `e` itself where it is jckpt's
    (or the process is stopping: `KeyboardInterrupt`), else, with several processes, a
    `DistributedError` naming it and raised from it, so that every process of the run gets
    a `CheckpointError` from a failed save (the others get one naming this process's) and
    one `except jckpt.CheckpointError` keeps them all in step."""
    if count == 1 or isinstance(e, CheckpointError) or not isinstance(e, Exception):
        return e
    own = DistributedError(f"the save failed in this process: {told(e)}", file=path,
                           fix="see the error this one was raised from; the other processes "
                               "failed naming it, nothing was published and the previous "
                               "checkpoint is intact")
    own.__cause__ = e
    return own


def refused_by(posted: list[tuple[str, str]], path: str, e: BaseException,
               failure: Exception | None) -> CheckpointError | None:
    """The error every process raises where some refused a save's arguments (`failure`, an
    `InputError`, `posted` by each as `described` as the save took its turn, by process):
    their class, one text naming each (`common`), as a restore and a manager's open raise
    (from `e` where it is this process's own `failure`); None where none did.

    >>> refused_by([], 'run', ValueError(), None) is None
    True
    """
    found = [(int(k), json.loads(v)) for k, v in posted]
    if not found:
        return None
    refused = common("saving a checkpoint", path, found)
    refused.__cause__ = e if e is failure else None
    return refused


__all__ = ['common', 'described', 'first_line', 'own_error', 'refused_by', 'told']
