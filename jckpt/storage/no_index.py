"""What a directory without a jckpt index is, and what to do with it.

A directory (or a bucket prefix) given as a checkpoint that has no `index.jckpt`
is an unfinished save, or something else: an orbax item or step (or a folder
holding one), a checkpoint manager's step in another format, or a manager's
directory. `no_index_fix` says which, and how to read it instead: the fix of
the `FormatError` whose message is `NO_INDEX`.

>>> import tempfile
>>> no_index_fix(tempfile.mkdtemp())
'restore from a complete checkpoint'
"""

from __future__ import annotations

import os

from jckpt.format.names import INDEX_NAME, STEP_RE, is_format_step

#: The message of the `FormatError` for a directory (or a prefix) without an index.
NO_INDEX = f"directory has no {INDEX_NAME}: not a checkpoint, or one whose save did not finish"
#: Files that mark another tool's checkpoint directory (orbax's items and steps).
FOREIGN_MARKERS = ('_METADATA', '_CHECKPOINT_METADATA', 'manifest.ocdbt')


def no_index_fix(path: str) -> str:
    """What to do with a directory that is not a jckpt checkpoint: convert a foreign one."""
    try:
        names = set(os.listdir(path))
    except OSError:
        names = set()
    if names & set(FOREIGN_MARKERS):  # an orbax item or step
        return (f"this is an orbax checkpoint: convert it to a jckpt file first, "
                f"jckpt.convert({path!r}, 'state.jckpt'), then restore from that")
    inner = sorted(n for n in names for m in FOREIGN_MARKERS
                   if os.path.exists(os.path.join(path, n, m)))
    if inner:  # a directory holding orbax checkpoints, under names orbax's steps do not take
        return (f"{os.path.join(path, inner[0])!r} in it is an orbax checkpoint: restore that "
                "path (or convert it to a jckpt file)")
    if is_format_step(path, names):
        parent, step = os.path.split(os.path.normpath(path))
        return (f"this is a checkpoint manager's step: restore it with jckpt.CheckpointManager("
                f"{parent or '.'!r}).restore({_step_of(step)})")
    steps = sorted(n for n in names if STEP_RE.match(n))
    if steps:
        return (f"this is a checkpoint manager's directory: jckpt.CheckpointManager({path!r})"
                f".restore(), or pass one of its steps ({os.path.join(path, steps[-1])!r})")
    return "restore from a complete checkpoint"


def _step_of(name: str) -> str:
    """The step number of a step's file name, as text ('STEP' when it is not one)."""
    m = STEP_RE.match(name)
    return str(int(m.group(1))) if m else 'STEP'


__all__ = ['FOREIGN_MARKERS', 'NO_INDEX', 'no_index_fix']
