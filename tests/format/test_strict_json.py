"""Strict JSON for stored values: every non-finite float tagged, read back as itself."""

import json
import math

import pytest

from jckpt.format import strict_json


def refuse(token):
    raise ValueError(f"{token} is not JSON")


@pytest.mark.parametrize('value', [
    {'loss': math.nan, 'acc': math.inf, 'low': -math.inf, 'ok': 0.25},
    [1, [math.nan, {'deep': -math.inf}]],
    {'$float': 'nan'}, {'$object': [['a', 1]]}, {'$float': math.nan}, {'a': {'$object': []}},
])
def test_dumps_is_strict_json_and_loads_gives_the_value_back(value):
    text = strict_json.dumps(value, sort_keys=True)
    json.loads(text, parse_constant=refuse)
    back = strict_json.loads(text)
    assert json.dumps(back, sort_keys=True) == json.dumps(value, sort_keys=True)  # NaN == NaN here


@pytest.mark.parametrize('text', ['{"$object": [[[1], 2]]}', '{"$object": [[{"a": 1}, 2]]}',
                                  '{"$float": ["nan"]}', '{"$float": "NaN"}'])
def test_tags_that_strict_did_not_write_stay_objects(text):
    """A crafted `$object` whose key is a list made the hook raise TypeError (unhashable)."""
    assert strict_json.loads(text) == json.loads(text)


def test_the_bare_tokens_of_earlier_versions_still_read():
    assert strict_json.loads('{"a": NaN, "b": -Infinity}')['b'] == -math.inf


def test_a_cycle_is_a_value_error_as_json_dumps_has_it():
    value: list = []
    value.append(value)
    with pytest.raises(ValueError, match="Circular"):
        strict_json.dumps(value)
