"""Quoted atoms and comments are found on a header's bytes where the tokenizer reads them."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jckpt.format import blanks
from jckpt.format.sexp import parse_slow


def _by_regex(body: bytes) -> list[int]:
    found = []
    for m in blanks._BLANK.finditer(body):
        found += [m.start(), m.end() - (m.lastindex == 2)] if m.lastindex else [m.start(), len(body)]
    return found


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet='"\\() a;\n', max_size=40))
def test_quotes_paired_on_the_bytes_agree_with_the_tokenizers_order(text):
    """Quotes paired with numpy (escapes counted) agree with the regular expression that
    reads quoted atoms and comments in the tokenizer's order, or hand the text to it."""
    body = text.encode()
    codes = np.frombuffer(body, np.uint8)
    paired = blanks.quotes(codes, 'q') if b';' not in body else None
    if paired is not None:
        assert list(paired) + ([len(body)] if len(paired) % 2 else []) == _by_regex(body)
    found = blanks.find_blanks(body, codes, None, open_end=True)
    assert [int(k) for k in found] == _by_regex(body)


def test_a_backslash_outside_a_quoted_atom_escapes_nothing():
    """`a\\"(b"` is the atom `a\\` and the quoted atom `"(b"`: the parenthesis is quoted."""
    body = b'(a\\"(b" c)'
    assert parse_slow(body.decode()) == ['a\\', '(b', 'c']
    codes = np.frombuffer(body, np.uint8)
    assert blanks.quotes(codes, 'q') is None  # handed to the regular expression
    assert [int(k) for k in blanks.find_blanks(body, codes, None)] == [3, 6]


def test_a_quote_left_open_is_none_unless_it_runs_to_the_end():
    body = b'(a "b) (c d)'
    codes = np.frombuffer(body, np.uint8)
    assert blanks.find_blanks(body, codes, None) is None
    assert [int(k) for k in blanks.find_blanks(body, codes, None, open_end=True)] == [3, 12]


def test_a_skipped_list_is_one_more_span_in_order():
    body = b'((a "x") (t ((b) (c))) (d "y"))'
    codes = np.frombuffer(body, np.uint8)
    at = body.index(b'((b)')
    found = blanks.find_blanks(body, codes, (at, body.index(b')))') + 1))
    assert [int(k) for k in found] == [4, 6, at, body.index(b')))'), 26, 28]


def test_only_the_spans_holding_a_parenthesis_are_kept():
    body = b'("a" "(" ; x\n "b")'
    codes = np.frombuffer(body, np.uint8)
    found = blanks.find_blanks(body, codes, None)
    assert [int(k) for k in blanks.holding(codes, found)] == [5, 7]
