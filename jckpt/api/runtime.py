"""Barriers and shared values between the processes of a `jax.distributed` run.

A multi-process save (`jckpt.api.multiprocess`) and a multi-process manager's
open (`agree`) meet through JAX's distributed client: its key-value store and
its barriers, each with a timeout, so a dead or absent peer gives an error in
bounded time, never a hang. With one process nothing is waited for.

>>> barrier_timeout() > 0
True
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from jckpt import errors
from jckpt.errors import CheckpointError, DistributedError, InputError

#: Seconds a process waits at a barrier for the others (`JCKPT_BARRIER_TIMEOUT` overrides).
DEFAULT_BARRIER_TIMEOUT = 300.0
SAVING = 'jckpt/saving'  # key of each process's save in progress (for errors)
MEETING = 'jckpt/meeting'  # key of each process's latest meeting (`agree`), for errors
_MEETINGS: collections.Counter[tuple[str, str]] = collections.Counter()  # begun here, by topic
_MEETINGS_LOCK = threading.Lock()
#: What a process told that the others are at another meeting is to do.
MISMATCH_FIX = ("every process must make the calls that meet the others (a manager's open, "
                "reload and restore, a restore onto arrays spread over processes) together, in "
                "the same order; one made by some processes alone shifts them: restart the "
                "run's processes together")
T = TypeVar('T')


def barrier_timeout() -> float:
    """The barrier timeout in seconds: `JCKPT_BARRIER_TIMEOUT` or the default."""
    raw = os.environ.get('JCKPT_BARRIER_TIMEOUT')
    try:
        return float(raw) if raw else DEFAULT_BARRIER_TIMEOUT
    except ValueError:
        raise InputError(f"JCKPT_BARRIER_TIMEOUT={raw!r} is not a number of seconds") from None


def client(processes: int, path: str) -> Any:
    """JAX's distributed client (`None` with one process); `DistributedError` when several
    processes run without one."""
    # JAX's client lives in a private module; imported here so a JAX that moves it
    # breaks only multi-process saves, not every import of jckpt.
    from jax._src import distributed as jdist
    found = jdist.global_state.client
    if found is None and processes > 1:
        raise DistributedError("several processes but jax.distributed is not initialized",
                               file=path, fix="call jax.distributed.initialize(...) in every "
                                              "process before saving")
    return found if processes > 1 else None


class Runtime:
    """Barriers and shared values through JAX's distributed client, under one save's `tag`."""

    def __init__(self, tag: str, path: str, timeout: float, processes: int,
                 process: int, announce: str | None = '') -> None:
        self.client: Any = client(processes, path)
        self.local = self.client is None  # one process: nobody to wait for
        self.tag = tag
        self.path = path
        self.process, self.processes = process, processes
        self.timeout_ms = max(1, int(timeout * 1000))
        self.announce = announce or path
        if not self.local and announce is not None:  # what this process saves, for errors
            with contextlib.suppress(Exception):
                self.client.key_value_set(f"{SAVING}/{process}", self.announce,
                                          allow_overwrite=True)

    def _elsewhere(self) -> str:
        """What process 0 saves instead, when it is not this save's path ('' otherwise)."""
        try:
            theirs = self.client.key_value_try_get(f"{SAVING}/0")
        except Exception:
            return ''
        return f"; process 0 is saving {theirs}" if theirs and theirs != self.announce else ''

    def share(self, key: str, value: str | None) -> str:
        """Process 0 sets `key` to `value`; every process returns it."""
        full = f"{self.tag}/{key}"
        if self.local:
            return value or ''
        if value is not None:
            self.client.key_value_set(full, value)
            return value
        try:
            return self.client.blocking_key_value_get(full, self.timeout_ms)
        except Exception as e:
            raise DistributedError(f"process 0 did not start the save within "
                                   f"{self.timeout_ms / 1000:g} s ({first_line(e)}"
                                   f"{self._elsewhere()})", file=self.path,
                                   fix="every process must save the same path, the same number "
                                       "of times; check process 0's log: it may have failed "
                                       "or died") from None

    def put(self, key: str, value: str) -> None:
        """Set this save's `key` (best effort: what it is for is an error message)."""
        if not self.local:
            with contextlib.suppress(Exception):
                self.client.key_value_set(f"{self.tag}/{key}", value, allow_overwrite=True)

    def put_global(self, key: str, value: str) -> None:
        """Set `key`, outside this meeting's tag (best effort: what it is for is an error message)."""
        if not self.local:
            with contextlib.suppress(Exception):
                self.client.key_value_set(key, value, allow_overwrite=True)

    def positions(self) -> dict[int, Meeting]:
        """The other processes' latest meetings (`agree`), as each said arriving there."""
        if self.local:
            return {}
        try:
            pairs = self.client.key_value_dir_get(f"{MEETING}/")
        except Exception:
            return {}
        found = {}
        for key, text in pairs:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                process = int(key.rsplit('/', 1)[-1])
                if process != self.process:
                    found[process] = Meeting.decode(text)
        return found

    def get(self, key: str, timeout: float) -> str | None:
        """This save's `key`, waiting up to `timeout` seconds for it (`None`: not there)."""
        if self.local:
            return None
        try:
            return self.client.blocking_key_value_get(f"{self.tag}/{key}",
                                                      max(1, int(timeout * 1000)))
        except Exception:
            return None

    def listed(self, prefix: str) -> list[tuple[str, str]]:
        """This save's keys under `prefix`, and their values (the last part of each key)."""
        if self.local:
            return []
        try:
            pairs = self.client.key_value_dir_get(f"{self.tag}/{prefix}/")
        except Exception:
            return []
        return [(k.rsplit('/', 1)[-1], v) for k, v in sorted(pairs)]

    def barrier(self, name: str, what: str, mark: bool = True) -> None:
        """Meet every process at barrier `name` (`mark`: say so first, so that a timeout names
        who did not come); `DistributedError` at the timeout, saying what is known."""
        if self.local:
            return
        start = time.monotonic()
        if mark:
            self.put(f"at/{name}/{self.process}", '')
        try:
            self.client.wait_at_barrier(f"{self.tag}/{name}", self.timeout_ms)
        except Exception as e:
            reached = [ln.strip() for ln in str(e).splitlines() if 'reached the barrier' in ln]
            waited = time.monotonic() - start
            outcome = {'published': "whether it was published is not known: check the checkpoint",
                       'opened': "the processes only meet there: nothing was written"
                       }.get(name, "nothing was published")
            raise DistributedError(f"not every process {what} (waited {waited:.1f} s of "
                                   f"{self.timeout_ms / 1000:g}{self._missing(name)}); {outcome} "
                                   f"({'; '.join([first_line(e), *reached])})", file=self.path,
                                   fix="check the other processes' logs (one may have died); "
                                       "raise JCKPT_BARRIER_TIMEOUT if they are only slow") from None

    def _missing(self, name: str) -> str:
        """`'; process 2 did not come'`: who did not reach barrier `name` ('' if not known)."""
        came = {k for k, _ in self.listed(f"at/{name}")}
        if not came:
            return ''
        missing = [str(p) for p in range(self.processes) if str(p) not in came]
        if not missing:
            return ''
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ''
        return (f"; process{'es' if len(missing) > 1 else ''} {', '.join(missing[:8])}{more} "
                f"did not come")

    def report(self, name: str, process: int, error: BaseException) -> None:
        if self.local:
            return
        try:
            self.client.key_value_set(f"{self.tag}/error/{name}/{process}",
                                      told(error)[:2000])
        except Exception:
            pass

    def errors(self, name: str) -> list[str]:
        """What the processes reported failing at phase `name` (each phase has its own)."""
        return [f"process {k}: {v}" for k, v in self.listed(f"error/{name}")]

    def check(self, name: str) -> None:
        errs = self.errors(name)
        if errs:
            raise DistributedError("the save failed in another process: " + "; ".join(errs),
                                   file=self.path, fix="see that process's error; nothing was "
                                   "published and the previous checkpoint is intact")

    def together(self, name: str, what: str, process: int,
                 step: Callable[[], None] | None) -> None:
        """Run `step` here (if any), meet every process at barrier `name`, raise if one failed.

        A failing step is reported to the others before this process reaches the barrier,
        so they fail at once instead of at their timeout, and raises its own error (not the
        barrier's). Errors are kept per phase: a peer that passed this barrier looks only at
        this phase's, and so still meets the others at the next one.
        """
        if step is not None:
            try:
                step()
            except BaseException as e:
                self.report(name, process, e)
                with contextlib.suppress(DistributedError):
                    self.barrier(name, what)
                raise
        self.barrier(name, what)
        self.check(name)


