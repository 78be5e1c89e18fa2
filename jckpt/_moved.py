"""Old module paths, kept importable with a ``DeprecationWarning``.

The package was flat before it was arranged by layer; code that imports an
old path (``import jckpt.mirror``, ``from jckpt.sharding import record_reads``)
keeps working and is told the new one. Each old name resolves to the very
module object of its new home, so ``jckpt.mirror.Mirror is jckpt.Mirror``.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter('always')
...     import jckpt.sharding
>>> 'jckpt.trees.sharding' in str(caught[0].message)
True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED = {
    'jckpt.tree': 'jckpt.trees.pytree',
    'jckpt.placement': 'jckpt.trees.placement',
    'jckpt.sharding': 'jckpt.trees.sharding',
    'jckpt.context': 'jckpt.api.context',
    'jckpt.progress': 'jckpt.api.progress',
    'jckpt.lease': 'jckpt.storage.lease',
    'jckpt.distributed': 'jckpt.services.distributed',
    'jckpt.mirror': 'jckpt.services.mirror',
    'jckpt.manager': 'jckpt.services.manager',
    'jckpt.trainer_state': 'jckpt.services.trainer_state',
    'jckpt.check': 'jckpt.tools.check',
    'jckpt.rewrite': 'jckpt.tools.rewrite',
    'jckpt.cli': 'jckpt.tools.cli',
    'jckpt.orbax': 'jckpt.adapters.orbax_handler',
}
"""Old module path -> where it lives now. (``jckpt.info`` is the function, so the
module ``jckpt.tools.info`` has no old alias: importing one would rebind ``jckpt.info``.)"""


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; import it from there",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the real module ran when it was imported under its new name


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of moved modules (consulted after the normal finders)."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Let the old module paths import (once per interpreter)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
