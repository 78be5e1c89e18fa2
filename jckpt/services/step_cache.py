"""What a manager read of each step, kept while the step's file stays the same, so that a
reader's `reload()` decodes only the steps published (or replaced) since its last listing.

A local step is keyed by what changes whenever its file is replaced: the
`(st_dev, st_ino, st_size, st_mtime_ns)` of the step file, or, for a step that is a
directory, of the directory itself and of its record (a step directory) or index (a
directory checkpoint), which are published last. A step re-saved under the same
number (retention, then a save; an atomic rename over it) has a new inode, so it is
read again. A step in a bucket is keyed by the version (ETag and size) its listing gives,
at no request more: a `reload()` of a reader of 200 steps with none new made 201 requests
(the listing and each step's GET), and now makes the listing alone. A directory step in a
bucket has no version in the listing (a prefix) and is read each time.

The cache holds only the steps of the last listing (`keep`), and the header of its
latest step alone (the lineage check reads it); the others keep their metadata.

>>> import tempfile, numpy as np, jckpt
>>> d = tempfile.mkdtemp()
>>> with jckpt.CheckpointManager(d) as mgr:
...     _ = mgr.save(1, {'w': np.ones(2, np.float32)})
>>> cache, path = StepCache(), f"{d}/step_00000001.jckpt"
>>> key = file_key(path)
>>> cache.get('step_00000001.jckpt', key) is None
True
>>> cache.put('step_00000001.jckpt', key, ({'jckpt.step': '1'}, None))
>>> cache.get('step_00000001.jckpt', file_key(path))
({'jckpt.step': '1'}, None)
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Callable, Mapping
from typing import Any

from jckpt.format.names import INDEX_NAME, TRAINER_STATE_NAME
from jckpt.storage.backend import is_url

#: A step's identity on disk: changes whenever the step is replaced.
Key = tuple[int | str, ...]
#: What `steps.scan` reads of a step: its metadata, and its header (None: a step directory).
Read = tuple[dict[str, str], Any]

#: Stands for a header the cache let go (a step that is not the latest): the step has one.
DROPPED: Any = object()


def _stat(path: str) -> Key | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, stat.S_ISDIR(st.st_mode)


def file_key(path: str) -> Key | None:
    """The key of the local step at `path` (None: nothing readable there, nothing kept): its
    file's stat, or a directory's and that of its record, else of its index."""
    own = _stat(path)
    if own is None or not own[-1]:
        return own
    for which, marker in enumerate((TRAINER_STATE_NAME, INDEX_NAME)):
        inner = _stat(os.path.join(path, marker))
        if inner is not None:
            return (*own, which, *inner)
    return None  # neither: no step (unfinished, or being removed), read as it is


@dataclasses.dataclass(frozen=True)
class _Entry:
    key: Key
    read: Read


class StepCache:
    """What a manager read of each local step it listed, by step name (see the module)."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def get(self, name: str, key: Key | None) -> Read | None:
        """What was read of step `name` if its key is still `key`, else None (read it)."""
        entry = self._entries.get(name)
        return entry.read if entry is not None and key is not None and entry.key == key else None

    def put(self, name: str, key: Key | None, read: Read) -> None:
        """Keep what was read of step `name` (its key taken before the read: a step replaced
        meanwhile has another key by the next listing, and is read again)."""
        if key is None:
            self._entries.pop(name, None)
        else:
            self._entries[name] = _Entry(key, read)

    def keep(self, found: Mapping[int, tuple[str, Read]]) -> tuple[str, Read] | None:
        """Forget every step but those `found` (`{step: (name, read)}`: the last listing's
        readable steps), and every header but the latest step's (a `DROPPED` one says the
        step has one); return the latest step's `(name, read)`, or None when its header was
        let go (the caller reads it again)."""
        latest = found[max(found)] if found else None
        wanted = {name for name, _ in found.values()}
        self._entries = {
            name: e if (latest and name == latest[0]) or e.read[1] is None
            else dataclasses.replace(e, read=(e.read[0], DROPPED))
            for name, e in self._entries.items() if name in wanted}
        return None if latest is None or latest[1][1] is DROPPED else latest

    def reading(self, read: Callable[[tuple[int, str]], Read | None], directory: str,
                versions: Mapping[str, str] | None = None) -> Callable[[tuple[int, str]], Read | None]:
        """`read` (of a `(step, name)` of `directory`, as `steps.scan` reads it), which returns
        what was kept of a step whose key is unchanged and keeps what it reads. A local step's
        key is its `file_key`; a bucket's is its version in `versions` (the listing's), and
        without `versions` a bucket's steps are read as they are, none kept."""
        if versions is None and is_url(directory):
            return read

        def cached(item: tuple[int, str]) -> Read | None:
            name = item[1]  # the key is taken before the read: see `put`
            key = file_key(os.path.join(directory, name)) if versions is None else \
                (versions[name],) if name in versions else None
            got = self.get(name, key)
            if got is None and (got := read(item)) is not None:
                self.put(name, key, got)
            return got
        return cached

    def __len__(self) -> int:
        return len(self._entries)


__all__ = ['DROPPED', 'Key', 'Read', 'StepCache', 'file_key']
