"""How `CheckpointManager.restore` reads a step: its metadata, its trainer state and its arrays.

The read side of the manager, apart from its writer: what it needs of the manager
is the step's path and what the manager's view of its directory knows of the step
(whether it is a directory, a prefix in a bucket), so that a step it listed is read
without a request asking what it is. A step it does not know is read as what its first
GETs find (`steps.step_metadata`).

>>> import tempfile, numpy as np, jckpt
>>> d = tempfile.mkdtemp()
>>> with jckpt.CheckpointManager(d) as mgr:
...     _ = mgr.save(1, {'w': np.ones(2, np.float32)}, metrics={'loss': 0.5})
>>> r = read_step(jckpt.Context(), f"{d}/step_00000001.jckpt", 1, False, None,
...               loaded=Loaded(CheckpointLoadOptions()))
>>> r.step, r.metrics, r.tree['jckpt']['w'].tolist()
(1, {'loss': 0.5}, [1.0, 1.0])
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from jckpt.api.agreement import agree, jointly
from jckpt.api.context import Context, check_flag
from jckpt.api.loading import spans_processes
from jckpt.errors import CheckpointError, FormatError, InputError
from jckpt.format.names import METRICS_KEY, TRAINER_STATE_KEY, step_name
from jckpt.services import steps
from jckpt.services.formats import CheckpointLoadOptions
from jckpt.services.retention import check_step
from jckpt.services.step_cache import StepCache
from jckpt.services.step_view import StepView
from jckpt.services.trainer_state import TrainerState
from jckpt.storage.backend import LOCAL, Backend, backend_for, checked_path
from jckpt.storage.checkpoint import reusing

#: What a read-only manager says to do instead of a write.
READ_ONLY_FIX = ("write with the run's own manager; open one without read_only=True only "
                 "where no other manager writes the directory")


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `CheckpointManager.restore` returns.

    Attributes:
      step: the step restored.
      tree: the arrays (the target's structure, or `{namespace: subtree}`).
      trainer_state: the stored `TrainerState` (adapted to the current
        layout when resharding), or `None` if the step has none.
      metrics: the metrics saved with the step.
      metadata: the user metadata saved with the step.
    """

    step: int
    tree: Any
    trainer_state: TrainerState | None
    metrics: dict[str, float]
    metadata: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Loaded:
    """How a step is read, beyond its target: `restore`'s options, as it checked them.

    Attributes:
      options: how a step directory is read (`CheckpointLoadOptions`).
      namespaces: read only these namespaces.
      layout: this run's `(dp, tp, pp)` (or a `TrainerState`), compared with the stored one's.
      reshard: on a different layout, adapt the trainer state instead of refusing it.
      cast: convert to the target's dtypes instead of refusing a mismatch.
      verify: check every payload read against its checksum.
    """

    options: CheckpointLoadOptions
    namespaces: str | Sequence[str] | None = None
    layout: TrainerState | tuple[int, int, int] | None = None
    reshard: bool = True
    cast: bool = False
    verify: bool = True


def read_step(ctx: Context, path: str, step: int, folder: bool | None, target: Any, *,
              loaded: Loaded, indexed: bool = False, absent: FormatError | None = None) -> Restored:
    """Read the step at `path` as `CheckpointManager.restore` returns it.

    `folder`: whether the manager's view holds the step as a directory (a prefix in a
    bucket), or `None` when it does not know the step: a known step is read without
    asking what it is (locally, the caller has checked that a step it does not know is
    there; in a bucket, the step's first GETs tell);
    `indexed`: the view holds it as a directory checkpoint (read by its index); `absent`: the
    error of a step it does not know that is not there (`steps.step_metadata`). A step it
    knows that is gone (retention, by the directory's writer, before or while it is read),
    locally or in a bucket, is the error that says so (`steps.removed`), not that of the
    file the read missed (a step directory's model or optimizer file, a piece).
    """
    try:
        with steps.step_metadata(path, step, folder, indexed, absent=absent) as (meta, kind, record):
            state = None
            if TRAINER_STATE_KEY in meta:
                state = TrainerState.from_json(meta[TRAINER_STATE_KEY], file=path)
                if loaded.layout is not None:
                    state = state.check_layout(loaded.layout, reshard=loaded.reshard, file=path)
            tree = steps.read_tree(ctx, path, step, target, loaded.namespaces, loaded.cast,
                                   loaded.options, loaded.verify, kind, record)
    except CheckpointError as e:
        if folder is None or not steps.gone(path, folder, indexed):
            raise
        raise steps.removed(step, path) from e
    user = {k: v for k, v in meta.items() if not k.startswith('jckpt.')}
    return Restored(step=step, tree=tree, trainer_state=state,
                    metrics=steps.parse_metrics(meta.get(METRICS_KEY), path), metadata=user)


