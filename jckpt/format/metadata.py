"""User metadata: string pairs in the header, checked before anything is written.

>>> check_metadata({'run': 'a'})
{'run': 'a'}
"""

from __future__ import annotations

from collections.abc import Mapping

from jckpt.errors import InputError
from jckpt.format.limits import json_loads
from jckpt.format.names import RESERVED_PREFIX


def check_metadata(metadata: Mapping[str, str] | None, file: str | None = None, *,
                   reserved: bool = True) -> dict[str, str]:
    """User metadata as a dict of strings; :class:`~jckpt.errors.InputError` naming the key otherwise.

    The header stores metadata as string pairs, so a number or ``None`` is
    refused here, before anything is written, rather than when the header is
    encoded. With ``reserved=False`` (the mirror and the manager, which write
    their own ``jckpt.`` keys), keys starting with ``jckpt.`` are refused too.

    >>> check_metadata({'step': '3'})
    {'step': '3'}
    """
    if metadata is not None and not isinstance(metadata, Mapping):
        raise InputError(f"metadata must be a mapping of strings to strings, not "
                         f"{type(metadata).__name__}", file=file, fix="pass e.g. metadata={'run': 'a'}")
    out: dict[str, str] = {}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str):
            raise InputError(f"metadata key {k!r} is a {type(k).__name__}: metadata maps strings "
                             f"to strings", file=file, fix=f"use the key {str(k)!r}")
        if not isinstance(v, str):
            raise InputError(f"metadata key {k!r} has the {type(v).__name__} value {v!r}: metadata "
                             f"maps strings to strings", file=file,
                             fix=f"store it as a string: metadata={{{k!r}: str(value)}} "
                                 f"(or json.dumps(value) for structured values)")
        if not reserved and k.startswith(RESERVED_PREFIX):
            raise InputError(f"metadata key {k!r} is reserved", file=file,
                             fix=f"use a key that does not start with {RESERVED_PREFIX!r}")
        out[k] = v
    return out


def parse_metrics(text: str | None) -> dict[str, float] | None:
    """The metrics a mirror or manager saved (a JSON object of numbers) as ``{name: float}``.

    ``None`` when ``text`` is not a JSON object (not JSON, nested deeper than
    :data:`jckpt.format.limits.MAX_NESTING`, a string, ``null``...); values
    that are not numbers are left out. Never raises: metrics only rank steps.

    >>> parse_metrics('{"loss": 0.5, "note": "x", "acc": null}'), parse_metrics('"x"')
    ({'loss': 0.5}, None)
    """
    if not text:
        return {}
    try:
        value = json_loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return {str(k): float(v) for k, v in value.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


__all__ = ['check_metadata', 'parse_metrics']
