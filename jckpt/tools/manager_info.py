"""The summary of a checkpoint manager's directory: a table of its steps.

Each step's header is read (never its payloads) for its size, entries,
metrics, generation and lineage; a damaged step is listed with the reason
instead of failing the whole summary. The best step is ranked as the
manager ranks it.

>>> import numpy as np, tempfile, os
>>> from jckpt.format import Entry, Header, lay_out
>>> from jckpt.storage import ArraySource, write_checkpoint
>>> d = tempfile.mkdtemp()
>>> e = Entry(id=0, namespace='jckpt', prec='Single_prec', dims=(1,), offset=0,
...           byte_length=4, path=(('k', 'w'),))
>>> for step, loss in ((10, 0.5), (20, 0.25)):
...     _ = write_checkpoint(os.path.join(d, f'step_{step:08d}.jckpt'),
...                          lay_out(Header(tensors=(e,), metadata=(
...                              ('jckpt.metrics', f'{{"loss": {loss}}}'),))),
...                          [ArraySource(np.ones(1, np.float32))], durable=False)
>>> m = manager_info(d)
>>> m.latest, m.best, m.best_metric
(20, 20, 'loss')
"""

from __future__ import annotations

import dataclasses
import html
import os
from typing import Any

from jckpt.adapters import formats
from jckpt.errors import CheckpointError, FormatError, InputError
from jckpt.format import strict_json
from jckpt.format.metadata import parse_metrics
from jckpt.format.names import GENERATION_KEY, LINEAGE_KEY, METRICS_KEY, STEP_RE, TRAINER_STATE_NAME
from jckpt.services.retention import ranked
from jckpt.storage import step_directory
from jckpt.storage.backend import backend_for, is_url
from jckpt.storage.object_backend import NO_SUCH_OBJECT, concurrency
from jckpt.storage.remote_reader import concurrently
from jckpt.tools.foreign_info import ForeignInfo, foreign_info
from jckpt.tools.render import (
    REPR_ROWS,
    VALUE_WIDTH,
    html_table,
    human_bytes,
    plural,
    printable,
    shorten,
    text_table,
)
from jckpt.tools.summary import DirectoryInfo, FileInfo, directory_info, file_info, known_metadata, tree_size


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """One step of a checkpoint manager directory.

    Attributes:
      step: the step number (from the name `step_00000100.jckpt`).
      path: the step's file (or directory, for a multi-process save).
      kind: `'file'`, `'directory'` (multi-process) or `'model'` (a step
        directory with the model in another format, `jckpt.services.formats`).
      size: bytes on disk (all files, for a directory).
      entries, payload_bytes: from the step's header; for a `'model'` step, its model
        file's arrays and its optimizer file's entries (None when unknown: a step in a
        bucket, a model only a `model_writer` reads).
      metrics: the metrics saved with the step.
      generation, lineage: the writer's generation counter and lineage id.
      error: why the step could not be read (None when it could).
    """

    step: int
    path: str
    kind: str
    size: int
    entries: int | None = None
    payload_bytes: int | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    generation: int | None = None
    lineage: str | None = None
    error: str | None = None
    model: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ManagerInfo:
    """The summary of a checkpoint manager directory: a table of its steps.

    `best` ranks the readable steps by `best_metric` (`best_mode`
    `'min'` or `'max'`; ties go to the later step, and a NaN or infinite value
    is never best, as the manager ranks them); `latest` is the highest readable step.
    """

    path: str
    steps: tuple[StepInfo, ...]
    best_metric: str | None = None
    best_mode: str = 'min'

    kind = 'manager'

    @property
    def metric_names(self) -> list[str]:
        """Every metric name saved with any step, sorted."""
        return sorted({k for s in self.steps for k in s.metrics})

    @property
    def latest(self) -> int | None:
        readable = [s.step for s in self.steps if s.error is None]
        return max(readable) if readable else None

    @property
    def best(self) -> int | None:
        if self.best_metric is None:
            return None
        best = ranked({s.step: s.metrics for s in self.steps if s.error is None},
                      self.best_metric, self.best_mode)  # as the manager ranks them
        return best[0] if best else None

    @property
    def size(self) -> int:
        return sum(s.size for s in self.steps)

    def _description(self) -> str:
        parts = [f"checkpoint manager directory, {plural(len(self.steps), 'step')}, "
                 f"{human_bytes(self.size)}"]
        if self.latest is not None:
            parts.append(f"latest {self.latest}")
        if self.best is not None:
            parts.append(f"best {self.best} by {self.best_metric} ({self.best_mode})")
        elif self.best_metric is not None and self.steps:  # a misspelt --best-metric said nothing
            why = 'no finite value' if self.best_metric in self.metric_names else \
                f"no step records it; they record {', '.join(self.metric_names) or 'no metrics'}"
            parts.append(f"no best by {self.best_metric} ({why})")
        return ', '.join(parts)

    def _rows(self) -> tuple[list[str], list[list[str]], list[int]]:
        metrics = self.metric_names
        headers = ['step', 'size', 'entries', 'generation', *metrics, 'note']
        rows = []
        latest, best = self.latest, self.best
        for s in self.steps:
            notes = [n for n, hit in (('latest', s.step == latest), ('best', s.step == best)) if hit]
            if s.kind == 'directory':
                notes.append('multi-process')
            if s.kind == 'model':
                notes.append(f"model: {s.model}")
            if s.error is not None:
                notes.append(f"unreadable: {shorten(s.error, 60)}")
            rows.append([str(s.step), human_bytes(s.size),
                         '?' if s.entries is None else str(s.entries),
                         '' if s.generation is None else str(s.generation),
                         *[f"{s.metrics[m]:.6g}" if m in s.metrics else '' for m in metrics],
                         ', '.join(notes)])
        right = [0, 1, 2, 3, *range(4, 4 + len(metrics))]
        return headers, rows, right

    def _lineage_line(self) -> str | None:
        lineages = sorted({s.lineage for s in self.steps if s.lineage is not None})
        if not lineages:
            return None
        # ids read from the files are escaped: a newline in one would forge rows of the table
        return printable(f"lineage{'s' if len(lineages) > 1 else ''}: {', '.join(lineages)}")

    def render(self, limit: int | None = None, width: int | None = VALUE_WIDTH) -> str:
        """The text view: summary, lineage, and one row per step (the last `limit`)."""
        headers, rows, right = self._rows()
        shown = rows if limit is None else rows[-limit:]
        parts = [f"{self.path}: {self._description()}"]
        if (line := self._lineage_line()) is not None:
            parts.append(line)
        parts.append('')
        if len(shown) < len(rows):
            parts.append(f"... {len(rows) - len(shown)} earlier steps")
        parts.append(text_table(headers, shown, right=right) if rows else '(no steps)')
        return '\n'.join(parts)

    def __repr__(self) -> str:
        return self.render(limit=REPR_ROWS)

    def _repr_html_(self) -> str:
        headers, rows, right = self._rows()
        line = self._lineage_line()
        return (f"<div><p><b>{html.escape(self.path)}</b>: {html.escape(self._description())}</p>"
                + (f"<p>{html.escape(line)}</p>" if line else '')
                + html_table(headers, rows[-REPR_ROWS:], right=right) + '</div>')

    def to_dict(self) -> dict[str, Any]:
        return {'kind': self.kind, 'path': self.path, 'size': self.size,
                'latest': self.latest, 'best': self.best, 'best_metric': self.best_metric,
                'best_mode': self.best_mode, 'steps': [s.to_dict() for s in self.steps]}