@dataclasses.dataclass(frozen=True)
class Meeting:
    """One meeting of the processes (`agree`): what it is about, the path it is about ('' where
    each process names its own) and how many such meetings this process began before.

    Meetings about different things never pair: the barrier's name is made of `what` and `n`,
    counted per `(what, path)`, so a meeting one process makes alone shifts only the meetings
    about that very thing (and those of another path, met at the same count, are refused at
    once: the processes name different paths).

    >>> Meeting('opening the manager', 'run', 1).tag.startswith('jckpt/agree/')
    True
    """

    what: str
    path: str
    n: int

    @property
    def tag(self) -> str:
        digest = hashlib.sha256(self.what.encode('utf-8', 'surrogatepass')).hexdigest()[:16]
        return f"jckpt/agree/{digest}/{self.n}"

    def encode(self) -> str:
        return json.dumps([self.what, self.path, self.n])

    @classmethod
    def decode(cls, text: str) -> Meeting:
        what, path, n = json.loads(text)
        return cls(str(what), str(path), int(n))

    def describe(self) -> str:
        """`'restoring the checkpoint (its 2nd such meeting)'`."""
        of = f" of {self.path}" if self.path else ''
        return f"{self.what}{of} (its {_ordinal(self.n + 1)} such meeting)"

    def mismatched(self, e: DistributedError, positions: dict[int, Meeting], processes: int,
                   process: int, path: str) -> DistributedError:
        """`e`, the barrier's timeout, naming where the processes that did not come are
        instead, as each said arriving at its latest meeting (`positions`), and what this
        process was doing."""
        absent = [p for p in range(processes) if p != process and positions.get(p) != self]
        if not absent:
            return e
        where = '; '.join(f"process {p} is at {positions[p].describe()}" if p in positions
                          else f"process {p} has been at no meeting" for p in absent[:8])
        more = f" and {len(absent) - 8} more" if len(absent) > 8 else ''
        return DistributedError(f"{e.message}; this process is at {self.describe()}, {where}"
                                f"{more}: the processes are at different meetings", file=path,
                                fix=MISMATCH_FIX)


