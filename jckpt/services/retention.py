"""Which steps a checkpoint manager keeps: the retention policy and the ranking by a metric.

Pure functions of the durable steps and their metrics; the manager deletes
what `Retention.doomed` names. The latest durable step is always kept,
so a crash during a later save still leaves something to resume from.

>>> policy = Retention(keep_last=2, keep_best=1, best_metric='loss')
>>> metrics = {1: {'loss': 0.5}, 2: {'loss': 0.1}, 3: {'loss': 0.4}, 4: {'loss': 0.9}}
>>> policy.doomed(metrics)
[1]
>>> ranked(metrics, 'loss', 'max')
[4, 1, 3, 2]
"""

from __future__ import annotations

import dataclasses
import math
import operator
import reprlib
import warnings
from collections.abc import Mapping

import numpy as np

from jckpt.errors import InputError

#: The metrics of each durable step: ``{step: {name: value}}``.
StepMetrics = Mapping[int, Mapping[str, float]]


def ranked(metrics: StepMetrics, metric: str, mode: str) -> list[int]:
    """The steps that have a finite `metric`, best first (`mode` `'min'` or `'max'`).

    Ties go to the later step. A NaN or an infinity is left out, as a missing value is: it
    is what a diverged run or a broken evaluation records, and an `acc` of `inf` ranked
    first by `'max'` would be kept as the best step for good.

    >>> ranked({1: {'acc': 0.5}, 2: {'acc': float('inf')}, 3: {'acc': 0.7}}, 'acc', 'max')
    [3, 1]
    """
    scored = [(v[metric], s) for s, v in metrics.items()
              if metric in v and math.isfinite(v[metric])]
    sign = 1 if mode == 'min' else -1
    return [s for _, s in sorted(scored, key=lambda t: (sign * t[0], -t[1]))]


@dataclasses.dataclass(frozen=True)
class Retention:
    """A retention policy; a step kept by any of its rules is kept (no rule: every step).

    Attributes:
      keep_last: keep the last N steps.
      keep_every: keep every step that is a multiple of K.
      keep_best: keep the best N steps by `best_metric`.
      best_metric: the metric `keep_best` ranks by.
      best_mode: `'min'` or `'max'`.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = 'min'

    def __post_init__(self) -> None:
        for name in ('keep_last', 'keep_every', 'keep_best'):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):  # a bool is no count
                raise InputError(f"{name} must be a positive integer or None, not {value!r}")
        if self.best_mode not in ('min', 'max'):
            raise InputError(f"best_mode must be 'min' or 'max', not {self.best_mode!r}")
        if self.best_metric is not None and not (isinstance(self.best_metric, str) and self.best_metric):
            raise InputError(f"best_metric must be a metric's name, not {self.best_metric!r:.80}",
                             fix="pass e.g. best_metric='loss'")
        if self.keep_best is not None and self.best_metric is None:
            raise InputError("keep_best needs best_metric", fix="name the metric to rank by")

    def doomed(self, metrics: StepMetrics) -> list[int]:
        """The steps of `metrics` that the policy does not keep, ascending."""
        if self.keep_last is None and self.keep_every is None and self.keep_best is None:
            return []
        steps = sorted(metrics)
        if not steps:
            return []
        keep = {steps[-1]}  # the latest durable step, always
        if self.keep_last is not None:
            keep.update(steps[-self.keep_last:])
        if self.keep_every is not None:
            keep.update(s for s in steps if s % self.keep_every == 0)
        if self.keep_best is not None and self.best_metric is not None:
            keep.update(ranked(metrics, self.best_metric, self.best_mode)[:self.keep_best])
        return [s for s in steps if s not in keep]


def check_step(step: object, where: str) -> int:
    """`step` as an `int` when it is a non-negative integer (a numpy or a 0-d JAX integer
    too: `operator.index` takes it); an `InputError` otherwise.

    >>> check_step(np.int64(20), 'run')
    20
    """
    if not isinstance(step, (bool, np.bool_)):
        try:
            value = operator.index(step)  # type: ignore[arg-type]
        except TypeError:
            value = -1
        if value >= 0:
            return value
    raise InputError(f"step must be a non-negative integer, not {type(step).__name__} "
                     f"{reprlib.repr(step):.80}", file=where,
                     fix="pass the step number first: mgr.save(step, tree), mgr.restore(step)")


def check_metrics(metrics: Mapping[str, float] | None, where: str,
                  rank_by: str | None = None, step: int | None = None) -> dict[str, float]:
    """Metrics as `{name: float}`, refusing a value that is not a number.

    With `rank_by` (a `keep_best` policy's metric), metrics of `step` that
    `ranked` leaves out get a warning (`unranked_reason`): without it, retention
    would later delete the step, or a misspelt `best_metric` the best steps,
    without a word.

    >>> check_metrics({'loss': 1}, 'run', 'loss', step=3)
    {'loss': 1.0}
    """
    if metrics is not None and not isinstance(metrics, Mapping):
        raise InputError(f"metrics must be a mapping {{name: number}}, not {type(metrics).__name__}",
                         file=where, fix="pass metrics={'loss': float(loss)}")
    out = {}
    for k, v in (metrics or {}).items():
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError, OverflowError):
            raise InputError(f"metric {k!r} is not a number: {v!r}", file=where,
                             fix="pass plain numbers (float(loss))") from None
        try:  # a lone surrogate: the JSON record reads back as damaged, every metric lost
            str(k).encode('utf-8')
        except UnicodeEncodeError:
            raise InputError(f"metric name {k!r} holds a lone surrogate, which no UTF-8 text can "
                             "hold: the step's metrics would all read back lost", file=where,
                             fix="name the metric in plain text") from None
    if rank_by is not None and (reason := unranked_reason(out, rank_by, step)) is not None:
        warnings.warn(f"{where}: {reason}", stacklevel=3)
    return out


def unranked_reason(metrics: Mapping[str, float], rank_by: str, step: int | None) -> str | None:
    """Why `keep_best` never keeps `step` with these `metrics` as a best one (None: it may).

    >>> unranked_reason({'loss': float('-inf')}, 'loss', 7).split(',')[0]
    "step 7's 'loss' is -inf"
    >>> unranked_reason({'loss': 0.5}, 'loss', 7) is None
    True
    """
    name = 'the step' if step is None else f"step {step}"
    then = ("retention keeps it only while keep_last, keep_every or being the latest step "
            "keeps it")
    if not metrics:
        return (f"{name} was saved with no metrics, so without {rank_by!r}, the best_metric "
                f"keep_best ranks by: {then} (pass metrics={{{rank_by!r}: ...}} to rank it)")
    if rank_by not in metrics:
        return (f"{name}'s metrics {sorted(metrics)[:5]} have no {rank_by!r}, the best_metric "
                f"keep_best ranks by: it is never kept as a best one, and {then} (is "
                "best_metric misspelt?)")
    if not math.isfinite(metrics[rank_by]):
        return (f"{name}'s {rank_by!r} is {metrics[rank_by]}, which is never ranked as a best "
                f"one (a diverged run or a broken evaluation, as NaN is): {then}")
    return None


__all__ = ['Retention', 'StepMetrics', 'check_metrics', 'check_step', 'ranked', 'unranked_reason']
