"""``CheckpointManager``: one checkpoint per training step in a directory, written in the background.

Each step is its own file, ``step_00000100.jckpt`` (or a directory of that
name for a multi-process save), published atomically; saves go through the
mirror's machinery (a host snapshot in a free slot, then a background writer),
so training blocks only for the device-to-host copy. Metrics and a
:class:`~jckpt.services.trainer_state.TrainerState` travel in the file's metadata.

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

Retention (``keep_last``, ``keep_every``, ``keep_best`` by ``best_metric``)
runs after each step is durable and never removes the latest durable step;
with no policy every step is kept. Staging files of a killed writer are
removed when the manager opens; a step file that cannot be read is ignored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from jckpt import api
from jckpt.api.context import Context
from jckpt.errors import CheckpointError, FormatError, InputError, LineageError
from jckpt.format.names import INDEX_NAME, METRICS_KEY, STEP_KEY, STEP_RE, step_name
from jckpt.services.mirror import (
    GENERATION_KEY,
    LINEAGE_KEY,
    NEXT_TAG,
    Job,
    MirrorCounters,
    Pipeline,
    Staged,
    build_entries,
    check_metadata,
    finish_staged,
    next_name,
    remove_staged,
    stage_items,
)
from jckpt.services.trainer_state import TRAINER_STATE_KEY, TrainerState
from jckpt.storage.lease import WriterLease
from jckpt.storage.publish import STAGE_TAG, fsync_dir, reclaim_staging
from jckpt.trees import pytree as tree_mod

log = logging.getLogger('jckpt')




@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`CheckpointManager.restore` returns.

    Attributes:
      step: the step restored.
      tree: the arrays (the target's structure, or ``{namespace: subtree}``).
      trainer_state: the stored :class:`TrainerState` (adapted to the current
        layout when resharding), or ``None`` if the step has none.
      metrics: the metrics saved with the step.
      metadata: the user metadata saved with the step.
    """

    step: int
    tree: Any
    trainer_state: TrainerState | None
    metrics: dict[str, float]
    metadata: dict[str, str]


def _read_metadata(path: str) -> dict[str, str]:
    """A step's header metadata (a file, or a directory's index)."""
    return api.describe(path).metadata_dict()


def _preemption_client_ready() -> bool:
    try:
        from jax._src import distributed as jax_distributed

        return jax_distributed.global_state.client is not None
    except Exception:
        return False


