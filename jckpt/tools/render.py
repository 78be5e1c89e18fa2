"""Text and HTML for people: sizes, shapes, plurals, aligned tables, metadata rows.

Pure functions over plain values, shared by the summaries (`jckpt.info`),
the reports of `verify` and `diff`, and the command line. Nothing here
reads a file.

>>> human_bytes(1536), format_shape((3,)), plural(2, 'entry')
('1.5 KiB', '(3,)', '2 entries')
>>> print(text_table(['a', 'size'], [['x', 1], ['yy', 22]], right=[1]))
a   size
x      1
yy    22
"""

from __future__ import annotations

import functools
import html
import json
import re
from collections.abc import Sequence
from itertools import repeat
from typing import Any

from jckpt.format._gc import paused
from jckpt.format.limits import json_loads
from jckpt.format.names import KNOWN_KEYS

#: Rows shown by ``repr`` and the HTML view before "... N more" (the CLI shows all).
REPR_ROWS = 40
#: Metadata values longer than this are shortened in the text and HTML views.
VALUE_WIDTH = 100


# C0 and C1 controls, DEL, and the invisible marks that reorder or hide text on a terminal
_BEYOND_C0 = '\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff'
_UNPRINTABLE = re.compile(f'[\x00-\x1f{_BEYOND_C0}]')


def printable(text: str, keep: str = '') -> str:
    r"""`text` with every control character (but those in `keep`) spelled as an escape, so
    that names read from a file cannot move the cursor, recolour or rewrite a terminal.

    >>> printable('w\x1b[2Jx'), printable('a\nb'), printable('a\nb', keep='\n')
    ('w\\x1b[2Jx', 'a\\nb', 'a\nb')
    """
    return _unprintable_but(keep).sub(lambda m: m[0] if m[0] in keep
                                      else m[0].encode('unicode_escape').decode('ascii'), text)


@functools.lru_cache(maxsize=8)
def _unprintable_but(keep: str) -> re.Pattern[str]:
    """`_UNPRINTABLE` less the C0 controls in `keep`: a table's newlines are not matched one
    by one (200,000 of them cost a Python call each)."""
    c0 = ''.join(f'\\x{c:02x}' for c in range(0x20) if chr(c) not in keep)
    return re.compile(f'[{c0}{_BEYOND_C0}]')


@functools.lru_cache(maxsize=4096)  # a table of many arrays repeats a few sizes
def human_bytes(n: int) -> str:
    """`1536` -> `'1.5 KiB'`: sizes for people (JSON keeps exact byte counts)."""
    value = float(n)
    for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
        if value < 1024 or unit == 'TiB':
            return f"{int(value)} B" if unit == 'B' else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError('unreachable')


def format_shape(shape: Sequence[int]) -> str:
    """`(784, 512)` -> `'(784, 512)'`, `()` -> `'()'`, `(3,)` -> `'(3,)'`."""
    return repr(tuple(shape))


def shorten(text: str, width: int | None = VALUE_WIDTH) -> str:
    """`text` on one line, cut to `width` characters with an ellipsis (None: never cut)."""
    text = printable(text.replace('\n', ' '))
    return text if width is None or len(text) <= width else text[:width - 3] + '...'


def plural(n: int, word: str) -> str:
    """`plural(1, 'entry')` -> `'1 entry'`; `plural(2, 'entry')` -> `'2 entries'`."""
    if n == 1:
        return f"{n} {word}"
    if word.endswith('y') and word[-2:-1] not in ('a', 'e', 'i', 'o', 'u'):
        return f"{n} {word[:-1]}ies"
    return f"{n} {word}s"


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
               right: Sequence[int] = ()) -> str:
    """Rows as aligned plain-text columns (`right`: indices of right-aligned columns).

    >>> print(text_table(['a', 'size'], [['x', 1], ['yy', 22]], right=[1]))
    a   size
    x      1
    yy    22
    """
    return column_table(headers, list(zip(*rows)) if rows else [()] * len(headers), right)


@paused
def column_table(headers: Sequence[str], columns: Sequence[Sequence[Any]],
                 right: Sequence[int] = ()) -> str:
    """`text_table` of the same cells given column by column, as a listing of many rows
    already holds them (no row-by-row transposing).

    >>> print(column_table(['a', 'size'], [['x', 'yy'], [1, 22]], right=[1]))
    a   size
    x      1
    yy    22
    """
    cells = [[str(h), *map(str, column)] for h, column in zip(headers, columns)]
    if any(_UNPRINTABLE.search(''.join(column)) for column in cells):  # escape only if needed
        cells = [list(map(printable, column)) for column in cells]
    # padded column by column and joined row by row in C: no Python call per cell
    padded = [map(str.rjust if i in right else str.ljust, column, repeat(max(map(len, column))))
              for i, column in enumerate(cells)]
    return '\n'.join(map(str.rstrip, map('  '.join, zip(*padded))))


def html_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
               right: Sequence[int] = ()) -> str:
    """Rows as an HTML table (every cell escaped)."""
    def cell(tag: str, i: int, c: Any) -> str:
        style = ' style="text-align:right"' if i in right else ' style="text-align:left"'
        return f"<{tag}{style}>{html.escape(str(c))}</{tag}>"
    head = ''.join(cell('th', i, h) for i, h in enumerate(headers))
    body = ''.join('<tr>' + ''.join(cell('td', i, c) for i, c in enumerate(r)) + '</tr>'
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def metadata_rows(writer: str | None,
                  metadata: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """`(label, value)` pairs to show: writer, the known keys by name, then user metadata."""
    rows = [('writer', writer if writer is not None else '(not recorded)')]
    meta = dict(metadata)
    rows += [(label, pretty_value(meta[key])) for key, label in KNOWN_KEYS.items() if key in meta]
    rows += [(key, pretty_value(value)) for key, value in metadata if key not in KNOWN_KEYS]
    return rows


def pretty_value(value: str) -> str:
    """A metadata value for display: JSON made compact, anything else as is."""
    text = value.strip()
    if text[:1] in ('{', '['):
        try:
            return json.dumps(json_loads(text), separators=(', ', ': '))
        except ValueError:
            pass
    return value


__all__ = ['REPR_ROWS', 'VALUE_WIDTH', 'column_table', 'format_shape', 'html_table', 'human_bytes',
           'metadata_rows', 'plural', 'pretty_value', 'printable', 'shorten', 'text_table']
