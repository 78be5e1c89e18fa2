"""Text and HTML for people (jckpt.tools.render): sizes, shapes, plurals, tables, metadata rows."""

import pytest

from jckpt.format.names import GENERATION_KEY, LINEAGE_KEY, METRICS_KEY, STEP_KEY, TRAINER_STATE_KEY
from jckpt.tools.render import (
    VALUE_WIDTH,
    column_table,
    format_shape,
    html_table,
    human_bytes,
    metadata_rows,
    plural,
    pretty_value,
    printable,
    shorten,
    text_table,
)


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 5 << 30)] == \
        ['0 B', '1023 B', '1.0 KiB', '1.5 KiB', '5.0 GiB']


def test_human_bytes_stops_at_tebibytes():
    assert human_bytes(3 << 40) == '3.0 TiB'
    assert human_bytes(5 << 50) == '5120.0 TiB'


def test_format_shape():
    assert [format_shape(s) for s in ((), (3,), (784, 512), [2, 1])] == \
        ['()', '(3,)', '(784, 512)', '(2, 1)']


def test_shorten():
    assert shorten('short') == 'short'
    assert shorten('a\nb') == 'a b'
    long = 'x' * (VALUE_WIDTH + 1)
    assert shorten(long) == 'x' * (VALUE_WIDTH - 3) + '...' and len(shorten(long)) == VALUE_WIDTH
    assert shorten('x' * VALUE_WIDTH) == 'x' * VALUE_WIDTH  # exactly the width: kept whole
    assert shorten('abcdefgh', 6) == 'abc...'
    assert shorten(long, None) == long


@pytest.mark.parametrize('n,word,text', [
    (1, 'entry', '1 entry'), (2, 'entry', '2 entries'), (0, 'entry', '0 entries'),
    (2, 'array', '2 arrays'), (2, 'key', '2 keys'), (2, 'day', '2 days'), (1, 'step', '1 step'),
    (3, 'piece file', '3 piece files')])
def test_plural(n, word, text):
    assert plural(n, word) == text


def test_text_table_aligns_columns_and_strips_trailing_space():
    text = text_table(['name', 'size', 'note'], [['w', 1024, ''], ['bias', 4, 'x']], right=[1])
    assert text.split('\n') == ['name  size  note',
                                'w     1024',
                                'bias     4  x']
    assert text_table(['a'], []) == 'a'


def test_text_table_escapes_a_control_character_in_any_cell_and_only_there():
    """The table is scanned once and cells escaped only when it holds a control character."""
    text = text_table(['name', 'n'], [['w', 1], ['a\x1b[2Jb', 22], ['c\u202ed', 3]], right=[1])
    assert text.split('\n') == ['name        n',
                                'w           1',
                                'a\\x1b[2Jb  22',
                                'c\\u202ed    3']
    assert printable('a\nb\tc\rd\x85', keep='\n\t') == 'a\nb\tc\\rd\\x85'
    assert printable('a\nb') == 'a\\nb'


def test_column_table_is_the_text_table_of_the_same_cells_given_by_column():
    rows = [['w', 1024, ''], ['a\x1b[2Jb', 4, 'x'], ['c', 22, 'yy']]
    columns = [list(column) for column in zip(*rows)]
    assert column_table(['name', 'size', 'note'], columns, right=[1]) == \
        text_table(['name', 'size', 'note'], rows, right=[1])
    assert column_table(['a', 'b'], [(), ()]) == 'a  b'


def test_html_table_escapes_every_cell_and_aligns():
    page = html_table(['<k>', 'n'], [['<b>x</b>', 3], ['a&b', 10]], right=[1])
    assert page.startswith('<table><thead><tr><th style="text-align:left">&lt;k&gt;</th>')
    assert '<th style="text-align:right">n</th>' in page
    assert '<td style="text-align:left">&lt;b&gt;x&lt;/b&gt;</td>' in page
    assert '<td style="text-align:right">10</td>' in page and 'a&amp;b' in page
    assert '<b>' not in page and page.count('<tr>') == 3


def test_metadata_rows_writer_known_keys_by_name_then_user_metadata():
    metadata = [('owner', 'me'), (GENERATION_KEY, '2'), (STEP_KEY, '10'), ('z', '1'),
                (METRICS_KEY, '{"loss":  0.5}'), (LINEAGE_KEY, 'run'), (TRAINER_STATE_KEY, '{}')]
    assert metadata_rows('jckpt 1.0', metadata) == [
        ('writer', 'jckpt 1.0'), ('step', '10'), ('metrics', '{"loss": 0.5}'),
        ('trainer state', '{}'), ('lineage', 'run'), ('generation', '2'),
        ('owner', 'me'), ('z', '1')]
    assert metadata_rows(None, []) == [('writer', '(not recorded)')]


def test_pretty_value_compacts_json_and_leaves_the_rest():
    assert pretty_value('{\n  "a": [1,  2],\n  "b": {"c": null}\n}') == '{"a": [1, 2], "b": {"c": null}}'
    assert pretty_value('  [1,2] ') == '[1, 2]'
    assert pretty_value('{not json') == '{not json'
    assert pretty_value('plain text') == 'plain text'
    assert pretty_value('') == ''
