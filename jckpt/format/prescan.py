"""A linear scan of a header's text that refuses crafted repetitions before any list is built.

The general S-expression reader builds a Python list per parenthesis, some
hundred bytes and a microsecond each: a header of tens of MB in which one
field, one path component or one entry is repeated hundreds of thousands of
times cost it seconds and hundreds of MB before `jckpt.format.header`
refused the first duplicate it came to. `check_header` finds those faults
first, with numpy over the text's bytes (no list built, a few bytes of
memory per byte of text), and only where the readers would refuse them
anyway, with the same words:

* a field list (the header, an entry, an index's `sharded` field and each
  of its arrays) whose field appears twice;
* a known field holding far more lists than any valid one can (a `dims` with
  a hundred values, a `path` of far more than `limits.MAX_PATH_LENGTH` components);
* a field holding two lists or more beside its key: never a `(key value)` pair;
* an entry (or an index's array) that repeats the one before it verbatim:
  a duplicate identity;
* a metadata pair repeated verbatim more than `MAX_METADATA_REPEATS` times in a row.

Text whose parentheses do not balance within `sexp.MAX_DEPTH` is refused with the
reader's words too, at the first MiB that shows it; a quote left open is left to the
reader, which reports it.

>>> check_header('((version 1) (tensors ()))')
>>> check_header('((version 1) (version 1) (tensors ()))')
Traceback (most recent call last):
...
jckpt.format.prescan.ShapeError: header: field version appears twice
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np

from jckpt.format.fastpath import PLACEHOLDER
from jckpt.format.limits import MAX_NDIM, MAX_PATH_LENGTH
from jckpt.format.sexp import MAX_DEPTH, SPLIT_QUOTED, unterminated

#: Most times one metadata pair may follow itself verbatim (later keys win, so a repeat
#: changes nothing; jckpt writes none).
MAX_METADATA_REPEATS = 16

# Most lists a known field `(key value)` holds, value included (a field not named: any).
_PATH = 1 + MAX_PATH_LENGTH
_HEADER = {'version': 0, 'alignment': 0, 'writer': 0, 'header_checksum': 1}
_ENTRY = {'id': 0, 'namespace': 0, 'label': 1, 'prec': 0, 'dims': 1, 'padding': 2 + MAX_NDIM,
          'offset': 0, 'byte_length': 0, 'path': _PATH, 'checksum': 1, 'key_impl': 0,
          'slice': 1 + MAX_NDIM, 'global_dims': 1}
_SHARDED = {'layout': 0, 'process_count': 0, 'files': 1}
_ARRAY = {'id': 0, 'namespace': 0, 'label': 1, 'prec': 0, 'global_dims': 1, 'path': _PATH,
          'key_impl': 0}
#: Lists beyond its bound a field may hold before the scan refuses it: a few too many are
#: left to the reader, whose error says more precisely what is wrong.
_SLACK = 64
#: Fields whose keys are compared at once (a few MB of temporaries).
_BATCH = 1 << 16
#: Bytes of a field's key compared at once (every known key is shorter; longer ones that
#: agree this far are compared in full before a refusal).
_KEY = 16
_BLANK = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|;[^\n]*')
#: Bytes that end a list's first atom: white space and parentheses.
_ENDS = np.zeros(256, bool)
_ENDS[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32, 40, 41]] = True
#: The offsets of a key's bytes from its list's parenthesis, and how many lists' keys are
#: read at once (one numpy pass each: a header's few fields cost a few calls, not `_KEY`).
_KEY_STEPS = np.arange(1, _KEY + 1)
_KEY_ROWS = 1 << 12


class ShapeError(ValueError):
    """The scan refuses the header: it repeats what its format allows once, or does not
    balance (`entry`: the entry at fault, `#N`, if one is)."""

    def __init__(self, message: str, entry: str | None = None):
        super().__init__(message)
        self.entry = entry


def _codes(text: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The text's characters as bytes (one each, so positions are the text's; encoded a MiB
    at a time, no second copy of the text), and where its quotes are: a quoted atom runs
    from an even-numbered one to the next. None when a quote is left open (the reader
    reports it)."""
    if ';' in text or '\\' in text:  # comments or escapes (rare): the tokenizer's reading
        codes = _codes_read(text)
        return None if codes is None else (codes, np.empty(0, np.int64))
    codes = _encoded(text)
    quotes = [np.flatnonzero(chunk == 34) + start  # without escapes, quotes pair up in order
              for start, chunk in _chunks(codes)]
    quotes = np.concatenate(quotes) if quotes else np.empty(0, np.int64)
    return None if quotes.size % 2 else (codes, quotes)


