"""The lineage rule: when a mirror or a manager continues the checkpoints it finds, and when it refuses.

Every checkpoint a mirror or a manager writes records its **lineage** (a
random id chosen when the run starts, or one the caller names) and a
**generation** number counting the checkpoints of that lineage
(`jckpt.lineage`, `jckpt.generation`). A writer that opens a path which
already holds a checkpoint (the mirror's file, the manager's latest step)
decides from that checkpoint's metadata:

| found | `lineage=None` | `lineage=X` | `new_lineage` |
|---|---|---|---|
| nothing | a new random id | X | (same) |
| lineage L, generation g | continue L after g | continue if X == L, else `LineageError` | new lineage, 0 |
| no lineage | `LineageError` | `LineageError` | (same) |
| unreadable generation | `LineageError` | `LineageError` | (same) |

A checkpoint this rule cannot prove to belong to the run (another lineage, or
none at all: written by `jckpt.save`, a converter or another tool) is
refused with `LineageError`, which names the file and the
fix, rather than continued or silently joined by a new lineage: two runs
pointed at the same place by mistake never mix their checkpoints (a mirror
would overwrite the other run's file; a manager would interleave its steps
with the other run's and prune them by its retention). `new_lineage=True`
is the explicit way to start over.

>>> open_lineage(None, file='run.jckpt', lineage='exp1', new_lineage=False)
Lineage(name='exp1', generation=0)
>>> open_lineage({'jckpt.lineage': 'exp1', 'jckpt.generation': '4'}, file='run.jckpt',
...              lineage=None, new_lineage=False)
Lineage(name='exp1', generation=4)
>>> try:
...     open_lineage({'note': 'saved by hand'}, file='run.jckpt', lineage=None, new_lineage=False)
... except LineageError as e:
...     print(e.message)
...     print(e.fix)
the file was not written by a mirror (it has no lineage)
pass new_lineage=True to start a new lineage over it, or mirror to another path
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping

from jckpt.errors import InputError, LineageError
from jckpt.format.names import GENERATION_KEY, LINEAGE_KEY


@dataclasses.dataclass(frozen=True)
class Lineage:
    """The lineage a writer continues, and the last generation written in it (0: none)."""

    name: str
    generation: int = 0


@dataclasses.dataclass(frozen=True)
class Holder:
    """How the refusals name what holds the lineage, for the error messages and their fixes.

    Attributes:
      subject: the checkpoint read (`'the file'`, `'the latest step'`).
      writer: what writes lineages there (`'a mirror'`).
      restart: what `new_lineage=True` does to it (`'over it'`).
      elsewhere: the other way out (`'mirror to another path'`).
    """

    subject: str
    writer: str
    restart: str
    elsewhere: str


#: A mirror's file: a new lineage replaces it.
MIRROR_FILE = Holder('the file', 'a mirror', 'over it', 'mirror to another path')

#: A manager's latest step: a new lineage's steps follow it in the directory.
MANAGER_STEP = Holder('the latest step', 'a checkpoint manager', 'after it',
                      'save to another directory')


def check_name(lineage: str | None, file: str) -> None:
    """Refuse a lineage name that is not a non-empty string (`None`: choose one)."""
    if lineage is not None and (not isinstance(lineage, str) or not lineage):
        raise InputError(f"lineage must be a non-empty string, not {lineage!r}", file=file)
    try:  # written to every file's header, in the background: refused here, at the call
        (lineage or '').encode('utf-8')
    except UnicodeEncodeError:
        raise InputError(f"lineage {lineage!r:.60} holds a lone surrogate, which no UTF-8 text, "
                         "and so no header, can hold", file=file,
                         fix="name the lineage in plain text") from None


def open_lineage(found: Mapping[str, str] | None, *, file: str, lineage: str | None,
                 new_lineage: bool, holder: Holder = MIRROR_FILE) -> Lineage:
    """The lineage a writer continues, given the metadata `found` in the checkpoint `file`.

    Args:
      found: the metadata of the checkpoint already there (`None`: there is none).
      file: that checkpoint's path (named by the errors).
      lineage: the lineage the caller asks for; `None` takes the one found
        (or a random one when there is none).
      new_lineage: start a new lineage (generation 0) whatever was found.
      holder: how errors name the checkpoint (a mirror's file, a manager's step).

    Raises `LineageError` for a checkpoint of another
    lineage, one with no lineage, or one with an unreadable generation.
    """
    check_name(lineage, file)
    if found is None or new_lineage:
        return Lineage(lineage or uuid.uuid4().hex)
    name = found.get(LINEAGE_KEY)
    if name is None:
        raise LineageError(f"{holder.subject} was not written by {holder.writer} (it has no lineage)",
                           file=file, fix=f"pass new_lineage=True to start a new lineage "
                                          f"{holder.restart}, or {holder.elsewhere}")
    if lineage is not None and lineage != name:
        raise LineageError(f"{holder.subject} belongs to lineage {name!r}, not {lineage!r}", file=file,
                           fix=f"pass lineage={name!r} to continue it, or new_lineage=True "
                               f"to start a new one {holder.restart}")
    try:
        return Lineage(name, int(found.get(GENERATION_KEY, '0')))
    except ValueError:
        raise LineageError(f"unreadable generation {found.get(GENERATION_KEY)!r}", file=file,
                           fix="pass new_lineage=True to start a new lineage") from None


__all__ = ['Holder', 'Lineage', 'MANAGER_STEP', 'MIRROR_FILE', 'check_name', 'open_lineage']
