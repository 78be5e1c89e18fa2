"""What a background writer queues: one admitted snapshot (`Job`), and how a `Committer`
(the mirror, the manager) makes it durable in two stages that overlap across jobs.

`jckpt.services.engine.Pipeline` runs the jobs; a job holds its snapshot's slot until it
is durable, and drains and hashes its leaves once, however often it is attempted.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Generic, Protocol, TypeVar

from jckpt.format.header import Entry
from jckpt.services.snapshot import Slot, Snapshot, SnapshotLeaf, build_entries
from jckpt.storage.writer import ArraySource

InfoT = TypeVar('InfoT')
StagedT = TypeVar('StagedT')


@dataclasses.dataclass(frozen=True, eq=False)
class Job(Generic[InfoT]):
    """One admitted snapshot: its number (1, 2, ...), slot and snapshot, the user's
    `metadata` for the generation and the committer's `info` (the manager: the step)."""

    seq: int
    slot: Slot
    snapshot: Snapshot
    metadata: Mapping[str, str]
    info: InfoT

    @functools.cached_property
    def items(self) -> tuple[SnapshotLeaf, ...]:
        """The leaves in host memory (device images drained on first use)."""
        return tuple(self.snapshot.drain())

    @functools.cached_property
    def built(self) -> tuple[tuple[Entry, ...], tuple[ArraySource, ...]]:
        """The entries and payload sources of the items: hashed once, kept across retries."""
        return build_entries(self.items)

    def release(self) -> None:
        """Drop the drained leaves: on the CPU they view the slot's image, which the slot's
        next snapshot can reuse (donate) only once no view of it is left."""
        self.__dict__.pop('built', None)
        self.__dict__.pop('items', None)


class Committer(Protocol[StagedT]):
    """How a pipeline makes one job durable, in two stages that overlap across jobs.

    `stage` writes the job's file under a temporary name without waiting
    for the disk; `publish` makes it durable (fsync, rename into place,
    directory fsync) and returns the generation it produced, or `None`.
    While job N is being published, job N+1 is staged. After a failure the
    pipeline calls `discard` on anything staged but not published, then
    `rollback` so the next `stage` starts from the last published state.
    """

    def stage(self, job: Job) -> StagedT: ...

    def publish(self, staged: StagedT) -> int | None: ...

    def discard(self, staged: StagedT) -> None: ...

    def rollback(self) -> None: ...


class Publisher:
    """A daemon thread that runs one call at a time, in order; each outcome comes back as a Future.

    The pipeline publishes each job on it while its own thread stages the next one.

    >>> p = Publisher('demo')
    >>> p.call(lambda x: x + 1, 41).result()
    42
    >>> p.stop()
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], int | None], Future] | None] = \
            queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, future = call
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)

    def call(self, fn: Callable[[StagedT], int | None], arg: StagedT) -> Future[int | None]:
        """Run `fn(arg)` on the publisher's thread, after the calls before it."""
        future: Future[int | None] = Future()
        self._calls.put((functools.partial(fn, arg), future))
        return future

    def stop(self) -> None:
        """End the thread once the calls already queued have run."""
        self._calls.put(None)


@dataclasses.dataclass(frozen=True)
class Publishing(Generic[StagedT]):
    """A job whose staged generation the `Publisher` is publishing; `begun`: how many
    attempts callers had asked the pipeline for when this one began."""

    job: Job
    staged: StagedT
    outcome: Future[int | None]
    begun: int = 0


__all__ = ['Committer', 'Job', 'Publisher', 'Publishing']
