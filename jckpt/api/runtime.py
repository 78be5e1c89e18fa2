"""Barriers and shared values between the processes of a `jax.distributed` run.

A multi-process save (`jckpt.api.multiprocess`) and the calls that agree on one
outcome in every process (`jckpt.api.agreement`: a manager's open, a restore) meet
through JAX's distributed client: barriers made in its
key-value store (`Runtime.gather`), each with a timeout, so a dead or absent
peer gives an error in bounded time, never a hang, and left at once where the
processes wait at different meetings (`jckpt.api.meetings`): none could ever
move on. With one process nothing is waited for.

>>> barrier_timeout() > 0
True
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any

from jckpt.api.meetings import (
    MEETING,
    MISMATCH_FIX,
    TOLD,
    Meeting,
    meeting,
    told_since,
)
from jckpt.api.outcomes import told
from jckpt.errors import DistributedError, InputError

#: Seconds a process waits at a barrier for the others (`JCKPT_BARRIER_TIMEOUT` overrides).
DEFAULT_BARRIER_TIMEOUT = 300.0
#: The key-value key under which each process announces its save in progress (for errors):
#: ``jckpt/saving/<process>`` (not `meetings.SAVING`, a meeting's topic).
SAVING_KEY = 'jckpt/saving'
#: Seconds between the first looks at where the process waited for is, while one waits for
#: it (`Runtime.gather`); each wait doubles it, up to `MAX_POLL`.
POLL = 0.25
MAX_POLL = 2.0
LEFT = 1 << 40  # what a process leaving a meeting failing adds to its outcome (`_settle`)
FEW = 8  # processes whose keys `Runtime.gather` gets one by one, without listing them first
#: Why a process stopped waiting early (`Runtime.gather`).
STUCK = "it waits at another meeting, for this process: no process can move on"
GONE = "it left this meeting failing: it will not come"  # `Meeting.stuck`, a position left


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
    """Barriers and shared values through JAX's distributed client, under one save's `tag`.

    `here`: the meeting this is (`jckpt.api.meetings`), posted as where this process is, so
    that a process waiting for it knows whether it may still come; waiting, this process
    looks where the process it waits for is, and fails at once where none can move on.
    """

    def __init__(self, tag: str, path: str, timeout: float, processes: int,
                 process: int, announce: str | None = '', here: Meeting | None = None) -> None:
        self.client: Any = client(processes, path)
        self.local = self.client is None  # one process: nobody to wait for
        self.tag = tag
        self.path = path
        self.process, self.processes = process, processes
        self.timeout_ms = max(1, int(timeout * 1000))
        self.announce = announce or path
        self.here = here
        if not self.local and announce is not None:  # what this process saves, for errors
            with contextlib.suppress(Exception):
                self.client.key_value_set(f"{SAVING_KEY}/{process}", self.announce,
                                          allow_overwrite=True)

    def post(self) -> None:
        """Post `here` as where this process is (before its part of the meeting)."""
        if self.here is not None:
            self.put_global(f"{MEETING}/{self.process}", self.here.encode())

    def _elsewhere(self) -> str:
        """What process 0 saves instead, when it is not this save's path ('' otherwise)."""
        try:
            theirs = self.client.key_value_try_get(f"{SAVING_KEY}/0")
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
        start = time.monotonic()
        found, seen = self._await(full, 0, start)
        if found is not None:
            return found
        why = _why(seen) or f"the wait timed out{self._elsewhere()}"  # `_placed` says where
        raise self._placed(seen, DistributedError(
            f"process 0 did not start the save within {time.monotonic() - start:.1f} s of "
            f"{self.timeout_ms / 1000:g} ({why})", file=self.path,
            fix="every process must save the same path, the same number of times; check "
                "process 0's log: it may have failed or died"))

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
        """The other processes' latest meetings (`agree`, a save), as each said arriving there."""
        found = {}
        for process, text in self._posted(MEETING).items():
            with contextlib.suppress(ValueError, TypeError, KeyError):
                found[process] = Meeting.decode(text)
        return found

    def _posted(self, prefix: str) -> dict[int, str]:
        """What the other processes posted under `prefix` (outside any meeting), by process."""
        if self.local:
            return {}
        try:
            pairs = self.client.key_value_dir_get(f"{prefix}/")
        except Exception:
            return {}
        found = {}
        for key, text in pairs:
            with contextlib.suppress(ValueError):
                process = int(key.rsplit('/', 1)[-1])
                if process != self.process:
                    found[process] = text
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

    def barrier(self, name: str, what: str) -> None:
        """Meet every process at barrier `name` (`gather`: each says it came, so that a timeout
        names who did not); `DistributedError` at the timeout, saying what is known."""
        if not self.local:
            self.gather(f"at/{name}", '', what, name)

    def gather(self, prefix: str, mine: str, what: str, name: str) -> list[tuple[str, str]]:
        """Set this process's key under `prefix` to `mine`; every process's (as `listed`), once
        each process set its own: a
        barrier (`name`) in the key-value store, which this process can leave early: waiting
        for a process, it looks where that one is (`_await`), and where no process can move
        on raises at once, as at the timeout, `DistributedError` naming where each is.

        Each key is read as its process sets it (a blocking get, woken by the set), so a
        meeting all make together costs what a barrier does: a get for each other process
        (with many, one listing first, and a get for each not there yet), and the outcome
        (`_settle`): a meeting a process left failing fails in a process that comes later,
        as a barrier that timed out does.
        """
        start = time.monotonic()
        self.put(f"{prefix}/{self.process}", mine)
        got = {str(self.process): mine}
        if self.processes > FEW:
            got.update(self.listed(prefix))
        for p in range(self.processes):
            if str(p) in got:
                continue
            found, seen = self._await(f"{self.tag}/{prefix}/{p}", p, start)
            if found is None and self._settle(prefix, 'failed'):
                came = set(got) | {k for k, _ in self.listed(prefix)}
                raise self._placed(seen, self._not_every(
                    name, what, time.monotonic() - start, came,
                    _why(seen) or "the barrier timed out"))
            if found is None:  # every process came after all: another settled it met
                return self.listed(prefix)
            got[str(p)] = found
        if not self._settle(prefix, 'met'):
            raise self._placed(None, self._not_every(
                name, what, time.monotonic() - start, set(got),
                "another process left this meeting failing before this one came"))
        return sorted(got.items(), key=lambda kv: int(kv[0]))

    def _settle(self, prefix: str, outcome: str) -> bool:
        """Whether the meeting under `prefix` ends with `outcome` ('met' or 'failed'): the
        first process to say one decides, and every other follows it. One atomic increment
        (where the client has one; else a key set once): a process that met every other adds
        1, and met if no process left before; one leaving adds `LEFT`, and the first to leave
        learns from the sum whether one met before it, and says so (`-first`) to those that
        leave after it. Not known (the coordination service does not answer): as if failed."""
        key = f"{self.tag}/{prefix}-outcome"
        leaving = outcome == 'failed'
        if hasattr(self.client, 'key_value_increment'):
            try:
                total = self.client.key_value_increment(key, LEFT if leaving else 1)
                if not leaving:
                    return total < LEFT
                if total >= 2 * LEFT:  # another left first, and decided
                    return self.client.blocking_key_value_get(f"{key}-first", 1000) == outcome
                self.put(f"{prefix}-outcome-first", 'failed' if total == LEFT else 'met')
                return total == LEFT
            except Exception:
                return leaving
        try:
            self.client.key_value_set(key, outcome)
            return True
        except Exception:
            pass
        try:
            return self.client.key_value_try_get(key) == outcome
        except Exception:
            return leaving

    def _await(self, key: str, process: int, start: float) -> tuple[str | None, Meeting | None]:
        """`(key's value, None)` once `process` set it; `(None, None)` at the timeout (from
        `start`), `(None, where process is)` as soon as `process` waits at a meeting this
        process can never come to (`_stuck`). The looks are `POLL` seconds apart at first,
        then further apart."""
        deadline, poll = start + self.timeout_ms / 1000, POLL
        while (left := deadline - time.monotonic()) > 0:
            began, wait = time.monotonic(), min(poll, left)
            try:
                return self.client.blocking_key_value_get(key, max(1, int(wait * 1000))), None
            except Exception:
                pass
            seen = self._stuck(process)
            if seen is not None:
                return None, seen
            time.sleep(max(0.0, began + wait - time.monotonic()))  # a client failing at once
            poll = min(2 * poll, MAX_POLL)
        return None, None

    def _stuck(self, process: int) -> Meeting | None:
        """Where `process` said it is, if this one (at `here`) can never come there."""
        if self.here is None:
            return None
        try:
            there = Meeting.decode(self.client.key_value_try_get(f"{MEETING}/{process}"))
        except Exception:  # not there yet, or not a meeting: not known to be stuck
            return None
        return there if self.here.stuck({process: there}) else None

    def _placed(self, seen: Meeting | None, e: DistributedError) -> DistributedError:
        """`e`, naming where the processes that did not come are (`Meeting.mismatched`), once
        this process posted that it left its meeting (finding a process stuck at `seen`):
        a process that has not begun it must not take this one as waiting there for it, and
        the one at `seen` fails too, if it has not found it itself."""
        if self.here is None:
            return e
        self.put_global(f"{MEETING}/{self.process}", self.here.leaving(seen).encode())
        positions = self.positions()
        return self.here.mismatched(e, positions, self.processes, self.process, self.path,
                                    told_since(self._posted(TOLD), positions))

    def _not_every(self, name: str, what: str, waited: float, came: set[str],
                   detail: str) -> DistributedError:
        """The error of a meeting not every process came to (`came`: those that said they did)."""
        outcome = {'published': "whether it was published is not known: check the checkpoint",
                   'said': "the processes only meet there: nothing was written"
                   }.get(name, "nothing was published")
        return DistributedError(f"not every process {what} (waited {waited:.1f} s of "
                                f"{self.timeout_ms / 1000:g}{self._missing(came)}); {outcome} "
                                f"({detail})", file=self.path,
                                fix="check the other processes' logs (one may have died); "
                                    "raise JCKPT_BARRIER_TIMEOUT if they are only slow")

    def _missing(self, came: set[str]) -> str:
        """`'; process 2 did not come'`: who is not among those that `came` ('' if not known)."""
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


def _why(seen: Meeting | None) -> str:
    """Why this process stopped waiting early for a process found at `seen` ('': it did not)."""
    return '' if seen is None else GONE if seen.left else STUCK


__all__ = ['DEFAULT_BARRIER_TIMEOUT', 'MEETING', 'MISMATCH_FIX', 'Meeting', 'Runtime',
           'barrier_timeout', 'client', 'meeting']
