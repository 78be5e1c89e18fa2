"""An orbax directory opened as a checkpoint: `jckpt.restore` and `jckpt.load` read it directly.

`jckpt.storage.open_checkpoint` opens a directory without `index.jckpt`
through the directory readers registered with it; this module is orbax's.
`OrbaxReader` reads an orbax PyTree item directory (namespace `jckpt`) or a
`CheckpointManager` step directory (one namespace per item) through
`jckpt.adapters.orbax.read`, and offers the surface every jckpt reader has:
a `header` listing one entry per array and `decode(entry)`. Nothing is ever
written to the directory.

orbax records a NamedTuple's fields as dict keys; `restore` matches a
target's attribute to the stored dict key of the same name, so an optax state
comes back as its NamedTuples, and its empty states (which hold no arrays)
come from the target's structure. The JSON items of a step (`ocp.args.JsonSave`)
are in the header's metadata under `jckpt.format.names.ORBAX_JSON_KEY`.

Example:
    ```python
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
    state = jckpt.restore(jckpt.Context(), jax.eval_shape(lambda: state), path)
    ```
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jckpt.adapters import orbax
from jckpt.adapters._common import host_items_with_keys
from jckpt.errors import FormatError
from jckpt.format import precs
from jckpt.format.entries import Entry, Header, entry_for


class OrbaxReader:
    """An orbax item or step directory, read whole into host memory, as a jckpt reader.

    Every array is read when the reader is made (orbax restores a whole item
    at once); `decode` then hands out the host arrays. `mmap` and `verify`
    are accepted for the common reader surface and have no effect: orbax
    checks what it reads itself.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        tree = orbax.read(self.path)
        items = host_items_with_keys(tree, self.path)
        entries, self._arrays = [], {}
        next_id: dict[str, int] = {}
        for ns, p, array, impl in items:
            if not precs.is_supported(array.dtype):
                raise FormatError(f"orbax array of dtype {array.dtype} has no jckpt element type",
                                  file=self.path, entry='/'.join(str(v) for _, v in p),
                                  fix="convert it with orbax to a supported dtype first")
            ident = next_id.get(ns, 0)
            next_id[ns] = ident + 1
            entry = entry_for(ns, p, array.dtype, array.shape, id=ident, key_impl=impl)
            entries.append(entry)
            self._arrays[entry.identity] = array
        self.header = Header(tensors=tuple(entries), writer='orbax',
                             metadata=tuple(orbax.json_metadata(self.path).items()))

    def decode(self, entry: Entry, *, mmap: bool = True, verify: bool = False,
               count: bool = True) -> np.ndarray:
        """The host array of `entry` (one of `header`'s entries)."""
        return self._arrays[entry.identity]

    def verify(self, entries: Any = None) -> list:
        """No failures: orbax checked the arrays as it read them."""
        return []


__all__ = ['OrbaxReader']
