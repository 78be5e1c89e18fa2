"""The background engine: snapshot slots, a FIFO of admitted jobs, and a writer that makes them durable.

`Pipeline` knows nothing about files: a `Committer` (the mirror,
the manager) says how one job is written (`stage`) and made durable
(`publish`). The pipeline runs the two stages on two threads so that job
N+1 is staged while job N is being published, keeps the jobs in order, retries
a failed one every `retry_after` seconds, and counts what is durable
(`MirrorCounters`). A job's slot is reused only once the job is
durable, so admitted work is never dropped while the pipeline is open (but for a job
no attempt could write: an `InputError` drops it), and a pipeline left open is flushed
when the interpreter exits (`jckpt.services.at_exit`). What a job is, what a committer
does with it and the thread that publishes it are `jckpt.services.jobs`; what the failed
attempts say, and when callers are told, `jckpt.services.failures`.

>>> import numpy as np
>>> class Counting:                      # a committer that writes nothing: generation = job number
...     def stage(self, job): return job.seq
...     def publish(self, staged): return staged
...     def discard(self, staged): pass
...     def rollback(self): pass
>>> p = Pipeline('demo', Counting())
>>> [p.admit([('jckpt', (('k', 'w'),), np.full(2, i))], {}) for i in range(3)]
[1, 2, 3]
>>> p.close()                            # waits until every admitted job is durable
>>> print(p.counters())
memory mirror: committed 3 durable 3 generation 3 pending 0 error 0
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

from jckpt.errors import CapacityError, CheckpointError, InputError
from jckpt.services import at_exit
from jckpt.services.counters import MirrorCounters, error_code
from jckpt.services.failures import Failures
from jckpt.services.jobs import Committer, Job, Publisher, Publishing
from jckpt.services.snapshot import Leaf, Slot
from jckpt.trees import image

log = logging.getLogger('jckpt')

InfoT = TypeVar('InfoT')
StagedT = TypeVar('StagedT')


def deadline_after(timeout: float | None) -> float | None:
    """The `time.monotonic()` at which `timeout` seconds from now end (None: no deadline).

    >>> deadline_after(None) is None
    True
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout != timeout:
        raise InputError(f"timeout must be a number of seconds or None, not {timeout!r:.80}",
                         fix="pass timeout=None to wait as long as it takes")
    if timeout < 0:
        raise InputError(f"timeout must be >= 0 seconds, not {timeout!r}",
                         fix="pass timeout=0 to check without waiting, or None to wait as long as it takes")
    if timeout == float('inf'):
        return None  # no deadline (monotonic() + inf is no time a wait can be given)
    return time.monotonic() + timeout


def _quietly(fn: Callable[..., object], *args: object) -> None:
    try:
        fn(*args)
    except Exception as e:  # cleanup must not mask the failure being handled
        log.debug("cleanup failed: %s", e)


def _check_options(slots: int, when_full: str, retry_after: float, patience: int) -> None:
    if type(slots) is not int or slots < 1:  # a bool is no count
        raise InputError(f"slots must be a positive integer, not {slots!r}")
    if when_full not in ('block', 'raise'):
        raise InputError(f"when_full must be 'block' or 'raise', not {when_full!r}")
    if isinstance(retry_after, bool) or not isinstance(retry_after, (int, float)) \
            or not retry_after >= 0:
        raise InputError(f"retry_after must be >= 0 seconds, not {retry_after!r}")
    if type(patience) is not int or patience < 1:
        raise InputError(f"patience must be a positive integer, not {patience!r}")


# --- the pipeline ------------------------------------------------------------

