"""The steps a `CheckpointManager` knows to be durable: their metrics, and which are directories.

The manager's view of its directory, read once when it opens (`jckpt.services.steps.scan`)
and kept since as steps are published and deleted, so that its queries (`all_steps`,
`best_step`, `metrics`), its retention and its restores ask the storage nothing.
The training loop's thread and the publishing thread both use it, under one lock.

>>> view = StepView()
>>> view.add(10, {'loss': 0.5}, folder=False)
>>> view.add(20, {'loss': 0.1}, folder=True)
>>> view.steps(), view.best('loss', 'min'), view.folder(20), view.folder(30)
([10, 20], 20, True, None)
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from jckpt.services.retention import Retention, ranked


class StepView:
    """The durable steps a manager knows, by step: their metrics, and whether each is a
    directory (a prefix in a bucket: a step directory or a directory checkpoint) or a file."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[int, dict[str, float]] = {}
        self._folders: set[int] = set()
        self._indexed: set[int] = set()  # the folders that are directory checkpoints
        self._deleted: set[int] = set()  # deleted (or being deleted) since the manager opened

    def reset(self, metrics: Mapping[int, Mapping[str, float]], folders: Iterable[int],
              indexed: Iterable[int] = (), deleted: Iterable[int] = ()) -> None:
        """Know exactly the steps found in the directory (`metrics`; `folders` the directories,
        `indexed` those of them that are directory checkpoints), and that the steps
        `deleted` were deleted (found being deleted by the directory's writer: `deleted`)."""
        with self._lock:
            self._metrics = {s: dict(m) for s, m in metrics.items()}
            self._folders, self._indexed = set(folders), set(indexed)
            self._deleted.update(deleted)

    def add(self, step: int, metrics: Mapping[str, float], *, folder: bool,
            indexed: bool = False) -> None:
        """Know `step`, durable now, with its `metrics` (`indexed`: a directory checkpoint)."""
        with self._lock:
            self._metrics[step] = dict(metrics)
            for known, now in ((self._folders, folder), (self._indexed, folder and indexed)):
                if now:
                    known.add(step)
                else:
                    known.discard(step)

    def forget(self, steps: Iterable[int]) -> None:
        """Know no more `steps` (deleted), but that they were deleted (`deleted`)."""
        with self._lock:
            for s in steps:
                self._metrics.pop(s, None)
                self._folders.discard(s)
                self._indexed.discard(s)
                self._deleted.add(s)

    def deleted(self, step: int) -> bool:
        """Whether `step` was deleted (`forget`) since this view was made, or found being
        deleted (`reset`): what is left of it (in a bucket, the files of a step directory
        whose markers went first) is no step, and a restore of it should say why."""
        with self._lock:
            return step in self._deleted

    def steps(self) -> list[int]:
        """Every durable step, ascending."""
        with self._lock:
            return sorted(self._metrics)

    def latest(self) -> int | None:
        """The latest durable step, or `None`."""
        with self._lock:
            return max(self._metrics, default=None)

    def best(self, metric: str, mode: str) -> int | None:
        """The step with the best `metric` (`mode` `'min'` or `'max'`), or `None`."""
        with self._lock:
            best = ranked(self._metrics, metric, mode)
        return best[0] if best else None

    def metrics(self, step: int) -> dict[str, float] | None:
        """The metrics of `step`, or `None` when it is not a durable step."""
        with self._lock:
            found = self._metrics.get(step)
            return None if found is None else dict(found)

    def folder(self, step: int) -> bool | None:
        """Whether `step` is a directory; `None` when it is not a durable step known here."""
        with self._lock:
            return (step in self._folders) if step in self._metrics else None

    def indexed(self, step: int) -> bool:
        """Whether `step` is known as a directory checkpoint (read by its index)."""
        with self._lock:
            return step in self._indexed

    def doomed(self, retention: Retention) -> dict[int, bool]:
        """The steps `retention` does not keep, each with whether it is a directory; never
        the latest durable step (`Retention.doomed` keeps it)."""
        with self._lock:
            return {s: s in self._folders for s in retention.doomed(self._metrics)}


__all__ = ['StepView']