class CheckpointManager:
    """Step checkpoints in ``directory``: asynchronous saves, retention, restore, trainer state.

    Args:
      directory: where the steps live (created if missing).
      ctx: namespace, alignment, durability and placement (default ``Context()``).
      keep_last: keep the last N steps.
      keep_every: keep every step that is a multiple of K.
      keep_best: keep the best N steps by ``best_metric``.
      best_metric: the metric ``keep_best`` and :meth:`best_step` rank by.
      best_mode: ``'min'`` (default) or ``'max'``.
      save_interval_steps: :meth:`save` writes only steps that are multiples of
        this (or when preemption is reached, or with ``force=True``).
      asynchronous: write in the background (default); ``False`` makes
        :meth:`save` return only once the step is durable.
      slots: snapshot slots, as for :class:`~jckpt.Mirror`.
      when_full: ``'block'`` or ``'raise'`` when every slot is pending, as for the mirror.
      retry_after: seconds before a failed write is retried, as for the mirror.
      patience: failed attempts in a row before the error is raised, as for the mirror.
      lineage: the lineage to continue, checked against the latest step.
      new_lineage: start a new lineage even if the latest step has another.
      handle_sigterm: where no JAX distributed client runs, treat SIGTERM as
        preemption (:meth:`reached_preemption` then says True).
      directory_steps: write each step as a multi-process directory checkpoint
        (``jckpt.services.distributed``), synchronously, from every process. Default:
        when ``jax.process_count() > 1``. Only process 0 deletes old steps.

    Only one manager may write a directory at a time
    (:class:`~jckpt.errors.InUseError` otherwise).

    Example::

        mgr = jckpt.CheckpointManager("ckpts", keep_last=3, save_interval_steps=100)
        start = mgr.latest_step()
        if start is not None:
            r = mgr.restore(target=state)
            state, trainer = r.tree, r.trainer_state
        for step in range(...):
            state = train_step(state)
            mgr.save(step, state, metrics={"loss": loss}, trainer_state=trainer)
        mgr.close()
    """

    def __init__(self, directory: str | os.PathLike, *, ctx: Context | None = None,
                 keep_last: int | None = None, keep_every: int | None = None,
                 keep_best: int | None = None, best_metric: str | None = None,
                 best_mode: str = 'min', save_interval_steps: int = 1, asynchronous: bool = True,
                 slots: int = 2, when_full: str = 'block', retry_after: float = 1.0,
                 patience: int = 3, lineage: str | None = None, new_lineage: bool = False,
                 handle_sigterm: bool = False, directory_steps: bool | None = None) -> None:
        import jax

        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        self.directory_steps = (self.process_count > 1 if directory_steps is None
                                else bool(directory_steps))
        self.directory = os.fspath(directory)
        self.ctx = ctx if ctx is not None else Context()
        for name, value in (('keep_last', keep_last), ('keep_every', keep_every),
                            ('keep_best', keep_best)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InputError(f"{name} must be a positive integer or None, not {value!r}")
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise InputError(f"save_interval_steps must be a positive integer, "
                             f"not {save_interval_steps!r}")
        if best_mode not in ('min', 'max'):
            raise InputError(f"best_mode must be 'min' or 'max', not {best_mode!r}")
        if keep_best is not None and best_metric is None:
            raise InputError("keep_best needs best_metric", fix="name the metric to rank by")
        self.keep_last, self.keep_every, self.keep_best = keep_last, keep_every, keep_best
        self.best_metric, self.best_mode = best_metric, best_mode
        self.save_interval_steps = save_interval_steps
        self.asynchronous = asynchronous
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            from jckpt.storage.publish import storage_error

            raise storage_error(e, "creating the checkpoint directory", self.directory) from e
        # One writer per directory; in a multi-process run, one per process of it.
        self._lease = WriterLease(self.directory if self.process_count == 1 else
                                  os.path.join(self.directory, f".process{self.process_index:05d}"))
        try:
            self._lock = threading.Lock()
            self._metrics: dict[int, dict[str, float]] = {}
            self._clean_staging()
            self._scan()
            self.lineage, generation = self._open_lineage(lineage, new_lineage)
            self._last_admitted: int | None = None
            self._preempted = threading.Event()
            if handle_sigterm:
                self._install_sigterm()
            self._staged_generation = self._published_generation = generation
            self._pipeline = Pipeline(self.directory, self, slots=slots,
                                      when_full=when_full, retry_after=retry_after,
                                      patience=patience, generation=generation)
        except BaseException:
            self._lease.release()
            raise

    # --- what is on disk ----------------------------------------------------

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, step_name(step))

    def _clean_staging(self) -> None:
        """Remove staging files and directories of steps whose writer died (incomplete steps)."""
        if self.process_index != 0:
            return
        from jckpt.services.distributed import STAGE_DIR_TAG, reclaim_stage_dirs

        files, dirs = set(), set()
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if STEP_RE.match(name) and os.path.isdir(path) and not os.path.islink(path) \
                    and not os.path.exists(os.path.join(path, INDEX_NAME)):
                log.info("jckpt: removing the half-deleted step directory %s", path)
                shutil.rmtree(path, ignore_errors=True)  # published directories have an index
                continue
            head, sep, _ = name.partition(NEXT_TAG)
            if sep and STEP_RE.match(head):
                remove_staged(os.path.join(self.directory, head))
                continue
            for tag, found in ((STAGE_TAG, files), (STAGE_DIR_TAG, dirs)):
                head, sep, _ = name.partition(tag)
                if sep and STEP_RE.match(head):
                    found.add(os.path.join(self.directory, head))
        for target in sorted(files):
            reclaim_staging(target)
        for target in sorted(dirs):
            reclaim_stage_dirs(target)

    def _scan(self) -> None:
        found: dict[int, dict[str, float]] = {}
        for name in os.listdir(self.directory):
            m = STEP_RE.match(name)
            if not m:
                continue
            path = os.path.join(self.directory, name)
            try:
                meta = _read_metadata(path)
            except CheckpointError as e:
                log.warning("jckpt: ignoring unreadable step %s: %s", name, e)
                continue
            found[int(m.group(1))] = _parse_metrics(meta.get(METRICS_KEY), path)
        with self._lock:
            self._metrics = found

    def _open_lineage(self, lineage: str | None, new_lineage: bool) -> tuple[str, int]:
        latest = self.latest_step()
        if latest is None or new_lineage:
            return lineage or uuid.uuid4().hex, 0
        path = self._path(latest)
        meta = _read_metadata(path)
        found = meta.get(LINEAGE_KEY)
        if found is None:
            return lineage or uuid.uuid4().hex, 0
        if lineage is not None and lineage != found:
            raise LineageError(f"the latest step belongs to lineage {found!r}, not {lineage!r}",
                               file=path, fix=f"pass lineage={found!r} to continue it, or "
                                              "new_lineage=True to start a new one")
        try:
            return found, int(meta.get(GENERATION_KEY, '0'))
        except ValueError:
            return found, 0

    def all_steps(self) -> list[int]:
        """Every durable step in the directory, ascending."""
        with self._lock:
            return sorted(self._metrics)

    def latest_step(self) -> int | None:
        """The latest durable step, or ``None`` if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self, metric: str | None = None, mode: str | None = None) -> int | None:
        """The durable step with the best ``metric`` (default ``best_metric``), or ``None``."""
        metric = metric or self.best_metric
        mode = mode or self.best_mode
        if metric is None:
            raise InputError("best_step needs a metric", fix="pass metric= or set best_metric")
        ranked = self._ranked(metric, mode)
        return ranked[0] if ranked else None

    def metrics(self, step: int) -> dict[str, float]:
        """The metrics saved with a durable ``step``."""
        with self._lock:
            if step not in self._metrics:
                raise FormatError(f"no durable step {step}", file=self.directory,
                                  fix=f"pick one of {sorted(self._metrics)[-5:]}")
            return dict(self._metrics[step])

    def _ranked(self, metric: str, mode: str) -> list[int]:
        with self._lock:
            scored = [(v[metric], s) for s, v in self._metrics.items()
                      if metric in v and not math.isnan(v[metric])]
        sign = 1 if mode == 'min' else -1
        return [s for _, s in sorted(scored, key=lambda t: (sign * t[0], -t[1]))]

    # --- saving ----------------------------------------------------------------

    @property
    def counters(self) -> MirrorCounters:
        """The writer's counters (``generation``: checkpoints written in this lineage)."""
        return self._pipeline.counters()

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` would write ``step``: on the interval, or at preemption."""
        return step % self.save_interval_steps == 0 or self.reached_preemption(step)

    def save(self, step: int, tree: Any = None, *, items: Mapping[str, Any] | None = None,
             metrics: Mapping[str, float] | None = None,
             trainer_state: TrainerState | None = None,
             metadata: Mapping[str, str] | None = None, force: bool = False,
             timeout: float | None = None) -> bool:
        """Snapshot ``tree`` as ``step`` and write it in the background; True if it will be saved.

        Call it every step: it writes only when :meth:`should_save` says so
        (or with ``force``). ``tree`` goes under ``ctx.namespace``; ``items``
        (``{namespace: subtree}``) puts subtrees in namespaces of their own,
        so that one can later be restored without the others. Blocks only for
        the device-to-host copy (and a free slot).

        Raises :class:`~jckpt.errors.InputError` for a step not above every
        step already saved.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InputError(f"step must be a non-negative integer, not {step!r}",
                             file=self.directory)
        if not force and not self.should_save(step):
            return False
        on_disk = self.latest_step()
        last = max(-1 if self._last_admitted is None else self._last_admitted,
                   -1 if on_disk is None else on_disk)
        if step <= last:
            raise InputError(f"step {step} is not above the last saved step {last}",
                             file=self.directory,
                             fix="save increasing steps (delete later steps to rewind)")
        if (tree is None) == (items is None):
            raise InputError("pass exactly one of tree and items", file=self.directory)
        meta = check_metadata(metadata, self.directory)
        clean_metrics = _check_metrics(metrics, self.directory)
        meta[STEP_KEY] = str(step)
        meta[METRICS_KEY] = json.dumps(clean_metrics, sort_keys=True)
        if trainer_state is not None:
            if not isinstance(trainer_state, TrainerState):
                raise InputError(f"trainer_state must be a TrainerState, not "
                                 f"{type(trainer_state).__name__}", file=self.directory)
            meta[TRAINER_STATE_KEY] = trainer_state.to_json()
        if self.directory_steps:
            self._save_directory(step, tree, items, meta, clean_metrics)
            return True
        if items is not None:
            leaves = []
            for namespace, sub in items.items():
                Context(namespace=namespace)  # validates the name
                leaves.extend((namespace, p, leaf) for p, leaf in tree_mod.flatten(sub))
        else:
            leaves = [(self.ctx.namespace, p, leaf) for p, leaf in tree_mod.flatten(tree)]
        self._pipeline.admit(leaves, meta, info=(step, clean_metrics), timeout=timeout)
        self._last_admitted = step
        if not self.asynchronous:
            self._pipeline.wait()
        return True

    def wait_durable(self, timeout: float | None = None) -> bool:
        """Wait until every saved step is durable; ``False`` if ``timeout`` passed first."""
        return self._pipeline.wait(timeout)

    def _save_directory(self, step: int, tree: Any, items: Mapping[str, Any] | None,
                        meta: dict[str, str], metrics: dict[str, float]) -> None:
        from jckpt.services.distributed import save_directory

        if items is not None:
            raise InputError("directory steps hold one namespace: pass tree, not items",
                             file=self.directory)

        def write(generation: int) -> None:
            full = dict(meta)
            full[LINEAGE_KEY] = self.lineage
            full[GENERATION_KEY] = str(generation)
            save_directory(self.ctx, tree, self._path(step), metadata=full)
            self._staged_generation = self._published_generation = generation

        self._pipeline.run_now(write)
        self._last_admitted = step
        with self._lock:
            self._metrics[step] = metrics
        try:
            self._prune()
        except OSError as e:
            log.warning("jckpt: retention in %s failed: %s", self.directory, e)

    # The two stages the pipeline runs (see jckpt.services.mirror.Committer).

    def stage(self, job: Job) -> Staged:
        step, metrics = job.info
        if 'entries' not in job.cache:
            job.cache['entries'], job.cache['sources'] = build_entries(job.items)
        generation = self._staged_generation + 1
        meta = dict(job.metadata)
        meta[LINEAGE_KEY] = self.lineage
        meta[GENERATION_KEY] = str(generation)
        target = self._path(step)
        temporary = next_name(target, job.seq)
        stage_items(temporary, target, job.cache['entries'], job.cache['sources'], metadata=meta,
                    ctx=self.ctx)
        self._staged_generation = generation
        return Staged(temporary, generation, info=(step, metrics))

    def publish(self, staged: Staged) -> int:
        step, metrics = staged.info
        finish_staged(staged.path, self._path(step), durable=self.ctx.durable)
        self._published_generation = staged.generation
        with self._lock:
            self._metrics[step] = metrics
        try:
            self._prune()
        except OSError as e:  # a failed deletion must not fail (and so repeat) the save
            log.warning("jckpt: retention in %s failed: %s", self.directory, e)
        return staged.generation

    def discard(self, staged: Staged | None) -> None:
        if staged is not None and staged.path is not None:
            try:
                os.unlink(staged.path)
            except FileNotFoundError:
                pass

    def rollback(self) -> None:
        self._staged_generation = self._published_generation

    def _prune(self) -> None:
        if self.keep_last is None and self.keep_every is None and self.keep_best is None:
            return
        steps = self.all_steps()
        if not steps:
            return
        keep = {steps[-1]}  # the latest durable step, always
        if self.keep_last is not None:
            keep.update(steps[-self.keep_last:])
        if self.keep_every is not None:
            keep.update(s for s in steps if s % self.keep_every == 0)
        if self.keep_best is not None:
            keep.update(self._ranked(self.best_metric, self.best_mode)[:self.keep_best])
        doomed = [s for s in steps if s not in keep]
        for s in doomed:
            with self._lock:
                self._metrics.pop(s, None)
            if self.process_index != 0:  # every process drops it; process 0 deletes it
                continue
            path = self._path(s)
            if os.path.isdir(path):  # the index first: a half-deleted directory is no step
                os.unlink(os.path.join(path, INDEX_NAME))
                shutil.rmtree(path)
            else:
                os.unlink(path)
        if doomed and self.ctx.durable and self.process_index == 0:
            fsync_dir(self.directory)

    # --- restoring -------------------------------------------------------------

    def restore(self, step: int | None = None, target: Any = None, *,
                namespaces: Sequence[str] | None = None,
                layout: TrainerState | tuple[int, int, int] | None = None,
                reshard: bool = True, ctx: Context | None = None, cast: bool = False) -> Restored:
        """Read ``step`` (default: the latest durable one).

        Args:
          step: the step to read.
          target: a tree to fill (its structure, dtypes and shardings; a
            partial tree reads only its leaves); ``None`` returns
            ``{namespace: subtree}``.
          namespaces: read only these namespaces (with a target, the target is
            ``{namespace: subtree}``): the model without the optimizer state.
          layout: this run's ``(dp, tp, pp)`` (or a TrainerState); compared with
            the stored trainer state's.
          reshard: on a different layout, place the arrays on the target's
            shardings and return the trainer state with the current layout;
            ``False`` refuses with :class:`~jckpt.errors.MismatchError`.
          ctx: placement and namespace (default the manager's).
          cast: convert to the target's dtypes instead of refusing a mismatch.

        Example::

            r = mgr.restore(target={"params": abstract_params}, layout=(8, 1, 1))
            params, trainer = r.tree["params"], r.trainer_state
        """
        ctx = ctx if ctx is not None else self.ctx
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FormatError("no checkpoint in the directory", file=self.directory,
                                  fix="save a step first, or check the directory")
        path = self._path(step)
        if not os.path.exists(path):
            raise FormatError(f"no step {step}", file=self.directory,
                              fix=f"pick one of {self.all_steps()[-5:]}")
        meta = _read_metadata(path)
        state = None
        if TRAINER_STATE_KEY in meta:
            state = TrainerState.from_json(meta[TRAINER_STATE_KEY], file=path)
            if layout is not None:
                state = state.check_layout(layout, reshard=reshard, file=path)
        if namespaces is None:
            tree = (api.load(ctx, path)[1] if target is None
                    else api.restore(ctx, target, path, cast=cast))
        else:
            tree = (api.load(ctx, path, namespaces=namespaces)[1] if target is None
                    else api.restore(ctx, target, path, cast=cast, namespaces=namespaces))
        user = {k: v for k, v in meta.items() if not k.startswith('jckpt.')}
        return Restored(step=step, tree=tree, trainer_state=state,
                        metrics=_parse_metrics(meta.get(METRICS_KEY), path), metadata=user)

    # --- preemption ------------------------------------------------------------

    def reached_preemption(self, step: int) -> bool:
        """Whether the run is being preempted and should save ``step`` now.

        With a JAX distributed client this is JAX's preemption sync point (every
        process must call it at every step); otherwise it reports a SIGTERM
        caught with ``handle_sigterm=True``, and False without one.
        """
        if _preemption_client_ready():
            try:
                from jax.experimental import multihost_utils

                return bool(multihost_utils.reached_preemption_sync_point(step))
            except Exception as e:  # no preemption service in this client
                log.debug("jckpt: preemption sync point unavailable: %s", e)
        return self._preempted.is_set()

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise InputError("handle_sigterm=True needs the main thread",
                             fix="create the manager in the main thread")
        previous = signal.getsignal(signal.SIGTERM)

        def handler(signum, frame):
            self._preempted.set()
            if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, handler)
        self._restore_sigterm = lambda: signal.signal(signal.SIGTERM, previous)

    def _uninstall_sigterm(self) -> None:
        """Put back the SIGTERM handler that was there before this manager (on close)."""
        restore, self._restore_sigterm = getattr(self, '_restore_sigterm', None), None
        if restore is not None and threading.current_thread() is threading.main_thread():
            restore()

    # --- lifetime --------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Make every saved step durable, stop the writer, release the directory."""
        try:
            self._pipeline.close(timeout)
        finally:
            self._lease.release()
            self._uninstall_sigterm()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:
            log.error("jckpt: closing the manager of %s after an error: %s", self.directory, e)

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, steps={self.all_steps()[-3:]}, "
                f"{self.counters})")


def _check_metrics(metrics: Mapping[str, float] | None, where: str) -> dict[str, float]:
    out = {}
    for k, v in (metrics or {}).items():
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            raise InputError(f"metric {k!r} is not a number: {v!r}", file=where,
                             fix="pass plain numbers (float(loss))") from None
    return out


def _parse_metrics(text: str | None, path: str) -> dict[str, float]:
    if not text:
        return {}
    try:
        value = json.loads(text)
        return {str(k): float(v) for k, v in value.items()}
    except (ValueError, TypeError, AttributeError):
        log.warning("jckpt: unreadable metrics in %s", path)
        return {}


__all__ = ['CheckpointManager', 'Restored', 'step_name']
