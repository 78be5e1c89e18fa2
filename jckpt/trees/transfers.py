"""Device to host: transfers started all at once, each awaited only when its data is needed.

`start_host_copies` starts the transfer of every array given before any is
awaited, so they overlap; `await_host` waits for one and answers its host
array. A one-shot save's transfers fill fresh host buffers. A snapshot's
recur, snapshot after snapshot, so they are made for that: into pinned host
memory the runtime hands out again (no page faults after the first), small
arrays joined on their device and moved in one transfer
(`jckpt.trees.packing.take_packed`). Which leaves travel, and how they are
checked and described, is `jckpt.trees.to_host`'s job.

>>> x = jax.numpy.arange(3.0)
>>> [await_host(h).tolist() for h in start_host_copies([x, x + 1])]
[[0.0, 1.0, 2.0], [1.0, 2.0, 3.0]]
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jckpt.trees import facts, packing
from jckpt.trees.sharding import Box

log = logging.getLogger('jckpt')


#: Where a snapshot's device data lands on the host (`start_host_copies`): 'pinned_host',
#: page-locked buffers the runtime hands out again snapshot after snapshot (no page faults
#: after the first, and the fastest device-to-host copy), where the device has that memory;
#: None, a fresh host buffer per transfer.
SNAPSHOT_MEMORY: str | None = 'pinned_host'

#: Log once that the runtime refused a transfer into pinned host memory.
_REFUSED: list[str] = []


def start_host_copies(arrays: Sequence[jax.Array], snapshot: bool = False) -> list[Any]:
    """Start the transfer of every device array in `arrays` to host memory, none awaited:
    what to read each with `await_host`. Each array's `copy_to_host_async`
    fills a fresh host buffer, unless:

    `snapshot`: the same transfers recur, snapshot after snapshot, so they are
    made for that. They land in `SNAPSHOT_MEMORY` (page-locked host memory,
    where the devices have it), in one dispatched `jax.device_put` (a copy,
    never an alias), whose buffers the runtime's host allocator hands out
    again once freed: no new page faults after the first snapshot, and numpy
    reads them without a copy. And small arrays of one accelerator travel
    joined, one transfer for them all (`jckpt.trees.packing.take_packed`),
    once their join has compiled in the background (until then, one by one).
    A refused transfer into pinned memory falls back to a plain one.

    >>> x = jax.numpy.arange(3.0)
    >>> [await_host(h).tolist() for h in start_host_copies([x], snapshot=True)]
    [[0.0, 1.0, 2.0]]
    """
    out = list(arrays)
    joined = _join_small(out) if snapshot else []
    alone = sorted(set(range(len(out))).difference(i for ix, _, _ in joined for i in ix))
    memory = SNAPSHOT_MEMORY if snapshot else None
    moved = _start([out[i] for i in alone] + [buffer for _, buffer, _ in joined], memory)
    for i, data in zip(alone, moved):
        out[i] = data
    for (indices, _, layout), buffer in zip(joined, moved[len(alone):]):
        for i, where in zip(indices, layout):
            out[i] = Piece(buffer, where)
    return out


def start_transfers(shards: Sequence[tuple[Box, Any]],
                    snapshot: bool = False) -> tuple[tuple[Box, Any], ...]:
    """Start the device-to-host copy of each shard (they overlap; none is awaited): `(box,
    data)` to read with `await_host` (see `start_host_copies` for `snapshot`)."""
    moved = start_host_copies([data for _, data in shards], snapshot)
    return tuple((box, data) for (box, _), data in zip(shards, moved))


def _join_small(arrays: Sequence[Any]) -> list[tuple[list[int], jax.Array, packing.Layout]]:
    """`(indices, joined buffer, layout)` for each group of `packing.PACK_MIN` or more small
    arrays of one accelerator whose join is compiled (`packing.take_packed`)."""
    groups: dict[Any, list[int]] = {}
    for i, a in enumerate(arrays):
        if packing.takeable(a) and a.sharding.memory_kind in (None, 'device'):
            placed = facts.of(a.sharding)
            if not (placed.on_cpu or placed.several):
                groups.setdefault(a.sharding, []).append(i)
    out = []
    for indices in groups.values():
        taken = packing.take_packed([arrays[i] for i in indices]) \
            if len(indices) >= packing.PACK_MIN else None
        if taken is not None:
            out.append((indices, *taken))
    return out


def _start(arrays: list[Any], host_memory: str | None) -> list[Any]:
    """`start_host_copies` of arrays that each travel alone, into `host_memory` (None: plain)."""
    out = [_one_copy(a) for a in arrays] if host_memory else list(arrays)
    into = [_in_memory(a.sharding, host_memory) for a in out] if host_memory else []
    moving = [i for i, s in enumerate(into) if s is not None]
    if moving:
        try:
            moved = jax.device_put([out[i] for i in moving], [into[i] for i in moving],
                                   may_alias=False)
        except Exception as e:  # e.g. the pinned pool exhausted: a plain transfer does
            if not _REFUSED:
                _REFUSED.append(str(e))
                log.warning("transfers into %s memory refused (%.200s); copying to "
                            "fresh host buffers", host_memory, e)
            moving = []
        else:
            for i, m in zip(moving, moved):
                out[i] = m
    pinned = set(moving)
    for i in range(len(out)):
        if i in pinned:
            continue
        try:
            out[i].copy_to_host_async()
        except Exception:  # a backend without async copies: the copy happens on read
            pass
    return out


def _one_copy(array: jax.Array) -> jax.Array:
    """One device's copy of a replicated array (the value, one transfer); any other as it is.

    Moved to another memory whole, a replicated array would move every replica,
    where a plain read of it copies one.
    """
    if facts.of(array.sharding).several and array.is_fully_replicated:
        return array.addressable_shards[0].data
    return array


#: `(sharding, memory kind)` -> that sharding in that memory, or None where a device lacks it.
_MEMORIES: dict[tuple[Any, str], Any] = {}


def _in_memory(sharding: Any, kind: str) -> Any:
    """`sharding` moved to memory `kind` (asked once per sharding), None where it cannot be."""
    try:
        return _MEMORIES[sharding, kind]
    except KeyError:
        pass
    except TypeError:  # an unhashable sharding
        return None
    into = None
    try:  # one device's arrays only: a sharded array is gathered by numpy, into fresh memory
        if len(sharding.device_set) == 1 and \
                all(kind in {m.kind for m in d.addressable_memories()} for d in sharding.device_set):
            into = sharding.with_memory_kind(kind)
    except Exception:  # a sharding or backend without memory kinds
        into = None
    if len(_MEMORIES) >= facts.SEEN_MAX:
        _MEMORIES.clear()
    _MEMORIES[sharding, kind] = into
    return into


class Piece(NamedTuple):
    """A small array on its way to host joined with others into `buffer` (`start_host_copies`)."""

    buffer: Any
    where: tuple[int, tuple[int, ...], np.dtype]


def await_host(data: Any) -> np.ndarray:
    """Wait for a transfer to host started earlier (a shard's, or a whole array's); its host array."""
    if type(data) is Piece:
        return packing.unpack_one(np.asarray(data.buffer), data.where)
    return np.asarray(data)


__all__ = ['SNAPSHOT_MEMORY', 'Piece', 'await_host', 'start_host_copies', 'start_transfers']
