"""Leaf to host: the one path from a leaf to be saved to its host data.

`host_leaves` checks every leaf (an array or a number, fully addressable, of
a storable dtype), turns typed PRNG keys into their key data, and starts every
device-to-host transfer before awaiting any, so they overlap
(`start_host_copies`: into fresh buffers; for a snapshot, into pinned host
memory, small arrays joined); a sharded array is kept as its distinct
shards, never gathered.
Arrays already in host memory (numpy, CPU devices) need no transfer; runs of
them are staged in one C call where the accelerator is built. The way back,
host to device, is `jckpt.trees.placement`.

>>> host = host_leaves([('jckpt/w', np.arange(3.0))])[0]
>>> host.dtype, host.shape, host.key_impl, host.private
(dtype('float64'), (3,), None, False)
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jckpt.errors import InputError
from jckpt.format import precs
from jckpt.format.fastpath import accelerator
from jckpt.trees import packing
from jckpt.trees import sharding as sharding_mod
from jckpt.trees.pytree import leaf_name
from jckpt.trees.sharding import Box

_PY_SCALARS = (bool, int, float, complex)

log = logging.getLogger('jckpt')


_KEY_DTYPES: dict[Any, bool] = {}  # dtype -> is a typed PRNG key dtype (asked once per dtype)
_SHARDINGS: dict[Any, _Placement] = {}  # sharding -> what staging asks of it
_STORABLE: set[np.dtype] = set()  # dtypes known to be storable
#: `_SHARDINGS` by the sharding's identity, for the shardings met lately (at most `_SEEN_MAX`):
#: a jitted step's outputs, and arrays saved again, carry the same sharding objects every
#: time, whose `__hash__` and `__eq__` are Python code. The C staging shares it.
_SEEN: dict[int, tuple[Any, Any]] = {}
_SEEN_MAX = 4096


def is_prng_key(x: Any) -> bool:
    """Whether `x` is a typed JAX PRNG key array."""
    return isinstance(x, jax.Array) and is_key_dtype(x.dtype)


def is_key_dtype(dtype: Any) -> bool:
    """Whether `dtype` is a typed PRNG key's (asked of JAX once per dtype)."""
    try:
        return _KEY_DTYPES[dtype]
    except KeyError:
        known = _KEY_DTYPES[dtype] = bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
        return known
    except TypeError:  # an unhashable dtype: ask every time
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


class _Placement(NamedTuple):
    """What staging needs to know of a sharding, asked once per sharding."""

    on_cpu: bool  # every device a CPU: the data is in host memory already
    several: bool  # spread over (or replicated on) more than one device
    whole: bool  # fully addressable from this process
    device: Any = None  # the one device, when there is only one


def _facts(sharding: Any) -> _Placement:
    """What staging asks of `sharding`: known by identity (`_SEEN`), else by equality, else asked."""
    seen = _SEEN.get(id(sharding))
    if seen is not None and seen[0] is sharding:
        return seen[1]
    try:
        facts = _SHARDINGS[sharding]
    except KeyError:
        facts = _SHARDINGS[sharding] = _ask(sharding)
    except TypeError:  # an unhashable sharding: ask every time
        return _ask(sharding)
    if len(_SEEN) >= _SEEN_MAX:
        _SEEN.clear()
    _SEEN[id(sharding)] = (sharding, facts)  # holding it keeps its id from being reused
    return facts


def _ask(sharding: Any) -> _Placement:
    devices = sharding.device_set
    return _Placement(all(d.platform == 'cpu' for d in devices), len(devices) > 1,
                      sharding.is_fully_addressable,
                      next(iter(devices)) if len(devices) == 1 else None)


def is_sharded(leaf: Any) -> bool:
    """Whether `leaf` is a `jax.Array` spread over (or replicated on) several devices."""
    return isinstance(leaf, jax.Array) and _facts(leaf.sharding).several


@functools.lru_cache(maxsize=1024)
def _owner_boxes(sharding: Any, shape: tuple[int, ...], process: int) -> dict[Any, Box]:
    """`{device: box}` for the devices of `process` that write a distinct shard.

    Each distinct box is owned by the first device holding it in the
    sharding's device order, the same in every process, so each replicated
    piece is written exactly once across all processes.
    """
    owners: dict[Box, Any] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        owners.setdefault(sharding_mod.box_of(index, shape), device)
    return {d: b for b, d in owners.items() if d.process_index == process}


def owned_shards(array: jax.Array) -> list[tuple[Box, jax.Array]]:
    """`(box, single-device array)` for each distinct shard this process must write."""
    plan = _owner_boxes(array.sharding, tuple(array.shape), jax.process_index())
    out = []
    for shard in array.addressable_shards:
        box = plan.get(shard.device)
        if box is not None:
            out.append((box, shard.data))
    return out


