"""User metadata: string pairs in the header, checked before anything is written.

>>> check_metadata({'run': 'a'})
{'run': 'a'}
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jckpt.errors import InputError
from jckpt.format.entries import INT_KINDS, PATH_KINDS, Header, KeyPath, check_prefix, prefixed
from jckpt.format.limits import MAX_PATH_LENGTH, json_as
from jckpt.format.names import EMPTY_NODES_KEY, RESERVED_PREFIX
from jckpt.format.strict_json import unstrict


def check_metadata(metadata: Mapping[str, str] | None, file: str | None = None) -> dict[str, str]:
    """User metadata as a dict of strings; `InputError` naming the key otherwise.

    The header stores metadata as string pairs, so a number or `None` is
    refused here, before anything is written, rather than when the header is
    encoded. Keys starting with `jckpt.` are refused too: they are what `save`,
    a mirror or a manager record themselves, and a file must not claim a
    lineage it was not written in.

    >>> check_metadata({'step': '3'})
    {'step': '3'}
    """
    if metadata is not None and not isinstance(metadata, Mapping):
        raise InputError(f"metadata must be a mapping of strings to strings, not "
                         f"{type(metadata).__name__}", file=file, fix="pass e.g. metadata={'run': 'a'}")
    out: dict[str, str] = {}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str):
            raise InputError(f"metadata key {k!r} is a {type(k).__name__}: metadata maps strings "
                             f"to strings", file=file, fix=f"use the key {str(k)!r}")
        if not isinstance(v, str):
            raise InputError(f"metadata key {k!r} has the {type(v).__name__} value {v!r}: metadata "
                             f"maps strings to strings", file=file,
                             fix=f"store it as a string: metadata={{{k!r}: str(value)}} "
                                 f"(or json.dumps(value) for structured values)")
        if k.startswith(RESERVED_PREFIX):
            raise InputError(f"metadata key {k!r} is reserved", file=file,
                             fix=f"use a key that does not start with {RESERVED_PREFIX!r}")
        _check_utf8(k, v, file)
        out[k] = v
    return out


def _check_utf8(key: str, value: str, file: str | None) -> None:
    """Refuse a key or value no UTF-8 text holds (a lone surrogate, as `os.fsdecode` makes of
    a file name's undecodable byte): no header can hold it, and a manager's or mirror's save,
    which writes later in the background, would fail there instead of at the call."""
    for what, text in (('key', key), ('value', value)):
        try:
            text.encode('utf-8')
        except UnicodeEncodeError:
            shown = key.encode('utf-8', 'backslashreplace').decode()
            raise InputError(f"the {what} of metadata key {shown!r:.60} holds a lone surrogate, "
                             "which no UTF-8 text, and so no header, can hold", file=file,
                             fix="drop the character, or store the text encoded "
                                 "(text.encode('utf-8', 'surrogateescape').hex())") from None


def parse_metrics(text: str | None) -> dict[str, float] | None:
    """The metrics a mirror or manager saved (a JSON object of numbers) as `{name: float}`.

    `None` when `text` is not a JSON object (not JSON, nested deeper than
    `jckpt.format.limits.MAX_NESTING`, a string, `null`...); values
    that are not numbers are left out. Never raises: metrics only rank steps. A non-finite
    value, written `{"$float": "nan"}` (`jckpt.format.strict_json`), reads as the float.

    >>> parse_metrics('{"loss": 0.5, "note": "x", "acc": null}'), parse_metrics('"x"')
    ({'loss': 0.5}, None)
    >>> parse_metrics('{"loss": {"$float": "nan"}, "old": Infinity}')
    {'loss': nan, 'old': inf}
    """
    if not text:
        return {}
    value = json_as(text, dict, object_hook=unstrict)
    if value is None:
        return None
    return {str(k): _real(v) for k, v in value.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _real(v: int | float) -> float:
    """A JSON number as a float: an integer past float's range (`1e400` written out) is inf."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def empty_nodes_text(old: str | None, namespace: str, paths: Sequence[KeyPath],
                     stored: Iterable[KeyPath] = ()) -> str | None:
    """The value of `EMPTY_NODES_KEY` after a save of `namespace` whose empty nodes are `paths`.

    `old` is the value an appended file had (`None`: a new file); its other
    namespaces are kept, and so are its empty nodes of `namespace` that no
    path in `stored` (the leaves saved now) nor in `paths` lies under, and that
    lie under none of `paths`: a node that now holds a leaf or another node is
    not empty, and one the new tree has empty holds nothing. `None` when no
    namespace has any (the key is then left out).

    >>> empty_nodes_text(None, 'jckpt', [(('i', 1),), (('i', 2),)])
    '{"jckpt": [[["i", 1]], [["i", 2]]]}'
    """
    table = {ns: ps for ns, ps in _parse_empty(old).items()}
    if old is not None and namespace in table:  # an append keeps the empties it does not fill
        olds = table[namespace]
        filled = _prefixes([*stored, *paths], {len(p) for p in olds}, proper=False)
        new = set(paths)
        kept = [p for p in olds  # neither above what is saved now nor below a new one
                if p not in filled and not any(p[:n] in new for n in range(len(p) + 1))]
        paths = list(dict.fromkeys([*kept, *paths]))
    table[namespace] = list(paths)
    return _empty_text(table)


