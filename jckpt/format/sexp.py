"""S-expressions with OCaml (sexplib) quoting: the header's text syntax.

A value is an atom (`str`) or a list of values (`list`). The reader has
two paths that give identical results:

* a fast path for the common header (no backslashes, comments or control
  bytes outside quoted atoms), which rewrites the text into JSON with a few
  C-speed regular-expression passes and lets `json.loads` build it;
* a tokenizer for everything else.

Both check the nesting depth before building anything, so a hostile header
cannot exhaust the stack.

>>> parse('((version 1) (label ("a b" c)))')
[['version', '1'], ['label', ['a b', 'c']]]
>>> dumps(['label', ['a b', 'c']])
'(label ("a b" c))'
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Sequence

import numpy as np

Sexp = str | list["Sexp"]

#: Deepest nesting the reader accepts. A jckpt header nests five deep.
MAX_DEPTH = 64


class SexpError(ValueError):
    """The text is not one well-formed S-expression."""


# --- reading ---------------------------------------------------------------

_QUOTED = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# A quoted atom, or an unterminated one to the end of the text: a match never fails once
# started, so splitting is linear (retrying at every later quote was quadratic).
SPLIT_QUOTED = re.compile(r'("[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z))', re.DOTALL)
_FAST_UNSAFE = re.compile(r'[^\t\n\r -~]|[\\;#|"]')
_ATOM_SPLIT = re.compile(r'([^\s()]+)')
_COMMA_BEFORE_CLOSE = re.compile(r',(?=\s*\])')
# a trailing comma before ']', outside the JSON strings (group 1 skips over them whole)
_TRAILING_COMMA = re.compile(r'("[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z))|,(\s*)\]')
_TOKEN = re.compile(
    r'(?P<ws>\s+)|(?P<comment>;[^\n]*)|(?P<open>\()|(?P<close>\))'
    r'|(?P<quoted>"[^"\\]*(?:\\.[^"\\]*)*")|(?P<atom>[^\s()";]+)|(?P<bad>.)',
    re.DOTALL,
)
_ESCAPE = re.compile(rb'\\(?:([\\"\'ntrb ])|(\d{3})|x([0-9a-fA-F]{2})|\n[ \t]*)')
#: A quoted atom's inside whose only escapes are \" and \\ (`_unescape`'s common case).
_QUOTES_ONLY = re.compile(r'[^\\]*(?:\\["\\][^\\]*)*')
_QUOTE_ESCAPE = re.compile(r'\\(["\\])')
_SIMPLE_ESCAPES = {b'\\': b'\\', b'"': b'"', b"'": b"'", b'n': b'\n', b't': b'\t',
                   b'r': b'\r', b'b': b'\b', b' ': b' '}


def _unescape(body: str) -> str:
    """Decode the inside of a quoted atom (OCaml escapes; bytes are UTF-8)."""
    if '\\' not in body:
        return body
    if body.isascii() and _QUOTES_ONLY.fullmatch(body):  # JSON in metadata: \" and \\ alone
        return _QUOTE_ESCAPE.sub(r'\1', body)

    def sub(m: re.Match[bytes]) -> bytes:
        simple, dec, hexa = m.groups()
        if simple is not None:
            return _SIMPLE_ESCAPES[simple]
        if dec is not None:
            value = int(dec)
            if value > 255:
                raise SexpError(f"escape \\{dec.decode()} is out of range")
            return bytes([value])
        if hexa is not None:
            return bytes([int(hexa, 16)])
        return b''  # backslash-newline: line continuation

    raw = _ESCAPE.sub(sub, body.encode('utf-8'))
    try:
        return raw.decode('utf-8')
    except UnicodeDecodeError as e:
        raise SexpError(f"quoted atom is not UTF-8: {e}") from None


def _check_depth(structural: str) -> None:
    """Raise unless parentheses in `structural` balance within MAX_DEPTH.

    Counted a MiB at a time in small integers: a header of 40 MB took 500 MB of
    temporaries (8 bytes of depth per byte of text) and seconds when counted at once.
    """
    check_depth(np.frombuffer(structural.encode('utf-8', 'surrogatepass'), dtype=np.uint8))


def check_depth(codes: np.ndarray) -> None:
    """`_check_depth` of text already as bytes (`codes`, one per character or UTF-8 byte)."""
    depth = 0
    for start in range(0, codes.size, _DEPTH_CHUNK):
        chunk = codes[start:start + _DEPTH_CHUNK]
        steps = (chunk == 40).view(np.int8) - (chunk == 41).view(np.int8)
        running = np.cumsum(steps, dtype=np.int32)
        running += depth
        if running.min() < 0:
            raise SexpError("unbalanced ')'")
        if running.max() > MAX_DEPTH:
            raise SexpError(f"nesting deeper than {MAX_DEPTH}")
        depth = int(running[-1])
    if depth != 0:
        raise SexpError("unbalanced '(': the text ends inside a list")


#: Bytes of text `_check_depth` counts at a time.
_DEPTH_CHUNK = 1 << 20


def _parse_fast(parts: list[str]) -> Sexp:
    """`parts` alternate unquoted text and quoted atoms (from re.split)."""
    out = []
    for n, part in enumerate(parts):
        if n % 2:
            out.append(json.dumps(_unescape(part[1:-1])) + ',')
        else:
            split = _ATOM_SPLIT.split(part)  # separators and atoms, alternating
            split[1::2] = map('"%s",'.__mod__, split[1::2])
            out.append(''.join(split).replace('(', '[').replace(')', '],'))
    text = ''.join(out)
    if any(',' in part or '\\' in part for part in parts):  # a JSON string may hold ",]"
        text = _TRAILING_COMMA.sub(lambda m: m[1] or m[2] + ']', text)
    else:  # every comma is one this function wrote
        text = _COMMA_BEFORE_CLOSE.sub('', text)
    text = text.rstrip().rstrip(',')
    # Several top-level values become one list so json.loads rejects them.
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise SexpError("expected exactly one S-expression") from None


def _parse_slow(text: str) -> Sexp:
    stack: list[list[Sexp]] = [[]]
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup
        if kind in ('ws', 'comment'):
            continue
        if kind == 'open':
            if len(stack) > MAX_DEPTH:
                raise SexpError(f"nesting deeper than {MAX_DEPTH}")
            stack.append([])
        elif kind == 'close':
            if len(stack) == 1:
                raise SexpError("unbalanced ')'")
            done = stack.pop()
            stack[-1].append(done)
        elif kind == 'quoted':
            stack[-1].append(_unescape(m.group()[1:-1]))
        elif kind == 'atom':
            stack[-1].append(m.group())
        else:
            raise SexpError(f"unexpected character {m.group()!r} at offset {m.start()}")
    if len(stack) != 1:
        raise SexpError("unbalanced '(': the text ends inside a list")
    if len(stack[0]) != 1:
        raise SexpError(f"expected exactly one S-expression, found {len(stack[0])}")
    return stack[0][0]


def parse(text: str) -> Sexp:
    """Read exactly one S-expression from `text`.

    Raises `SexpError` on malformed input or nesting deeper than
    `MAX_DEPTH`.
    """
    parts = SPLIT_QUOTED.split(text)
    structural = ''.join(parts[0::2])
    if ';' in structural:  # a comment may hold parentheses and quotes: the tokenizer's work
        return _parse_slow(text)
    if unterminated(parts):  # what the tokenizer would come to, after building all before it
        at = len(text) - len(parts[-2]) - len(parts[-1])
        raise SexpError(f"unexpected character '\"' at offset {at}")
    _check_depth(structural)  # before either path builds a list: the tokenizer's took seconds
    if _FAST_UNSAFE.search(structural) is None:
        return _parse_fast(parts)
    return _parse_slow(text)


def unterminated(parts: list[str]) -> bool:
    """Whether `SPLIT_QUOTED.split`'s last quoted part runs to the end unclosed."""
    return len(parts) > 1 and _QUOTED.fullmatch(parts[-2]) is None