def start_transfers(shards: Sequence[tuple[Box, Any]],
                    snapshot: bool = False) -> tuple[tuple[Box, Any], ...]:
    """Start the device-to-host copy of each shard (they overlap; none is awaited): `(box,
    data)` to read with `await_host` (see `start_host_copies` for `snapshot`)."""
    moved = start_host_copies([data for _, data in shards], snapshot)
    return tuple((box, data) for (box, _), data in zip(shards, moved))


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


def _join_small(arrays: Sequence[Any]) -> list[tuple[list[int], jax.Array, packing.Layout]]:
    """`(indices, joined buffer, layout)` for each group of `packing.PACK_MIN` or more small
    arrays of one accelerator whose join is compiled (`packing.take_packed`)."""
    groups: dict[Any, list[int]] = {}
    for i, a in enumerate(arrays):
        if packing.takeable(a) and a.sharding.memory_kind in (None, 'device'):
            facts = _facts(a.sharding)
            if not (facts.on_cpu or facts.several):
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
                log.warning("jckpt: transfers into %s memory refused (%.200s); copying to "
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
    if _facts(array.sharding).several and array.is_fully_replicated:
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
    if len(_MEMORIES) >= _SEEN_MAX:
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


class HostLeaf(NamedTuple):
    """One leaf on its way to host: what it stores, and its data, whole or in pieces.

    `dtype` and `shape` are what is stored (a typed PRNG key's data, with
    `key_impl` naming its implementation). `array` is the whole host
    array; it is `None` when the leaf is held as `shards` instead, or when
    it was only described (`fetch=False`). `shards` are `(box,
    single-device array)` for each distinct shard this process writes, their
    transfers started: read each with `await_host` when it is written.
    `private`: `array` is a host buffer no one else holds (a device
    transfer's result, or a copy), so it stays valid whatever later happens
    to the tree it came from (a numpy leaf or a CPU array may alias memory the
    caller reuses).
    """

    dtype: np.dtype
    shape: tuple[int, ...]
    key_impl: str | None = None
    array: np.ndarray | None = None
    shards: tuple[tuple[Box, Any], ...] = ()
    private: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the stored payload."""
        return math.prod(self.shape) * self.dtype.itemsize


def host_leaves(leaves: Iterable[tuple[Any, Any]], *, namespace: str | None = None,
                pieces: bool = False, spread: bool = False, fetch: bool = True,
                copy: bool = False, snapshot: bool = False) -> list[HostLeaf]:
    """Bring `(where, leaf)` pairs to host: every leaf checked and its transfer started, then the waits.

    The one path from a leaf to be stored to its host data. Typed PRNG keys
    become their key data and `key_impl`. Every leaf is checked (an array
    or a number, fully addressable, of a storable dtype; otherwise
    `InputError` naming `where`) and every transfer is
    started before the first is awaited, so they overlap. Arrays already in
    host memory (numpy, CPU devices) need no transfer; runs of them are staged
    in one C call where the accelerator is built.

    Args:
      leaves: `(where, leaf)`: `where` names the leaf in errors: its name (`namespace/a/b`),
        or with `namespace` its key path, named (`jckpt.trees.pytree.leaf_name`) only
        when an error needs it.
      namespace: the namespace the key paths in `leaves` are under.
      pieces: keep a multi-device array as its distinct shards (`HostLeaf.shards`,
        read with `await_host` when written) instead of gathering it whole.
      spread: accept arrays spread over several processes (with `pieces`): this
        process's shards of them.
      fetch: `False` to only check and describe the leaves this process holds
        whole (another process writes them): no transfer, `array` None for each.
      copy: make each `array` private (`HostLeaf.private`), copying only
        what a transfer did not already copy: the snapshot a background writer needs.
      snapshot: the transfers from a device recur, snapshot after snapshot: into pinned
        buffers the runtime reuses, small arrays joined (`start_host_copies`).

    >>> [h.shape for h in host_leaves([('ns/w', np.ones((2, 3))), ('ns/n', 7)])]
    [(2, 3), ()]
    >>> host_leaves([((('k', 'w'),), np.ones(2))], namespace='ns')[0].shape
    (2,)
    """
    leaves = leaves if type(leaves) is list else list(leaves)
    staged: list[HostLeaf] = []
    finish = []  # the leaves staged in Python: a transfer to await, or a copy to make
    i = 0
    while True:
        i = _stage_plain(leaves, i, staged) if fetch else i
        if i == len(leaves):
            break
        where, leaf = leaves[i]
        name = where if namespace is None else leaf_name(namespace, where)
        finish.append(len(staged))
        staged.append(_stage(name, leaf, pieces=pieces, spread=spread, fetch=fetch,
                             snapshot=snapshot))
        i += 1
    _start_whole(staged, finish, snapshot)
    for k in range(len(staged)) if copy else finish:
        staged[k] = _finish(staged[k], copy)
    return staged


#: The `jax.Array` types met so far (`_stage` records them): their CPU arrays are staged in C.
_JAX_TYPES: frozenset[type] = frozenset()


def _stage_plain(leaves: list[tuple[Any, Any]], start: int, out: list[HostLeaf]) -> int:
    """Stage the run of plain leaves from `start` on in C (a numpy array, or an array on one
    CPU device of this process, of a known storable dtype); the index of the first other one."""
    if accelerator is None or not ACCELERATE:
        return start
    return accelerator.stage_leaves(leaves, start, _STORABLE, _SHARDINGS, _SEEN, _SEEN_MAX,
                                    _JAX_TYPES, HostLeaf, np.asarray, out, np.ndarray)


#: Whether `host_leaves` stages plain leaves in C where the accelerator is built (False: every
#: leaf through `_stage`, the reference the tests compare it with).
ACCELERATE = True


def _start_whole(staged: list[HostLeaf], indices: Sequence[int], snapshot: bool) -> None:
    """Start the transfers of the whole leaves at `indices` still on a device, all at once."""
    on_device = [k for k in indices if isinstance(staged[k].array, jax.Array)]
    if not on_device:
        return
    moved = start_host_copies([staged[k].array for k in on_device], snapshot)
    for k, data in zip(on_device, moved):
        staged[k] = staged[k]._replace(array=data)


def _stage(where: str, leaf: Any, *, pieces: bool, spread: bool, fetch: bool,
           snapshot: bool = False) -> HostLeaf:
    """Check one leaf and start its shards' transfers (a whole leaf's are started with the
    others', `_start_whole`); the host data of a non-JAX leaf is final."""
    if not isinstance(leaf, jax.Array):
        return _stage_host(where, leaf, fetch)
    global _JAX_TYPES
    if type(leaf) not in _JAX_TYPES:
        _JAX_TYPES = _JAX_TYPES | {type(leaf)}
    key_impl = None
    dtype = leaf.dtype
    if is_key_dtype(dtype):
        key_impl = str(jax.random.key_impl(leaf))
        leaf = jax.random.key_data(leaf)
        dtype = leaf.dtype
    facts = _facts(leaf.sharding)
    if not facts.whole and not (pieces and spread):
        raise InputError("array is not fully addressable from this process", entry=where,
                         fix="save from every process (multi-process checkpoints)")
    if dtype not in _STORABLE:
        _check_dtype(dtype, where)
    shape = leaf.shape
    if pieces and (not facts.whole or facts.several):
        shards = tuple(owned_shards(leaf)) if fetch or not facts.whole else ()
        return HostLeaf(dtype, shape, key_impl, shards=start_transfers(shards, snapshot))
    if not fetch:
        return HostLeaf(dtype, shape, key_impl)
    if facts.on_cpu:  # in host memory already: no transfer to wait for
        return HostLeaf(dtype, shape, key_impl, np.asarray(leaf))
    return HostLeaf(dtype, shape, key_impl, leaf)  # array: the device array until _finish


def _stage_host(where: str, leaf: Any, fetch: bool) -> HostLeaf:
    """A numpy array or a number: checked, and its host data (final)."""
    if not isinstance(leaf, (np.ndarray, np.generic, *_PY_SCALARS)):
        raise InputError(f"leaf of type {type(leaf).__name__} is not an array", entry=where,
                         fix="store arrays or numbers only; put other values in metadata")
    array = np.asarray(leaf)
    _check_dtype(array.dtype, where)
    if not fetch:
        return HostLeaf(array.dtype, array.shape)
    # np.asarray made a new array of anything but an ndarray (which the caller may reuse)
    return HostLeaf(array.dtype, array.shape, None, array,
                    private=not isinstance(leaf, np.ndarray))


def _finish(staged: HostLeaf, copy: bool) -> HostLeaf:
    """Wait for a whole leaf's transfer; copy what must be private."""
    array = staged.array
    if array is None or (type(array) is np.ndarray and (staged.private or not copy)):
        return staged
    private = staged.private
    if not isinstance(array, np.ndarray):  # from an accelerator: a fresh host buffer
        array, private = await_host(array), True
    if copy and not private:
        array, private = np.array(array, copy=True), True
    elif array is staged.array:
        return staged
    return staged._replace(array=array, private=private)


def _check_dtype(dtype: np.dtype, where: str) -> None:
    if dtype not in _STORABLE:
        if not precs.is_supported(dtype):
            raise InputError(f"dtype {dtype} cannot be stored", entry=where,
                             fix="cast to a supported dtype (see the format's prec table)")
        _STORABLE.add(dtype)