class StepReader:
    """The read side of `CheckpointManager`: its queries (`all_steps`, `latest_step`,
    `best_step`, `metrics`) and `restore`, answered from the manager's view of its
    directory (`StepView`), so that a reader and a writer read the same way.

    The manager sets the attributes below; this class writes none of them but `_resume_reader`,
    which the first restore takes (the latest step's reader, its header not read again).

    >>> import tempfile, numpy as np, jckpt
    >>> d = tempfile.mkdtemp()
    >>> with jckpt.CheckpointManager(d) as mgr:
    ...     _ = mgr.save(1, {'w': np.ones(2, np.float32)}, metrics={'loss': 0.5})
    >>> with jckpt.CheckpointManager(d, read_only=True) as reader:
    ...     print(reader.all_steps(), reader.best_step('loss'), reader.restore().step)
    [1] 1 1
    """

    directory: str
    backend: Backend
    ctx: Context
    load_options: CheckpointLoadOptions
    best_metric: str | None
    best_mode: str
    read_only: bool
    _ranks: int  # processes that read the directory together (1: this one alone)
    _rank: int
    process_index: int  # of the run (a manager of file steps is this process's own)
    process_count: int
    _view: StepView
    _resume_reader: Any  # the latest step's reader as the open read it (`steps.Found.reader`), or None
    reload: Callable[[], list[int]]
    wait_durable: Callable[..., bool]  # the writer's (a reader has nothing to wait for)
    counters: Any  # the writer's `MirrorCounters`: `pending` says whether it is writing

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, step_name(step))

    def all_steps(self) -> list[int]:
        """Every durable step in the directory, ascending."""
        return self._view.steps()

    def latest_step(self) -> int | None:
        """The latest durable step, or `None` if there is none."""
        return self._view.latest()

    def best_step(self, metric: str | None = None, mode: str | None = None) -> int | None:
        """The durable step with the best `metric` (default `best_metric`), or `None`."""
        metric = metric or self.best_metric
        mode = mode or self.best_mode
        if metric is None:
            raise InputError("best_step needs a metric", file=self.directory,
                             fix="pass metric= (best_step('loss')), or set best_metric= when "
                                 "opening the manager")
        if not isinstance(metric, str) or mode not in ('min', 'max'):
            raise InputError(f"best_step takes a metric name and mode 'min' or 'max', not "
                             f"{metric!r}, {mode!r}", file=self.directory)
        return self._view.best(metric, mode)

    def metrics(self, step: int) -> dict[str, float]:
        """The metrics saved with a durable `step`."""
        step = check_step(step, self.directory)
        found = self._view.metrics(step)
        if found is None:
            raise FormatError(f"no durable step {step}", file=self.directory,
                              fix=f"pick one of {self.all_steps()[-5:]}")
        return found

    def restore(self, step: int | None = None, target: Any = None, *,
                namespaces: str | Sequence[str] | None = None,
                layout: TrainerState | tuple[int, int, int] | None = None,
                reshard: bool = True, ctx: Context | None = None, cast: bool = False,
                options: CheckpointLoadOptions | None = None, verify: bool = True) -> Restored:
        """Read `step` (default: the latest durable one).

        A manager that is writing reads what it saved: when `step` is one it is still
        writing, or none is given while it writes any, `restore` first waits for its
        writes (`wait_durable`, raising their error), so `save(1, ...)` then `restore(1)` or
        `restore()` reads step 1, not an error or an older step.

        A manager of several processes (a reader's, or a writer's of directory steps) restores
        in all of them together: they meet once, then return together or raise together
        (`_read_together`), so that no process trains on while another failed. So does each
        process's own manager of file steps (`directory_steps=False`) onto arrays placed on
        other processes' devices too, as `jckpt.restore` does; onto host values or this
        process's devices, it meets no other.

        Args:
          step: the step to read.
          target: a tree to fill (its structure, dtypes and shardings; a
            partial tree reads only its leaves); `None` returns
            `{namespace: subtree}`.
          namespaces: read only these namespaces (with a target, the target is
            `{namespace: subtree}`): the model without the optimizer state.
          layout: this run's `(dp, tp, pp)` (or a TrainerState); compared with
            the stored trainer state's.
          reshard: on a different layout, place the arrays on the target's
            shardings and return the trainer state with the current layout;
            `False` refuses with `MismatchError`.
          ctx: placement and namespace (default the manager's).
          cast: convert to the target's dtypes instead of refusing a mismatch.
          options: overrides the manager's `CheckpointLoadOptions`
            for a step directory (a model loader; the model without the optimizer).
          verify: check every payload read against its checksum (`ChecksumError`
            on damage): a resume is rare, and damage must not train on silently.

        Example:
            ```python
            r = mgr.restore(target={"params": abstract_params}, namespaces=["params"],
                            layout=(8, 1, 1))
            params, trainer = r.tree["params"], r.trainer_state
            ```
        """
        self._written_first(step)
        ctx = ctx if ctx is not None else self.ctx
        read = functools.partial(self._read, ctx, target=target, options=options,
                                 loaded=Loaded(CheckpointLoadOptions(), namespaces, layout,
                                               reshard, cast, verify))
        if self._ranks > 1:
            return self._read_together(step, read)
        if self.process_count > 1 and spans_processes(ctx, target):  # this process's file steps
            return jointly("restoring a step", self.directory, functools.partial(read, step),
                           process=self.process_index, processes=self.process_count,
                           same_path=False)
        return read(step)

    def _written_first(self, step: Any) -> None:
        """Wait for this manager's writes before `restore` reads `step` (None: the latest), if
        it may be one of them: a step not yet durable while steps are being written."""
        if self.read_only or not self.counters.pending:
            return
        if step is None or not isinstance(step, int) or step not in self._view.steps():
            self.wait_durable()

    def _read(self, ctx: Context, step: int | None, *, target: Any,
              options: CheckpointLoadOptions | None, loaded: Loaded) -> Restored:
        """`restore` in this process alone: `step`, or the latest listed. Its arguments are
        checked here, before anything is read: with several processes, one process's refusal
        is raised in all of them (`_read_together`)."""
        check_flag(loaded.verify, 'verify', self.directory, optional=False)
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FormatError("no checkpoint in the directory", file=self.directory,
                                  fix="save a step first, or check the directory")
        step = check_step(step, self.directory)
        path = self._path(step)
        folder = self._view.folder(step)  # a step this manager knows: no request asks what it is
        deleted = folder is None and self._view.deleted(step)  # what is left of it is no step
        absent = FormatError(f"no step {step}" + (": retention deleted it" if deleted else ""),
                             file=self.directory, fix=f"pick one of {self.all_steps()[-5:]}")
        if deleted or (folder is None and self.backend is LOCAL and not os.path.exists(path)):
            raise absent  # in a bucket, the step's first GET tells (`steps.step_metadata`)
        options = steps.checked(options, CheckpointLoadOptions, 'options', self.load_options)
        opened, self._resume_reader = self._resume_reader, None  # once: a reader keeps what it fetched
        with reusing(opened) if opened is not None else contextlib.nullcontext():  # a job resuming
            return read_step(ctx, path, step, folder, target, indexed=self._view.indexed(step),
                             loaded=dataclasses.replace(loaded, options=options), absent=absent)

    def _read_together(self, step: int | None, read: Callable[[int | None], Restored]) -> Restored:
        """A multi-process manager's `restore`: every process reads its part of the step, then
        all meet (`agree`: one barrier, one meeting of the directory's restores, whatever step
        each asks for) and return together or fail together: a step one process refuses (no
        step number) fails in all, and so do processes asking for different steps. Where a reader's
        step read was the latest listed and the writer's retention removed it while they read
        (one process read it, another found it gone), they list again together (`reload`) and
        read the new latest, `RELISTS` times at most; a step asked for by number fails in all.
        """
        where = os.path.abspath(self.directory) if self.backend is LOCAL else self.directory
        for attempt in range(RELISTS):
            asked, restored, failure = None, None, None
            try:
                asked = self.latest_step() if step is None else check_step(step, self.directory)
                restored = read(asked)
            except Exception as e:
                failure = e
            vanished = self.read_only and isinstance(failure, FormatError) and self._vanished(asked)
            said = agree("restoring a step", where, None if vanished else failure,
                         process=self._rank, processes=self._ranks, value=[vanished, asked])
            _same_step(said, where)
            if restored is not None and not any(v for v, _ in said):
                return restored
            assert asked is not None  # a process found it gone: they all listed it
            if step is not None or attempt == RELISTS - 1:
                raise steps.removed(asked, self._path(asked)) from failure
            self.reload()
        raise AssertionError("unreachable")

    def _vanished(self, step: int | None) -> bool:
        """Whether `step`, which this manager listed, is gone (removed by the writer's
        retention); False for a step it did not list, or where that cannot be told."""
        folder = None if step is None else self._view.folder(step)
        return step is not None and folder is not None and steps.gone(
            self._path(step), folder, self._view.indexed(step))


