"""Which save of each process pairs with which in a multi-process save, and what they agree on.

The processes of a `jax.distributed` run meet save by save, in the order each
makes them. Before writing anything, each compares its `Claim` with process
0's: the path, the save's place among this process's saves of that path, where
in the program it is made (`call_site`) and its place among the saves made
there, and a digest of the leaves. A save one process makes alone (the others
not calling it) meets the others' next save; as it is made from another line
of the program, the two are refused together instead of publishing a mix of
two states, and the saves that follow are refused too (their places from that
line differ), until the processes restart together.

>>> a = Claim('/ckpt', 0, ('train.py:40 (main)',), 0, 'ab')
>>> check_claims(a, a)  # the same save: nothing to say
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import os
import sys
import sysconfig
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from jckpt.api.meetings import SAVING, Meeting, meeting
from jckpt.errors import DistributedError
from jckpt.storage.backend import LOCAL, backend_for

_SAVES = itertools.count()  # saves begun in this process
_PLACES: collections.Counter[Any] = collections.Counter()  # ... of each path, and of each site
_LOCK = threading.Lock()
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # jckpt's own files
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ('stdlib', 'platstdlib')})
#: How many frames of the caller's stack (outside jckpt and the standard library) name a call site.
SITE_FRAMES = 8


@dataclasses.dataclass(frozen=True)
class Claim:
    """What one process says of its save: the others must say the same.

    Attributes:
      path: the checkpoint's path.
      place: how many saves of `path` this process began before this one.
      site: the frames that call the save, innermost first (`call_site`).
      site_place: how many saves of `path` this process began before from `site`.
      plan: a digest of the leaves' ids, paths, dtypes, shapes and PRNG
        implementations (`'-'`: this process's plan failed; its error is raised).
    """

    path: str
    place: int
    site: tuple[str, ...]
    site_place: int
    plan: str

    def encode(self) -> str:
        return json.dumps(dataclasses.astuple(self))

    @classmethod
    def decode(cls, text: str) -> Claim:
        path, place, site, site_place, plan = json.loads(text)
        return cls(path, place, tuple(site), site_place, plan)


def _foreign(filename: str) -> bool:
    """Whether a frame of `filename` is the caller's own code (not jckpt's, nor the standard
    library's, which differ with how a process was started: runpy, threading)."""
    if filename.startswith('<'):
        return not filename.startswith('<frozen')
    filename = os.path.abspath(filename)
    if filename.startswith(_OWN):
        return False
    return not filename.startswith(_STDLIB) or 'site-packages' in filename or 'dist-packages' in filename


def call_site(frames: int = SITE_FRAMES) -> tuple[str, ...]:
    """Where the caller's program calls the save: its innermost `frames` frames outside jckpt
    and the standard library, each `'file.py:line (function)'` (the file's base name: the
    processes of a run may run it from different places).

    >>> call_site()[0].startswith('<doctest')
    True
    """
    found: list[str] = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and len(found) < frames:
        code = frame.f_code
        if _foreign(code.co_filename):
            found.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} ({code.co_name})")
        frame = frame.f_back
    return tuple(found)


def next_save(path: str, site: tuple[str, ...]) -> tuple[str, int, int]:
    """This process's next save of `path` from `site`: its coordination tag (how many saves
    this process began before), its place among the saves of `path` (3: the 4th) and its
    place among those made from `site`. A process whose save failed before its barriers
    still took its turn.

    >>> next_save('/ckpt/a', ('t.py:1 (f)',))[1:], next_save('/ckpt/a', ('t.py:2 (f)',))[1:]
    ((0, 0), (1, 0))
    """
    with _LOCK:
        place, site_place = _PLACES[path], _PLACES[path, site]
        _PLACES[path] += 1
        _PLACES[path, site] += 1
        return f"jckpt/save/{next(_SAVES)}", place, site_place


def refused_save(path: Any) -> Meeting:
    """A save of `path` refused in this process before it took its turn (its context, its
    path): it takes its turn all the same (`next_save`), so that its next save pairs
    with the others' next one, not with the one they make now; returns the position it posts
    for them (`refusing`), that save, left: they fail there at once."""
    try:
        path = os.path.abspath(os.fspath(path)) if backend_for(path) is LOCAL else os.fspath(path)
    except Exception:
        path = ''  # no path: the others' saves of theirs are not shifted
    next_save(path, call_site())
    return meeting(SAVING, '').leaving(None)


_RESTART = ("every process must make the same saves in the same order, from the same line "
            "of the program (a save made by one process alone shifts them); restart the "
            "run's processes together")


