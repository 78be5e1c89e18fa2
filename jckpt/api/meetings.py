"""Where each process of a `jax.distributed` run is: the meetings it makes (`agree`, a save),
counted per thing, and whether the processes wait for each other at different meetings.

Each process posts its latest meeting (`Meeting.encode`, under `MEETING`) before its part
of it; a process waiting for another reads where that one is: at the same meeting (slow),
at one this process began (behind: it may still come), or at one this process has not begun,
where it waits for this one as this one waits for it (`Meeting.stuck`: no process can move
on, so both fail at once instead of at the barrier's timeout).

>>> here = Meeting('restoring step 2', 'run', 0)
>>> here.stuck({1: Meeting('saving a checkpoint', 'elsewhere', 10**6)})  # not begun here
True
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import threading
from collections.abc import Iterator

from jckpt.errors import DistributedError, InputError

MEETING = 'jckpt/meeting'  # key of each process's latest meeting (`agree`, a save), for errors
TOLD = 'jckpt/told'  # key of what each process was told refusing a call alone (`told_alone`)
#: What a save's meetings are about: they pair by the count of saves (`pairing.next_save`).
SAVING = 'saving a checkpoint'
_MEETINGS: collections.Counter[tuple[str, str]] = collections.Counter()  # begun here, by topic
_MEETINGS_LOCK = threading.Lock()
_CALLING: list[tuple[int, str]] = []  # (thread, what) of each call meeting the others, under way here
#: What a process told that the others are at another meeting is to do.
MISMATCH_FIX = ("every process must make the calls that meet the others (a save, a manager's "
                "open, reload and restore, a restore onto arrays spread over processes) "
                "together, in the same order; one made by some processes alone shifts them: "
                "restart the run's processes together")

#: What a process told that another thread of it is at a meeting is to do (`alone`).
ONE_THREAD_FIX = ("make the calls that meet the other processes (a save, a restore onto arrays "
                  "spread over processes, a manager's open, reload, save and restore) from one "
                  "thread, one after the other; a jckpt.Mirror, which meets no other process, "
                  "may write from its own thread meanwhile")


@dataclasses.dataclass(frozen=True)
class Meeting:
    """One meeting of the processes (`agree`, a save): what it is about, the path it is about ('' where
    each process names its own), how many such meetings this process began before, and, as a
    posted position, whether this process `left` it failing: it is at no meeting then, not
    waiting there for the others; `against` is the meeting (encoded) of the process it found
    waiting for it there (no process could move on: that one fails too, `stuck`), '' where
    this process timed out.

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
    left: bool = False
    against: str = ''

    @property
    def tag(self) -> str:
        digest = hashlib.sha256(self.what.encode('utf-8', 'surrogatepass')).hexdigest()[:16]
        return f"jckpt/agree/{digest}/{self.n}"

    def encode(self) -> str:
        return json.dumps([self.what, self.path, self.n,
                           *([True, self.against] if self.left else [])])

    @classmethod
    def decode(cls, text: str) -> Meeting:
        what, path, n, *left = json.loads(text)
        return cls(str(what), str(path), int(n), bool(left and left[0]),
                   str(left[1]) if len(left) > 1 else '')

    def leaving(self, against: Meeting | None) -> Meeting:
        """This meeting as the position of a process that left it failing, where it found a
        process waiting for it at meeting `against` (None: it timed out)."""
        return dataclasses.replace(self, left=True, against=against.encode() if against else '')

    def describe(self) -> str:
        """`'restoring the checkpoint (its 2nd such meeting)'`."""
        of = f" of {self.path}" if self.path else ''
        return f"{self.what}{of} (its {_ordinal(self.n + 1)} such meeting)"

    def stuck(self, positions: dict[int, Meeting]) -> bool:
        """Whether a process waits where this one, waiting at this meeting, can never come: at
        another meeting, which this process has not begun (it waits there for this one, as this
        one waits here for it, so neither moves on). A process at a meeting this one began is
        behind (or has not said yet where it is now), not stuck: it may still come here. One
        that left its meeting failing is at none, unless it left this very meeting (it will
        not come: it refused the call, `refused`, or gave up waiting there) or left finding this
        one stuck here (`against`): this one then fails too, as it would have found it.

        >>> Meeting('restoring step 2', 'run', 0).stuck({1: Meeting('restoring step 2', 'run', 0)})
        False
        """
        return any(m.against == self.encode() or m.plain() == self if m.left
                   else m != self and not begun(m) for m in positions.values())

    def plain(self) -> Meeting:
        """This meeting, not left (what a position left failing was at)."""
        return dataclasses.replace(self, left=False, against='')

    def mismatched(self, e: DistributedError, positions: dict[int, Meeting], processes: int,
                   process: int, path: str, told: dict[int, str] | None = None) -> DistributedError:
        """`e`, the barrier's timeout, naming where the processes that did not come are
        instead, as each said arriving at its latest meeting (`positions`), what each was
        told there refusing a call alone (`told`, as `told_since` reads it), and what this
        process was doing."""
        absent = [p for p in range(processes) if p != process and positions.get(p) != self]
        if not absent:
            return e
        told = told or {}
        where = '; '.join((f"process {p} {_where(positions[p])}" if p in positions
                           else f"process {p} has been at no meeting")
                          + (f", and was told since: {told[p]}" if p in told else '')
                          for p in absent[:8])
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


