"""Matching a target's leaves to a checkpoint's entries, and saying why one has none.

`restore` pairs each target leaf with the entry stored at its `(namespace, path)`:
exactly, or where the paths differ only in key kinds (a dict key and an attribute
of the same name; `loose_path`). A leaf with no entry gets the error that names
what the file holds instead: the same name nested otherwise, the tree saved whole
and restored in part (or the other way round), an `nnx.State` against its pure
dict, the entries nearest a renamed leaf, or another namespace.

>>> import numpy as np
>>> from jckpt.format.entries import Header
>>> from jckpt.format.entries import Entry
>>> e = Entry(id=0, namespace='n', prec='Single_prec', dims=(2,), offset=0, byte_length=8,
...           path=(('k', 'w'),))
>>> index = index_entries(Header(tensors=(e,)), {'n'})
>>> [entry.path for entry, _, _ in match_all(index, [('n', [((('k', 'w'),), None)], None)], 'f')]
[(('k', 'w'),)]
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from jckpt.api import targets
from jckpt.errors import MissingEntryError
from jckpt.format.entries import Entry, Header, KeyPath, nearest_paths, path_name
from jckpt.trees import pytree as tree_mod
from jckpt.trees.nested import entry_path


class Stored:
    """One namespace's entries by stored path, and by path less key kinds (built on first need);
    `others`: the file's namespaces, for errors."""

    def __init__(self, others: set[str]) -> None:
        self.by_path: dict[KeyPath, Entry] = {}
        self._loose: dict[KeyPath, list[Entry]] | None = None
        self.others = others

    def loose(self) -> dict[KeyPath, list[Entry]]:
        if self._loose is None:
            self._loose = {}
            for q, e in self.by_path.items():
                self._loose.setdefault(tree_mod.loose_path(q), []).append(e)
        return self._loose


def index_entries(header: Header, names: Collection[str]) -> dict[str, Stored]:
    """The entries of the namespaces in `names`, by namespace."""
    others: set[str] = set()
    out: dict[str, Stored] = {ns: Stored(others) for ns in names}
    for e in header.tensors:
        others.add(e.namespace)
        found = out.get(e.namespace)
        if found is not None:
            found.by_path[entry_path(e)] = e
    return out


def match_all(index: dict[str, Stored], parts: Sequence[tuple[str, list, Any]],
               path: str) -> list[tuple[Entry, Any, str]]:
    """`(entry, target leaf, name)` of each target leaf; for leaves the file lacks, one error
    counting them all (a model with new layers lacks several). A subtree of the target the file
    has nothing of (`batch_stats` restored from a file of `params` alone) is named as a whole;
    else the first leaf is explained, with the other leaves counted: explaining each searches
    the file's entries, and a target of another nesting lacks every one of its 100,000 leaves."""
    out: list[tuple[Entry, Any, str]] = []
    missing: list[tuple[str, KeyPath, Sequence[Entry], str]] = []
    for ns, items, _ in parts:
        for p, leaf in items:
            where = tree_mod.leaf_name(ns, p)
            entry, found = _match(index[ns], p)
            if entry is not None:
                out.append((entry, leaf, where))
            elif not targets.is_target(leaf):  # never stored: say what it is, not "missing"
                raise targets.not_a_target(leaf, path, where)
            else:
                missing.append((ns, p, found, where))
    if not missing:
        return out
    absent = _absent_subtrees(index, missing) if out else {}
    if absent:
        error = _absent_error(absent, missing, parts, path)
        rest = [where for ns, p, _, where in missing if _under(absent, ns, p) is None]
    else:
        ns, p, found, where = _explained(index, missing, nested=not out)
        error = _missing(index[ns], ns, p, found, path, where, nested=not out)
        rest = [w for *_, w in missing if w != where]
    if rest:
        more = rest[:5] + (['...'] if len(rest) > 5 else [])
        n = len(rest)
        error.message += (f"; {n} other target {'leaf is' if n == 1 else 'leaves are'} "
                          f"missing too: {', '.join(more)}")
    raise error