def _same_step(said: Sequence[Sequence[Any]], directory: str) -> None:
    """Refuse, in every process alike, a restore whose processes asked for different steps
    (`said`: each process's `[vanished, step]`): each would return its own."""
    asked = [s for _, s in said]
    if len(set(asked)) > 1:
        raise InputError("the processes restore different steps (" + "; ".join(
            f"process {p}: {s}" for p, s in enumerate(asked[:8])) + ")", file=directory,
            fix="pass every process the same step (or none: the latest step they all list)")


def read_only_refusal(directory: str, what: str) -> InputError:
    """The error of `what`, a write asked of a read-only manager (`read_only=True`).

    >>> print(read_only_refusal('ckpts', 'save').message)
    save: the manager is read-only (read_only=True) and writes nothing
    """
    return InputError(f"{what}: the manager is read-only (read_only=True) and writes nothing",
                      file=directory, fix=READ_ONLY_FIX)


def check_reader(backend: Backend, directory: str, writes: Sequence[tuple[str, Any]]) -> None:
    """Refuse a read-only manager what only a writer does (`writes`: `(argument, value)` pairs
    where a true value asks for a write: retention, a new lineage, catching SIGTERM), and a
    local `directory` that is not there (a reader creates none: a misspelt path must not look
    like a run with no steps yet).
    """
    asked = [name for name, value in writes if value]
    if asked:
        raise read_only_refusal(directory, ', '.join(asked))
    if backend is LOCAL:
        refuse_a_file(directory)
    if backend is LOCAL and not os.path.isdir(directory):
        raise FormatError("no such directory: a read-only manager creates none", file=directory,
                          fix="check the path, or open the reader once the run has made it")