def step_info(step: int, path: str, *, folder: bool | None = None) -> StepInfo:
    """The `StepInfo` of one manager step (never raises for a damaged step). `folder`, when the
    caller's listing says it: whether the step is a directory (a prefix in a bucket); a file
    step is then read with its header's GET alone, not asked first whether it is a directory.
    A step that links out of the manager's directory is not read (its error says so)."""
    try:
        step_directory.check_step_link(path)
    except CheckpointError as e:
        kind = 'directory' if os.path.isdir(path) else 'file'  # a link out: not read
        return StepInfo(step, path, kind, 0, error=str(e.message))
    if folder and is_url(path):  # a prefix: its record's GET tells a step directory, no HEAD first
        try:
            return _model_step_info(step, path, step_directory.read_record(path, step))
        except FormatError as e:
            if e.message != NO_SUCH_OBJECT:
                return StepInfo(step, path, 'model', tree_size(path), error=e.message)
    elif folder is not False and step_directory.is_published(path, TRAINER_STATE_NAME):
        return _model_step_info(step, path)
    is_dir = folder if folder is not None else backend_for(path).isdir(path)  # a bucket's prefix too
    kind = 'directory' if is_dir else 'file'
    try:
        fi: FileInfo | DirectoryInfo = directory_info(path) if kind == 'directory' \
            else file_info(path)
    except CheckpointError as e:
        return StepInfo(step, path, kind, tree_size(path), error=str(e.message))
    known = known_metadata(dict(fi.metadata))
    metrics = parse_metrics(dict(fi.metadata).get(METRICS_KEY)) or {}
    generation = known.get('generation')
    return StepInfo(step, path, kind, fi.size, len(fi.entries), fi.payload_bytes, metrics,
                    generation if isinstance(generation, int) else None, known.get('lineage'))


