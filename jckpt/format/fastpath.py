"""The fast decoder of entries laid out exactly as jckpt writes them.

A checkpoint of 100,000 leaves has a header of 100,000 entries; building a
generic S-expression tree for it and validating it field by field would
dominate a load. Entries in jckpt's canonical layout are instead matched in
one step, by the C accelerator (`_canonical.c`, built with the package when
a compiler is available) or, without it, one regular expression. Anything
else (quoted atoms, padding, unknown fields, an inconsistent length) makes
`canonical_entries` answer `None` and the general reader of
`jckpt.format.header` decides, so every path accepts and produces
exactly the same headers (`tests/format/test_codec.py` checks the three agree).
"""

from __future__ import annotations

import dataclasses
import math
import re

from jckpt.format import precs
from jckpt.format.entries import INT_KINDS, MAX_INT64, Entry
from jckpt.format.limits import MAX_NDIM, MAX_PATH_LENGTH

_A = r"[!$%&'*+,\-./0-9:<=>?@A-Z\[\]^_`a-z{}~]+"
_P = rf"\((?:k|a) {_A}\)|\((?:ki|i|f) -?[0-9]{{1,19}}\)"
_CANONICAL_ENTRY = re.compile(
    rf"\s*\(\(id ([0-9]{{1,19}})\) \(namespace ([A-Za-z_][A-Za-z0-9_]*)\) "
    rf"\(label \(((?:{_A}(?: {_A})*)?)\)\) \(prec ([A-Za-z0-9_]+)\) "
    rf"\(dims \(((?:[0-9]{{1,19}}(?: [0-9]{{1,19}})*)?)\)\) \(padding none\) "
    rf"\(offset ([0-9]{{1,19}})\) "
    rf"\(byte_length ([0-9]{{1,19}})\)(?: \(path \(((?:(?:{_P})(?: (?:{_P}))*)?)\)\))?"
    rf"(?: \(checksum \(([A-Za-z0-9_]+) ([0-9a-f]+)\)\))?(?: \(key_impl ([A-Za-z0-9_]+)\))?\)")
_CANONICAL_HEAD = re.compile(r"\(\(version [0-9]+\)\s*(?:\(alignment [0-9]+\)\s*)?\(tensors\s*\(")
_CANONICAL_TAIL = re.compile(r"\s*\)")
_COMPONENT = re.compile(rf"\((k|ki|i|a|f) ({_A})\)")
_FIELDS = tuple(f.name for f in dataclasses.fields(Entry))


try:  # the same decoder in C (built with the package when a compiler is available)
    from jckpt.format import _canonical as accelerator
except ImportError:  # pragma: no cover - exercised where no compiler was available
    accelerator = None
_PREC_SIZES = {p: (p, precs.element_size(p)) for p in precs.ALL_PRECS}
_KINDS = ('k', 'ki', 'i', 'a', 'f')


def _within_limits(entries: list[Entry]) -> bool:
    """Whether no entry needs `jckpt.format.limits`' checks (too many dims, an empty shape
    whose other dims could be huge, a key path too long): the general reader reports those."""
    return not any(len(e.dims) > MAX_NDIM or (not e.byte_length and e.dims)
                   or (e.path is not None and len(e.path) > MAX_PATH_LENGTH) for e in entries)


def canonical_entries(text: str, *, accelerate: bool = True) -> tuple[list[Entry], int, int] | None:
    """Entries of a header laid out as jckpt writes it, or None to use the general reader.

    Returns `(entries, list_open, list_close)`: the positions of the
    parentheses around the tensors list, so the rest can be read generally.
    `accelerate=False` uses the regular expression even when the C
    accelerator is built (the tests compare the two).
    """
    head = _CANONICAL_HEAD.match(text)
    if head is None:
        return None
    if accelerate and accelerator is not None:
        found = accelerator.decode_entries(text, head.end(), Entry, _FIELDS, _PREC_SIZES, _KINDS)
        if found is None or not _within_limits(found[0]):
            return None
        return found[0], head.end() - 1, found[1]
    scanner = _CANONICAL_ENTRY.scanner(text, head.end())
    entries: list[Entry] = []
    append = entries.append
    new = object.__new__
    setattr_ = object.__setattr__  # Entry is frozen; this bypasses its __setattr__
    element_size = precs.element_size
    prod = math.prod
    int_kinds = INT_KINDS
    findall = _COMPONENT.findall
    pos = head.end()
    while (m := scanner.match()) is not None:
        (ident, namespace, label, prec, dims, offset, byte_length, path, algo, digest,
         key_impl) = m.groups()
        if prec not in precs.ALL_PRECS:
            return None
        dims = tuple(map(int, dims.split())) if dims else ()
        byte_length = int(byte_length)
        if prod(dims) * element_size(prec) != byte_length or byte_length > MAX_INT64:
            return None  # let the general reader report it
        if path is not None:
            path = tuple([(k, int(v)) if k in int_kinds else (k, v) for k, v in findall(path)])
        e = new(Entry)
        for name, value in zip(_FIELDS, (
                int(ident), namespace, prec, dims, int(offset), byte_length,
                tuple(label.split(' ')) if label else (), None, path,
                (algo, digest) if algo is not None else None, key_impl, None, None, ())):
            setattr_(e, name, value)
        append(e)
        pos = m.end()
    tail = _CANONICAL_TAIL.match(text, pos)
    if tail is None or text[tail.end() - 1] != ')' or not _within_limits(entries):
        return None
    return entries, head.end() - 1, tail.end() - 1


__all__ = ['accelerator', 'canonical_entries']