def refuse_a_file(directory: str) -> None:
    """`InputError` when the local `directory` a manager is given is a file: a manager's
    directory holds its steps, and one checkpoint file (a step passed by mistake) reads with
    `jckpt.restore`. Opening one failed with the bare "File exists" of the directory it
    could not create, or, read-only, as "no such directory"."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise InputError("is a file, not a directory: a checkpoint manager keeps its steps in "
                         "a directory", file=directory,
                         fix="pass the run's directory (the one holding its step_NNNNNNNN.jckpt "
                             "steps); to read this one checkpoint, jckpt.restore or jckpt.load it")


def common_steps(found: steps.Found, listed: Sequence[Sequence[int]]) -> steps.Found:
    """`found`, less the steps another process of the run did not find (`listed`: each
    process's steps): what a read-only manager's processes all list, and restore by default,
    when the writer published or deleted a step between their listings (each restoring its
    latest would mix two steps in one global array).

    >>> found = steps.Found({1: {}, 2: {}, 3: {}}, frozenset({3}), None)
    >>> sorted(common_steps(found, [[1, 2], [1, 2, 3]]).metrics)
    [1, 2]
    """
    kept = set(found.metrics).intersection(*listed)
    if kept == set(found.metrics):
        return found
    latest = found.latest if kept and max(kept) == max(found.metrics) else None  # else read again
    return dataclasses.replace(found, metrics={s: m for s, m in found.metrics.items() if s in kept},
                               folders=found.folders & kept, latest=latest,
                               indexed=found.indexed & kept)


#: How many times a reader lists a directory whose writer removed listed steps meanwhile.
RELISTS = 3


def recovered(backend: Backend, directory: str, rank: int, ranks: int, read_only: bool,
              cache: StepCache | None = None) -> steps.Found:
    """What a manager of process `rank` of `ranks` finds opening (or a reader reloading)
    `directory` (`steps.recover`: process 0 of a writer cleans up first; a reader's `cache`:
    what it read of each step, so that a reload reads only steps new or replaced since). A reader's
    processes list together (`agree`: one that cannot fails them all at once) and keep
    the steps they all found (`common_steps`); so every process must open and `reload`.
    A reader lists again (`RELISTS` times at most) while steps it listed were gone when read.
    """
    if not read_only:
        return steps.recover(backend, directory, clean=rank == 0)
    found, failure = steps.Found({}, frozenset(), None), None
    try:
        for _ in range(RELISTS):  # the writer's retention removed listed steps: it moved on
            found = steps.recover(backend, directory, clean=False, cache=cache)
            if not found.vanished:
                break
    except CheckpointError as e:
        failure = e
    listed = agree("listing the steps", meeting_path(backend, directory), failure, process=rank,
                   processes=ranks, value=sorted(found.metrics))
    return common_steps(found, listed)


def meeting_path(backend: Backend, directory: str) -> str:
    """The path a manager's processes meet about (its open, a reader's listing): absolute on
    a local disk, as each process may name it relative to its own working directory.

    >>> meeting_path(LOCAL, '/runs/a')
    '/runs/a'
    """
    return os.path.abspath(directory) if backend is LOCAL else directory


@contextlib.contextmanager
def refusing_open(directory: Any, read_only: Any, directory_steps: bool | None) -> Iterator[None]:
    """An argument this process refuses opening a manager of several processes, taken to the
    meeting the others wait at (its open; a reader's first listing) as this process's failure
    there (`agree`): every process raises the same error at once, not the others at their
    timeout.

    Example:
        ```python
        with refusing_open(directory, read_only, directory_steps):
            check_flag(read_only, 'read_only', directory, optional=False)
        ```
    """
    try:
        yield
    except Exception as e:
        processes = jax.process_count() if directory_steps is None or directory_steps else 1
        try:
            path = checked_path(directory)
            where = meeting_path(backend_for(path), path)
        except Exception:
            where = ''  # a path no other process names: they all fail naming theirs
        agree('listing the steps' if read_only is True else 'opening the manager', where, e,
              process=jax.process_index(), processes=processes)
        raise  # `agree` raised already


__all__ = ['Loaded', 'Restored', 'StepReader', 'check_reader', 'common_steps', 'meeting_path',
           'read_only_refusal', 'read_step', 'recovered', 'refusing_open']
