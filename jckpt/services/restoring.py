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

import dataclasses
from collections.abc import Sequence
from typing import Any

from jckpt.api.context import Context
from jckpt.errors import FormatError
from jckpt.format.names import METRICS_KEY, TRAINER_STATE_KEY
from jckpt.services import steps
from jckpt.services.formats import CheckpointLoadOptions
from jckpt.services.trainer_state import TrainerState


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
    error of a step it does not know that is not there (`steps.step_metadata`).
    """
    with steps.step_metadata(path, step, folder, indexed, absent=absent) as (meta, kind, record):
        state = None
        if TRAINER_STATE_KEY in meta:
            state = TrainerState.from_json(meta[TRAINER_STATE_KEY], file=path)
            if loaded.layout is not None:
                state = state.check_layout(loaded.layout, reshard=loaded.reshard, file=path)
        tree = steps.read_tree(ctx, path, step, target, loaded.namespaces, loaded.cast,
                               loaded.options, loaded.verify, kind, record)
    user = {k: v for k, v in meta.items() if not k.startswith('jckpt.')}
    return Restored(step=step, tree=tree, trainer_state=state,
                    metrics=steps.parse_metrics(meta.get(METRICS_KEY), path), metadata=user)


__all__ = ['Loaded', 'Restored', 'read_step']