def prefixed_empty_nodes(text: str | None, prefix: str | None) -> str | None:
    """`EMPTY_NODES_KEY`'s value with every namespace renamed as `prefix_namespace` renames
    the entries' (`prefix__ns`), so that the empty nodes stay with their namespace's entries.

    >>> prefixed_empty_nodes('{"jckpt": [[["k", "opt"]]]}', 'ema')
    '{"ema__jckpt": [[["k", "opt"]]]}'
    """
    if not prefix:
        return text
    return _empty_text({prefixed(ns, prefix): ps for ns, ps in _parse_empty(text).items()})


def prefix_header(header: Header, prefix: str | None) -> Header:
    """`header` with every entry's namespace `prefixed` (ids unchanged), and the empty nodes
    its metadata records of each namespace (`EMPTY_NODES_KEY`) moved with them: a pure function.

    >>> h = Header(metadata=(('jckpt.empty_nodes', '{"jckpt": [[["k", "opt"]]]}'),))
    >>> prefix_header(h, 'ema').metadata
    (('jckpt.empty_nodes', '{"ema__jckpt": [[["k", "opt"]]]}'),)
    """
    check_prefix(prefix)
    if not prefix:
        return header
    metadata = tuple((k, prefixed_empty_nodes(v, prefix) if k == EMPTY_NODES_KEY else v)
                     for k, v in header.metadata)
    metadata = tuple((k, v) for k, v in metadata if v is not None)  # nothing left to record
    return dataclasses.replace(header, metadata=metadata, tensors=tuple(
        dataclasses.replace(e, namespace=prefixed(e.namespace, prefix)) for e in header.tensors))


def merged_empty_nodes(texts: Iterable[str | None]) -> str | None:
    """The `EMPTY_NODES_KEY` value of a file holding the entries of files whose values are
    `texts`: every namespace's empty nodes, of every file (`jckpt.merge`), less those that
    another file's node lies under (no longer empty).

    >>> merged_empty_nodes(['{"a": [[["i", 0]]]}', None, '{"b": [[["k", "x"]]], "a": [[["i", 0]]]}'])
    '{"a": [[["i", 0]]], "b": [[["k", "x"]]]}'
    >>> merged_empty_nodes(['{"a": [[]]}', '{"a": [[["k", "z"]]]}'])  # the root holds z now
    '{"a": [[["k", "z"]]]}'
    """
    table: dict[str, list[KeyPath]] = {}
    for text in texts:
        for ns, paths in _parse_empty(text).items():
            table[ns] = list(dict.fromkeys([*table.get(ns, []), *paths]))
    above = {ns: _prefixes(ps, {len(p) for p in ps}, proper=True) for ns, ps in table.items()}
    return _empty_text({ns: [p for p in ps if p not in above[ns]] for ns, ps in table.items()})


