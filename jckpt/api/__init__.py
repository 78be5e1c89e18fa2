"""The public operations: `save`, `load`, `restore` and the immutable `Context`.

>>> import jax.numpy as jnp, tempfile, os
>>> from jckpt.api import Context, load, restore, save
>>> path = os.path.join(tempfile.mkdtemp(), 'model.jckpt')
>>> ctx = Context()
>>> save(ctx, {'w': jnp.ones((2, 3)), 'step': 7}, path)
>>> ctx, tree = load(ctx, path)
>>> tree['jckpt']['w'].shape, int(tree['jckpt']['step'])
((2, 3), 7)
>>> restore(Context(), {'w': jnp.zeros((2, 3))}, path)['w'].sum()
Array(6., dtype=float32)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jckpt.api.context import Context, Registry
    from jckpt.api.loading import describe, ingestion_counts, load, restore
    from jckpt.api.saving import save

# imported on first use, so that ``jckpt.api.context`` and ``jckpt.api.progress`` stay JAX-free
_LAZY = {'Context': 'jckpt.api.context', 'Registry': 'jckpt.api.context',
         **dict.fromkeys(['describe', 'ingestion_counts', 'load', 'restore'], 'jckpt.api.loading'),
         'save': 'jckpt.api.saving'}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jckpt.api' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

__all__ = ['Context', 'Registry', 'describe', 'ingestion_counts', 'load', 'restore', 'save']
