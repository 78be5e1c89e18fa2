"""The bounds on untrusted shapes, dtypes, integers, key paths and JSON."""

import numpy as np
import pytest

from jckpt.errors import InputError
from jckpt.format import limits
from tests.helpers import peak_bytes


@pytest.mark.parametrize('shape', [(), (0,), (2, 3), (0, 2**40), [np.int64(4)], (1,) * limits.MAX_NDIM])
def test_shapes_numpy_can_build_pass(shape):
    dims = limits.check_shape(shape, 4)
    assert np.empty(dims, np.float32).shape == dims


@pytest.mark.parametrize('shape', [(0, 10**30), (0, 2**40, 2**40), (1,) * (limits.MAX_NDIM + 1),
                                   (True, 2), (-1,), (2.0,), 'ab', None])
def test_shapes_numpy_cannot_build_are_refused(shape):
    with pytest.raises(ValueError):
        limits.check_shape(shape, 4)
    if isinstance(shape, tuple) and shape and all(type(d) is int for d in shape) and min(shape) >= 0:
        with pytest.raises(ValueError):  # what the check stands in front of
            np.empty(shape, np.float32)


def test_zero_sized_dtypes_are_refused():
    assert limits.check_itemsize(np.dtype('<f4')) == np.dtype('<f4')
    with pytest.raises(ValueError, match='0 bytes'):
        limits.check_itemsize(np.dtype('U0'))


def test_key_path_length():
    limits.check_path_length(limits.MAX_PATH_LENGTH)
    with pytest.raises(ValueError, match='components'):
        limits.check_path_length(limits.MAX_PATH_LENGTH + 1)


def test_json_nesting_is_bounded_and_strings_do_not_count():
    assert limits.json_depth('{"a": [1, {"b": "[[[["}]}') == 3
    assert limits.json_loads(b'[[1]]') == [[1]]
    with pytest.raises(ValueError, match='deeper'):
        limits.json_loads('[' * 5000 + ']' * 5000)


def test_json_depth_counts_across_chunks_and_skips_a_huge_string_cheaply():
    from jckpt.format.limits import json_depth
    deep = "[" * (3 << 20) + "]" * (3 << 20)  # deeper than one chunk of the count
    assert json_depth(deep) == 3 << 20
    assert json_depth('{"a": "' + "[\\\"" * (1 << 20) + '", "b": [[]]}') == 3
    assert json_depth("") == 0 and json_depth('"x"') == 0


def test_json_depth_does_not_encode_the_whole_text_at_once():
    """The text outside strings was encoded whole, and counted with int64 arrays a MiB long:
    4.3 times the text at the peak here (28 MiB of a 65 MB safetensors fuzz case's 286). Now
    the copy the string removal makes (twice the text while it joins), and a few MiB."""
    text = '{"a": [' + '1, ' * (4 << 20) + '1]}'  # 12 MiB, nearly all outside strings
    depth = []
    peak = peak_bytes(lambda: depth.append(limits.json_depth(text)))
    assert depth == [2] and peak < 2 * len(text) + (4 << 20), (peak, len(text))


def test_an_unterminated_json_string_is_measured_in_linear_time():
    """Each quote started a scan to the end: a 320 KB safetensors header took minutes."""
    text = '{"a": "' + '\\"' * 500_000
    assert limits.json_depth(text) == 1
    with pytest.raises(ValueError):
        limits.json_loads(text)


@pytest.mark.parametrize('text', ['{"w\\ud800": 1}', '["\\udc00"]', '{"a": {"b": ["x", "\\uD800y"]}}'])
def test_json_with_a_lone_surrogate_is_refused(text):
    """A tensor named "w\\ud800" was read, then failed every writer with UnicodeEncodeError."""
    with pytest.raises(ValueError, match='lone surrogate'):
        limits.json_loads(text)


def test_json_with_a_surrogate_pair_reads():
    assert limits.json_loads('["\\ud83d\\ude00", "\\\\ud800"]') == ['\U0001F600', '\\ud800']


@pytest.mark.parametrize('text, kind, expected', [
    ('{"a": 1}', dict, {'a': 1}), ('[1, 2]', list, [1, 2]), ('[1]', dict, None),
    ('{', list, None), ('', dict, None), (None, dict, None), ('[' * 1000, list, None),
    ('["\\ud800"]', list, None)])
def test_json_as_gives_a_hint_record_or_none(text, kind, expected):
    """Metrics, empty nodes and a torch file's numbers are hints: damage reads as None."""
    assert limits.json_as(text, kind) == expected


def test_json_top_keys_counts_the_outer_objects_keys_only():
    assert limits.json_top_keys('{"a": {"b": 1, "c:": [2]}, "d": 3}') == 2
    assert limits.json_top_keys('{"a\\":{": 1, "b": "x:y"}') == 2  # escapes: read apart
    assert limits.json_top_keys('[1, {"a": 2}]') == 0 and limits.json_top_keys('') == 0
    many = '{' + ','.join(f'"{i}":{{"x":"{{:"}}' for i in range(200_000)) + '}'  # 3 MiB
    assert limits.json_top_keys(many) == 200_000


def test_a_json_text_of_short_strings_is_measured_without_a_string_per_piece():
    """Taking the strings out with `re.sub` made a string of each piece between two of them
    before joining the pieces: eight times the text at the peak for a safetensors header of
    millions of short keys. Without escapes the strings are blanked a MiB at a time (some
    12 MiB of temporaries, whatever the size of the text)."""
    text = '{' + '"k":0,' * (2 << 20) + '"k":0}'  # 12 MiB
    peak = peak_bytes(lambda: limits.json_depth(text))
    assert peak < 2 * len(text), (peak, len(text))  # 12 times it before


def test_keys_are_counted_past_escapes_without_a_copy_of_the_text():
    """With a backslash anywhere, the strings were cut out with `re.sub` before counting: a
    copy of the text and a string object a piece, 8 times a header of millions of escaped
    keys. The escaped quotes are now told on each chunk (the backslashes before them)."""
    text = '{' + ','.join(f'"k\\u00e9{i}\\"\\\\":[]' for i in range(300_000)) + '}'
    found = []
    peak = peak_bytes(lambda: found.append(limits.json_top_keys(text)))
    assert found == [300_000] and peak < len(text) / 2 + (8 << 20), (peak, len(text))


@pytest.mark.parametrize('text', ['{"a\\\\": [[[1]]], "b\\"[": 2}', '{"x": "\\\\\\"{:"}',
                                  '{"' + 'a' * (1 << 18) + '\\\\": {"b": "\\\\\\\\"}, "c": []}',
                                  '{"' + '\\\\' * (1 << 18) + '": {"b": 1}}'])
def test_escaped_quotes_and_backslash_runs_across_chunks_are_told(text):
    import json

    assert limits.json_top_keys(text) == len(json.loads(text))
    assert limits.json_depth(text) == 2 if '{"b"' in text else True


@pytest.mark.parametrize('alignment', [1, 2, 32, 64, 4096, np.int64(128), limits.MAX_ALIGNMENT])
def test_writers_take_powers_of_two(alignment):
    assert limits.check_alignment(alignment) == alignment


@pytest.mark.parametrize('alignment', [3, 48, 100, 0, -1, limits.MAX_ALIGNMENT * 2, True, '8'])
def test_writers_refuse_alignments_that_are_not_powers_of_two(alignment):
    # the format reads any alignment from 1 up; a writer only makes ones that align something
    with pytest.raises(InputError, match='power of two') as e:
        limits.check_alignment(alignment, 'a.jckpt')
    assert e.value.file == 'a.jckpt' and 'such as 32' in e.value.fix