def meeting(what: str, path: str) -> Meeting:
    """This process's next meeting about `what` and `path`, counted."""
    with _MEETINGS_LOCK:
        n = _MEETINGS[what, path]
        _MEETINGS[what, path] += 1
    return Meeting(what, path, n)


def _ordinal(n: int) -> str:
    """`'1st'`, `'2nd'`, `'11th'`."""
    suffix = 'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')
    return f"{n}{suffix}"


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def told(e: BaseException) -> str:
    """What the other processes are told of `e`: its first line, after its type where it is
    not jckpt's (whose message names the file, the entry and the fix).

    >>> told(ValueError("bad shape"))
    'ValueError: bad shape'
    """
    return first_line(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {first_line(e)}"


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
    here = here or meeting(what, os.fspath(path) if same_path else '')  # `arrive`'s, if any
    rt = Runtime(here.tag, path, barrier_timeout() if timeout is None else float(timeout),
                 processes, process, announce=None)
    rt.put(f"said/{process}", json.dumps({'path': os.fspath(path), 'value': value,
                                          **_described(failure)}))
    rt.put_global(f"{MEETING}/{process}", here.encode())
    try:  # where each process is, not who came: `positions` tells, on a timeout
        rt.barrier('opened', f"reached {what}", mark=False)
    except DistributedError as e:
        if failure is not None:
            raise failure from None
        raise here.mismatched(e, rt.positions(), processes, process, rt.path) from None
    said = sorted((int(k), json.loads(v)) for k, v in rt.listed('said'))
    paths = {d['path'] for _, d in said}
    if same_path and len(paths) > 1:
        raise DistributedError(f"{what}: the processes name different paths (" + '; '.join(
            f"process {k}: {d['path']}" for k, d in said[:8]) + ')', file=path,
            fix="pass every process the same path, on a filesystem (or object store) every "
                "process sees") from failure
    failed = [(k, d) for k, d in said if d['type'] is not None]
    if failed:
        raise _common(what, path, failed) from failure
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
    Runtime(here.tag, path, 1.0, processes, process, announce=None).put_global(
        f"{MEETING}/{process}", here.encode())
    return here


def _described(e: BaseException | None) -> dict[str, str | None]:
    if e is None:
        return {'type': None, 'message': None, 'fix': None}
    if isinstance(e, CheckpointError):
        return {'type': type(e).__name__, 'message': e.message, 'fix': e.fix}
    return {'type': 'DistributedError', 'message': told(e),
            'fix': None}


def _common(what: str, path: str, failed: list[tuple[int, dict[str, Any]]]) -> CheckpointError:
    """The one error every process raises: the first failure's type, every failure named."""
    kind = getattr(errors, failed[0][1]['type'], None)
    if not (isinstance(kind, type) and issubclass(kind, CheckpointError)):
        kind = DistributedError
    said = '; '.join(f"process {k}: {d['message']}" for k, d in failed)
    return kind(f"{what} failed in {len(failed)} of the run's processes ({said})", file=path,
                fix=failed[0][1]['fix'])


__all__ = ['DEFAULT_BARRIER_TIMEOUT', 'MEETING', 'MISMATCH_FIX', 'Meeting', 'Runtime', 'agree',
           'arrive', 'barrier_timeout', 'client', 'first_line', 'jointly', 'meeting', 'told']