class Pipeline(Generic[InfoT, StagedT]):
    """Slots, a FIFO of admitted jobs, and a writer that makes them durable in order.

    The writer thread stages each job (`Committer`) while a helper
    thread publishes the one before it, so writing a snapshot overlaps with
    waiting for the disk to persist the previous one. A failure keeps the job
    and retries it after `retry_after` seconds; an `InputError` (what the
    job holds cannot be written, however often it is tried) drops the job
    instead, so that the jobs behind it are written.

    Args:
      name: what errors and thread names call it (the path written).
      commit: stages and publishes each job.
      slots: snapshot slots (each holds one whole snapshot).
      when_full: `'block'` waits for a free slot, `'raise'` refuses with
        `CapacityError`.
      retry_after: seconds between attempts after a failure.
      patience: failed attempts in a row after which waiting callers get the error.
      generation: the generation already on disk (the counters start from it).
      owner: what is closed at interpreter exit if left open (default: the pipeline).
      image_bytes: the most device memory a slot's image of accelerator arrays may take
        (None: what the devices have free; 0: copy to host at submit instead).
      less_often: how the `CapacityError` of `when_full='raise'` tells the caller to admit
        less often, in the words of the call it makes (`'submit less often'`, a mirror's).
    """

    def __init__(self, name: str, commit: Committer[StagedT], *, slots: int = 2,
                 when_full: str = 'block', retry_after: float = 1.0, patience: int = 3,
                 generation: int = 0, owner: at_exit.Closable | None = None,
                 image_bytes: int | None = None, less_often: str = 'submit less often') -> None:
        _check_options(slots, when_full, retry_after, patience)
        image.check_limit(image_bytes)
        self.name = name
        self.less_often = less_often
        self._commit = commit
        self.when_full = when_full
        self.retry_after = float(retry_after)
        self.patience = patience
        self._cond = threading.Condition()
        self._submit_lock = threading.Lock()
        self._free: collections.deque[Slot] = collections.deque(
            Slot(i, image_limit=image_bytes) for i in range(slots))
        self._images = 0
        self._queue: collections.deque[Job[InfoT]] = collections.deque()
        self._committed = self._durable = 0
        self._generation = generation
        self._failed = Failures(patience, wake=self._cond.notify_all)
        self._stalls = 0
        self._closing = self._closed = False
        self._died: BaseException | None = None  # what ended the writer thread, if anything did
        self._helper = Publisher(f"jckpt-publisher {name}")
        self._thread = threading.Thread(target=self._run, name=f"jckpt-writer {name}", daemon=True)
        self._thread.start()
        self._owner: at_exit.Closable = owner if owner is not None else self
        at_exit.keep(self._owner)

    # The caller's side.

    def counters(self) -> MirrorCounters:
        """A consistent reading of the progress."""
        with self._cond:
            return MirrorCounters(committed=self._committed, durable=self._durable,
                                  generation=self._generation, pending=len(self._queue),
                                  error=error_code(failed) if (failed := self._died
                                                               or self._failed.error)
                                  is not None else 0,
                                  failures=self._failed.count, last_error=self._failed.last_error,
                                  stalls=self._stalls, images=self._images)

    def _check_open(self) -> None:
        """Refuse new work once closing, or once the writer thread has died (`_stopped`)."""
        if self._closing:
            raise CheckpointError("the writer is closed", file=self.name, fix="open a new one")
        self._check_alive()

    def _check_alive(self) -> None:
        """Raise, if the writer thread is gone, an error saying so and why: a snapshot admitted
        now would never be written, and a caller waiting for a slot would wait forever."""
        if self._died is None and self._thread.is_alive():
            return
        cause = self._died
        raise CheckpointError(
            "the background writer stopped" + (f" ({type(cause).__name__}: {cause})" if cause else "")
            + ": snapshots not yet durable are not written", file=self.name,
            fix="close it and open a new one; what it made durable is kept, save the rest "
                "again") from cause

    def admit(self, leaves: Sequence[Leaf], metadata: Mapping[str, str], info: InfoT = None,
              timeout: float | None = None) -> int:
        """Snapshot `leaves` into a free slot and queue them; return the snapshot's number.

        Returns once the snapshot is taken (`Slot.take`): device images are
        dispatched, not awaited, and drained to host by the writer thread.
        """
        with self._submit_lock:
            slot = self._take_slot(timeout)
            try:
                snapshot = slot.take(leaves)
            except BaseException:
                with self._cond:
                    self._free.appendleft(slot)
                    self._cond.notify_all()
                raise
            with self._cond:
                self._committed += 1
                self._images += snapshot.on_device
                job = Job(self._committed, slot, snapshot, dict(metadata), info)
                self._queue.append(job)
                self._cond.notify_all()
                return job.seq

    def _take_slot(self, timeout: float | None) -> Slot:
        """A free slot: wait for one (`when_full='block'`) or refuse."""
        deadline = deadline_after(timeout)
        with self._cond:
            stalled, asked = False, 0
            while True:
                self._check_open()
                if self._free:
                    return self._free.popleft()
                asked = self._failed.raise_given_up(asked)
                if self.when_full == 'raise':
                    raise CapacityError(f"all {len(self._queue)} snapshot slots are still "
                                        "being written", file=self.name,
                                        fix=f"{self.less_often}, add slots, or use "
                                            "when_full='block'")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise CapacityError("timed out waiting for a free snapshot slot",
                                        file=self.name, fix="wait longer or add slots")
                if not stalled:
                    stalled = True
                    self._stalls += 1
                self._cond.wait(remaining)

    def run_now(self, write: Callable[[int], None]) -> int:
        """Run `write(generation)` in the caller's thread, after everything admitted is durable.

        For saves that cannot be snapshotted into a slot (a multi-process save
        with barriers): counted like a snapshot, its failure raised at once.
        """
        with self._submit_lock:
            self.wait()
            with self._cond:
                self._check_open()
                generation = self._generation + 1
            try:
                write(generation)
            except BaseException as e:
                with self._cond:
                    if isinstance(e, InputError):  # the tree, not the storage: as `_drop` counts it
                        self._failed.counted(e)
                    else:  # it stands in the counters until a write succeeds (raised here, once)
                        self._failed.recorded(e)
                raise
            with self._cond:
                self._committed += 1
                self._durable = self._committed
                self._generation = generation
                self._failed.succeeded()
                self._cond.notify_all()
                return self._committed

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every admitted snapshot is durable (or dropped); False on timeout.

        Raises the persistence error once `patience` attempts in a row failed (once: a later
        `wait` makes the writer try again at once, and raises only if that attempt fails too),
        and the error of the first snapshot dropped since the last `wait` (once, with a note of
        how many more were) when nothing admitted before it is pending.
        """
        deadline = deadline_after(timeout)
        with self._cond:
            goal, asked = self._committed, 0
            while self._queue and self._queue[0].seq <= goal:
                asked = self._failed.raise_given_up(asked)
                self._check_alive()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self._failed.raise_dropped(goal)
            return True

    def close(self, timeout: float | None = None) -> None:
        """Make everything durable, stop the writer; raise what could not be persisted.

        After `patience` failures the writer is woken for one more attempt before giving up
        (the disk may have been freed since): one begun after `close` was called. Past
        `timeout`, a `CheckpointError` says so and the writer stays open, writing: the next
        `close` waits for the rest.
        """
        if self._closed:
            return
        with self._cond:
            self._failed.last_attempt()  # a writer that gave up tries once more, now
        try:
            done = self.wait(timeout)
        except BaseException as e:
            with self._cond:  # no later `wait` will raise them
                self._failed.note_dropped(e)
            self._stop()
            raise
        if not done:  # still open, still writing: a later `close` waits for the rest
            with self._cond:
                self._failed.last_attempt(False)
                n = len(self._queue)
            raise CheckpointError(f"close timed out with {n} snapshot(s) not yet durable: the "
                                  "writer is still open and goes on writing them", file=self.name,
                                  fix="call close() again, with a longer timeout or none, to "
                                      "wait for them and release the path")
        self._stop()

    @property
    def closed(self) -> bool:
        """Whether `close` stopped the writer (a `close` that timed out leaves it open)."""
        return self._closed

    def _stop(self) -> None:
        """Stop the writer thread (after what it is writing) and forget the pipeline."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._closed = True
        at_exit.forget(self._owner)

    # The writer's side.

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a fault of jckpt's own: say so to every caller, not hang them
            log.error("the writer of %s stopped: %r", self.name, e, exc_info=e)
            with self._cond:
                self._died = e
                self._cond.notify_all()
        finally:
            self._helper.stop()

    def _loop(self) -> None:
        """Stage the next job while the helper publishes the one before it; in order, with retries."""
        c = self._commit
        inflight: Publishing[StagedT] | None = None
        while True:
            job = self._next_job(busy=inflight is not None)
            if job is None and inflight is None:
                return  # closing
            staged, failure = None, None
            if job is not None:
                begun = self._failed.asked  # the attempt answers the requests made before it
                try:
                    staged = c.stage(job)
                except BaseException as e:
                    failure = e
            if inflight is not None:
                done, inflight = inflight, None
                error = done.outcome.exception()
                if error is None:
                    self._completed(done.job, done.outcome.result())
                else:
                    if job is not None and failure is None:
                        _quietly(c.discard, staged)
                    _quietly(c.discard, done.staged)
                    self._retry(error, done.begun)
                    continue
            if failure is not None:
                if isinstance(failure, InputError):  # the tree, not the disk: retrying cannot help
                    self._drop(job, failure)
                else:
                    self._retry(failure, begun)
                continue
            if job is not None:
                inflight = Publishing(job, staged, self._helper.call(c.publish, staged), begun)

    def _next_job(self, *, busy: bool) -> Job[InfoT] | None:
        """The job to stage next: the first in line, or the second while the first is `busy`.

        Idle, it waits for one; `None` when there is none to stage now
        (`busy`) or the pipeline is closing.
        """
        index = 1 if busy else 0
        with self._cond:
            while len(self._queue) <= index and not busy and not self._closing:
                self._cond.wait()
            if self._closing or len(self._queue) <= index:
                return None
            return self._queue[index]

    def _completed(self, job: Job[InfoT], generation: int | None) -> None:
        with self._cond:
            self._durable = job.seq
            if generation is not None:
                self._generation = generation
            self._failed.succeeded()
            self._leave(job)

    def _leave(self, job: Job[InfoT]) -> None:
        """Take `job` out of the line and free its slot (holding `_cond`)."""
        if self._queue[0] is job:
            self._queue.popleft()
        else:  # a dropped job, staged behind one being published
            self._queue.remove(job)
        job.release()
        self._free.append(job.slot)
        self._cond.notify_all()

    def _drop(self, job: Job[InfoT], e: BaseException) -> None:
        """Give up on a job that can never be written (an `InputError`: a model tree its
        format cannot hold): it leaves the line, its slot is freed and the jobs behind it go
        on; the next `wait` raises the error, once. The storage did not fail: the counters'
        `error` is left as it was (`failures` and `last_error` count it)."""
        _quietly(self._commit.rollback)
        with self._cond:
            self._failed.drop(job.seq, e)
            self._leave(job)
        log.error("writing %s: snapshot %d is dropped, not retried: %s", self.name, job.seq, e)

    def _retry(self, e: BaseException, begun: int) -> None:
        """Roll back, record the failure of the attempt `begun` (`asked` when it began) and
        wait `retry_after` seconds, unless a caller asked for an attempt since (the job stays
        first)."""
        _quietly(self._commit.rollback)
        with self._cond:
            streak = self._failed.retried(e, begun)
            self._cond.notify_all()
            log.warning("writing %s failed (attempt %d, retrying in %.3g s): %s",
                        self.name, streak, self.retry_after, e)
            if not self._closing and not self._failed.asked_since(begun):
                self._cond.wait(self.retry_after)


__all__ = ['Committer', 'Job', 'MirrorCounters', 'Pipeline', 'error_code']
