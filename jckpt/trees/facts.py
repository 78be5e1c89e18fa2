"""What a sharding says about where its data lives, asked once per sharding.

Saving and snapshotting ask the same few questions of every leaf's sharding:
is the data in host memory already, is it on several devices, does this
process hold all of it, and which device holds it. A sharding's answers never
change, and `jax.sharding` objects answer slowly (their `device_set`,
`__hash__` and `__eq__` are Python code), so `of` asks once per sharding and
remembers the answers: by the sharding object's identity for those met lately
(a jitted step's outputs, and arrays saved again, carry the same sharding
objects every time), else by equality. The C staging shares these tables.

>>> import jax
>>> placed = of(jax.numpy.ones(3).sharding)
>>> placed.on_cpu, placed.several, placed.whole, placed.device == jax.devices('cpu')[0]
(True, False, True, True)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class Placement(NamedTuple):
    """What saving needs to know of a sharding (the C staging reads the first three fields)."""

    on_cpu: bool  # every device a CPU: the data is in host memory already
    several: bool  # spread over (or replicated on) more than one device
    whole: bool  # fully addressable from this process
    device: Any = None  # the one device, when there is only one


#: sharding -> its `Placement`, by equality.
SHARDINGS: dict[Any, Placement] = {}
#: id(sharding) -> (sharding, its `Placement`) for the shardings met lately (at most `SEEN_MAX`).
SEEN: dict[int, tuple[Any, Placement]] = {}
SEEN_MAX = 4096


def of(sharding: Any) -> Placement:
    """What saving asks of `sharding`: known by identity (`SEEN`), else by equality, else asked."""
    seen = SEEN.get(id(sharding))
    if seen is not None and seen[0] is sharding:
        return seen[1]
    try:
        placed = SHARDINGS[sharding]
    except KeyError:
        placed = SHARDINGS[sharding] = _ask(sharding)
    except TypeError:  # an unhashable sharding: ask every time
        return _ask(sharding)
    if len(SEEN) >= SEEN_MAX:
        SEEN.clear()
    SEEN[id(sharding)] = (sharding, placed)  # holding it keeps its id from being reused
    return placed


def _ask(sharding: Any) -> Placement:
    devices = sharding.device_set
    return Placement(all(d.platform == 'cpu' for d in devices), len(devices) > 1,
                     sharding.is_fully_addressable,
                     next(iter(devices)) if len(devices) == 1 else None)


def is_sharded(leaf: Any) -> bool:
    """Whether `leaf` is a `jax.Array` spread over (or replicated on) several devices."""
    return isinstance(leaf, jax.Array) and of(leaf.sharding).several


__all__ = ['SEEN', 'SEEN_MAX', 'SHARDINGS', 'Placement', 'is_sharded', 'of']
