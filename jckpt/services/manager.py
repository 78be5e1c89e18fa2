"""`CheckpointManager`: one checkpoint per training step in a directory, written in the background.

Each step is its own file, `step_00000100.jckpt` (or a directory of that name for a
multi-process save), published atomically; saves go through the mirror's machinery (a
snapshot in a free slot, then a background writer), so training blocks only for
taking the snapshot. Metrics and a `TrainerState` travel in the file's metadata.
With `options=CheckpointOptions(format="llmc")` (or another registered format) a
step is instead a directory whose model file another toolchain reads directly,
beside `optimizer.jckpt` and `trainer_state.json` (`jckpt.services.formats`).

>>> import tempfile, numpy as np
>>> d = tempfile.mkdtemp()
>>> with CheckpointManager(d, keep_last=2) as mgr:
...     for step in (10, 20, 30):
...         _ = mgr.save(step, {'w': np.full(3, step, np.float32)}, metrics={'loss': 1 / step})
...     _ = mgr.wait_durable()
...     print(mgr.all_steps(), mgr.latest_step())
...     print(mgr.restore(target={'w': np.zeros(3, np.float32)}).tree['w'])
[20, 30] 30
[30. 30. 30.]

Retention (`keep_last`, `keep_every`, `keep_best` by `best_metric`)
runs after each step is durable and never removes the latest durable step;
with no policy every step is kept. Staging files of a killed writer are
removed when the manager opens (`read_only=True`: a reader, which removes
nothing); a step file that cannot be read is ignored.
The steps share a lineage (`jckpt.services.lineage`): a directory whose
latest step belongs to another run, or records none, is refused unless
`new_lineage=True`.
This module is the writer's side; the queries and `restore` are the read side's
(`jckpt.services.restoring.StepReader`), which a reader and a writer share.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jckpt.api.agreement import agree, tell
from jckpt.api.context import Context, check_context, check_flag
from jckpt.api.meetings import SAVING, refused
from jckpt.api.multiprocess import save_directory
from jckpt.errors import InputError, StorageError, naming_file
from jckpt.format import strict_json
from jckpt.format.metadata import check_metadata
from jckpt.format.names import (
    METRICS_KEY,
    STEP_KEY,
    TRAINER_STATE_KEY,
    step_name,
)
from jckpt.services import formats, restoring, step_removal, steps
from jckpt.services.base import BackgroundWriter, Staged
from jckpt.services.engine import Job
from jckpt.services.formats import CheckpointLoadOptions, CheckpointOptions
from jckpt.services.lineage import MANAGER_STEP
from jckpt.services.preemption import Preemption
from jckpt.services.restoring import Restored, StepReader
from jckpt.services.retention import Retention, check_metrics, check_step
from jckpt.services.snapshot import Digest, empty_nodes_metadata, namespace_leaves
from jckpt.services.step_cache import StepCache
from jckpt.services.step_view import StepView
from jckpt.services.trainer_state import TrainerState
from jckpt.storage.backend import LOCAL, backend_for, checked_path
from jckpt.storage.lease import leases
from jckpt.storage.publish import fsync_dir, storage_error

log = logging.getLogger('jckpt')


@dataclasses.dataclass(frozen=True)
class _Step:
    """What a snapshot job carries for the manager: its step, metrics and how to write it.

    `model_namespace` is the namespace written as the model of a foreign-format step.
    """

    step: int
    metrics: Mapping[str, float]
    options: CheckpointOptions
    model_namespace: str


class CheckpointManager(StepReader, BackgroundWriter[_Step]):
    """Step checkpoints in `directory`: asynchronous saves, retention, restore, trainer state.

    Args:
      directory: where the steps live (created if missing; a reader creates none
        and refuses a missing one with `FormatError`).
      ctx: namespace, alignment, durability and placement (default `Context()`).
      keep_last: keep the last N steps.
      keep_every: keep every step that is a multiple of K.
      keep_best: keep the best N steps by `best_metric`.
      best_metric: the metric `keep_best` and `best_step` rank by.
      best_mode: `'min'` (default) or `'max'`.
      save_interval_steps: `save` writes only steps that are multiples of
        this (or when preemption is reached, or with `force=True`).
      asynchronous: write in the background (default); `False` makes
        `save` return only once the step is durable.
      slots: snapshot slots, as for `Mirror`.
      when_full: `'block'` or `'raise'` when every slot is pending, as for the mirror.
      retry_after: seconds before a failed write is retried, as for the mirror.
      patience: failed attempts in a row before the error is raised, as for the mirror.
      device_image_bytes: the most device memory one slot's snapshot image may take, as
        for the mirror.
      lineage: the lineage to continue, checked against the latest step (by a reader, at
        each `reload` too).
      new_lineage: start a new lineage even if the latest step has another or
        none; without it, such a step is refused with `LineageError`
        (`jckpt.services.lineage`, as for the mirror). Earlier steps stay and
        count for retention; new steps must be above them.
      handle_sigterm: where no JAX distributed client runs, treat SIGTERM as
        preemption (`reached_preemption` then says True).
      directory_steps: write each step as a multi-process directory checkpoint
        (`jckpt.api.multiprocess`), synchronously, from every process. Default:
        when `jax.process_count() > 1`. Only process 0 deletes old steps. `False`
        with several processes: this process's own steps (a directory of its own).
      options: how steps are written (`jckpt.CheckpointOptions`: one jckpt file, or a
        directory with the model in another format; see `jckpt.services.formats`);
        `save` may override it.
      load_options: how step directories are read (`jckpt.CheckpointLoadOptions`);
        `restore` may override it.
      read_only: read a directory another manager may be writing (an evaluation job's):
        no lease, nothing created or removed; `save` and retention are refused with
        `InputError`, and `reload` reads the steps published since.

    Only one manager may write a directory at a time (`InUseError` otherwise;
    any number may read it with `read_only=True`). A URL no storage backend
    serves is refused with `InputError` before anything is created.

    Example:
        ```python
        mgr = jckpt.CheckpointManager("ckpts", keep_last=3, save_interval_steps=100)
        start = 0
        if mgr.latest_step() is not None:  # resume after the last durable step
            r = mgr.restore(target=state)
            state, start = r.tree, r.step + 1
        for step in range(start, num_steps):
            state, loss = train_step(state)
            mgr.save(step, state, metrics={"loss": float(loss)},
                     trainer_state=jckpt.TrainerState(global_step=step))
        mgr.close()
        ```
    """

    _holder = MANAGER_STEP
    _kind = 'manager'
    _less_often = ("save less often (a larger save_interval_steps: save writes only where "
                   "should_save(step) is True, unless force=True)")

    def __init__(self, directory: str | os.PathLike, *, ctx: Context | None = None,
                 keep_last: int | None = None, keep_every: int | None = None,
                 keep_best: int | None = None, best_metric: str | None = None,
                 best_mode: str = 'min', save_interval_steps: int = 1, asynchronous: bool = True,
                 slots: int = 2, when_full: str = 'block', retry_after: float = 1.0,
                 patience: int = 3, lineage: str | None = None, new_lineage: bool = False,
                 handle_sigterm: bool = False, directory_steps: bool | None = None,
                 options: CheckpointOptions | None = None,
                 load_options: CheckpointLoadOptions | None = None,
                 device_image_bytes: int | None = None, read_only: bool = False) -> None:
        with restoring.refusing_open(directory, read_only, directory_steps):  # others: at once
            self.directory = checked_path(directory)
            self.read_only = check_flag(read_only, 'read_only', self.directory, optional=False)
            self.options = steps.checked(options, CheckpointOptions, 'options')
            self.load_options = steps.checked(load_options, CheckpointLoadOptions, 'load_options')
            backend = backend_for(self.directory)  # a URL is refused before the directory is made
            ctx = check_context(ctx) if ctx is not None else None  # so is a ctx that is not a Context
            self.process_index, self.process_count = jax.process_index(), jax.process_count()
            self.directory_steps = (self.process_count > 1 if directory_steps is None
                                    else bool(directory_steps))
            self._rank, self._ranks = ((self.process_index, self.process_count)  # who writes the steps
                                       if self.directory_steps else (0, 1))  # file steps: this process
            if not self.read_only:  # at open, not at the first save, hours of training later
                self.options.refuse_directory_steps(self.directory_steps, self.directory)
            self._retention = Retention(keep_last, keep_every, keep_best, best_metric, best_mode)
            if type(save_interval_steps) is not int or save_interval_steps < 1:  # a bool is no count
                raise InputError(f"save_interval_steps must be a positive integer, "
                                 f"not {save_interval_steps!r}")
            self.keep_last, self.keep_every, self.keep_best = keep_last, keep_every, keep_best
            self.best_metric, self.best_mode, self.save_interval_steps = (best_metric, best_mode,
                                                                          save_interval_steps)
            self.asynchronous = check_flag(asynchronous, 'asynchronous', self.directory, optional=False)
            if self.read_only:
                restoring.check_reader(backend, self.directory, (
                    ('keep_last', keep_last), ('keep_every', keep_every), ('keep_best', keep_best),
                    ('new_lineage', new_lineage), ('handle_sigterm', handle_sigterm)))
            elif backend is LOCAL:  # an object store's prefix needs no creating
                restoring.refuse_a_file(self.directory)
                try:
                    os.makedirs(self.directory, exist_ok=True)
                except OSError as e:
                    raise storage_error(e, "creating the checkpoint directory", self.directory) from e
        self._view = StepView()
        self._found: tuple[dict[str, str], Any] | None = None
        self._resume_reader: Any = None  # the latest step's reader, for the restore resuming from it
        self._step_cache = StepCache() if self.read_only else None  # what `reload` need not read again
        self._last_admitted: int | None = None
        lease, rivals = (None, []) if read_only else leases(self.directory, self._rank, self._ranks)
        self._preemption = Preemption(handle_sigterm)
        try:
            super().__init__(self.directory, backend=backend, lease=lease, rivals=rivals, ctx=ctx,
                             lineage=lineage, new_lineage=new_lineage, slots=slots,
                             when_full=when_full, retry_after=retry_after, patience=patience,
                             device_image_bytes=device_image_bytes)
        except BaseException:
            self._preemption.close()
            raise

    # --- what is on disk ----------------------------------------------------

    def _opened(self, failure: BaseException | None) -> None:
        """Every process raises at open what one met taking its lease (`agreement.agree`)."""
        agree("opening the manager", restoring.meeting_path(self.backend, self.directory), failure,
              process=self._rank, processes=self._ranks)

    def _recover(self) -> str | None:
        found = restoring.recovered(self.backend, self.directory, self._rank, self._ranks, self.read_only,
                                    self._step_cache)
        steps.say_if_orbax(self.directory, found.metrics)
        self._view.reset(found.metrics, found.folders, found.indexed, deleted=found.deleted)
        self._found = found.latest
        self._resume_reader = None if self.read_only else found.reader  # a reader's may be replaced
        return None if (latest := self.latest_step()) is None else self._path(latest)

    def reload(self) -> list[int]:
        """Read the directory again (a read-only manager): the steps a writer published (and
        retention left) since, as `all_steps()` returns them. Queries and `restore()` use the
        listing of the last `reload` (or the open): `reader.reload(); r = reader.restore()`.
        With several processes, all call it together and keep the steps they all found.

        A writer closed still answers queries and `restore()`, as orbax's manager does after
        `close()`, from its listing as of its close (another writer may since have added or
        removed steps: a removed one is a `FormatError` saying so); its `reload` is refused
        with the fix, a `CheckpointManager(directory, read_only=True)`.
        """
        if not self.read_only and self._pipeline.closed:  # its lease given back: others may write
            raise InputError("reload reads the steps another manager wrote: this manager was "
                             "their writer and is closed, its listing as of its close",
                             file=self.directory, fix="open CheckpointManager(directory, "
                             "read_only=True) to read the steps there now (reload it to follow them)")
        if not self.read_only:
            raise InputError("reload reads the steps another manager wrote: this manager is "
                             "their writer, and lists them as it goes", file=self.directory,
                             fix="call all_steps(), or reload a CheckpointManager(read_only=True)")
        self.lineage = self._follow(self._lineage_asked)
        return self.all_steps()

    # --- saving ----------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether `save` would write `step`: on the interval, or where preemption is noticed."""
        step = check_step(step, self.directory)
        if self.read_only:
            raise restoring.read_only_refusal(self.directory, f"should_save({step})")
        due = self._preemption.due(step)  # asked at every step
        return step % self.save_interval_steps == 0 or due

    def save(self, step: int, tree: Any = None, *, items: Mapping[str, Any] | None = None,
             metrics: Mapping[str, float] | None = None,
             trainer_state: TrainerState | None = None,
             metadata: Mapping[str, str] | None = None, force: bool = False,
             timeout: float | None = None, options: CheckpointOptions | None = None) -> bool:
        """Snapshot `tree` as `step` and write it in the background; True if it will be saved.

        Call it every step: it writes only when `should_save` says so
        (or with `force`). `tree` goes under `ctx.namespace`; `items`
        (`{namespace: subtree}`) puts subtrees in namespaces of their own,
        so that one can later be restored without the others. Blocks only for
        taking the snapshot, as `Mirror.submit` does (and for a free slot). `options` overrides the
        manager's `CheckpointOptions` for this step: with a foreign
        format, `tree` is the model, or `items[options.model_namespace]` is
        and the other items are the optimizer state.

        With directory steps, an argument one process passes that is refused (`items`, a
        step not above the last, `metrics`, `options`, a `force` that is no flag on a step
        `should_save` writes anyway) fails the step in every process, an `InputError` there
        and a `DistributedError` naming it in the others, once the save took its turn; a
        `step` that is no step is refused in that process alone (where it would save is not
        known), and the others' error at their timeout says what it was told.

        Raises:
            InputError: for a step not above every step already saved.
        """
        try:
            step = check_step(step, self.directory)  # a numpy or JAX integer becomes an int
        except InputError as e:
            raise self._told(e) from None
        if self.read_only:
            raise restoring.read_only_refusal(self.directory, f"save({step})")
        wanted, refused = self._wanted(step, force)
        if not wanted:
            return False
        self._resume_reader = None  # a job saving no longer resumes: the reader's bytes go
        if self.directory_steps:  # every process takes the save's turn, its arguments refused or not

            def checked() -> dict[str, str]:
                if refused is not None:
                    raise refused
                self._arguments(step, tree, items, options)
                return self._step_metadata(step, metrics, trainer_state, metadata)[0]

            self._save_directory(step, tree, checked)
            return True
        options, model_ns = self._arguments(step, tree, items, options)
        meta, clean_metrics = self._step_metadata(step, metrics, trainer_state, metadata)
        trees = items if items is not None else {self.ctx.namespace: tree}
        with naming_file(self._path(step)):  # a leaf's error names the step too
            leaves = namespace_leaves(trees)  # a tree JAX cannot flatten: InputError, first
            formats.check_model(options, trees, model_ns, step, self._path(step))  # before admitting
            meta.update(empty_nodes_metadata(trees))
            self._admit(leaves, meta, _Step(step, clean_metrics, options, model_ns), timeout)
        self._last_admitted = step
        if not self.asynchronous:
            self._pipeline.wait()
        return True

    def _wanted(self, step: int, force: Any) -> tuple[bool, InputError | None]:
        """Whether `save` writes `step` (`force`, or `should_save`), and the refusal of a
        `force` that is no flag where the step is written all the same: with directory steps,
        a step on the interval, whose save every process makes, so that the refusal fails it
        in all of them (`_save_directory`); elsewhere it is refused in this process alone."""
        try:
            if check_flag(force, 'force', self.directory, optional=False):
                return True, None
        except InputError as e:
            if self.directory_steps and self.should_save(step):
                return True, e
            raise self._told(e) from None
        return self.should_save(step), None

    def _told(self, e: InputError) -> InputError:
        """`e`, refused in this process alone where the others' save cannot meet it (where it
        would save is not known), posted for the errors of the processes waiting for it."""
        if self.directory_steps:
            tell(e, refused(SAVING, ''), process=self._rank, processes=self._ranks)
        return e

    def _arguments(self, step: int, tree: Any, items: Mapping[str, Any] | None,
                   options: CheckpointOptions | None) -> tuple[CheckpointOptions, str]:
        """`save`'s options and model namespace (`CheckpointOptions.model_namespace_of`), once
        its step, `tree`, `items` and `options` are checked; `InputError` for one that is
        refused. With directory steps, each process checks them once the save took its turn
        (`_save_directory`), so that one process's refusal fails the save in all of them."""
        self._check_next(step)
        if (tree is None) == (items is None):
            raise InputError("pass exactly one of tree and items", file=self.directory)
        if items is not None and not isinstance(items, Mapping):
            raise InputError(f"items must be {{namespace: subtree}}, not {type(items).__name__}",
                             file=self.directory, fix="pass items={'params': params, ...}")
        if items is not None and self.directory_steps:
            raise InputError("directory steps hold one namespace: pass tree, not items",
                             file=self.directory)
        options = steps.checked(options, CheckpointOptions, 'options', self.options)
        return options, options.model_namespace_of(items, self.ctx.namespace, directory=self.directory,
                                                   directory_steps=self.directory_steps)

    def _step_metadata(self, step: int, metrics: Mapping[str, float] | None,
                       trainer_state: TrainerState | None, metadata: Mapping[str, str] | None
                       ) -> tuple[dict[str, str], dict[str, float]]:
        """The metadata `step` records (the user's, its step, metrics and trainer state),
        and its metrics: `InputError` for one that cannot be stored."""
        meta = check_metadata(metadata, self.directory)
        clean_metrics = check_metrics(metrics, self.directory,
                                      self.best_metric if self.keep_best else None, step)
        meta[STEP_KEY] = str(step)
        meta[METRICS_KEY] = strict_json.dumps(clean_metrics, sort_keys=True)
        if trainer_state is not None:
            if not isinstance(trainer_state, TrainerState):
                raise InputError(f"trainer_state must be a TrainerState, not "
                                 f"{type(trainer_state).__name__}", file=self.directory)
            meta[TRAINER_STATE_KEY] = trainer_state.to_json()
        return meta, clean_metrics

    def _check_next(self, step: int) -> None:
        """Refuse a step not above every step saved or on disk."""
        on_disk = self.latest_step()
        last = max(-1 if self._last_admitted is None else self._last_admitted,
                   -1 if on_disk is None else on_disk)
        if step <= last:
            raise InputError(f"step {step} is not above the last saved step {last}",
                             file=self.directory,
                             fix="save increasing steps (delete later steps to rewind)")

    def _save_directory(self, step: int, tree: Any, metadata: Callable[[], dict[str, str]]) -> None:
        """Save `step` from every process. An error one process meets before its save (its
        lease taken over, its metrics, say) fails the save in all of them once it has taken
        its turn: raised before, the others' save met that process's next one. A lease taken
        over while it saved fails the published step in all of them too, and none applies
        retention (`save_directory`'s `then`): raised in that process alone, process 0 went
        on deleting steps for a writer that was no longer one."""
        recorded: dict[str, str] = {}  # process 0's metrics, which every process keeps

        def write(generation: int) -> None:
            meta: dict[str, str] = {}
            failure: Exception | None = None
            try:
                self._lease.check()  # a writer whose lease was taken over writes nothing more
                meta = metadata()
            except Exception as e:  # the save's arguments too: refused in every process
                failure = e
            recorded.update(save_directory(self.ctx, tree, self._path(step), returning=(METRICS_KEY,),
                                           metadata=self._stamped(meta, generation),
                                           failure=failure, then=lambda: self._lease.check()))
            self._mark_published(generation)  # every process checked its lease after: retention

        self._pipeline.run_now(write)
        self._last_admitted = step
        self._record(step, steps.parse_metrics(recorded.get(METRICS_KEY), self._path(step)),
                     folder=True, indexed=True)

    def _target(self, info: _Step) -> str:
        return self._path(info.step)

    def _describe(self, path: str) -> tuple[dict[str, str], Digest | None]:
        found, self._found = self._found, None  # the latest step, as the scan read it
        return steps.described(path, found)

    def _write_staged(self, temporary: str, target: str, job: Job[_Step],
                      metadata: Mapping[str, str]) -> None:
        info = job.info
        if not info.options.foreign:
            return super()._write_staged(temporary, target, job, metadata)
        formats.stage_step(temporary, target, info.step, job.items, job.built, options=info.options,
                           namespace=info.model_namespace, metadata=metadata,
                           alignment=self.ctx.alignment)

    def _finish_staged(self, staged: Staged[_Step]) -> None:
        if not staged.info.options.foreign:
            return super()._finish_staged(staged)
        formats.finish_step(staged.temporary, staged.target, durable=self.ctx.durable)

    def _discard_staged(self, staged: Staged[_Step]) -> None:
        formats.staging_remove(staged.temporary)

    def _on_published(self, staged: Staged[_Step]) -> None:
        self._record(staged.info.step, staged.info.metrics, folder=staged.info.options.foreign)

    def _record(self, step: int, metrics: Mapping[str, float], *, folder: bool,
                indexed: bool = False) -> None:
        """Count a durable `step` (`folder`: a directory; `indexed`: a directory checkpoint)
        and apply the retention policy."""
        self._view.add(step, metrics, folder=folder, indexed=indexed)
        try:
            self._prune()
        except (OSError, StorageError) as e:  # a failed deletion must not fail (and so repeat) the save
            log.warning("retention in %s failed: %s", self.directory, e)

    def _prune(self) -> None:
        """Delete the steps the retention policy does not keep (process 0; the others forget them).

        A step is forgotten once it is no step on storage any more: one whose deletion failed
        stays known (and restorable), and the next prune deletes it again.
        """
        doomed = self._view.doomed(self._retention)  # never the latest durable step
        if self._rank != 0 or not doomed:
            self._view.forget(doomed)
            return
        paths = {self._path(s): s for s in doomed}
        step_removal.remove_steps(self.backend, {p: doomed[s] for p, s in paths.items()},
                           lambda gone: self._view.forget(paths[p] for p in gone))
        if self.ctx.durable and self.backend is LOCAL:
            fsync_dir(self.directory)

    # --- preemption ------------------------------------------------------------

    def reached_preemption(self, step: int) -> bool:
        """Whether the run is being preempted and should save `step` now.

        With a JAX distributed client this is JAX's preemption sync point (every
        process must call it at every step); otherwise it reports a SIGTERM
        caught with `handle_sigterm=True`, and False without one. A `step` that
        is not a non-negative integer is an `InputError`.
        """
        return self._preemption.reached(check_step(step, self.directory))

    # --- lifetime --------------------------------------------------------------

    def _on_close(self) -> None:
        self._preemption.close()  # the SIGTERM handler that was there before this manager

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, steps={self.all_steps()[-3:]}, "
                f"{self.counters})")


__all__ = ['CheckpointLoadOptions', 'CheckpointManager', 'CheckpointOptions', 'Restored', 'step_name']
