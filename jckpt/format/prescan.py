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
reader's words too, at the first chunk of text that shows it; a quote left open is left to the
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

from jckpt.format.blanks import CHUNK, Buffer, chunks, find_blanks, holding, holds, outside
from jckpt.format.fastpath import PLACEHOLDER
from jckpt.format.limits import MAX_NDIM, MAX_PATH_LENGTH
from jckpt.format.sexp import MAX_DEPTH

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
#: The nesting levels indexed together (one pass over the text each): the header's fields,
#: then the entries' and metadata's down to their fields' values, then an index's arrays';
#: the first two groups at once when the header has no more than `_FEW` fields (as every
#: valid one: a crafted header of one field repeated is refused before the rest is indexed).
_LEVELS = ((1, 2), (3, 4, 5, 6), (7, 8))
_FEW = 64
#: Fields whose keys are compared at once (a few MB of temporaries).
_BATCH = 1 << 16
#: Bytes of a field's key compared at once (every known key is shorter; longer ones that
#: agree this far are compared in full before a refusal).
_KEY = 16
#: Bytes that end a list's first atom: white space, parentheses, a quote, a comment.
_ENDS = np.zeros(256, bool)
_ENDS[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32, 34, 40, 41, 59]] = True
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


def unbalanced(text: str | Buffer) -> str | None:
    """What the S-expression reader would say of `text` (best given as its bytes, read in
    place) when its parentheses certainly do not balance or nest deeper than `MAX_DEPTH`
    (outside quoted atoms, a quote left open running to the end); None otherwise, and where
    a comment could hold some. Counted a chunk at a time, quoted atoms found as the scan
    finds them: a header nested too deep after hundreds of thousands of entries is refused
    before the fast decoder builds them.

    >>> unbalanced('((a "(") b)'), unbalanced('((a ")") b'), unbalanced('(a ; )')
    (None, "unbalanced '(': the text ends inside a list", None)
    >>> unbalanced('(a ' + '(' * 65 + ')' * 65 + ')')
    'nesting deeper than 64'
    """
    body = text.encode('utf-8', 'surrogatepass') if isinstance(text, str) else text
    codes = np.frombuffer(body, np.uint8)
    if holds(codes, 59):
        return None
    blanks, depth = find_blanks(body, codes, None, open_end=True), 0
    for start, chunk in chunks(codes):
        at = outside(chunk, start, blanks)
        if at is None:  # no quoted atom in it: bounded 64 bytes at a time, most often enough
            ends = _within_bounds(chunk, depth)
            if ends is not None:
                depth = ends
                continue
            at = np.flatnonzero((chunk | 1) == 41) + start
        running = np.cumsum((codes[at] == 40).view(np.int8) * np.int32(2) - 1, dtype=np.int32)
        running += depth
        why = _fault(running)
        if why is not None:
            return why
        depth = int(running[-1]) if running.size else depth
    return "unbalanced '(': the text ends inside a list" if depth else None


#: Adds up the eight bytes of a 64-bit word (each at most 8) in its top byte.
_LANES = np.uint64(0x0101010101010101)


def _block_counts(mask: np.ndarray) -> np.ndarray:
    """How many of each 64 bytes of `mask` (0 or 1 each) are 1: eight words added at once
    (a byte each at most 8), then the bytes of their sum."""
    words = mask.view(np.uint64).reshape(-1, 8)
    total = words[:, 0] + words[:, 1] + words[:, 2] + words[:, 3]
    total += words[:, 4] + words[:, 5] + words[:, 6] + words[:, 7]
    return ((total * _LANES) >> np.uint64(56)).astype(np.int32)