def _explained(index: dict[str, Stored], missing: list, nested: bool) -> tuple:
    """The missing leaf to explain: when no target leaf matched, the first one, under each of
    the target's top-level keys in turn, that the file holds nested otherwise (`_moved`); the
    first one's key may be a subtree the file lacks (`batch_stats` beside a moved `params`)."""
    if nested:
        seen: set[tuple[str, Any]] = set()
        for item in missing:
            ns, p = item[0], item[1]
            top = (ns, tree_mod.loose_path(p[:1]))
            if top in seen or len(seen) >= 16:
                continue
            seen.add(top)
            if _moved(index[ns], p) is not None:
                return item
    return missing[0]


def _absent_subtrees(index: dict[str, Stored], missing: list) -> dict[tuple[str, KeyPath], int]:
    """`{(namespace, prefix): leaves}`: the target subtrees (above a leaf) under which the file
    stores nothing at all, with how many target leaves each has; from the missing leaves, since
    every leaf under such a prefix is missing."""
    prefixes: dict[str, set[KeyPath]] = {}
    absent: dict[tuple[str, KeyPath], int] = {}
    for ns, p, _, _ in missing:
        stored = index[ns]
        if not stored.by_path or len(p) < 2:  # a namespace the file lacks is told as such
            continue
        have = prefixes.get(ns)
        if have is None:
            have = prefixes[ns] = {lq[:k] for lq in stored.loose() for k in range(1, len(lq) + 1)}
        lp = tree_mod.loose_path(p)
        k = next((k for k in range(1, len(p)) if lp[:k] not in have), None)
        if k is not None:
            absent[(ns, p[:k])] = absent.get((ns, p[:k]), 0) + 1
    return absent


def _under(absent: dict[tuple[str, KeyPath], int], ns: str, p: KeyPath) -> KeyPath | None:
    """The prefix in `absent` that `p` lies under, if any."""
    return next((q for k in range(1, len(p)) if (ns, q := p[:k]) in absent), None)


def _absent_error(absent: dict[tuple[str, KeyPath], int], missing: list,
                  parts: Sequence[tuple[str, list, Any]], path: str) -> MissingEntryError:
    """The error for target subtrees the file has nothing of: a new part of the state (Flax's
    `batch_stats` beside `params`, a new layer) whose initial value is to be kept."""
    show = tree_mod.path_repr
    one = len(absent) == 1
    named = [f"{show(q)} ({n} {'leaf' if n == 1 else 'leaves'})" for (_, q), n in absent.items()]
    (ns, first), = list(absent)[:1]
    kept = sorted({show(p[:len(first)]) for n, items, _ in parts if n == ns for p, _ in items
                   if len(p) >= len(first) and p[:len(first) - 1] == first[:-1]
                   and (n, p[:len(first)]) not in absent}, key=str)
    example = f" (e.g. restore only its {', '.join(kept[:4])})" if kept else ""
    where = next(w for n, p, _, w in missing if _under(absent, n, p) is not None)
    return MissingEntryError(
        f"not in the checkpoint: the file has nothing under the target's {', '.join(named[:6])}"
        f"{', ...' if len(named) > 6 else ''}: it lacks {'that subtree' if one else 'those subtrees'}"
        " as a whole, not single leaves", file=path, entry=where,
        fix=f"restore a target without {'it' if one else 'them'}{example} and keep "
            "the initial values, adding them to the restored tree after")


def _match(stored: Stored, p: KeyPath) -> tuple[Entry | None, Sequence[Entry]]:
    """The entry stored at `p`, or at the one path that differs from `p` only in key kinds;
    else `(None, the entries that differ from it only in key kinds: none, or several)`.

    A dict key and an attribute of the same name match, and so do a sequence
    index, a flattened index, an integer dict key of the same number and a string
    dict key that writes it out (`loose_path`): orbax, for one, records a
    NamedTuple's fields as dict keys, and integer dict keys as strings.
    """
    entry = stored.by_path.get(p)
    if entry is not None:
        return entry, ()
    found = stored.loose().get(tree_mod.loose_path(p), ())
    if len(found) == 1:
        return found[0], ()
    return None, found


