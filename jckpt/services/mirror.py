"""The asynchronous durable mirror: keep a checkpoint file in step with training, in the background.

``submit(tree)`` copies the tree to host memory into a free snapshot slot and
returns; in the background, snapshots are encoded and written one after
another, in order, each under a temporary name (``<path>.jckpt-next.<n>``),
then fsynced, renamed over the file and the directory fsynced, writing the
next snapshot while the previous one is being persisted. Training blocks
only for the copy. The counters say at any moment how much of the work is
durable:

>>> import tempfile, os, numpy as np
>>> path = os.path.join(tempfile.mkdtemp(), 'run.jckpt')
>>> with Mirror(path) as m:
...     _ = m.submit({'w': np.ones(3, np.float32)})
...     _ = m.submit({'w': np.ones(3, np.float32)})      # same content: no new generation
...     _ = m.submit({'w': np.zeros(3, np.float32)})
...     _ = m.wait_durable()
...     print(m.counters)
memory mirror: committed 3 durable 3 generation 2 pending 0 error 0

The file is an ordinary checkpoint (``jckpt.restore`` reads it at any time
and always sees a complete generation); its metadata records the mirror's
lineage (``jckpt.lineage``) and generation (``jckpt.generation``).

Guarantees:

* A slot is reused only once its snapshot is durable (or found identical to
  the last durable generation), so a later buffer donation or update cannot
  corrupt a snapshot, and admitted work is never dropped while the mirror is
  open.
* A disk error keeps the snapshot and retries it every ``retry_after``
  seconds; the error shows in the counters, and is raised by
  :meth:`Mirror.wait_durable`, :meth:`Mirror.close` and a blocked
  :meth:`Mirror.submit` once ``patience`` attempts in a row have failed.
* One writer per path: a second mirror on the same path, in this or another
  process, is refused with :class:`~jckpt.errors.InUseError`.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import errno as errno_mod
import logging
import os
import queue
import re
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from jckpt.api.context import Context
from jckpt.errors import CapacityError, CheckpointError, InputError, LineageError
from jckpt.format import payload as payload_mod
from jckpt.format import precs
from jckpt.format.header import Entry, Header, KeyPath, path_name
from jckpt.format.layout import lay_out
from jckpt.format.names import GENERATION_KEY, LINEAGE_KEY, NEXT_TAG, RESERVED_PREFIX
from jckpt.storage.lease import WriterLease
from jckpt.storage.publish import fsync_dir, reclaim_staging, storage_error
from jckpt.storage.writer import Sink, write_checkpoint
from jckpt.trees import placement
from jckpt.trees import pytree as tree_mod
from jckpt.version import __version__

log = logging.getLogger('jckpt')


Item = tuple[str, KeyPath, np.ndarray, 'str | None']  # namespace, path, host array, key_impl


# --- counters ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MirrorCounters:
    """A consistent reading of a mirror's progress; ``str()`` is the one-line summary.

    Attributes:
      committed: snapshots accepted by ``submit`` so far.
      durable: the number (1-based, in submit order) of the last accepted
        snapshot that is now synchronized on disk (or found identical to it).
      generation: the generation number in the file (0: none written yet).
      pending: slots whose snapshot is waiting to be written or being written.
      error: ``0``, or the last persistence error while it is unrecovered, as an
        errno name (``"ENOSPC"``) or the error's class name.
      failures: failed write attempts since the mirror opened.
      last_error: the message of the most recent failure, kept after recovery.
      stalls: submits that had to wait for a free slot (the disk is not keeping up).
    """

    committed: int = 0
    durable: int = 0
    generation: int = 0
    pending: int = 0
    error: int | str = 0
    failures: int = 0
    last_error: str | None = None
    stalls: int = 0

    def __str__(self) -> str:
        return (f"memory mirror: committed {self.committed} durable {self.durable} "
                f"generation {self.generation} pending {self.pending} error {self.error}")


def _error_code(exc: BaseException) -> str:
    code = getattr(exc, 'errno', None)
    if isinstance(code, int) and code in errno_mod.errorcode:
        return errno_mod.errorcode[code]
    return type(exc).__name__


# --- snapshots ---------------------------------------------------------------

def _on_cpu(leaf: jax.Array) -> bool:
    try:
        return all(d.platform == 'cpu' for d in leaf.sharding.device_set)
    except Exception:
        return True


class Slot:
    """One snapshot's worth of host buffers, reused from snapshot to snapshot."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.buffers: list[np.ndarray] = []

    def fill(self, leaves: Sequence[tuple[str, KeyPath, Any]]) -> list[Item]:
        """Copy every leaf into this slot's buffers (device-to-host for JAX arrays).

        All device transfers are started before any is awaited. A leaf that
        lives on an accelerator is adopted as the private host copy its
        transfer made; a CPU or numpy leaf (which may alias memory the caller
        will reuse) is copied into the slot's buffer of its shape.
        """
        placement.start_host_copies([leaf for _, _, leaf in leaves])
        items: list[Item] = []
        buffers: list[np.ndarray] = []
        for i, (namespace, path, leaf) in enumerate(leaves):
            where = f"{namespace}/{path_name(path) or '<root>'}"
            source = jax.random.key_data(leaf) if placement.is_prng_key(leaf) else leaf
            host, key_impl = placement.to_host(leaf, where)
            if isinstance(source, jax.Array) and not _on_cpu(source):
                array = host
            else:
                buf = self.buffers[i] if i < len(self.buffers) else None
                if (buf is None or buf.shape != host.shape or buf.dtype != host.dtype
                        or not buf.flags.writeable):
                    buf = np.empty(host.shape, host.dtype)
                np.copyto(buf, host)
                array = buf
            buffers.append(array)
            items.append((namespace, path, array, key_impl))
        self.buffers = buffers
        return items