def _model_step_info(step: int, path: str, record: dict[str, Any] | None = None) -> StepInfo:
    """A step directory's `StepInfo`, from its `trainer_state.json` (`record`, when read;
    never raises)."""
    size = tree_size(path)
    try:
        if record is None:
            record = step_directory.read_record(path, step)  # checked as the manager checks it
        meta = record['metadata']
        generation = meta.get(GENERATION_KEY)
        entries, payload_bytes = _model_counts(path, record)
        return StepInfo(step, path, 'model', size, entries, payload_bytes,
                        metrics=parse_metrics(strict_json.dumps(record.get('metrics', {}))) or {},
                        generation=int(generation) if str(generation or '').isdigit() else None,
                        lineage=meta.get(LINEAGE_KEY), model=record['model'])
    except CheckpointError as e:
        return StepInfo(step, path, 'model', size, error=e.message)


def _model_counts(path: str, record: dict[str, Any]) -> tuple[int | None, int | None]:
    """The entries and payload bytes of a model step's model and optimizer files, read as
    `jckpt inspect` reads each; None (shown `?`) for a step in a bucket (its model would be
    downloaded whole), or a model no registered reader reads (a `model_writer`'s file)."""
    fmt = record.get('model_format')
    if is_url(path) or fmt not in formats():
        return None, None
    try:
        infos: list[ForeignInfo | FileInfo] = [foreign_info(os.path.join(path, record['model']), fmt)]
        if record.get('optimizer') is not None:
            infos.append(file_info(os.path.join(path, record['optimizer'])))
    except CheckpointError:  # restoring the step says what is wrong, naming the file
        return None, None
    return sum(len(i.entries) for i in infos), sum(i.payload_bytes for i in infos)


def manager_info(path: str | os.PathLike, *, best_metric: str | None = None,
                 best_mode: str = 'min',
                 listing: tuple[list[str], list[str]] | None = None) -> ManagerInfo:
    """The `ManagerInfo` of a checkpoint manager directory (headers only).

    `best_metric` defaults to `loss` when the steps record it, else to the
    first metric name in sorted order. `listing`: the directory's `list_kinds`, when the
    caller has listed it (`classify` a bucket's prefix), so that it is not listed again.
    """
    path = os.fspath(path)
    if best_mode not in ('min', 'max'):
        raise InputError(f"best_mode must be 'min' or 'max', not {best_mode!r}", file=path,
                         fix="pass best_mode='min' (the lowest is best) or 'max'")
    objects, prefixes = listing or backend_for(path).list_kinds(path)  # file steps from the others
    folders = set(prefixes)
    found = sorted((int(m.group(1)), name) for name in set(objects) | folders
                   if (m := STEP_RE.match(name)))
    # a bucket's steps: one GET each, the store's `concurrency` in flight (one at a time, 1,203
    # steps took 1,206 requests in turn)
    steps = tuple(concurrently(lambda found: step_info(found[0], os.path.join(path, found[1]),
                                                       folder=found[1] in folders), found,
                               concurrency(path) if is_url(path) else 1))
    names = sorted({k for s in steps for k in s.metrics})
    if best_metric is None and names:
        best_metric = 'loss' if 'loss' in names else names[0]
    return ManagerInfo(path, steps, best_metric, best_mode)


__all__ = ['ManagerInfo', 'StepInfo', 'manager_info', 'step_info']