def _within_bounds(chunk: np.ndarray, depth: int) -> int | None:
    """The depth after `chunk` (text without quoted atoms, from `depth`) when no list in it
    opens past `MAX_DEPTH`, told from each 64 bytes' counts of parentheses (a list opens
    there at most as deep as the depth before them and their opens); None when the counts
    cannot tell (then each parenthesis is counted). A valid header nests a few lists deep,
    so the counts tell, at a third of the cost. A list closed below 0 is left to the count
    at the end, as before (the readers refuse it, at no cost an amplified header adds)."""
    if chunk.size % 64:
        return None
    opens = _block_counts((chunk == 40).view(np.uint8))
    closes = _block_counts((chunk == 41).view(np.uint8))
    ends = np.cumsum(opens - closes, dtype=np.int32)
    ends += depth
    return None if (ends + closes).max() > MAX_DEPTH else int(ends[-1])


def _fault(running: np.ndarray) -> str | None:
    """What the S-expression reader says of a chunk's running depths first: a list closed
    that was not open, or one opened past `MAX_DEPTH`; None when neither."""
    if not running.size or (running.min() >= 0 and running.max() <= MAX_DEPTH):
        return None
    deep = running.max() > MAX_DEPTH and np.argmax(running > MAX_DEPTH) < (
        np.argmax(running < 0) if running.min() < 0 else running.size)
    return f"nesting deeper than {MAX_DEPTH}" if deep else "unbalanced ')'"


