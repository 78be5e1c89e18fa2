"""An orbax directory opened as a checkpoint: `jckpt.restore` and `jckpt.load` read it directly.

`jckpt.storage.open_checkpoint` opens a directory without `index.jckpt`
through the directory readers registered with it; this module is orbax's.
`OrbaxReader` opens an orbax PyTree item directory (namespace `jckpt`) or a
`CheckpointManager` step directory (one namespace per item) and offers the
surface every jckpt reader has: a `header` listing one entry per array, made
from orbax's metadata without reading an array, and `decode(entry)`, which
reads the entry's item (orbax restores an item whole) the first time one of
its entries is asked for. A restore of one namespace reads one item; nothing
is ever written to the directory.

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
from collections.abc import Iterator
from typing import Any

import numpy as np

from jckpt.adapters import orbax
from jckpt.adapters._common import host_items_with_keys
from jckpt.errors import FormatError
from jckpt.format import precs
from jckpt.format.entries import Entry, Header, KeyPath, entry_for, path_name
from jckpt.trees import pytree as tree_mod

#: What a header entry is made from: `(path, shape, dtype, PRNG implementation or None)`.
Spec = tuple[KeyPath, tuple[int, ...], np.dtype, str | None]


class OrbaxReader:
    """An orbax item or step directory as a jckpt reader; each item is read on first use.

    `mmap` and `verify` are accepted for the common reader surface and have
    no effect: the arrays are read into host memory, and orbax checks what it
    reads itself.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._items: dict[str, str] = {}
        self._checked: dict[str, int] = {}  # the bytes each item's sizes are checked against
        self._arrays: dict[str, dict[KeyPath, np.ndarray]] = {}  # by namespace, once read
        entries: list[Entry] = []
        for ns, item, checked in orbax.checked_items(self.path, per_item=True):  # walked once
            self._items[ns], self._checked[ns] = item, checked
            entries.extend(self._entries(ns, item, self._specs(ns, item)))
        self.header = Header(tensors=tuple(entries), writer='orbax',
                             metadata=tuple(orbax.json_metadata(self.path).items()))

    def _specs(self, ns: str, item: str) -> list[Spec]:
        """The arrays of one item, from its metadata; or read, where orbax gives none."""
        specs = orbax.item_specs(item)
        if specs is not None:
            return [(tree_mod.to_path(kp), shape, dtype, impl) for kp, shape, dtype, impl in specs]
        arrays = self._read(ns)
        return [(p, a.shape, a.dtype, impl) for p, (a, impl) in arrays.items()]

    def _entries(self, ns: str, item: str, specs: list[Spec]) -> list[Entry]:
        out = []
        for ident, (p, shape, dtype, impl) in enumerate(specs):
            if not precs.is_supported(dtype):
                raise FormatError(f"orbax array of dtype {dtype} has no jckpt element type",
                                  file=item, entry=path_name(p),
                                  fix="convert it with orbax to a supported dtype first")
            out.append(entry_for(ns, p, dtype, shape, id=ident, key_impl=impl))
        return out

    def _read(self, ns: str) -> dict[KeyPath, tuple[np.ndarray, str | None]]:
        """`{path: (host array, PRNG implementation)}` of one item, read through orbax."""
        item = self._items[ns]
        items = host_items_with_keys({ns: orbax.read_item(item, self._checked[ns])}, item)
        found = {p: (a, impl) for _, p, a, impl in items}
        self._arrays[ns] = {p: a for p, (a, _) in found.items()}
        return found

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The header's metadata (the step's JSON items)."""
        return self.header.metadata

    def specs(self) -> Iterator[tuple[str, KeyPath, np.dtype, tuple[int, ...], int]]:
        """`(namespace, path, dtype, shape, nbytes)` of each entry of `header`, in order (what
        `jckpt.adapters.tree_reader.TreeReader.specs` gives of a file)."""
        return ((e.namespace, e.path, e.dtype, e.shape, e.byte_length)  # type: ignore[misc]
                for e in self.header.tensors)

    def decode(self, entry: Entry, *, mmap: bool = True, verify: bool = False,
               count: bool = True) -> np.ndarray:
        """The host array of `entry` (one of `header`'s entries); reads its item the first time."""
        if entry.namespace not in self._arrays:
            self._read(entry.namespace)
        array = self._arrays[entry.namespace].get(entry.path)  # type: ignore[arg-type]
        if array is None or array.shape != entry.shape or array.dtype != entry.dtype:
            found = 'nothing' if array is None else f"{array.dtype}{list(array.shape)}"
            raise FormatError(f"orbax's metadata lists {entry.dtype}{list(entry.shape)} here, its "
                              f"data holds {found}", file=self._items[entry.namespace],
                              entry=entry.name, fix="the checkpoint is damaged; save it again")
        return array

    def verify(self, entries: Any = None) -> list:
        """No failures: orbax checks the arrays as it reads them."""
        return []


__all__ = ['OrbaxReader']
