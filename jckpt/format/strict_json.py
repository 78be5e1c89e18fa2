"""Strict JSON for the values jckpt stores: a non-finite float as a tagged object.

`json.dumps` writes a NaN loss as the bare token `NaN`, which strict JSON parsers (jq,
JavaScript's `JSON.parse`, serde_json) refuse; refusing the value instead would cost a
training loop its save. Every JSON jckpt writes that can hold a user's float (a trainer
state, a manager's metrics, a step directory's `trainer_state.json`, `jckpt inspect --json`)
goes through `dumps`, and is read back through `loads` (or `unstrict` as an object hook):

>>> text = dumps({'loss': float('nan'), 'acc': [0.5, float('inf')]}, sort_keys=True)
>>> text
'{"acc": [0.5, {"$float": "inf"}], "loss": {"$float": "nan"}}'
>>> loads(text)
{'acc': [0.5, inf], 'loss': nan}

A dict whose one key is a tag is wrapped (`{"$object": [[key, value]]}`) so that it also reads
back as itself; the bare `NaN` and `Infinity` that earlier versions wrote still read.
"""

from __future__ import annotations

import json
import math
from typing import Any

from jckpt.format.limits import json_loads

#: The one-key objects that stand for what strict JSON cannot hold: a non-finite float, and a
#: dict that would read as one of these (its one item as a `[key, value]` pair).
FLOAT_TAG, OBJECT_TAG = '$float', '$object'
_NON_FINITE = {'nan': math.nan, 'inf': math.inf, '-inf': -math.inf}


def strict(value: Any, path: tuple[int, ...] = ()) -> Any:
    """`value` with each non-finite float as `{"$float": "nan"}` (`"inf"`, `"-inf"`), which
    strict JSON parsers accept and `unstrict` turns back; a dict whose one key is a tag is
    wrapped so that it reads back as itself (`path`: the containers above, for cycles).

    >>> strict({'loss': float('nan'), 'ok': [1.5, float('-inf')], 'x': {'$float': 1}})
    {'loss': {'$float': 'nan'}, 'ok': [1.5, {'$float': '-inf'}], 'x': {'$object': [['$float', 1]]}}
    """
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {FLOAT_TAG: 'nan' if math.isnan(value) else 'inf' if value > 0 else '-inf'}
    if not isinstance(value, (dict, list, tuple)):
        return value
    if id(value) in path:
        raise ValueError("Circular reference detected")
    inner = (*path, id(value))
    if not isinstance(value, dict):
        return [strict(v, inner) for v in value]
    out = {k: strict(v, inner) for k, v in value.items()}
    if len(out) == 1 and next(iter(out)) in (FLOAT_TAG, OBJECT_TAG):
        return {OBJECT_TAG: [list(*out.items())]}
    return out


def unstrict(obj: dict[str, Any]) -> Any:
    """`json.loads`'s object hook undoing `strict` (an object that is no tag stays itself).

    >>> json.loads('[{"$float": "-inf"}, {"$object": [["$float", 1]]}]', object_hook=unstrict)
    [-inf, {'$float': 1}]
    """
    if len(obj) == 1:
        (key, value), = obj.items()
        if key == FLOAT_TAG and isinstance(value, str) and value in _NON_FINITE:
            return _NON_FINITE[value]
        if key == OBJECT_TAG and isinstance(value, list) and len(value) == 1 \
                and isinstance(value[0], list) and len(value[0]) == 2 \
                and isinstance(value[0][0], str):
            return {value[0][0]: value[0][1]}
    return obj


def dumps(value: Any, **options: Any) -> str:
    """`json.dumps` of `strict(value)`, refusing (`ValueError`) any non-finite float left
    (one a `default` hook returned unencoded); `options`: `json.dumps`'s.

    >>> dumps({'$float': 'nan', 'best': -float('inf')}, sort_keys=True)
    '{"$float": "nan", "best": {"$float": "-inf"}}'
    """
    return json.dumps(strict(value), allow_nan=False, **options)


def loads(text: str | bytes) -> Any:
    """`dumps`'s output as the value it was given (`jckpt.format.limits.json_loads`: a
    `ValueError` for text that is not JSON or nests too deep).

    >>> loads('{"loss": {"$float": "nan"}, "old": -Infinity}')
    {'loss': nan, 'old': -inf}
    """
    return json_loads(text, object_hook=unstrict)


__all__ = ['FLOAT_TAG', 'OBJECT_TAG', 'dumps', 'loads', 'strict', 'unstrict']
