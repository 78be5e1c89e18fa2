"""The asynchronous durable mirror: keep a checkpoint file in step with training, in the background.

`submit(tree)` takes a snapshot of the tree into a free slot and returns: a
copy on the device for jax arrays (accelerator arrays, and CPU arrays of 64 KiB
or more; drained to host in the background), a copy into the slot's host
buffers for the rest. In the background, snapshots are encoded and written one
after another, in order, each under a temporary name (`<path>.jckpt-next.<n>`),
then fsynced, renamed over the file and the directory fsynced, writing the
next snapshot while the previous one is being persisted. Training blocks
only for taking the snapshot. The counters say at any moment how much of the
work is durable:

>>> import tempfile, os, numpy as np
>>> path = os.path.join(tempfile.mkdtemp(), 'run.jckpt')
>>> with Mirror(path) as m:
...     _ = m.submit({'w': np.ones(3, np.float32)})
...     _ = m.submit({'w': np.ones(3, np.float32)})      # same content: no new generation
...     _ = m.submit({'w': np.zeros(3, np.float32)})
...     _ = m.wait_durable()
...     print(m.counters)
memory mirror: committed 3 durable 3 generation 2 pending 0 error 0

The file is an ordinary checkpoint (`jckpt.restore` reads it at any time
and always sees a complete generation); its metadata records the mirror's
lineage (`jckpt.lineage`) and generation (`jckpt.generation`).

Guarantees:

* A slot is reused only once its snapshot is durable (or found identical to
  the last durable generation), so a later buffer donation or update cannot
  corrupt a snapshot, and admitted work is never dropped while the mirror is
  open.
* A disk error keeps the snapshot and retries it every `retry_after`
  seconds; the error shows in the counters, and is raised by
  `Mirror.wait_durable`, `Mirror.close` and a blocked
  `Mirror.submit` once `patience` attempts in a row have failed.
* One writer per path: a second mirror on the same path, in this or another
  process, is refused with `InUseError`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from jckpt.api.context import Context
from jckpt.errors import FormatError, InputError, LineageError, naming_file
from jckpt.format.entries import Header
from jckpt.format.metadata import check_metadata
from jckpt.format.names import STEP_KEY
from jckpt.services.base import BackgroundWriter
from jckpt.services.engine import MirrorCounters
from jckpt.services.lineage import MIRROR_FILE
from jckpt.services.snapshot import Digest, content_digest, empty_nodes_metadata, namespace_leaves
from jckpt.storage import staging
from jckpt.storage.backend import LOCAL, backend_for, checked_path, folder_path_error, names_folder
from jckpt.storage.object_store import MISSING_OBJECT


class Mirror(BackgroundWriter[None]):
    """Keep the checkpoint file `path` in step with submitted trees, in the background.

    Args:
      path: the checkpoint file (replaced atomically by each new generation).
      ctx: namespace, alignment and durability of the file (default `Context()`).
      lineage: this run's lineage name. `None` continues the file's lineage
        (or starts a random one for a new file).
      new_lineage: start a new lineage (generation 1) even if the file holds
        another one; without it, a file of another lineage, or one not written
        by a mirror, is refused with `LineageError` (the
        rule of `jckpt.services.lineage`, which the manager follows too).
      slots: snapshot slots (each holds one whole snapshot; default 2).
      when_full: `'block'` (default) waits for a slot when every one is
        pending; `'raise'` refuses with `CapacityError`.
      retry_after: seconds between attempts after a disk error (default 1).
      patience: failed attempts in a row after which waiting callers get the error.
      device_image_bytes: the most device memory one slot's snapshot image may
        take (None: as much as the devices have free; 0: copy to host at submit).

    Raises:
        InUseError: if another mirror holds `path`.
        LineageError: if the file holds another lineage, or none, and `new_lineage` is False.
        InputError: for a URL no storage backend serves (before anything is created).

    Example:
        ```python
        with jckpt.Mirror("run.jckpt") as mirror:
            for step in range(steps):
                state = train_step(state)
                mirror.submit(state, metadata={"step": str(step)})
                print(mirror.counters)
        ```
    """

    _holder = MIRROR_FILE
    _kind = 'mirror'
    _dedupe = True  # an unchanged state makes no new generation

    def __init__(self, path: str | os.PathLike, *, ctx: Context | None = None,
                 lineage: str | None = None, new_lineage: bool = False, slots: int = 2,
                 when_full: str = 'block', retry_after: float = 1.0, patience: int = 3,
                 device_image_bytes: int | None = None) -> None:
        self.path = checked_path(path)
        if names_folder(self.path):  # its generations are one file: refused before the lease
            backend_for(self.path).check_target(self.path)  # a bucket's root is said as such
            raise folder_path_error(self.path, saving=True)
        if backend_for(self.path) is LOCAL and os.path.isdir(self.path) \
                and not os.path.islink(self.path):  # no file can be published over it
            raise _folder_error(self.path, "a directory")
        self._found: Header | None = None  # the header `_recover` read of a checkpoint in a bucket
        super().__init__(self.path, backend=backend_for(self.path), lease=self.path, ctx=ctx,
                         lineage=lineage, new_lineage=new_lineage, slots=slots,
                         when_full=when_full, retry_after=retry_after, patience=patience,
                         device_image_bytes=device_image_bytes)

    def submit(self, tree: Any, *, metadata: Mapping[str, str] | None = None,
               timeout: float | None = None) -> int:
        """Snapshot `tree` and queue it; return its number (1, 2, ...).

        Blocks only to take the snapshot, and for a free slot when every slot
        is pending (or raises `CapacityError` with `when_full='raise'`, or
        after `timeout` seconds). jax arrays (on an accelerator, and CPU
        arrays of 64 KiB or more) are copied on their device in one
        dispatched call (drained to host in the background); numpy leaves and
        smaller CPU arrays are copied into the slot's reused buffers. Once it
        returns, the caller may donate or overwrite the arrays. The tree's
        nodes without leaves are recorded as `save` records them.
        """
        trees = {self.ctx.namespace: tree}
        meta = {**check_metadata(metadata, self.path), **empty_nodes_metadata(trees)}
        with naming_file(self.path):  # a leaf's error names the file too
            leaves = namespace_leaves(trees)
            return self._admit(leaves, meta, None, timeout)

    def __repr__(self) -> str:
        return f"Mirror({self.path!r}, lineage={self.lineage!r}, {self.counters})"

    def _recover(self) -> str | None:
        staging.remove_staged(self.path)
        if self.backend is LOCAL:
            return self.path if self.backend.exists(self.path) else None
        try:  # in a bucket, the header's GET says whether it is there: no HEAD first
            self._found = self.backend.open(self.path).header
        except FormatError as e:
            if e.message != MISSING_OBJECT:
                raise
            if self.backend.isdir(self.path):  # a run's or a directory checkpoint's objects
                raise _folder_error(self.path, "a prefix holding objects") from None
            return None
        return self.path

    def _describe(self, path: str) -> tuple[dict[str, str], Digest | None]:
        header, self._found = self._found, None  # as `_recover` read it
        if header is None:
            found, digest = super()._describe(path)
        else:
            found = header.metadata_dict()
            digest = content_digest(header.tensors, found)
        if STEP_KEY in found:  # its manager's retention deletes it; its steps are not a mirror's
            raise LineageError(f"the file is step {found[STEP_KEY]} of a checkpoint manager, "
                               "whose lineage a mirror does not continue", file=path,
                               fix="mirror to a path of its own, outside the manager's directory "
                                   "(read the step with CheckpointManager(directory).restore(step)); "
                                   "for a copy of a step, pass new_lineage=True to start over it")
        return found, digest

    def _target(self, info: None) -> str:
        return self.path


def _folder_error(path: str, what: str) -> InputError:
    """The refusal of a mirror onto `what` is at `path` (a local directory, a bucket's prefix
    holding objects): a mirror keeps one file, and never publishes over what is there."""
    return InputError(f"is {what}: a mirror keeps one checkpoint file", file=path,
                      fix="mirror to a file path (inside it, perhaps: path + '/state.jckpt'); "
                          "for one checkpoint per step in a directory, use jckpt.CheckpointManager")


__all__ = ['Mirror', 'MirrorCounters']