@contextlib.contextmanager
def alone(what: str, path: str, processes: int) -> Iterator[None]:
    """A call meeting the other processes about `what` (`agree`, a save), made while no other
    thread of this process is in one: `InputError` otherwise. Each process posts one position
    and counts its meetings in the order it makes them, so meetings made at once from two
    threads would be taken for stuck where they are not, or pair in another order in each
    process. Nothing is checked with one process (nothing meets).

    >>> with alone('saving a checkpoint', 'run', 2):
    ...     with alone('restoring the checkpoint', 'run', 2):  # the same thread: a call within
    ...         pass
    """
    me = threading.get_ident()
    with _MEETINGS_LOCK:
        other = next((w for t, w in _CALLING if t != me), None) if processes > 1 else None
        if other is not None:
            raise InputError(f"{what} meets the other processes while another thread of this "
                             f"process is {other}", file=path, fix=ONE_THREAD_FIX)
        _CALLING.append((me, what))
    try:
        yield
    finally:
        with _MEETINGS_LOCK:
            _CALLING.remove((me, what))


def begun(m: Meeting) -> bool:
    """Whether this process began meeting `m` (or a later one about the same thing)."""
    with _MEETINGS_LOCK:
        return _MEETINGS[m.what, m.path] > m.n


def _where(m: Meeting) -> str:
    """`'is at restoring a step of run (its 1st such meeting)'`, or `'left ...'`."""
    return f"{'left' if m.left else 'is at'} {m.describe()}{', failing' if m.left else ''}"


def refused(what: str, path: str) -> Meeting:
    """The position of a process that refused, alone, a call meeting the others about `what`
    and `path` (a manager's save of a step that is no step, an argument refused before the
    meeting): it left, failing, the meeting it would have made next, and will not come there,
    so the processes waiting for it there fail at once (`Meeting.stuck`). Not counted: its next
    call about that thing is that meeting again, as its count in the others may be too.

    >>> refused('opening the manager', '/run').left
    True
    """
    with _MEETINGS_LOCK:
        return Meeting(what, path, _MEETINGS[what, path], left=True)


def told_alone(message: str, at: Meeting) -> str:
    """What this process posts (under `TOLD`) refusing a call alone: `message`, and the position
    it posted then (`refused`), so that `told_since` shows it only while this process has made
    no other meeting since."""
    return json.dumps([at.encode(), message])


def told_since(posted: dict[int, str], positions: dict[int, Meeting]) -> dict[int, str]:
    """What each process was told (`posted`, as `told_alone` wrote it) while still at the
    position it posted then (`positions`); not what it was told before it went on to another."""
    found = {}
    for p, text in posted.items():
        with contextlib.suppress(ValueError, TypeError):
            at, message = json.loads(text)
            if p in positions and at == positions[p].encode():
                found[p] = str(message)
    return found


def _ordinal(n: int) -> str:
    """`'1st'`, `'2nd'`, `'11th'`."""
    suffix = 'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')
    return f"{n}{suffix}"


__all__ = ['MEETING', 'MISMATCH_FIX', 'SAVING', 'TOLD', 'Meeting', 'alone', 'begun', 'meeting', 'refused',
           'told_alone', 'told_since']