def _missing(stored: Stored, namespace: str, p: KeyPath, found: Sequence[Entry], path: str,
             where: str, nested: bool = False) -> MissingEntryError:
    """The error for a target leaf no stored entry matches, never listing its own name as present;
    `nested`: no leaf of the target matched, so the file may hold it nested otherwise (`_moved`)."""
    show = tree_mod.path_repr
    if found:
        return MissingEntryError(
            f"ambiguous: the target's {show(p)} differs only in key kinds from "
            f"{', '.join(show(entry_path(e)) for e in found)} in the file", file=path, entry=where,
            fix="load the file and pick the entry, or restore into a target whose key kinds "
                "(dict key, attribute, index) match one of them exactly")
    name = path_name(p)
    same = [q for q in stored.by_path if path_name(q) == name]
    if same:
        return MissingEntryError(
            f"not in the checkpoint: the file's {show(same[0])} has the same name but another "
            f"nesting than the target's {show(p)}", file=path, entry=where,
            fix="restore into a target of the stored structure (jckpt.load shows it)")
    moved = _moved(stored, p) if nested else None  # only when no target leaf matched
    if moved is not None:
        message, fix = moved
        return MissingEntryError(f"not in the checkpoint: {message}", file=path, entry=where, fix=fix)
    near = [path_name(q) for q in nearest_paths(stored.by_path, p)]  # a renamed leaf's old name
    if near:
        return MissingEntryError("not in the checkpoint", file=path, entry=where,
                                 fix=f"check the tree (the file's {namespace!r} entries nearest "
                                     f"it: {near}); to keep a new leaf's initial value, restore a "
                                     "target without it and add it after")
    return MissingEntryError(f"not in the checkpoint: it has no namespace {namespace!r}",
                             file=path, entry=where, fix=_namespace_fix(stored.others, p))


def _namespace_fix(others: set[str], p: KeyPath) -> str:
    """The fix for a target of a namespace the file lacks; when the target's first key names
    one of the file's namespaces, it is `{namespace: subtree}` (as a manager's `items=`
    saved it) and wants `namespaces=`."""
    if not others:
        return "the file holds no arrays"
    head = p[0][1] if p and p[0][0] == 'k' else None
    if head in others:
        return (f"the target's key {head!r} is a namespace of the file: restore a target of "
                f"{{namespace: subtree}} with namespaces=[...] naming its keys (the file's "
                f"namespaces are {sorted(others)})")
    return (f"its namespaces are {sorted(others)}: pass namespace=... (or "
            "jckpt.Context(namespace=...)), or namespaces=[...] with {namespace: subtree} targets")


def _moved(stored: Stored, p: KeyPath) -> tuple[str, str] | None:
    """`(message, fix)` when a stored path is the target's `p` with steps more or fewer at
    one end: a tree saved whole and restored in part (a Linen `init` dict and its `params`),
    or an `nnx.State` (paths end in `value`) and its pure dict. None when there is none."""
    show, lp = tree_mod.path_repr, tree_mod.loose_path(p)
    for q in stored.by_path:
        lq = tree_mod.loose_path(q)
        if len(lq) == len(lp):
            continue
        short, long_ = (lp, lq) if len(lp) < len(lq) else (lq, lp)
        extra = len(long_) - len(short)
        if long_[extra:] == short:  # the same path under a prefix
            if long_ is lq:
                return (f"the file has it as {show(q)}, under {show(q[:extra])}",
                        f"restore a target nested as the file's tree is, under {show(q[:extra])}")
            return (f"the file has it as {show(q)}, without the target's {show(p[:extra])}",
                    f"restore into the target's subtree at {show(p[:extra])}")
        if long_[:len(short)] == short:  # a leaf in one is a subtree in the other
            tail = (q if long_ is lq else p)[len(short):]
            pure = [key for _, key in tail] == ['value']  # flax NNX's Variable holds `value`
            if long_ is lq:
                return (f"the file holds a subtree there, {show(q)}",
                        "the file was saved from an nnx.State (its paths end in `value`): restore "
                        "into nnx.state(abstract_model), not its pure dict" if pure else
                        "restore into a target of the stored structure (jckpt.load shows it)")
            return (f"the file has a leaf at {show(q)}, where the target has {show(p)}",
                    "the file was saved from a pure dict (nnx.to_pure_dict): restore into "
                    "nnx.to_pure_dict(state), then nnx.replace_by_pure_dict(state, restored)"
                    if pure else "restore into a target of the stored structure (jckpt.load shows it)")
    return None


__all__ = ['Stored', 'index_entries', 'match_all']