@dataclasses.dataclass(frozen=True)
class _HashedSource:
    """A slot array whose checksum is already known: streamed without hashing again."""

    array: np.ndarray
    checksum: tuple[str, str]

    def write(self, sink: Sink) -> tuple[str, str]:
        for chunk in payload_mod.iter_payload_chunks(self.array):
            sink.write(chunk)
        return self.checksum


def _array_checksum(array: np.ndarray) -> tuple[str, str]:
    hasher = payload_mod.new_hasher()
    for chunk in payload_mod.iter_payload_chunks(array):
        hasher.update(chunk)
    return payload_mod.hasher_checksum(hasher)


def build_entries(items: Sequence[Item]) -> tuple[list[Entry], list[_HashedSource]]:
    """Entries (with checksums, ids per namespace in order) and payload sources for ``items``."""
    next_ids: dict[str, int] = {}
    entries, sources = [], []
    for namespace, path, array, key_impl in items:
        ident = next_ids.get(namespace, 0)
        next_ids[namespace] = ident + 1
        sum_ = _array_checksum(array)
        entries.append(Entry(id=ident, namespace=namespace, prec=precs.prec_of(array.dtype),
                             dims=tuple(array.shape), offset=0, byte_length=array.nbytes,
                             label=tuple(str(v) for _, v in path), path=path,
                             checksum=sum_, key_impl=key_impl))
        sources.append(_HashedSource(array, sum_))
    return entries, sources


def content_digest(entries: Sequence[Entry], metadata: Mapping[str, str]) -> tuple:
    """What makes two generations equal: entries' identity, type, shape, checksum, user metadata."""
    return (tuple((e.namespace, e.path, e.prec, e.dims, e.key_impl, e.checksum) for e in entries),
            tuple(sorted((k, v) for k, v in metadata.items() if not k.startswith(RESERVED_PREFIX))))


def write_items(target: str, entries: Sequence[Entry], sources: Sequence[_HashedSource], *,
                metadata: Mapping[str, str], ctx: Context) -> Header:
    """Lay out and publish a file of already-host arrays (atomically; durably per ``ctx``)."""
    header = lay_out(Header(tensors=tuple(entries), alignment=ctx.alignment,
                            writer=f"jckpt {__version__}", metadata=tuple(metadata.items())))
    return write_checkpoint(target, header, sources, durable=ctx.durable)


def stage_items(temporary: str, target: str, entries: Sequence[Entry],
                sources: Sequence[_HashedSource], *, metadata: Mapping[str, str],
                ctx: Context) -> None:
    """Write a generation of ``target`` under ``temporary``, not yet durable (errors name ``target``)."""
    try:
        write_items(temporary, entries, sources, metadata=metadata, ctx=ctx.replace(durable=False))
    except CheckpointError as e:
        e.file = target
        raise


def check_metadata(metadata: Mapping[str, str] | None, where: str) -> dict[str, str]:
    """User metadata as a dict of strings, refusing the reserved ``jckpt.`` keys."""
    out: dict[str, str] = {}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InputError(f"metadata must map strings to strings, not {k!r}: {v!r}",
                             file=where, fix="convert values with str() or json.dumps()")
        if k.startswith(RESERVED_PREFIX):
            raise InputError(f"metadata key {k!r} is reserved", file=where,
                             fix=f"use a key that does not start with {RESERVED_PREFIX!r}")
        out[k] = v
    return out


