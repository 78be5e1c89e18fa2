"""jckpt: JAX-native, functional checkpoints in one self-describing, mappable file.

>>> import jckpt, jax.numpy as jnp, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt.jckpt")
>>> jckpt.save(jckpt.Context(), {"w": jnp.arange(3.0)}, path)
>>> jckpt.restore(jckpt.Context(), {"w": jnp.zeros(3)}, path)["w"]
Array([0., 1., 2.], dtype=float32)

The codec (`jckpt.format`) and the errors import without JAX; everything
that touches devices is imported on first use.
"""

from __future__ import annotations

import importlib
import logging
import types
from typing import TYPE_CHECKING

from jckpt import _moved
from jckpt.errors import (
    CapacityError,
    CheckpointError,
    ChecksumError,
    ClashError,
    DistributedError,
    FormatError,
    InputError,
    InUseError,
    LineageError,
    MismatchError,
    MissingEntryError,
    StorageError,
    TargetError,
)
from jckpt.tools.info import info  # bound eagerly: the name must stay the function, not the module
from jckpt.version import __version__

logging.getLogger('jckpt').addHandler(logging.NullHandler())  # the library prints nothing
_moved.install()  # old module paths (jckpt.mirror, jckpt.sharding, ...) still import

if TYPE_CHECKING:
    from jckpt.adapters import convert, detect_format, register_format
    from jckpt.api.context import Context, Registry
    from jckpt.api.loading import describe, ingestion_counts, load, restore
    from jckpt.api.saving import save
    from jckpt.services.formats import CheckpointLoadOptions, CheckpointOptions
    from jckpt.services.manager import CheckpointManager, Restored
    from jckpt.services.mirror import Mirror, MirrorCounters
    from jckpt.services.trainer_state import TrainerState
    from jckpt.tools.consolidate import consolidate
    from jckpt.tools.diff import diff
    from jckpt.tools.rewrite import merge, relayout
    from jckpt.tools.verify import verify
    from jckpt.trees.pytree import prefix_namespace

# name -> module that defines it, imported lazily so the codec stays JAX-free.
_LAZY = {
    'save': 'jckpt.api.saving', 'load': 'jckpt.api.loading', 'restore': 'jckpt.api.loading',
    'ingestion_counts': 'jckpt.api.loading', 'describe': 'jckpt.api.loading',
    'Context': 'jckpt.api.context', 'Registry': 'jckpt.api.context',
    'consolidate': 'jckpt.tools.consolidate',
    'prefix_namespace': 'jckpt.trees.pytree',
    'convert': 'jckpt.adapters', 'detect_format': 'jckpt.adapters',
    'register_format': 'jckpt.adapters',
    'verify': 'jckpt.tools.verify', 'diff': 'jckpt.tools.diff',
    'merge': 'jckpt.tools.rewrite', 'relayout': 'jckpt.tools.rewrite',
    'Mirror': 'jckpt.services.mirror', 'MirrorCounters': 'jckpt.services.counters',
    'CheckpointManager': 'jckpt.services.manager', 'Restored': 'jckpt.services.manager',
    'CheckpointOptions': 'jckpt.services.formats', 'CheckpointLoadOptions': 'jckpt.services.formats',
    'TrainerState': 'jckpt.services.trainer_state',
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'jckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names and jckpt's submodules (not `logging`, `importlib`, ... used here)."""
    modules = {name for name, value in globals().items() if isinstance(value, types.ModuleType)
               and value.__name__.startswith('jckpt.') and not name.startswith('_')}
    return sorted(set(__all__) | modules)


__all__ = [
    'convert', 'detect_format', 'register_format',
    'CheckpointLoadOptions', 'CheckpointManager', 'CheckpointOptions', 'Mirror', 'MirrorCounters',
    'Restored', 'TrainerState',
    'CapacityError', 'CheckpointError', 'ChecksumError', 'ClashError', 'Context',
    'DistributedError', 'consolidate',
    'FormatError', 'InUseError', 'InputError', 'LineageError', 'MismatchError',
    'MissingEntryError', 'Registry', 'StorageError', 'TargetError', '__version__',
    'describe', 'diff', 'info', 'ingestion_counts', 'load', 'merge', 'prefix_namespace',
    'relayout', 'restore', 'save', 'verify',
]
