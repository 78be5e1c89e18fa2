"""A background writer's failed attempts: counted, retried, and told to its callers once.

The engine (`jckpt.services.engine.Pipeline`) retries a failed job until it is written;
`Failures` keeps what those attempts say: the error that stands until a write succeeds,
the streak of failures in a row after which waiting callers get that error (`patience`),
each error raised once (a caller then asks the writer for an attempt at once, and is told
only of an attempt begun since), and the jobs dropped because no attempt could ever write
them. It holds no lock: the pipeline's condition guards it, and `wake` is that condition's
`notify_all`.

>>> f = Failures(patience=1, wake=lambda: None)
>>> f.retried(OSError("disk full"), begun=0)  # the writer's first attempt failed
1
>>> f.raise_given_up(0)
Traceback (most recent call last):
...
OSError: disk full
>>> f.raise_given_up(0)  # told once: the caller asks for another attempt instead
1
>>> f.succeeded(); f.raise_given_up(0), f.count, f.last_error
(0, 1, 'disk full')
"""

from __future__ import annotations

from collections.abc import Callable

from jckpt.services.counters import kept_error


class Failures:
    """The failed attempts of one background writer (guarded by its pipeline's condition).

    Args:
      patience: failed attempts in a row after which waiting callers get the error.
      wake: wakes the writer from its wait between attempts (a caller asked for one).
    """

    def __init__(self, patience: int, wake: Callable[[], None]) -> None:
        self.patience = patience
        self._wake = wake
        self.error: BaseException | None = None  # stands until a write succeeds
        self.told = False  # the failing streak's error was raised to a caller
        self.final = False  # close's last attempt: its error is raised as it is, not retried
        self.asked = self.answered = 0  # callers' requests for an attempt; the last one failed
        self.streak = 0
        self.dropped: list[tuple[int, BaseException]] = []  # (seq, error), not yet raised
        self.count = 0  # failed attempts, in all (the counters' `failures`)
        self.last_error: str | None = None

    def given_up(self) -> BaseException | None:
        """The standing error once `patience` attempts in a row failed (None before)."""
        return self.error if self.streak >= self.patience else None

    def raise_given_up(self, asked: int) -> int:
        """Raise, once, the error of `patience` failed attempts in a row.

        Once it was raised, a caller asks the writer for an attempt at once (the disk may
        have room now) and raises only the failure of an attempt begun since, never one of
        the retries before: an error is raised once, and not for a snapshot written since.
        `asked`: the caller's request so far (0: none); returns it.
        """
        failed = self.given_up()
        if failed is None:
            return asked
        if not self.told or 0 < asked <= self.answered:
            self.told = True
            raise failed if self.final else kept_error(failed)  # close: not retried after it
        if not asked:
            self.asked += 1
            asked = self.asked
            self._wake()  # wakes the writer from its wait between attempts
        return asked

    def last_attempt(self, last: bool = True) -> None:
        """Close's last attempt begins (`last`): a writer that gave up tries once more, now,
        and its failure is raised as it is; a close that timed out ends it (`last=False`)."""
        self.told = self.told or last
        self.final = last

    def succeeded(self) -> None:
        """A write went through: no error stands."""
        self.error, self.streak, self.told = None, 0, False

    def counted(self, e: BaseException) -> None:
        """Count a failed attempt in `count` and `last_error` (the error does not stand)."""
        self.count += 1
        self.last_error = str(e)

    def recorded(self, e: BaseException) -> None:
        """Count a failed write, whose error stands until a write succeeds."""
        self.counted(e)
        self.error = e

    def retried(self, e: BaseException, begun: int) -> int:
        """Record the failure of the attempt `begun` (`asked` when it began), to be retried;
        the streak of failures in a row it makes."""
        self.streak += 1
        self.recorded(e)
        self.answered = max(self.answered, begun)
        return self.streak

    def asked_since(self, begun: int) -> bool:
        """Whether a caller asked for an attempt after the one `begun` began."""
        return self.asked > begun

    def drop(self, seq: int, e: BaseException) -> None:
        """Job `seq` can never be written (`e`, an `InputError`): the next wait raises it."""
        self.dropped.append((seq, e))
        self.counted(e)

    def raise_dropped(self, goal: int) -> None:
        """Raise the error of the first job dropped up to `goal`, once, with a note of how
        many more were; those after `goal` are kept for a later wait."""
        dropped = [e for seq, e in self.dropped if seq <= goal]
        self.dropped = [(seq, e) for seq, e in self.dropped if seq > goal]
        if dropped:
            if len(dropped) > 1:
                dropped[0].add_note(f"{len(dropped) - 1} later snapshot(s) were dropped too "
                                    f"(the log names each)")
            raise dropped[0]

    def note_dropped(self, e: BaseException) -> None:
        """Note on `e`, raised by a close, the jobs dropped that no later wait will raise."""
        dropped, self.dropped = self.dropped, []
        if dropped:
            e.add_note(f"{len(dropped)} snapshot(s) were dropped too, not written (the "
                       f"first, {dropped[0][0]}: {dropped[0][1]})")


__all__ = ['Failures']
