"""Python numbers and tuples in a torch file, remembered across a conversion that loses them.

A torch checkpoint holds Python numbers beside its tensors: an optimizer's
`lr`, `betas` and `params` ids, an `epoch`. A jckpt file stores every leaf as
an array, so converted there and back they would come back as 0-d tensors,
and `optimizer.load_state_dict` would match `params` ids that are tensors to
no state (silently resuming with fresh moments). A jckpt file reads its
sequences as lists, so an optimizer's `betas` tuple would come back a list.
`scalar_record` lists where the numbers and the tuples are (in the metadata
`jckpt.convert` hands on, under `SCALARS_KEY`); `with_scalars` makes the 0-d
arrays there numbers and the lists there tuples again.

>>> record = scalar_record({'lr': 0.5, 'betas': (0.9, 0.99), 'w': None})
>>> with_scalars({'lr': np.array(0.5), 'betas': [np.array(0.9), np.array(0.99)]}, record)
{'lr': 0.5, 'betas': (0.9, 0.99)}
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from jckpt.format.limits import json_as

#: The metadata key listing where a torch file's Python numbers and tuples are.
SCALARS_KEY = 'torch.scalars'
#: Most numbers and tuples recorded (an optimizer's groups hold tens); a file with more records
#: none.
MAX_SCALARS = 10_000


def _number(kind: type) -> Callable[[Any], Any]:
    """A 0-d array made a `kind` (a Python number); anything else left alone."""
    def make(node: Any) -> Any:
        ok = getattr(node, 'shape', None) == () and getattr(node, 'dtype', None) is not None
        return kind(np.asarray(node).item()) if ok else node
    return make


def _tuple(node: Any) -> Any:
    """A list made a tuple (as a jckpt file reads a tuple), and `None` made `()` (a jckpt
    file keeps an empty tuple as an empty node, which reads as `None`); anything else left
    alone."""
    return tuple(node) if isinstance(node, list) else () if node is None else node


#: What each type a record names makes of the node at its path.
_MAKE: dict[str, Callable[[Any], Any]] = {
    'bool': _number(bool), 'int': _number(int), 'float': _number(float), 'tuple': _tuple}


def scalar_record(tree: Any) -> str | None:
    """JSON `[[path, type], ...]` of the Python numbers (type `bool`, `int`, `float`) and
    the tuples (type `tuple`) in `tree` (a path is a list of `[kind, key]`: `k` str key,
    `ki` int key, `i` index); None when there are none or more than `MAX_SCALARS`."""
    found: list = []
    stack: list[tuple[list, Any]] = [([], tree)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            stack.extend(([*path, ['ki' if isinstance(k, int) else 'k', k]], v)
                         for k, v in node.items() if isinstance(k, (str, int)))
        elif isinstance(node, (list, tuple)):
            stack.extend(([*path, ['i', i]], v) for i, v in enumerate(node))
        if type(node) is tuple or (type(node) in (bool, int, float) and -2**63 <= node < 2**63):
            found.append([path, type(node).__name__])
            if len(found) > MAX_SCALARS:
                return None
    return json.dumps(found, separators=(',', ':')) if found else None


def with_scalars(tree: Any, record: str) -> Any:
    """`tree` with the 0-d arrays at the record's paths made Python numbers again, and the
    lists at its tuples' paths tuples (a path that is not there, or holds something else,
    is left alone)."""
    for item in (json_as(record, list) or [])[:MAX_SCALARS]:
        if isinstance(item, list) and len(item) == 2 and item[1] in _MAKE \
                and isinstance(item[0], list):
            tree = _replace(tree, item[0], _MAKE[item[1]])
    return tree


def _replace(node: Any, path: list, make: Callable[[Any], Any]) -> Any:
    """`node` with the node at `path` made anew by `make`, containers copied along the way."""
    if not path:
        return make(node)
    step = path[0]
    if not (isinstance(step, list) and len(step) == 2):
        return node
    key = step[1]
    if isinstance(node, dict) and key in node and not isinstance(key, list):
        return {**node, key: _replace(node[key], path[1:], make)}
    if isinstance(node, (list, tuple)) and type(key) is int and 0 <= key < len(node):
        return type(node)([*node[:key], _replace(node[key], path[1:], make), *node[key + 1:]])
    return node