def parse_slow(text: str) -> Sexp:
    """The tokenizer path of `parse`, exposed for testing."""
    return _parse_slow(text)


# --- writing ---------------------------------------------------------------

_PLAIN_ATOM = re.compile(r'[!#-\'*-:<-~]+')  # printable ASCII except space ( ) " ;
_CHAR_ESCAPES = {'"': '\\"', '\\': '\\\\', '\n': '\\n', '\t': '\\t', '\r': '\\r', '\b': '\\b'}


@functools.lru_cache(maxsize=1 << 16)  # labels and path keys repeat across entries
def quote(atom: str) -> str:
    """Spell `atom` so that it reads back as the same atom.

    >>> quote('kernel'), quote('a b'), quote('')
    ('kernel', '"a b"', '""')
    """
    if _PLAIN_ATOM.fullmatch(atom) and '\\' not in atom and '#|' not in atom \
            and '|#' not in atom and not atom.startswith('#;'):
        return atom
    out = ['"']
    for byte in atom.encode('utf-8'):
        ch = chr(byte)
        if ch in _CHAR_ESCAPES:
            out.append(_CHAR_ESCAPES[ch])
        elif 32 <= byte < 127:
            out.append(ch)
        else:
            out.append(f'\\{byte:03d}')
    out.append('"')
    return ''.join(out)


class Verbatim(str):
    """The text of a list, kept as read and written back as is.

    A directory index holds a million pieces; its codec keeps their list as
    text and reads it with numpy rather than as a million small lists (see
    `jckpt.format.fastpath.with_canonical_lists`).

    >>> dumps(['pieces', Verbatim('((0 ((0 2))))')])
    '(pieces ((0 ((0 2)))))'
    """


def float_atom(x: float) -> str:
    """A float in OCaml's spelling: `0.`, `1.5`, `-inf`, `nan`.

    >>> float_atom(0.0), float_atom(-1.5), float_atom(float('inf'))
    ('0.', '-1.5', 'inf')
    """
    if math.isnan(x):
        return 'nan'
    if math.isinf(x):
        return 'inf' if x > 0 else '-inf'
    if x == int(x) and abs(x) < 1e16:
        return f'{int(x)}.'
    return repr(x)


def dumps(value: Sexp | int | Sequence) -> str:
    """Write `value` (atoms, ints and nested sequences) on one line."""
    if type(value) is Verbatim:
        return str(value)
    if isinstance(value, str):
        return quote(value)
    if isinstance(value, bool):
        raise TypeError("booleans have no S-expression spelling; use a string")
    if isinstance(value, int):
        return str(value)
    return '(' + ' '.join([quote(v) if type(v) is str else dumps(v) for v in value]) + ')'
