"""The S-expression reader and writer: OCaml quoting, escapes, limits, both paths."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jckpt.format.sexp import MAX_DEPTH, SexpError, Verbatim, dumps, parse, parse_slow, quote


def test_atoms_and_lists():
    assert parse("(a (b c) ())") == ["a", ["b", "c"], []]
    assert parse("atom") == "atom"
    assert parse('  ( "a b"  c )\n') == ["a b", "c"]


@pytest.mark.parametrize("text,value", [
    (r'"\""', '"'), (r'"\\"', "\\"), (r'"\n\t\r\b"', "\n\t\r\b"),
    (r'"\065\066"', "AB"), (r'"\x41\x42"', "AB"), (r'"\195\169"', "é"),
    ('"line\\\n   continued"', "linecontinued"), (r'"\q"', "\\q"),
])
def test_ocaml_escapes(text, value):
    assert parse(text) == value
    assert parse_slow(text) == value


def test_comments_only_in_slow_path_but_same_result():
    assert parse("(a ; comment\n b)") == ["a", "b"]


@pytest.mark.parametrize("atom,spelled", [
    ("kernel", "kernel"), ("", '""'), ("a b", '"a b"'), ("(x)", '"(x)"'), ('q"', '"q\\""'),
    ("semi;", '"semi;"'), ("é", '"\\195\\169"'), ("tab\t", '"tab\\t"'), ("#|x", '"#|x"'),
    ("back\\slash", '"back\\\\slash"'), ("0.", "0."), ("-inf", "-inf"),
])
def test_quote(atom, spelled):
    assert quote(atom) == spelled
    assert parse(spelled) == atom


@pytest.mark.parametrize("bad", ["", "(", ")", "(a))", "a b", "(a) (b)", '"open', "(a \"b)",
                                 '"\\999"'])
def test_malformed(bad):
    with pytest.raises(SexpError):
        parse(bad)
    with pytest.raises(SexpError):
        parse_slow(bad)


def test_nesting_limit():
    ok = "(" * MAX_DEPTH + ")" * MAX_DEPTH
    assert parse(ok) is not None
    deep = "(" * (MAX_DEPTH + 1) + ")" * (MAX_DEPTH + 1)
    with pytest.raises(SexpError, match="nesting"):
        parse(deep)
    with pytest.raises(SexpError, match="nesting"):
        parse_slow(deep + ";")
    with pytest.raises(SexpError):
        parse("(" * 100000)


sexps = st.recursive(st.text(max_size=8), lambda c: st.lists(c, max_size=5), max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(sexps)
def test_roundtrip_both_paths(value):
    text = dumps(value)
    assert parse(text) == value
    assert parse_slow(text) == value


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='()"\\ ab;#|\n\x01é', max_size=30))
def test_fast_and_slow_paths_agree(text):
    try:
        fast = ("ok", parse(text))
    except SexpError:
        fast = ("err", None)
    try:
        slow = ("ok", parse_slow(text))
    except SexpError:
        slow = ("err", None)
    assert fast == slow


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='() ,[]"\\0\n', max_size=30))
def test_fast_and_slow_paths_agree_on_json_punctuation(text):
    outcomes = []
    for read in (parse, parse_slow):
        try:
            outcomes.append(("ok", read(text)))
        except SexpError:
            outcomes.append(("err", None))
    assert outcomes[0] == outcomes[1]


def test_verbatim_text_is_written_as_is_and_reads_back_as_lists():
    """What a directory index keeps as text (its pieces): written unquoted, read as lists."""
    value = ('pieces', Verbatim('((0 ((0 2) (10 12))) (1 ()) (7 ((3 4))))'))
    text = dumps(value)
    assert text == '(pieces ((0 ((0 2) (10 12))) (1 ()) (7 ((3 4)))))'
    assert parse(text) == parse_slow(text) == [
        'pieces', [['0', [['0', '2'], ['10', '12']]], ['1', []], ['7', [['3', '4']]]]]
    assert dumps(('pieces', 'a b')) == '(pieces "a b")'  # a plain string is quoted as always


def test_atoms_that_look_like_json_punctuation_survive_the_fast_path():
    for value in [',]', ['a,]', ', ]'], ',', ['x', [',]']], '"a,]"']:
        text = dumps(value)
        assert parse(text) == value and parse_slow(text) == value


@pytest.mark.parametrize('text', [
    '((writer "' + '\\"' * 500_000 + '))',        # an unterminated atom full of escaped quotes
    '((writer "' + '\\"' * 500_000 + '\\',        # ... ending in a lone backslash
])
def test_an_unterminated_quoted_atom_is_refused_in_linear_time(text):
    """Each quote started a scan to the end: 64 KB took a minute, this 1 MB would take hours."""
    with pytest.raises(SexpError, match='unexpected character'):
        parse(text)


def test_quotes_in_a_comment_parse_in_linear_time():
    text = '((version 1) ; "' + '\\"' * 500_000 + '\n (tensors ()))'
    assert parse(text) == parse('((version 1) (tensors ()))')


def test_a_long_quoted_atom_is_read_in_memory_linear_in_it():
    """`"(?:[^"\\]|\\.)*"` kept a backtracking frame per character: a 20 MB atom (a writer
    field, a metadata value) took 3 GB to read, and a MemoryError under a limit."""
    import struct
    import tracemalloc

    from jckpt.format import decode_header
    atom = 'a' * (4 << 20)
    text = f'((version 1) (alignment 1) (tensors ()) (writer "{atom}"))'.encode()
    tracemalloc.start()
    try:
        header = decode_header(struct.pack('>I', len(text)) + text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert header.writer == atom and peak < 20 * len(text)  # it was about 140 times


@pytest.mark.parametrize('text, message', [
    ('(a\\b ' + '(c) ' * 1000, "unbalanced '\\('"),       # off the fast path: a backslash
    ('(a\\b ' + '(' * 100 + ')' * 100 + ')', 'nesting deeper'),
    ('(a\\b ' + '(c) ' * 1000 + '"d)', 'unexpected character \'"\' at offset 4005'),
])
def test_malformed_text_off_the_fast_path_is_refused_before_the_tokenizer(
        monkeypatch, text, message):
    """Unbalanced, too deep or unterminated text that the fast path does not take was read
    whole by the tokenizer before it said so: a crafted 6 MB header took seconds a read."""
    from jckpt.format import sexp

    with pytest.raises(SexpError, match=message):
        parse_slow(text)  # what it says, as the tokenizer says it
    monkeypatch.setattr(sexp, '_parse_slow', lambda t: pytest.fail("the tokenizer was reached"))
    with pytest.raises(SexpError, match=message):
        parse(text)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('\\"ntx0a1\n \u00e9{}:')), max_size=24))
def test_a_quoted_atom_of_quote_escapes_alone_reads_as_the_general_unescape_reads_it(body):
    """The common case (JSON in a metadata value: `\\"` and `\\\\` only) is read at C speed;
    every body reads as the general escape reader reads it, or is refused alike."""
    import re

    from jckpt.format import sexp
    outcomes = []
    for quotes_only in (sexp._QUOTES_ONLY, re.compile(r'(?!)')):
        sexp_patch = sexp._QUOTES_ONLY
        sexp._QUOTES_ONLY = quotes_only
        try:
            outcomes.append(sexp._unescape(body))
        except SexpError as e:
            outcomes.append(str(e))
        finally:
            sexp._QUOTES_ONLY = sexp_patch
    assert outcomes[0] == outcomes[1]
