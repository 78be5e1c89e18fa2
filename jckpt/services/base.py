"""What the mirror and the checkpoint manager share: one background writer of staged generations.

`BackgroundWriter` takes the writer lease on its path from the path's
storage backend (`jckpt.storage.backend_for`), clears what a
writer that died left there, applies the lineage rule
(`jckpt.services.lineage`) to the checkpoint it finds, and runs a
`Pipeline` whose two stages it implements: each
admitted snapshot is written as the next generation of its target under a
temporary name, then made durable and renamed into place
(`jckpt.storage.staging`). A subclass says only what differs: where the
latest checkpoint is (`BackgroundWriter._recover`), where a snapshot
goes (`BackgroundWriter._target`), what follows a publish, and whether
a snapshot equal to the last generation is skipped (the mirror) or written
(the manager, one file per step).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import ClassVar, Generic, Self, TypeVar

from jckpt import api
from jckpt.api.context import Context, check_context, check_flag
from jckpt.format.names import GENERATION_KEY, LINEAGE_KEY
from jckpt.services.engine import Job, MirrorCounters, Pipeline
from jckpt.services.lineage import Holder, check_name, open_lineage
from jckpt.services.snapshot import Digest, Leaf, content_digest
from jckpt.storage import staging
from jckpt.storage.backend import Backend
from jckpt.storage.lease import refuse_if_held

log = logging.getLogger('jckpt')

InfoT = TypeVar('InfoT')


@dataclasses.dataclass(frozen=True)
class Staged(Generic[InfoT]):
    """A generation of `target` written under `temporary` (`None`: equal content, nothing to write)."""

    temporary: str | None
    target: str
    generation: int
    digest: Digest | None
    info: InfoT


@dataclasses.dataclass(frozen=True)
class _Head:
    """The last generation staged or published, and its content (`None`: not known)."""

    generation: int
    digest: Digest | None = None


class BackgroundWriter(Generic[InfoT]):
    """The lease, lineage, pipeline and two-stage commit shared by the mirror and the manager.

    Subclasses set the class attributes, implement `_recover` and
    `_target`, and call `__init__` once their own fields are set,
    passing `backend`, the storage backend of their path (which they get
    from `backend_for` before touching anything). `lease=None` opens a reader instead:
    no lease, no writer thread; `_recover` finds the latest checkpoint and removes nothing.
    """

    #: How lineage errors name the checkpoint found.
    _holder: ClassVar[Holder]
    #: What log messages call the writer (``'mirror'``, ``'manager'``).
    _kind: ClassVar[str]
    #: How a full writer's `CapacityError` (`when_full='raise'`) tells the user to call less often.
    _less_often: ClassVar[str] = 'submit less often'
    #: Skip a snapshot whose content equals the last generation's.
    _dedupe: ClassVar[bool] = False

    def __init__(self, name: str, *, backend: Backend, lease: str | None, ctx: Context | None,
                 lineage: str | None, new_lineage: bool, slots: int, when_full: str,
                 retry_after: float, patience: int, device_image_bytes: int | None = None,
                 rivals: Sequence[str] = ()) -> None:
        self.ctx = check_context(ctx) if ctx is not None else Context()
        self.backend = backend
        check_name(lineage, name)
        check_flag(new_lineage, 'new_lineage', name, optional=False)
        self._name = name
        if lease is None:  # a reader: no lease, no writer thread, nothing written or removed
            self._lease, self._pipeline, self._lineage_asked = None, None, lineage
            self.lineage = self._follow(lineage)
            return
        held, failure = None, None
        try:
            held = backend.lease(lease)
            refuse_if_held(rivals, file=name)  # before recovery touches anything there
        except Exception as e:
            failure = e
        try:
            self._opened(failure)
            assert held is not None
            self._lease = held
            latest = self._recover()
            found, digest = None, None
            if latest is not None and not new_lineage:
                found, digest = self._describe(latest)
            opened = open_lineage(found, file=latest or name, lineage=lineage,
                                  new_lineage=new_lineage, holder=self._holder)
            self.lineage = opened.name
            self._staged = self._published = _Head(opened.generation, digest)
            self._pipeline: Pipeline[InfoT, Staged[InfoT]] = Pipeline(
                name, _Stages(self), slots=slots, when_full=when_full, retry_after=retry_after,
                patience=patience, generation=opened.generation, owner=self,
                image_bytes=device_image_bytes, less_often=self._less_often)
        except BaseException:
            if held is not None:
                held.release()
            raise

    def _follow(self, lineage: str | None = None) -> str | None:
        """A reader's look at the path (`_recover`, which then removes nothing): the latest
        checkpoint's lineage (None: none there, or one without), which must be `lineage` if given."""
        latest = self._recover()
        found = None if latest is None else self._describe(latest)[0]
        if found is None or lineage is None:
            return lineage if found is None else found.get(LINEAGE_KEY)
        return open_lineage(found, file=latest, lineage=lineage, new_lineage=False,
                            holder=self._holder).name

    # What a subclass says.

    def _opened(self, failure: BaseException | None) -> None:
        """Raise `failure`, met taking the lease (default); a writer of several processes
        raises in every one what any of them met (`jckpt.api.agreement.agree`)."""
        if failure is not None:
            raise failure

    def _recover(self) -> str | None:
        """Clear what a writer that died left; return the latest durable checkpoint, if any."""
        raise NotImplementedError

    def _target(self, info: InfoT) -> str:
        """The path the generation of a job with `info` is published to."""
        raise NotImplementedError

    def _describe(self, path: str) -> tuple[dict[str, str], Digest | None]:
        """The metadata and content digest of the checkpoint at `path` (the latest one)."""
        header = api.describe(path)
        found = header.metadata_dict()
        return found, content_digest(header.tensors, found)

    def _write_staged(self, temporary: str, target: str, job: Job[InfoT],
                      metadata: Mapping[str, str]) -> None:
        """Write `job` under `temporary` with `metadata` (default: one jckpt file)."""
        entries, sources = job.built
        staging.stage_items(temporary, target, entries, sources, metadata=metadata,
                            alignment=self.ctx.alignment)

    def _finish_staged(self, staged: Staged[InfoT]) -> None:
        """Make `staged.temporary` durable and rename it to its target."""
        staging.finish_staged(staged.temporary, staged.target, durable=self.ctx.durable)

    def _discard_staged(self, staged: Staged[InfoT]) -> None:
        """Remove `staged.temporary`."""
        staging.discard_staged(staged.temporary)

    def _on_published(self, staged: Staged[InfoT]) -> None:
        """Called once `staged` is durable (on the publishing thread)."""

    def _on_close(self) -> None:
        """Called when the writer closes, after the lease is released."""

    # The public surface.

    @property
    def counters(self) -> MirrorCounters:
        """The current counters (`print(writer.counters)` gives the one-line summary).

        `generation` counts the checkpoints written in this lineage (a reader's are all 0).
        """
        return MirrorCounters() if self._pipeline is None else self._pipeline.counters()

    def wait_durable(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted is on disk; `False` if `timeout` passed first.

        Raises the persistence error (a `StorageError`) once `patience` attempts in a row
        have failed, once: the next call makes the writer try again at once and raises only
        the failure of an attempt begun after it (so it returns normally once the disk has
        room again). Raises, once, the `InputError` of a snapshot dropped since the last call.
        A reader has nothing to wait for.
        """
        return True if self._pipeline is None else self._pipeline.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Make everything submitted durable, stop the writer and release the path (idempotent).

        Past `timeout`, a `CheckpointError` says so and nothing is closed: the writer goes on
        writing under its lease, and the next `close()` waits for the rest.
        """
        if self._pipeline is None or self._lease is None:  # a reader holds nothing
            self._on_close()
            return
        try:
            self._pipeline.close(timeout)
        finally:
            if self._pipeline.closed:  # one that timed out still writes, under the lease
                self._lease.release()
                self._on_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # do not hide the exception that ended the block
            log.error("closing the %s of %s after an error: %s", self._kind, self._name, e)

    # The two stages the pipeline runs (see jckpt.services.engine.Committer).

    def _stamped(self, metadata: Mapping[str, str], generation: int) -> dict[str, str]:
        """`metadata` with this writer's lineage and `generation` added."""
        return {**metadata, LINEAGE_KEY: self.lineage, GENERATION_KEY: str(generation)}

    def _mark_published(self, generation: int) -> None:
        """Record a generation written outside the pipeline's stages (`Pipeline.run_now`)."""
        self._staged = self._published = _Head(generation)

    def _admit(self, leaves: Sequence[Leaf], metadata: Mapping[str, str], info: InfoT,
               timeout: float | None) -> int:
        """Take a snapshot into the pipeline; `InUseError` once the lease is lost."""
        self._lease.check()
        return self._pipeline.admit(leaves, metadata, info, timeout=timeout)

    def _stage(self, job: Job[InfoT]) -> Staged[InfoT]:
        """Write the job's generation under a temporary name, not yet durable."""
        self._lease.check()  # a writer whose lease was taken over writes nothing more
        entries, _ = job.built
        digest = content_digest(entries, job.metadata)
        target = self._target(job.info)
        if self._dedupe and digest == self._staged.digest:
            return Staged(None, target, self._staged.generation, digest, job.info)
        generation = self._staged.generation + 1
        temporary = staging.next_name(target, job.seq)
        self._write_staged(temporary, target, job, self._stamped(job.metadata, generation))
        self._staged = _Head(generation, digest)
        return Staged(temporary, target, generation, digest, job.info)

    def _publish(self, staged: Staged[InfoT]) -> int | None:
        """Make a staged generation durable and put it in place; its number (`None`: none written)."""
        if staged.temporary is None:
            return None
        self._lease.check()  # nor publishes (nor deletes, by retention) what it staged
        self._finish_staged(staged)
        self._published = _Head(staged.generation, staged.digest)
        self._on_published(staged)
        return staged.generation

    def _discard(self, staged: Staged[InfoT]) -> None:
        """Remove a staged generation that will not be published."""
        if staged.temporary is not None:
            self._discard_staged(staged)

    def _rollback(self) -> None:
        """Stage the next job from the last published generation again."""
        self._staged = self._published


@dataclasses.dataclass(frozen=True)
class _Stages(Generic[InfoT]):
    """A writer's two stages as the pipeline's `Committer`: kept off the mirror's and the
    manager's own surface, which users see."""

    writer: BackgroundWriter[InfoT]

    def stage(self, job: Job[InfoT]) -> Staged[InfoT]:
        return self.writer._stage(job)

    def publish(self, staged: Staged[InfoT]) -> int | None:
        return self.writer._publish(staged)

    def discard(self, staged: Staged[InfoT]) -> None:
        self.writer._discard(staged)

    def rollback(self) -> None:
        self.writer._rollback()


__all__ = ['BackgroundWriter', 'Staged']