def check_claims(first: Claim, mine: Claim) -> None:
    """Refuse to write pieces for another save than process 0's (`first`): its directory
    is the one published, and a piece of another path, of another save of this path,
    of a save made elsewhere in the program or of another tree would land there."""
    path = mine.path
    if path != first.path:
        raise DistributedError(f"process 0 saves to {first.path}, this process to {path}", file=path,
                               fix="pass every process the same path, on a filesystem (or "
                                   "object store) every process sees")
    if first.site != mine.site:
        theirs, ours = _first_difference(first.site, mine.site)
        raise DistributedError(f"process 0 makes this save from {theirs}, this process from "
                               f"{ours}: a save of one path made by one process alone would "
                               f"pair with the others' next save and mix two states", file=path,
                               fix="call save from every process together, from the same line; "
                                   "a process that saves alone writes a file of its own with a "
                                   "one-process writer (jckpt.Mirror)")
    if first.place != mine.place:
        raise DistributedError(f"process 0 is at its save {first.place + 1} of this path, this "
                               f"process at its save {mine.place + 1}", file=path, fix=_RESTART)
    if first.site_place != mine.site_place:
        raise DistributedError(f"process 0 is at its save {first.site_place + 1} of this path "
                               f"from {_innermost(mine.site)}, this process at its save "
                               f"{mine.site_place + 1}", file=path, fix=_RESTART)
    if '-' not in (first.plan, mine.plan) and first.plan != mine.plan:
        raise DistributedError("processes disagree about the tree they save: a leaf's path, "
                               "dtype, shape, id or PRNG implementation differs from process "
                               "0's", file=path,
                               fix="save the same tree in every process; a host value (numpy, "
                                   "a number) must have the same shape and dtype in each, and "
                                   "is saved from process 0's copy")


def _innermost(site: Sequence[str]) -> str:
    return site[0] if site else 'outside any Python frame of the program'


def _first_difference(a: Sequence[str], b: Sequence[str]) -> tuple[str, str]:
    """The first frames where two call sites differ (what the user looks for in each)."""
    for x, y in itertools.zip_longest(a, b, fillvalue=None):
        if x != y:
            return x or 'a caller with fewer frames', y or 'a caller with fewer frames'
    return _innermost(a), _innermost(b)


# --- the leaves: a digest to compare, and a description to name what differs ----------------

def leaf_facts(ident: int, name: str, dtype: Any, shape: Sequence[int],
               key_impl: str | None) -> list[Any]:
    """What processes must agree on of one leaf, as JSON values."""
    return [ident, name, str(dtype), list(shape), key_impl]


def plan_digest(facts: Sequence[list[Any]]) -> str:
    """A digest of every leaf's facts (`leaf_facts`)."""
    h = hashlib.sha256()
    for f in facts:
        h.update(repr(f).encode('utf-8', 'surrogatepass'))
    return h.hexdigest()[:32]


def difference(mine: Sequence[list[Any]], theirs: Sequence[list[Any]],
               other: str) -> tuple[str, str] | None:
    """`(entry, what differs)` of the first leaf two processes' facts disagree on (this
    process's `mine`, `other`'s `theirs`), or `None` if they agree.

    >>> difference([[1, 'w', 'float32', [4], None]], [[1, 'w', 'float32', [8], None]], 'process 0')
    ('w', 'float32[4] here, float32[8] in process 0')
    """
    by_name, names = {f[1]: f for f in theirs}, {f[1] for f in mine}
    for f in mine:  # what one process saves and the other does not, first
        if f[1] not in by_name:
            return f[1], f"this process saves it ({_leaf(f)}), {other} does not"
    for t in theirs:
        if t[1] not in names:
            return t[1], f"{other} saves it ({_leaf(t)}), this process does not"
    for f in mine:  # then a dtype, shape or PRNG implementation; then an id alone
        if f[2:] != by_name[f[1]][2:]:
            return f[1], f"{_leaf(f)} here, {_leaf(by_name[f[1]])} in {other}"
    for f in mine:
        if f != by_name[f[1]]:
            return f[1], f"{_leaf(f, True)} here, {_leaf(by_name[f[1]], True)} in {other}"
    return None


def _leaf(f: list[Any], ident: bool = False) -> str:
    n, _, dtype, shape, key_impl = f
    text = f"{dtype}[{','.join(map(str, shape))}]"
    return text + (f" of {key_impl} keys" if key_impl else '') + (f" (id {n})" if ident else '')


__all__ = ['SITE_FRAMES', 'Claim', 'call_site', 'check_claims', 'difference', 'leaf_facts',
           'next_save', 'plan_digest', 'refused_save']