# --- the background pipeline -------------------------------------------------

@dataclasses.dataclass
class Job:
    """One admitted snapshot: its number, slot, host arrays and what the committer needs."""

    seq: int
    slot: Slot
    items: list[Item]
    metadata: dict[str, str]
    info: Any = None
    cache: dict = dataclasses.field(default_factory=dict)


_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:  # pragma: no cover - exercised by interpreter shutdown
    for writer in list(_OPEN):
        try:
            writer.close()
        except Exception as e:
            log.error("jckpt: snapshots not made durable at exit: %s", e)


class Committer(Protocol):
    """How a pipeline makes one job durable, in two stages that overlap across jobs.

    ``stage`` writes the job's file under a temporary name without waiting
    for the disk; ``publish`` makes it durable (fsync, rename into place,
    directory fsync) and returns the generation it produced, or ``None``.
    While job N is being published, job N+1 is staged. After a failure the
    pipeline calls ``discard`` on anything staged but not published, then
    ``rollback`` so the next ``stage`` starts from the last published state.
    """

    def stage(self, job: Job) -> Any: ...

    def publish(self, staged: Any) -> int | None: ...

    def discard(self, staged: Any) -> None: ...

    def rollback(self) -> None: ...


class _Helper:
    """A daemon thread that runs one call at a time and hands back its outcome."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, arg, done, out = self._calls.get()
            try:
                out.append((True, fn(arg)))
            except BaseException as e:
                out.append((False, e))
            done.set()

    def call(self, fn: Callable[[Any], Any], arg: Any) -> Callable[[], tuple[bool, Any]]:
        done, out = threading.Event(), []
        self._calls.put((fn, arg, done, out))

        def result() -> tuple[bool, Any]:
            done.wait()
            return out[0]

        return result

    def stop(self) -> None:
        self._calls.put((_exit_thread, None, threading.Event(), []))


def _exit_thread(_: Any) -> None:
    raise SystemExit


class Pipeline:
    """Slots, a FIFO of admitted jobs, and a writer that makes them durable in order.

    The writer thread stages each job (:class:`Committer`) while a helper
    thread publishes the one before it, so writing a snapshot overlaps with
    waiting for the disk to persist the previous one. A failure keeps the job
    and retries it after ``retry_after`` seconds.
    """

    def __init__(self, name: str, commit: Committer, *, slots: int = 2,
                 when_full: str = 'block', retry_after: float = 1.0, patience: int = 3,
                 generation: int = 0) -> None:
        if not isinstance(slots, int) or slots < 1:
            raise InputError(f"slots must be a positive integer, not {slots!r}")
        if when_full not in ('block', 'raise'):
            raise InputError(f"when_full must be 'block' or 'raise', not {when_full!r}")
        if not retry_after >= 0:
            raise InputError(f"retry_after must be >= 0 seconds, not {retry_after!r}")
        if not isinstance(patience, int) or patience < 1:
            raise InputError(f"patience must be a positive integer, not {patience!r}")
        self.name = name
        self._commit = commit
        self.when_full = when_full
        self.retry_after = float(retry_after)
        self.patience = patience
        self._cond = threading.Condition()
        self._submit_lock = threading.Lock()
        self._free: collections.deque[Slot] = collections.deque(Slot(i) for i in range(slots))
        self._queue: collections.deque[Job] = collections.deque()
        self._committed = 0
        self._durable = 0
        self._generation = generation
        self._error: BaseException | None = None
        self._streak = 0
        self._failures = 0
        self._last_error: str | None = None
        self._stalls = 0
        self._closing = False
        self._closed = False
        self._helper = _Helper(f"jckpt-publisher {name}")
        self._thread = threading.Thread(target=self._run, name=f"jckpt-writer {name}", daemon=True)
        self._thread.start()
        # Flushed at interpreter exit if left open: the owner (mirror, manager) when it closes.
        self._owner = commit if callable(getattr(commit, 'close', None)) else self
        _OPEN.add(self._owner)

    # The caller's side.

    def counters(self) -> MirrorCounters:
        with self._cond:
            return MirrorCounters(committed=self._committed, durable=self._durable,
                                  generation=self._generation, pending=len(self._queue),
                                  error=_error_code(self._error) if self._error is not None else 0,
                                  failures=self._failures, last_error=self._last_error,
                                  stalls=self._stalls)

    def _given_up(self) -> BaseException | None:
        return self._error if self._error is not None and self._streak >= self.patience else None

    def admit(self, leaves: Sequence[tuple[str, KeyPath, Any]], metadata: dict[str, str],
              info: Any = None, timeout: float | None = None) -> int:
        """Copy ``leaves`` into a free slot and queue them; return the snapshot's number."""
        with self._submit_lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            with self._cond:
                stalled = False
                while True:
                    if self._closing:
                        raise CheckpointError("the writer is closed", file=self.name,
                                              fix="open a new one")
                    if self._free:
                        slot = self._free.popleft()
                        break
                    failed = self._given_up()
                    if failed is not None:
                        raise failed
                    if self.when_full == 'raise':
                        raise CapacityError(f"all {len(self._queue)} snapshot slots are still "
                                            "being written", file=self.name,
                                            fix="submit less often, add slots, or use "
                                                "when_full='block'")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise CapacityError("timed out waiting for a free snapshot slot",
                                            file=self.name, fix="wait longer or add slots")
                    if not stalled:
                        stalled = True
                        self._stalls += 1
                    self._cond.wait(remaining)
            try:
                items = slot.fill(leaves)
            except BaseException:
                with self._cond:
                    self._free.appendleft(slot)
                    self._cond.notify_all()
                raise
            with self._cond:
                self._committed += 1
                job = Job(self._committed, slot, items, metadata, info)
                self._queue.append(job)
                self._cond.notify_all()
                return job.seq

    def run_now(self, write: Callable[[int], None]) -> int:
        """Run ``write(generation)`` in the caller's thread, after everything admitted is durable.

        For saves that cannot be snapshotted into a slot (a multi-process save
        with barriers): counted like a snapshot, its failure raised at once.
        """
        with self._submit_lock:
            self.wait()
            with self._cond:
                if self._closing:
                    raise CheckpointError("the writer is closed", file=self.name,
                                          fix="open a new one")
                generation = self._generation + 1
            try:
                write(generation)
            except BaseException as e:
                with self._cond:
                    self._failures += 1
                    self._last_error = str(e)
                raise
            with self._cond:
                self._committed += 1
                self._durable = self._committed
                self._generation = generation
                self._cond.notify_all()
                return self._committed

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every admitted snapshot is durable; False on timeout.

        Raises the persistence error once ``patience`` attempts in a row failed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            goal = self._committed
            while self._durable < goal:
                failed = self._given_up()
                if failed is not None:
                    raise failed
                if not self._thread.is_alive():
                    raise CheckpointError("the background writer stopped", file=self.name)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def close(self, timeout: float | None = None) -> None:
        """Make everything durable, stop the writer; raise what could not be persisted."""
        if self._closed:
            return
        try:
            if not self.wait(timeout):
                n = self.counters().pending
                raise CheckpointError(f"close timed out with {n} snapshot(s) not yet durable",
                                      file=self.name, fix="close with a longer timeout")
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            if self._thread is not threading.current_thread():
                self._thread.join()
            self._closed = True
            _OPEN.discard(self._owner)

    # The writer's side.

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._helper.stop()

    def _loop(self) -> None:
        c = self._commit
        inflight = None  # (job, staged, result): being published by the helper
        while True:
            with self._cond:
                if self._closing and inflight is None:
                    return
                index = 0 if inflight is None else 1  # the job after the one in flight
                while len(self._queue) <= index and inflight is None and not self._closing:
                    self._cond.wait()
                if self._closing and inflight is None:
                    return
                job = (self._queue[index] if len(self._queue) > index and not self._closing
                       else None)
            staged, failure = None, None
            if job is not None:
                try:
                    staged = c.stage(job)
                except BaseException as e:
                    failure = e
            if inflight is not None:
                done_job, done_staged, result = inflight
                inflight = None
                ok, value = result()
                if ok:
                    self._completed(done_job, value)
                else:
                    if job is not None and failure is None:
                        _quietly(c.discard, staged)
                    _quietly(c.discard, done_staged)
                    _quietly(c.rollback)
                    self._failed(value)
                    continue
            if failure is not None:
                _quietly(c.rollback)
                self._failed(failure)
                continue
            if job is not None:
                inflight = (job, staged, self._helper.call(c.publish, staged))

    def _completed(self, job: Job, generation: int | None) -> None:
        with self._cond:
            self._queue.popleft()
            self._durable = job.seq
            if generation is not None:
                self._generation = generation
            self._error = None
            self._streak = 0
            job.items = []
            job.cache.clear()
            self._free.append(job.slot)
            self._cond.notify_all()

    def _failed(self, e: BaseException) -> None:
        """Record a failure and wait ``retry_after`` seconds (the job stays first in line)."""
        with self._cond:
            self._error = e
            self._streak += 1
            self._failures += 1
            self._last_error = str(e)
            self._cond.notify_all()
            log.warning("jckpt: writing %s failed (attempt %d, retrying in %.3g s): %s",
                        self.name, self._streak, self.retry_after, e)
            if not self._closing:
                self._cond.wait(self.retry_after)