def _prefixes(paths: Iterable[KeyPath], lengths: set[int], *, proper: bool) -> set[KeyPath]:
    """The prefixes of `paths` of the given `lengths` (`proper`: shorter than the path): a node
    is above one of `paths` when it is in this set, found in one lookup, not a scan of them all
    (a save of 200,000 leaves, a merge of files recording many empty nodes)."""
    return {q[:n] for q in paths for n in lengths if n < len(q) or (n == len(q) and not proper)}


def _empty_text(table: Mapping[str, Sequence[KeyPath]]) -> str | None:
    table = {ns: ps for ns, ps in table.items() if ps}
    if not table:
        return None
    return json.dumps({ns: [[list(c) for c in p] for p in ps] for ns, ps in sorted(table.items())})


def empty_nodes(text: str | None, namespace: str) -> list[KeyPath]:
    """The key paths of `namespace`'s empty nodes in `EMPTY_NODES_KEY`'s value.

    Never raises: a value that is not as `empty_nodes_text` writes it (or a
    path that is not one) is left out, as the nodes are only a hint for exports.

    >>> empty_nodes('{"jckpt": [[["i", 1]]], "opt": "bad"}', 'jckpt')
    [(('i', 1),)]
    """
    return _parse_empty(text).get(namespace, [])


def empty_node_namespaces(text: str | None) -> list[str]:
    """The namespaces `EMPTY_NODES_KEY`'s value records empty nodes of, in its order: one
    whose nodes are all empty (`optax.sgd`'s `EmptyState`s) holds no entry to name it.

    >>> empty_node_namespaces('{"opt": [[["i", 0]]], "bad": 1}')
    ['opt']
    """
    return list(_parse_empty(text))


def empty_nodes_table(text: str | None) -> dict[str, list[KeyPath]]:
    """Every namespace's empty nodes in `EMPTY_NODES_KEY`'s value, in its order, from one
    parse (`empty_nodes` of each namespace parses the value again). Never raises, as
    `empty_nodes`.

    >>> empty_nodes_table('{"opt": [[["i", 0]], []], "bad": 1}')
    {'opt': [(('i', 0),), ()]}
    """
    return _parse_empty(text)


def _parse_empty(text: str | None) -> dict[str, list[KeyPath]]:
    value = json_as(text, dict) or {}
    out: dict[str, list[KeyPath]] = {}
    for ns, paths in value.items():
        if isinstance(ns, str) and isinstance(paths, list):
            good = [p for p in (_path(q) for q in paths) if p is not None]
            if good:
                out[ns] = good
    return out


def _path(value: Any) -> KeyPath | None:
    """A stored key path from its JSON form `[[kind, key], ...]`, or None if it is not one
    (`[]` is the root's: a namespace that is itself one empty node)."""
    if not isinstance(value, list) or len(value) > MAX_PATH_LENGTH:
        return None
    out = []
    for c in value:
        if not (isinstance(c, list) and len(c) == 2 and c[0] in PATH_KINDS):
            return None
        kind, key = c
        if kind in INT_KINDS:
            if not isinstance(key, int) or isinstance(key, bool) or (key < 0 and kind != 'ki'):
                return None
        elif not isinstance(key, str):
            return None
        out.append((kind, key))
    return tuple(out)


__all__ = ['check_metadata', 'empty_node_namespaces', 'empty_nodes', 'empty_nodes_table',
           'empty_nodes_text',
           'merged_empty_nodes', 'parse_metrics', 'prefix_header',
           'prefixed_empty_nodes']