def _codes_read(text: str) -> np.ndarray | None:
    """The bytes of a text with comments or escapes, its quoted atoms and comments blanked
    as the tokenizer reads them."""
    if ';' in text:  # the tokenizer's order: a quote inside a comment opens nothing
        blanked = _BLANK.sub(lambda m: ' ' * len(m[0]) if m[0][0] == ';' else 'x' * len(m[0]),
                             text)
        if '"' in blanked:
            return None
        return np.frombuffer(blanked.encode('latin-1', 'replace'), dtype=np.uint8)
    codes = _encoded(text)
    for m in SPLIT_QUOTED.finditer(text):  # blanked in place, an atom at a time: a list of
        if m.end() == len(text) and unterminated(['', m[0], '']):  # them all and the text
            return None  # joined again cost six times a crafted header's size
        codes[m.start():m.end()] = 120  # 'x'
    return codes


def _encoded(text: str) -> np.ndarray:
    """The text's characters as bytes, one each (others as '?'), a MiB at a time."""
    codes = np.empty(len(text), np.uint8)
    for start, chunk in _chunks(codes):
        chunk[:] = np.frombuffer(text[start:start + chunk.size].encode('latin-1', 'replace'),
                                 dtype=np.uint8)
    return codes


def unbalanced(text: str) -> str | None:
    """What the S-expression reader would say of `text` when its parentheses certainly do
    not balance (more of one kind than of the other outside quoted atoms); None otherwise,
    and where a comment could hold some. Two counts at C speed, and a look at each quoted
    atom (a header holds few).

    >>> unbalanced('((a "(") b)'), unbalanced('((a ")") b'), unbalanced('(a ; )')
    (None, "unbalanced '(': the text ends inside a list", None)
    """
    if ';' in text:
        return None
    opens, closes = text.count('('), text.count(')')
    for m in SPLIT_QUOTED.finditer(text) if '"' in text else ():  # closed or not; one at a
        opens, closes = opens - m[0].count('('), closes - m[0].count(')')  # time, not a list
    if opens == closes:
        return None
    return "unbalanced '(': the text ends inside a list" if opens > closes else "unbalanced ')'"