class _Lists:
    """The lists of a balanced text by nesting level: where each opens and closes, and how
    many lists it holds. Each level is found when first asked for, by a pass over the text's
    bytes that finds its group of `_LEVELS`: a header refused for its fields holds no index
    of the lists inside them."""

    def __init__(self, codes: np.ndarray, blanks: np.ndarray, counts: np.ndarray):
        self.codes, self._blanks, self._counts = codes, blanks, counts
        self._dtype = np.int32 if codes.size < 1 << 31 else np.int64
        self._cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._parents: dict[int, np.ndarray] = {}

    def level(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(opens, closes, inner)` of the lists at nesting level `n` (the whole text's is 1):
        text positions, and the lists each holds (balanced: half the parentheses between)."""
        if n not in self._cache:
            group = next((group for group in _LEVELS if n in group), (n,))
            if group == _LEVELS[0] and self._counts[2] <= _FEW:
                group += _LEVELS[1]
            self._collect(group)
        return self._cache[n]

    def _collect(self, levels: tuple[int, ...]) -> None:
        """Index `levels` in one pass over the text, into arrays of their exact size: where
        each list opens and closes (the k-th closing parenthesis of a level closes its k-th
        list), and the lists between (the ordinal of its opening parenthesis until then)."""
        levels = tuple(n for n in levels if n < self._counts.size)
        out = {n: [np.empty(self._counts[n], self._dtype) for _ in range(3)] for n in levels}
        filled = {n: [0, 0] for n in levels}
        for at, is_open, running, first in _parentheses(self.codes, self._blanks):
            level = (running + ~is_open).astype(np.int8)  # of the list each opens or closes
            order = np.argsort(level, kind='stable')  # a radix sort: by level, in text order
            ends = np.cumsum(np.bincount(level, minlength=self._counts.size))
            for n in levels:
                at_n = order[ends[n - 1]:ends[n]]
                opening = is_open[at_n]
                opens, closes, inner = out[n]
                picked, k = at_n[opening], filled[n][0]
                opens[k:k + picked.size], inner[k:k + picked.size] = at[picked], picked + first
                picked, k = at_n[~opening], filled[n][1]
                closes[k:k + picked.size] = at[picked]
                gap = inner[k:k + picked.size]  # the open's ordinal: opens come first
                np.subtract(picked + first - 1, gap, out=gap, casting='unsafe')
                gap //= 2  # the parentheses between, halved
                filled[n][0] += np.count_nonzero(opening)
                filled[n][1] += picked.size
        self._cache.update((n, tuple(out[n])) for n in levels)

    def parent(self, n: int) -> np.ndarray:
        """For each list at level `n`, which list of level `n - 1` holds it (its index)."""
        if n not in self._parents:
            outer, inner = self.level(n - 1)[0], self.level(n)[0]
            if outer.size == 1:  # the header's fields: all in one list, no index needed
                self._parents[n] = np.broadcast_to(np.int32(0), inner.shape)
                return self._parents[n]
            found = np.empty(inner.size, np.int32)
            for start in range(0, inner.size, CHUNK):  # no 8-byte index of them all
                found[start:start + CHUNK] = np.searchsorted(
                    outer, inner[start:start + CHUNK], side='right') - 1
            self._parents[n] = found
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


def _parentheses(codes: np.ndarray, blanks: np.ndarray):
    """`(at, is_open, running, first)` of the parentheses outside `blanks`, a chunk of text
    at a time: their places, which open, the depth after each, the ordinal of the first."""
    depth = seen = 0
    for start, chunk in chunks(codes):
        at = outside(chunk, start, blanks)
        at = np.flatnonzero((chunk | 1) == 41) + start if at is None else at
        is_open = codes[at] == 40
        running = np.cumsum(is_open.view(np.int8) * np.int32(2) - 1, dtype=np.int32) + depth
        yield at, is_open, running, seen
        depth = int(running[-1]) if running.size else depth
        seen += at.size


def _lists(codes: np.ndarray, blanks: np.ndarray) -> _Lists | None:
    """The lists of `codes` (parentheses in `blanks` aside; None if none), refused as the
    S-expression reader would unless they balance within `MAX_DEPTH`: counted a chunk at a
    time, so a text too deep stops at its first chunk that is."""
    counts = np.zeros(MAX_DEPTH + 2, np.int64)
    depth = 0
    for _, is_open, running, _ in _parentheses(codes, blanks):
        why = _fault(running)
        if why is not None:
            raise ShapeError(_MALFORMED + why)
        counts += np.bincount(running[is_open], minlength=counts.size)
        depth = int(running[-1]) if running.size else depth
    if depth != 0:
        raise ShapeError(_MALFORMED + "unbalanced '(': the text ends inside a list")
    return _Lists(codes, blanks, counts) if counts.any() else None


def check_header(text: str | Buffer, skip: tuple[int, int] | None = None) -> None:
    """Raise `ShapeError` when the header's text repeats what its format allows once.

    `text` is best given as the header's bytes (UTF-8), which are read in place: the scan
    then holds no copy of them, only an index of the lists it checks (a text is encoded
    first). `skip`: the places of the parentheses of a list whose inside is left out (a
    tensors list the fast decoder has read), as if it were empty."""
    body = text.encode('utf-8', 'surrogatepass') if isinstance(text, str) else text
    codes = np.frombuffer(body, np.uint8)
    blanks = find_blanks(body, codes, skip)
    found = _lists(codes, holding(codes, blanks)) if blanks is not None else None
    if found is None:
        return
    text = memoryview(body).cast('B')  # slices compared in place
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


def _fields(found: _Lists, text: Buffer, n: int, owners: np.ndarray, bounds: dict[str, int],
            what: Callable[[int], str], wanted: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Check the fields of the field lists at level `n` picked by `owners` (a mask over
    that level): no key twice, no known field beyond its bound. The fields of each `wanted`
    key (a mask over level `n + 1`). Checked `_BATCH` fields at a time (a crafted header
    repeats one field millions of times: the first batch finds it), then the field lists
    that span two batches as a whole."""
    fields, _, inner = found.level(n + 1)
    parent = found.parent(n + 1)
    mine = _nonzero(owners[parent])
    chosen: dict[str, list[np.ndarray]] = {key: [] for key in wanted}
    for start in range(0, mine.size, _BATCH):
        part = mine[start:start + _BATCH]
        keys = found.keys(fields[part])
        _check_fields(text, fields[part], keys, parent[part], inner[part], bounds, what)
        for key in wanted:
            chosen[key].append(part[keys == key.encode()])
    masks = {key: np.zeros(fields.size, bool) for key in wanted}
    for key, parts in chosen.items():
        for part in parts:
            masks[key][part] = True
    _check_pairs(found, text, n, mine, what)
    ends = parent[mine[_BATCH::_BATCH]]
    spanning = ends[ends == parent[mine[_BATCH - 1:-1:_BATCH]]]
    if spanning.size:
        part = mine[np.isin(parent[mine], spanning)]
        _check_fields(text, fields[part], found.keys(fields[part]), parent[part], inner[part],
                      {}, what)
    return masks


def _nonzero(mask: np.ndarray) -> np.ndarray:
    """`np.flatnonzero(mask)` as 4-byte numbers, found a chunk at a time (no 8-byte index)."""
    out = np.empty(np.count_nonzero(mask), np.int32)
    filled = 0
    for start in range(0, mask.size, CHUNK):
        found = np.flatnonzero(mask[start:start + CHUNK]) + start
        out[filled:filled + found.size] = found
        filled += found.size
    return out


def _check_pairs(found: _Lists, text: Buffer, n: int, mine: np.ndarray,
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
        cut = bytes(text[fields[k]:min(closes[k] + 1, fields[k] + 240)])
        short = _NO_SPACE.sub('', _SPACES.sub(' ', cut.decode('utf-8', 'replace')))
        short = short if len(short) <= 60 else short[:57] + '...'
        raise ShapeError(f"{owner}: field {short} is not a (key value) pair", _entry(owner))


def _check_fields(text: Buffer, fields: np.ndarray, keys: np.ndarray, parent: np.ndarray,
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


def _key(text: Buffer, at: int) -> str:
    """The first atom of the list opening at `at`, in full ('' if quoted or none): its bytes
    up to a byte that ends it, read as the tokenizer reads them (a non-ASCII space ends it
    too)."""
    m = _FIRST_BYTES.match(text, int(at))
    if m is None:
        return ''
    m = _FIRST_ATOM.match('(' + m[1].decode('utf-8', 'replace'))
    return m[1] if m else ''


def _entry(what: str) -> str | None:
    """`#N` of 'tensor #N' or 'array #N', what errors name the entry by."""
    return what[what.index('#'):] if '#' in what else None


_MALFORMED = "header is not a well-formed S-expression: "
_SPLICED = re.compile(re.escape(PLACEHOLDER.encode()) + rb'[0-9]+')
_FIRST_BYTES = re.compile(rb'\([\t-\r\x1c-\x1f ]*([^\t-\r\x1c-\x1f ()";]+)')
_FIRST_ATOM = re.compile(r'\(\s*([^\s()";]+)')
_SPACES = re.compile(r'\s+')
_NO_SPACE = re.compile(r'(?<=\() | (?=\))')


def _items(found: _Lists, text: Buffer, n: int, values: np.ndarray, bounds: dict[str, int],
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


def _repeats(text: memoryview, opens: np.ndarray, closes: np.ndarray, most: int) -> Iterator[int]:
    """Which list repeats verbatim the `most` lists before it (siblings, in text order):
    lists of one length compared, `_BATCH` at a time (a crafted run stops the first)."""
    spliced = holds(np.frombuffer(text, np.uint8), PLACEHOLDER.encode()[0])
    run = 0
    last = -1
    for start in range(1, opens.size, _BATCH):
        length = closes[start - 1:start + _BATCH] - opens[start - 1:start + _BATCH]
        for k in np.flatnonzero(length[1:] == length[:-1]) + start:
            a, b, size = int(opens[k - 1]), int(opens[k]), int(closes[k] - opens[k]) + 1
            if (_unspliced(text[a:a + size]) == _unspliced(text[b:b + size]) if spliced
                    else text[a:a + size] == text[b:b + size]):
                run = run + 1 if last == k - 1 else 1
                last = k
                if run >= most:
                    yield int(k)
                    return


def _unspliced(text: memoryview) -> bytes:
    """`text` without the numbers of the placeholders that stand for an index's pieces lists
    (`jckpt.format.fastpath`): arrays that differ in pieces alone are still one array."""
    return _SPLICED.sub(PLACEHOLDER.encode(), text)


__all__ = ['MAX_METADATA_REPEATS', 'ShapeError', 'check_header', 'unbalanced']