def _quietly(fn: Callable, *args: Any) -> None:
    try:
        fn(*args)
    except Exception as e:  # cleanup must not mask the failure being handled
        log.debug("jckpt: cleanup failed: %s", e)


def finish_staged(temporary: str, target: str, *, durable: bool) -> None:
    """fsync ``temporary``, rename it over ``target``, fsync the directory."""
    try:
        if durable:
            fd = os.open(temporary, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.rename(temporary, target)
        if durable:
            fsync_dir(os.path.dirname(os.path.abspath(target)))
    except OSError as e:
        raise storage_error(e, "publishing the checkpoint", target) from e




def next_name(target: str, seq: int) -> str:
    """The temporary name a snapshot is staged under before it is made durable."""
    return f"{target}{NEXT_TAG}{seq}"


def remove_staged(target: str) -> list[str]:
    """Remove what a writer of ``target`` that died left staged; return the names.

    That is its generations written but not made durable (``<target>.jckpt-next.<n>``)
    and the staging files of those (reclaimed as :func:`reclaim_staging` does).
    """
    directory = os.path.dirname(os.path.abspath(target))
    pattern = re.compile(re.escape(os.path.basename(target)) + re.escape(NEXT_TAG) + r'([0-9]+)')
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    temporaries = set()
    for name in names:
        m = pattern.match(name)
        if m is None:
            continue
        temporary = os.path.join(directory, m.group(0))
        temporaries.add(temporary)
        if m.end() == len(name):
            try:
                os.unlink(temporary)
                removed.append(name)
            except OSError:
                pass
    for temporary in sorted(temporaries):
        removed.extend(os.path.basename(p) for p in reclaim_staging(temporary))
    return removed


@dataclasses.dataclass(frozen=True)
class Staged:
    """A generation written under a temporary name (``path`` None: nothing to write)."""

    path: str | None
    generation: int | None = None
    digest: tuple | None = None
    info: Any = None


# --- the mirror --------------------------------------------------------------

class Mirror:
    """Keep the checkpoint file ``path`` in step with submitted trees, in the background.

    Args:
      path: the checkpoint file (replaced atomically by each new generation).
      ctx: namespace, alignment and durability of the file (default ``Context()``).
      lineage: this run's lineage name. ``None`` continues the file's lineage
        (or starts a random one for a new file).
      new_lineage: start a new lineage (generation 1) even if the file holds
        another one; without it, a file of another lineage, or one not written
        by a mirror, is refused with :class:`~jckpt.errors.LineageError`.
      slots: snapshot slots (each holds one whole snapshot; default 2).
      when_full: ``'block'`` (default) waits for a slot when every one is
        pending; ``'raise'`` refuses with :class:`~jckpt.errors.CapacityError`.
      retry_after: seconds between attempts after a disk error (default 1).
      patience: failed attempts in a row after which waiting callers get the error.

    Raises :class:`~jckpt.errors.InUseError` if another mirror holds ``path``.

    Example::

        with jckpt.Mirror("run.jckpt") as mirror:
            for step in range(steps):
                state = train_step(state)
                mirror.submit(state, metadata={"step": str(step)})
                print(mirror.counters)
    """

    def __init__(self, path: str | os.PathLike, *, ctx: Context | None = None,
                 lineage: str | None = None, new_lineage: bool = False, slots: int = 2,
                 when_full: str = 'block', retry_after: float = 1.0, patience: int = 3) -> None:
        self.path = os.fspath(path)
        self.ctx = ctx if ctx is not None else Context()
        if lineage is not None and (not isinstance(lineage, str) or not lineage):
            raise InputError(f"lineage must be a non-empty string, not {lineage!r}", file=self.path)
        self._lease = WriterLease(self.path)
        try:
            self.lineage, generation, digest = _open_lineage(self.path, lineage, new_lineage)
            remove_staged(self.path)
            self._published = self._staged = (generation, digest)
            self._pipeline = Pipeline(self.path, self, slots=slots, when_full=when_full,
                                      retry_after=retry_after, patience=patience,
                                      generation=generation)
        except BaseException:
            self._lease.release()
            raise

    @property
    def counters(self) -> MirrorCounters:
        """The current counters (``print(mirror.counters)`` gives the one-line summary)."""
        return self._pipeline.counters()

    def submit(self, tree: Any, *, metadata: Mapping[str, str] | None = None,
               timeout: float | None = None) -> int:
        """Snapshot ``tree`` to host memory and queue it; return its number (1, 2, ...).

        Blocks only for the device-to-host copy, and for a free slot when every
        slot is pending (or raises :class:`~jckpt.errors.CapacityError` with
        ``when_full='raise'``, or after ``timeout`` seconds). Once it returns,
        the caller may donate or overwrite the arrays.
        """
        meta = check_metadata(metadata, self.path)
        namespace = self.ctx.namespace
        leaves = [(namespace, p, leaf) for p, leaf in tree_mod.flatten(tree)]
        return self._pipeline.admit(leaves, meta, timeout=timeout)

    def wait_durable(self, timeout: float | None = None) -> bool:
        """Wait until every submitted snapshot is on disk; ``False`` if ``timeout`` passed first.

        Raises the persistence error (a :class:`~jckpt.errors.StorageError`)
        once ``patience`` attempts in a row have failed.
        """
        return self._pipeline.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Make every snapshot durable, stop the writer and release the path (idempotent)."""
        try:
            self._pipeline.close(timeout)
        finally:
            self._lease.release()

    def __enter__(self) -> Mirror:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # do not hide the exception that ended the block
            log.error("jckpt: closing the mirror of %s after an error: %s", self.path, e)

    def __repr__(self) -> str:
        return f"Mirror({self.path!r}, lineage={self.lineage!r}, {self.counters})"

    # The two stages the pipeline runs (see Committer).

    def stage(self, job: Job) -> Staged:
        if 'entries' not in job.cache:
            job.cache['entries'], job.cache['sources'] = build_entries(job.items)
        entries, sources = job.cache['entries'], job.cache['sources']
        digest = content_digest(entries, job.metadata)
        last_generation, last_digest = self._staged
        if digest == last_digest:
            return Staged(None)
        generation = last_generation + 1
        meta = dict(job.metadata)
        meta[LINEAGE_KEY] = self.lineage
        meta[GENERATION_KEY] = str(generation)
        temporary = next_name(self.path, job.seq)
        stage_items(temporary, self.path, entries, sources, metadata=meta, ctx=self.ctx)
        self._staged = (generation, digest)
        return Staged(temporary, generation, digest)

    def publish(self, staged: Staged) -> int | None:
        if staged.path is None:
            return None
        finish_staged(staged.path, self.path, durable=self.ctx.durable)
        self._published = (staged.generation, staged.digest)
        return staged.generation

    def discard(self, staged: Staged | None) -> None:
        if staged is not None and staged.path is not None:
            try:
                os.unlink(staged.path)
            except FileNotFoundError:
                pass

    def rollback(self) -> None:
        self._staged = self._published


def _open_lineage(path: str, lineage: str | None, new_lineage: bool) -> tuple[str, int, tuple | None]:
    """``(lineage, generation, digest of the file's content)`` for a mirror opening ``path``."""
    if not os.path.exists(path) or new_lineage:
        return lineage or uuid.uuid4().hex, 0, None
    from jckpt.storage.reader import CheckpointReader

    header = CheckpointReader(path).header
    meta = header.metadata_dict()
    found = meta.get(LINEAGE_KEY)
    if found is None:
        raise LineageError("the file was not written by a mirror (it has no lineage)", file=path,
                           fix="pass new_lineage=True to start a new lineage over it, "
                               "or mirror to another path")
    if lineage is not None and lineage != found:
        raise LineageError(f"the file belongs to lineage {found!r}, not {lineage!r}", file=path,
                           fix=f"pass lineage={found!r} to continue it, or new_lineage=True "
                               "to start a new one over it")
    try:
        generation = int(meta.get(GENERATION_KEY, '0'))
    except ValueError:
        raise LineageError(f"unreadable generation {meta.get(GENERATION_KEY)!r}", file=path,
                           fix="pass new_lineage=True to start a new lineage") from None
    return found, generation, content_digest(header.tensors, meta)


__all__ = ['Mirror', 'MirrorCounters']
