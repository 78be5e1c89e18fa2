"""Leaf to host: the one path from a leaf to be saved to its host data.

`host_leaves` checks every leaf (an array or a number, fully addressable, of
a storable dtype), turns typed PRNG keys into their key data, and starts every
device-to-host transfer before awaiting any, so they overlap
(`jckpt.trees.transfers`: into fresh buffers; for a snapshot, into pinned
host memory, small arrays joined); a sharded array is kept as its distinct
shards, never gathered. Arrays already in host memory (numpy, CPU devices)
need no transfer; runs of them are staged in one C call where the
accelerator is built. The way back, host to device, is
`jckpt.trees.placement`.

>>> host = host_leaves([('jckpt/w', np.arange(3.0))])[0]
>>> host.dtype, host.shape, host.key_impl, host.private
(dtype('float64'), (3,), None, False)
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jckpt.errors import CheckpointError, InputError
from jckpt.format import precs
from jckpt.format.fastpath import accelerator
from jckpt.trees import facts, transfers
from jckpt.trees import sharding as sharding_mod
from jckpt.trees.pytree import leaf_name
from jckpt.trees.sharding import Box

_PY_SCALARS = (bool, int, float, complex)

_KEY_DTYPES: dict[Any, bool] = {}  # dtype -> is a typed PRNG key dtype (asked once per dtype)
_STORABLE: set[np.dtype] = set()  # dtypes known to be storable


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


class HostLeaf(NamedTuple):
    """One leaf on its way to host: what it stores, and its data, whole or in pieces.

    `dtype` and `shape` are what is stored (a typed PRNG key's data, with
    `key_impl` naming its implementation). `array` is the whole host
    array; it is `None` when the leaf is held as `shards` instead, or when
    it was only described (`fetch=False`). `shards` are `(box,
    single-device array)` for each distinct shard this process writes, their
    transfers started: read each with `transfers.await_host` when it is written.
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
                copy: bool = False, snapshot: bool = False, keep_cpu: bool = False) -> list[HostLeaf]:
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
        read with `transfers.await_host` when written) instead of gathering it whole.
      spread: accept arrays spread over several processes (with `pieces`): this
        process's shards of them.
      fetch: `False` to only check and describe the leaves this process holds
        whole (another process writes them): no transfer, `array` None for each.
      copy: make each `array` private (`HostLeaf.private`), copying only
        what a transfer did not already copy: the snapshot a background writer needs.
      snapshot: the transfers from a device recur, snapshot after snapshot: into pinned
        buffers the runtime reuses, small arrays joined (`transfers.start_host_copies`).
      keep_cpu: an array on one CPU device that is staged in C keeps the `jax.Array` itself
        as `array` (its buffer is in host memory; no numpy view of it is made), for a
        caller that reads it at once from its buffer: a snapshot copies it
        (`jckpt.services.snapshot.copy_all`), a save hashes and writes a small one from
        a view of its buffer (`jckpt.format.payload.flat_bytes`).

    >>> [h.shape for h in host_leaves([('ns/w', np.ones((2, 3))), ('ns/n', 7)])]
    [(2, 3), ()]
    >>> host_leaves([((('k', 'w'),), np.ones(2))], namespace='ns')[0].shape
    (2,)
    """
    leaves = leaves if type(leaves) is list else list(leaves)
    staged: list[HostLeaf] = []
    finish = []  # the leaves staged in Python: a transfer to await, or a copy to make
    i = 0
    with naming_unusable(lambda: ((w if namespace is None else leaf_name(namespace, w), x)
                                  for w, x in leaves)):
        while True:
            i = _stage_plain(leaves, i, staged, keep_cpu) if fetch else i
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


@contextlib.contextmanager
def naming_unusable(named: Callable[[], Iterable[tuple[str, Any]]]) -> Iterator[None]:
    """Turn what JAX raises for a leaf no snapshot can read into an `InputError` naming it.

    A tracer (a save inside `jax.jit`) and an array whose buffer was donated raise
    JAX's own errors deep inside a snapshot; only after such a failure are the
    `named()` leaves, `(name, leaf)`, searched for the culprit, so a snapshot
    that succeeds pays nothing.
    """
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        found = unusable_leaf(named())
        if found is None:
            raise
        raise found from e


def unusable_leaf(named: Iterable[tuple[str, Any]]) -> InputError | None:
    """The error for the first leaf that cannot be read: a tracer or a deleted array; or None.

    >>> unusable_leaf([('ns/w', np.ones(2))]) is None
    True
    """
    for where, leaf in named:
        if isinstance(leaf, jax.core.Tracer):
            return InputError("the leaf is a tracer: a checkpoint was taken inside jax.jit or "
                              "another transformation", entry=where,
                              fix="save outside the jitted function: return the state from the "
                                  "step and save what it returned")
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            return InputError("the array has been deleted (its buffer was donated to a jitted "
                              "step, or deleted)", entry=where,
                              fix="save the state the step returned, or save before the step "
                                  "that donates these buffers")
    return None


#: The `jax.Array` types met so far (`_stage` records them): their CPU arrays are staged in C.
_JAX_TYPES: frozenset[type] = frozenset()


def _stage_plain(leaves: list[tuple[Any, Any]], start: int, out: list[HostLeaf],
                 keep_cpu: bool = False) -> int:
    """Stage the run of plain leaves from `start` on in C (a numpy array, or an array on one
    CPU device of this process, of a known storable dtype); the index of the first other one."""
    if accelerator is None or not ACCELERATE:
        return start
    return accelerator.stage_leaves(leaves, start, _STORABLE, facts.SHARDINGS, facts.SEEN,
                                    facts.SEEN_MAX, _JAX_TYPES, HostLeaf,
                                    None if keep_cpu else np.asarray, out, np.ndarray)


#: Whether `host_leaves` stages plain leaves in C where the accelerator is built (False: every
#: leaf through `_stage`, the reference the tests compare it with).
ACCELERATE = True


def _start_whole(staged: list[HostLeaf], indices: Sequence[int], snapshot: bool) -> None:
    """Start the transfers of the whole leaves at `indices` still on a device, all at once."""
    on_device = [k for k in indices if isinstance(staged[k].array, jax.Array)]
    if not on_device:
        return
    moved = transfers.start_host_copies([staged[k].array for k in on_device], snapshot)
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
    placed = facts.of(leaf.sharding)
    if not placed.whole and not (pieces and spread):
        raise InputError("array is not fully addressable from this process, and this writes "
                         "one file from one process", entry=where,
                         fix="call jckpt.save from every process (a directory checkpoint), or "
                             "use a CheckpointManager, which saves each step from every process; "
                             "a Mirror and the other formats' writers hold one process's arrays")
    if dtype not in _STORABLE:
        _check_dtype(dtype, where)
    shape = leaf.shape
    if pieces and (not placed.whole or placed.several):
        shards = tuple(owned_shards(leaf)) if fetch or not placed.whole else ()
        return HostLeaf(dtype, shape, key_impl, shards=transfers.start_transfers(shards, snapshot))
    if not fetch:
        return HostLeaf(dtype, shape, key_impl)
    if placed.on_cpu:  # in host memory already: no transfer to wait for
        return HostLeaf(dtype, shape, key_impl, np.asarray(leaf))
    return HostLeaf(dtype, shape, key_impl, leaf)  # array: the device array until _finish


def _stage_host(where: str, leaf: Any, fetch: bool) -> HostLeaf:
    """A numpy array or a number: checked, and its host data (final)."""
    if not isinstance(leaf, (np.ndarray, np.generic, *_PY_SCALARS)):
        raise InputError(f"leaf of type {type(leaf).__name__} is not an array", entry=where,
                         fix="store arrays or numbers only; put other values in metadata")
    array = np.asarray(leaf)
    if array.dtype == object and isinstance(leaf, int):  # beyond 64 bits
        raise InputError(f"an integer of {len(str(abs(leaf)))} digits does not fit 64 bits",
                         entry=where,
                         fix="store it as a float, or as a string in metadata")
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
        array, private = transfers.await_host(array), True
    if copy and not private:
        array, private = np.array(array, copy=True), True
    elif array is staged.array:
        return staged
    return staged._replace(array=array, private=private)


def _check_dtype(dtype: np.dtype, where: str) -> None:
    if dtype not in _STORABLE:
        if dtype == jax.dtypes.float0:
            raise InputError("a float0 array (the gradient of an integer input) holds no values",
                             entry=where, fix="leave float0 leaves out of the checkpoint "
                                              "(map them to None), or differentiate float inputs only")
        if not precs.is_supported(dtype):
            raise InputError(f"dtype {dtype} cannot be stored", entry=where,
                             fix="cast to a supported dtype (see the format's prec table)")
        _STORABLE.add(dtype)