class _Lists:
    """The lists of a balanced text by nesting level: where each opens and closes, and how
    many lists it holds."""

    def __init__(self, codes: np.ndarray, depth: np.ndarray, at: np.ndarray):
        self.codes, self._depth, self._at = codes, depth, at
        self._is_open = codes[at] == 40
        self._cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._parents: dict[int, np.ndarray] = {}

    def level(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(opens, closes, inner)` of the lists at nesting level `n` (the whole text's is 1):
        text positions, and the lists each holds (balanced: half what lies between)."""
        if n not in self._cache:
            opens = np.flatnonzero(self._is_open & (self._depth == n))
            closes = np.flatnonzero(~self._is_open & (self._depth == n - 1))
            inner = ((closes - opens - 1) // 2).astype(np.int32)
            self._cache[n] = (self._at[opens], self._at[closes], inner)
        return self._cache[n]

    def parent(self, n: int) -> np.ndarray:
        """For each list at level `n`, which list of level `n - 1` holds it (its index)."""
        if n not in self._parents:
            outer = self.level(n - 1)[0]
            self._parents[n] = (np.searchsorted(outer, self.level(n)[0], side='right')
                                - 1).astype(np.int32)
        return self._parents[n]

    def keys(self, opens: np.ndarray) -> np.ndarray:
        """The first `_KEY` bytes of each list's first atom (zero-padded), `_KEY_ROWS` lists
        at a time (an index per byte of those rows only: a few hundred KiB at most)."""
        block = np.empty((opens.size, _KEY), np.uint8)
        last = self.codes.size - 1
        for start in range(0, opens.size, _KEY_ROWS):
            rows = opens[start:start + _KEY_ROWS, None].astype(np.int64)
            chars = self.codes[np.minimum(rows + _KEY_STEPS, last)]
            ended = np.logical_or.accumulate(_ENDS[chars], axis=1)
            block[start:start + rows.shape[0]] = np.where(ended, 0, chars)
        return block.view(f'S{_KEY}').ravel()


def _lists(codes: np.ndarray, quotes: np.ndarray) -> _Lists | None:
    """The lists of `codes` (parentheses in quoted atoms aside; None if none), refused as
    the S-expression reader would unless they balance within `MAX_DEPTH`: counted a MiB at
    a time, so a text too deep stops at its first MiB that is."""
    upper = sum(np.count_nonzero((chunk == 40) | (chunk == 41)) for _, chunk in _chunks(codes))
    ats, depths = np.empty(upper, np.int32), np.empty(upper, np.int8)  # filled in place:
    depth = filled = 0  # no second copy of either as the chunks are joined
    for start, chunk in _chunks(codes):
        at = np.flatnonzero((chunk == 40) | (chunk == 41)).astype(np.int32) + start
        if quotes.size:
            at = at[np.searchsorted(quotes, at) % 2 == 0]
        running = np.cumsum((codes[at] == 40).view(np.int8) * np.int32(2) - 1) + depth
        if running.size and (running.min() < 0 or running.max() > MAX_DEPTH):
            deep = running.max() > MAX_DEPTH and np.argmax(running > MAX_DEPTH) < (
                np.argmax(running < 0) if running.min() < 0 else running.size)
            raise ShapeError(_MALFORMED + (f"nesting deeper than {MAX_DEPTH}" if deep
                                           else "unbalanced ')'"))
        depth = int(running[-1]) if running.size else depth
        ats[filled:filled + at.size] = at
        depths[filled:filled + at.size] = running
        filled += at.size
    if depth != 0:
        raise ShapeError(_MALFORMED + "unbalanced '(': the text ends inside a list")
    if not filled:
        return None
    return _Lists(codes, depths[:filled], ats[:filled])


def _chunks(codes: np.ndarray):
    """`(start, view)` of `codes` a MiB at a time."""
    for start in range(0, codes.size, 1 << 20):
        yield np.int32(start), codes[start:start + (1 << 20)]


def check_header(text: str) -> None:
    """Raise `ShapeError` when the header's text repeats what its format allows once."""
    read = _codes(text)
    found = _lists(*read) if read is not None else None
    if found is None:
        return
    roots = found.level(1)[0]
    top = _fields(found, text, 1, np.ones(roots.size, bool), _HEADER, lambda k: 'header',
                  ('tensors', 'metadata', 'sharded'))
    values = {key: top[key][found.parent(3)] for key in top}  # the lists they hold
    if values['tensors'].any():
        _items(found, text, 3, values['tensors'], _ENTRY, 'tensor', 'duplicate entry identity')
    if values['metadata'].any():
        pairs, closes, _ = found.level(4)
        mine = np.flatnonzero(values['metadata'][found.parent(4)])
        for _ in _repeats(text, pairs[mine], closes[mine], MAX_METADATA_REPEATS + 1):
            raise ShapeError(f"metadata: a pair is repeated more than {MAX_METADATA_REPEATS} "
                             "times in a row")
    if values['sharded'].any():
        inner = _fields(found, text, 3, values['sharded'], _SHARDED, lambda k: 'sharded',
                        ('arrays',))
        arrays = inner['arrays'][found.parent(5)]
        if arrays.any():
            _items(found, text, 5, arrays, _ARRAY, 'array', 'duplicate array')


def _fields(found: _Lists, text: str, n: int, owners: np.ndarray, bounds: dict[str, int],
            what: Callable[[int], str], wanted: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Check the fields of the field lists at level `n` picked by `owners` (a mask over
    that level): no key twice, no known field beyond its bound. The fields of each `wanted`
    key (a mask over level `n + 1`). Checked `_BATCH` fields at a time (a crafted header
    repeats one field millions of times: the first batch finds it), then the field lists
    that span two batches as a whole."""
    fields, _, inner = found.level(n + 1)
    parent = found.parent(n + 1)
    mine = np.flatnonzero(owners[parent]).astype(np.int32)
    masks = {key: np.zeros(fields.size, bool) for key in wanted}
    for start in range(0, mine.size, _BATCH):
        part = mine[start:start + _BATCH]
        keys = found.keys(fields[part])
        _check_fields(text, fields[part], keys, parent[part], inner[part], bounds, what)
        for key in wanted:
            masks[key][part[keys == key.encode()]] = True
    _check_pairs(found, text, n, mine, what)
    ends = parent[mine[_BATCH::_BATCH]]
    spanning = ends[ends == parent[mine[_BATCH - 1:-1:_BATCH]]]
    if spanning.size:
        part = mine[np.isin(parent[mine], spanning)]
        _check_fields(text, fields[part], found.keys(fields[part]), parent[part], inner[part],
                      {}, what)
    return masks


def _check_pairs(found: _Lists, text: str, n: int, mine: np.ndarray,
                 what: Callable[[int], str]) -> None:
    """Refuse a field of the level `n + 1` lists `mine` that holds two lists or more beside
    its key: never a `(key value)` pair, which the reader finds only once it has built them
    all (a field that holds a pair repeated 400,000 times: seconds and hundreds of MB)."""
    (fields, closes, _), parent = found.level(n + 1), found.parent(n + 1)
    held = np.bincount(found.parent(n + 2), minlength=fields.size)
    over = mine[held[mine] > 1]
    if over.size:
        k = over[np.argmin(fields[over])]
        owner = what(parent[k])
        short = _NO_SPACE.sub('', _SPACES.sub(' ', text[fields[k]:min(closes[k] + 1, fields[k] + 240)]))
        short = short if len(short) <= 60 else short[:57] + '...'
        raise ShapeError(f"{owner}: field {short} is not a (key value) pair", _entry(owner))


def _check_fields(text: str, fields: np.ndarray, keys: np.ndarray, parent: np.ndarray,
                  inner: np.ndarray, bounds: dict[str, int], what: Callable[[int], str]) -> None:
    """Refuse a key twice in one field list, or a known field beyond its bound (`fields`:
    where they open; `parent`: which list holds each, as `what` names it)."""
    order = np.lexsort((fields, keys, parent))
    by_parent, by_key, by_place = parent[order], keys[order], fields[order]
    twice = (by_parent[1:] == by_parent[:-1]) & (by_key[1:] == by_key[:-1])
    first, later = by_place[:-1][twice], by_place[1:][twice]
    for k in np.argsort(np.maximum(first, later))[:64]:  # in text order, each checked whole
        key = _key(text, first[k])
        if key and key == _key(text, later[k]):
            owner = what(parent[fields == later[k]][0])
            raise ShapeError(f"{owner}: field {key} appears twice", _entry(owner))
    for key, bound in bounds.items():
        over = (keys == key.encode()) & (inner > bound + _SLACK)
        if over.any():
            owner, lists = what(parent[over][0]), int(inner[over][0])
            why = (f"key path of {lists - 1} components is deeper than {MAX_PATH_LENGTH}"
                   if key == 'path' else  # the words of the reader's refusal
                   f"field {key} holds {lists} lists, more than any valid one ({bound})")
            raise ShapeError(f"{owner}: {why}", _entry(owner))


def _key(text: str, at: int) -> str:
    """The first atom of the list opening at `at`, in full ('' if quoted or none)."""
    m = _FIRST_ATOM.match(text, int(at))
    return m[1] if m else ''


def _entry(what: str) -> str | None:
    """`#N` of 'tensor #N' or 'array #N', what errors name the entry by."""
    return what[what.index('#'):] if '#' in what else None


_MALFORMED = "header is not a well-formed S-expression: "
_SPLICED = re.compile(re.escape(PLACEHOLDER) + '[0-9]+')
_FIRST_ATOM = re.compile(r'\(\s*([^\s()";]+)')
_SPACES = re.compile(r'\s+')
_NO_SPACE = re.compile(r'(?<=\() | (?=\))')



def _items(found: _Lists, text: str, n: int, values: np.ndarray, bounds: dict[str, int],
           noun: str, duplicate: str) -> None:
    """Check the items (entries, arrays) of the lists at level `n` that `values` picks (a
    mask): each item's fields, and no item repeating the one before it."""
    items, closes, _ = found.level(n + 1)
    mine = values[found.parent(n + 1)]
    rank = np.cumsum(mine, dtype=np.int32) - 1

    def what(k: int) -> str:
        return f"{noun} #{rank[k]}"

    picked = np.flatnonzero(mine)
    for k in _repeats(text, items[picked], closes[picked], 1):  # first: it needs no keys
        raise ShapeError(f"{duplicate}: {what(picked[k])} repeats the one before it",
                         _entry(what(picked[k])))
    _fields(found, text, n + 1, mine, bounds, what)


def _repeats(text: str, opens: np.ndarray, closes: np.ndarray, most: int) -> Iterator[int]:
    """Which list repeats verbatim the `most` lists before it (siblings, in text order):
    lists of one length compared, `_BATCH` at a time (a crafted run stops the first)."""
    run = 0
    last = -1
    for start in range(1, opens.size, _BATCH):
        length = closes[start - 1:start + _BATCH] - opens[start - 1:start + _BATCH]
        for k in np.flatnonzero(length[1:] == length[:-1]) + start:
            a, b, size = int(opens[k - 1]), int(opens[k]), int(closes[k] - opens[k]) + 1
            if _unspliced(text[a:a + size]) == _unspliced(text[b:b + size]):
                run = run + 1 if last == k - 1 else 1
                last = k
                if run >= most:
                    yield int(k)
                    return


def _unspliced(text: str) -> str:
    """`text` without the numbers of the placeholders that stand for an index's pieces lists
    (`jckpt.format.fastpath`): arrays that differ in pieces alone are still one array."""
    return _SPLICED.sub(PLACEHOLDER, text) if PLACEHOLDER in text else text


__all__ = ['MAX_METADATA_REPEATS', 'ShapeError', 'check_header', 'unbalanced']
