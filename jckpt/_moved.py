"""Old module paths, kept importable with a `DeprecationWarning`.

The package was flat before it was arranged by layer; code that imports an
old path (`import jckpt.mirror`, `from jckpt.sharding import record_reads`)
keeps working and is told the new one. An old module that moved whole
resolves to the very module object of its new home, so
`jckpt.mirror.Mirror is jckpt.Mirror`; one whose contents went to several
homes (`jckpt.distributed`) is an alias module that looks each attribute up
in them, in order, importing each only when an earlier one lacks the name.

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
    # split: leaf to host went to to_host (its transfers to transfers, sharding facts to facts),
    # host to device stayed in placement
    'jckpt.placement': ('jckpt.trees.placement', 'jckpt.trees.to_host', 'jckpt.trees.facts',
                        'jckpt.trees.transfers', 'jckpt.trees.batched_put'),
    # split: restore's side stayed, saving's side went to to_host, writes in place to storage
    'jckpt.sharding': ('jckpt.trees.sharding', 'jckpt.trees.to_host', 'jckpt.trees.facts',
                       'jckpt.trees.transfers', 'jckpt.trees.placement', 'jckpt.trees.batched_put',
                       'jckpt.storage.regions', 'jckpt.format.boxes'),
    'jckpt.context': 'jckpt.api.context',
    'jckpt.progress': 'jckpt.api.progress',
    'jckpt.lease': 'jckpt.storage.lease',
    # split by layer: the directory form and its index went to storage and the codec, the
    # multi-process save (it needs JAX) to the api, consolidate to the tools
    'jckpt.distributed': ('jckpt.tools.consolidate', 'jckpt.storage.directory',
                          'jckpt.storage.checkpoint', 'jckpt.format.index', 'jckpt.format.names',
                          'jckpt.errors', 'jckpt.api.multiprocess'),
    # split: the engine, the snapshot and the staged generations have modules of their own
    'jckpt.mirror': ('jckpt.services.mirror', 'jckpt.services.engine', 'jckpt.services.snapshot',
                     'jckpt.storage.staging', 'jckpt.format.names'),
    'jckpt.manager': ('jckpt.services.manager', 'jckpt.services.retention', 'jckpt.format.names'),
    'jckpt.trainer_state': 'jckpt.services.trainer_state',
    'jckpt.check': ('jckpt.tools.verify', 'jckpt.tools.diff'),
    'jckpt.rewrite': 'jckpt.tools.rewrite',
    'jckpt.cli': 'jckpt.tools.cli',
    'jckpt.orbax': 'jckpt.adapters.orbax_handler',
}
"""Old module path -> where it lives now, or the modules its names went to (searched in
order: JAX-free ones first, so looking up ``consolidate`` does not import JAX). (``jckpt.info``
is the function, so the module ``jckpt.tools.info`` has no old alias: importing one would
rebind ``jckpt.info``.)"""


class _Merged(ModuleType):
    """A module whose attributes are those of several modules, looked up in order."""

    def __init__(self, name: str, sources: tuple[str, ...]) -> None:
        super().__init__(name, f"Deprecated: the names of {name} now live in {', '.join(sources)}.")
        self._sources = sources

    def __getattr__(self, attr: str) -> object:
        if attr.startswith('__') and attr.endswith('__'):  # not a package, no module dunders
            raise AttributeError(attr)
        for source in self._sources:
            module = importlib.import_module(source)
            if hasattr(module, attr):
                value = getattr(module, attr)
                setattr(self, attr, value)
                return value
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r} "
                             f"(its names moved to {', '.join(self._sources)})")

    def __dir__(self) -> list[str]:
        names = set(super().__dir__())
        for source in self._sources:
            names.update(n for n in dir(importlib.import_module(source)) if not n.startswith('_'))
        return sorted(names)


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str | tuple[str, ...]) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        where = self.new if isinstance(self.new, str) else ', '.join(self.new)
        warnings.warn(f"{spec.name} moved to {where}; import it from there",
                      DeprecationWarning, stacklevel=2)
        if isinstance(self.new, tuple):
            return _Merged(spec.name, self.new)
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
