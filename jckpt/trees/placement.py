"""Host <-> device: the only module that moves array data between numpy and JAX.

Saving brings every leaf to host through `host_leaves`, the one path
from a leaf to its host data (all transfers started with
`copy_to_host_async` before any is awaited; sharded arrays as their
distinct shards, never gathered). Restoring places each host array (usually
a view of the mapped file) onto the target's sharding, building each
device's shard from its own slice so a device reads only what it holds;
`place_all` batches the arrays bound for one device.

>>> host = host_leaves([('jckpt/w', np.arange(3.0))])[0]
>>> host.dtype, host.shape, host.key_impl, host.private
(dtype('float64'), (3,), None, False)
"""

from __future__ import annotations

import functools
import math
import mmap as mmap_mod
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jckpt.errors import FormatError, InputError
from jckpt.format import precs
from jckpt.trees import packing
from jckpt.trees import sharding as sharding_mod
from jckpt.trees.sharding import Box

_PY_SCALARS = (bool, int, float, complex)
_warned_x64 = False


_KEY_DTYPES: dict[Any, bool] = {}  # dtype -> is a typed PRNG key dtype (asked once per dtype)
_SHARDINGS: dict[Any, _Placement] = {}  # sharding -> what staging asks of it
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


class _Placement(NamedTuple):
    """What staging needs to know of a sharding, asked once per sharding."""

    on_cpu: bool  # every device a CPU: the data is in host memory already
    several: bool  # spread over (or replicated on) more than one device
    whole: bool  # fully addressable from this process


def _facts(sharding: Any) -> _Placement:
    try:
        return _SHARDINGS[sharding]
    except KeyError:
        facts = _SHARDINGS[sharding] = _ask(sharding)
        return facts
    except TypeError:  # an unhashable sharding: ask every time
        return _ask(sharding)


def _ask(sharding: Any) -> _Placement:
    devices = sharding.device_set
    return _Placement(all(d.platform == 'cpu' for d in devices), len(devices) > 1,
                      sharding.is_fully_addressable)


def _on_cpu(leaf: jax.Array) -> bool:
    """Whether `leaf` lives in host memory already (every device a CPU): no transfer to start."""
    return _facts(leaf.sharding).on_cpu


# --- leaf to host ---------------------------------------------------------------------

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


def start_transfers(shards: Sequence[tuple[Box, Any]]) -> None:
    """Start the device-to-host copy of each shard (they overlap; none is awaited)."""
    for _, data in shards:
        try:
            data.copy_to_host_async()
        except Exception:  # a backend without async copies: the copy happens on read
            pass


def await_host(data: Any) -> np.ndarray:
    """Wait for a transfer to host started earlier (a shard's, or a whole array's); its host array."""
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

    where: str
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


def host_leaves(leaves: Iterable[tuple[str, Any]], *, pieces: bool = False, spread: bool = False,
                fetch: bool = True, copy: bool = False) -> list[HostLeaf]:
    """Bring `(where, leaf)` pairs to host: every leaf checked and its transfer started, then the waits.

    The one path from a leaf to be stored to its host data. Typed PRNG keys
    become their key data and `key_impl`. Every leaf is checked (an array
    or a number, fully addressable, of a storable dtype; otherwise
    `InputError` naming `where`) and every transfer is
    started before the first is awaited, so they overlap. Arrays already in
    host memory (numpy, CPU devices) need no transfer.

    Args:
      leaves: `(where, leaf)`: `where` names the leaf in errors (`namespace/a/b`).
      pieces: keep a multi-device array as its distinct shards (`HostLeaf.shards`,
        read with `await_host` when written) instead of gathering it whole.
      spread: accept arrays spread over several processes (with `pieces`): this
        process's shards of them.
      fetch: `False` to only check and describe the leaves this process holds
        whole (another process writes them): no transfer, `array` None for each.
      copy: make each `array` private (`HostLeaf.private`), copying only
        what a transfer did not already copy: the snapshot a background writer needs.

    >>> [h.shape for h in host_leaves([('ns/w', np.ones((2, 3))), ('ns/n', 7)])]
    [(2, 3), ()]
    """
    staged = [_stage(where, leaf, pieces=pieces, spread=spread, fetch=fetch)
              for where, leaf in leaves]
    return [_finish(h, copy) for h in staged]


def _stage(where: str, leaf: Any, *, pieces: bool, spread: bool, fetch: bool) -> HostLeaf:
    """Check one leaf and start its transfers; the host data of a non-JAX leaf is final."""
    if not isinstance(leaf, jax.Array):
        return _stage_host(where, leaf, fetch)
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
        start_transfers(shards)
        return HostLeaf(where, dtype, shape, key_impl, shards=shards)
    if not fetch:
        return HostLeaf(where, dtype, shape, key_impl)
    if facts.on_cpu:  # in host memory already: no transfer to wait for
        return HostLeaf(where, dtype, shape, key_impl, np.asarray(leaf))
    try:
        leaf.copy_to_host_async()
    except Exception:  # a backend without async copies: the copy happens on read
        pass
    return HostLeaf(where, dtype, shape, key_impl, leaf)  # array: the device array until _finish


def _stage_host(where: str, leaf: Any, fetch: bool) -> HostLeaf:
    """A numpy array or a number: checked, and its host data (final)."""
    if not isinstance(leaf, (np.ndarray, np.generic, *_PY_SCALARS)):
        raise InputError(f"leaf of type {type(leaf).__name__} is not an array", entry=where,
                         fix="store arrays or numbers only; put other values in metadata")
    array = np.asarray(leaf)
    _check_dtype(array.dtype, where)
    if not fetch:
        return HostLeaf(where, array.dtype, array.shape)
    # np.asarray made a new array of anything but an ndarray (which the caller may reuse)
    return HostLeaf(where, array.dtype, array.shape, None, array,
                    private=not isinstance(leaf, np.ndarray))


def _finish(staged: HostLeaf, copy: bool) -> HostLeaf:
    """Wait for a whole leaf's transfer; copy what must be private."""
    array = staged.array
    if array is None or (type(array) is np.ndarray and (staged.private or not copy)):
        return staged
    private = staged.private
    if isinstance(array, jax.Array):  # from an accelerator: the transfer made a fresh host buffer
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


def _x64_ok(dtype: np.dtype) -> bool:
    return dtype.itemsize < 8 or (dtype.kind == 'c' and dtype.itemsize == 8) or bool(
        jax.config.jax_enable_x64)


def _warn_x64(where: str) -> None:
    global _warned_x64
    if not _warned_x64:
        _warned_x64 = True
        warnings.warn(f"{where}: 64-bit entries stay host numpy arrays because jax_enable_x64 "
                      "is off (set jax.config.update('jax_enable_x64', True) to get device "
                      "arrays)", stacklevel=3)


def default_placement(device: Any):
    """The sharding or device loaded arrays go to when nothing else says."""
    return device if device is not None else jax.local_devices()[0]  # addressable in every process


def put(array: np.ndarray, placement: Any) -> jax.Array:
    """Place a host array on a device or sharding, each device reading only its slice."""
    if isinstance(placement, jax.sharding.Sharding) and len(placement.device_set) > 1:
        return jax.make_array_from_callback(array.shape, placement,
                                            lambda index: sharding_mod.read_index(array, index))
    return jax.device_put(np.asarray(array), placement)


def place(array: np.ndarray, target: Any, *, host: bool, device: Any, where: str,
          key_impl: str | None = None, file: str | None = None) -> Any:
    """Turn a loaded host array into what `target` (a leaf, or None) asks for.

    Typed PRNG keys always come back as key arrays (numpy has no key dtype),
    even for host contexts; their raw data is `jax.random.key_data(key)`.
    """
    placement = getattr(target, 'sharding', None) if target is not None else None
    if key_impl is not None:  # key data has a trailing dim the key's sharding lacks
        try:
            keys = jax.random.wrap_key_data(jax.device_put(np.asarray(array),
                                                           default_placement(device)),
                                            impl=key_impl)
        except (ValueError, TypeError) as e:  # an unknown impl, or data of the wrong shape
            raise FormatError(f"cannot rebuild PRNG keys of {key_impl!r}: {e}", file=file,
                              entry=where, fix="the entry's key_impl or dims are damaged") from None
        return keys if placement is None else jax.device_put(keys, placement)
    if isinstance(target, _PY_SCALARS) and not isinstance(target, np.generic):
        return type(target)(np.asarray(array).item())
    if isinstance(target, (np.ndarray, np.generic)):
        return np.asarray(array)
    if host and not isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        return np.asarray(array)
    if not _x64_ok(array.dtype):
        _warn_x64(where)
        return np.asarray(array)
    return put(array, placement if placement is not None else default_placement(device))


#: XLA's CPU client uses host memory in place (no copy) only at this alignment.
CPU_ALIAS_ALIGNMENT = 64
#: Bytes copied between releases of the mapping's pages in :func:`aligned_copy`.
_COPY_CHUNK = 32 << 20


def plain_target(array: Any, target: Any, *, host: bool, device: Any,
                 key_impl: str | None = None) -> Any:
    """The one device (or one-device sharding) a plain `device_put` puts `array` on.

    `None` when `place` has more to do: keys, scalars, host results,
    64-bit values without x64, multi-device shardings, lazily read pieces.
    """
    if key_impl is not None or not isinstance(array, np.ndarray) or (
            isinstance(target, (*_PY_SCALARS, np.ndarray, np.generic))):
        return None
    if host and not isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        return None
    if not _x64_ok(array.dtype):
        return None
    dest = getattr(target, 'sharding', None) if target is not None else None
    dest = dest if dest is not None else default_placement(device)
    if isinstance(dest, jax.sharding.Sharding) and len(dest.device_set) != 1:
        return None
    return dest


def _is_cpu(dest: Any) -> bool:
    devices = dest.device_set if isinstance(dest, jax.sharding.Sharding) else {dest}
    return all(getattr(d, 'platform', None) == 'cpu' for d in devices)


def aligned_copy(array: np.ndarray, alignment: int = CPU_ALIAS_ALIGNMENT) -> np.ndarray:
    """A copy of `array` at an `alignment`-byte address, so the CPU client can alias it.

    When `array` views a memory mapping, the mapping's pages are released
    behind the copy, chunk by chunk (they are clean file pages; a later read
    maps them again), so the process never holds the payload twice.
    """
    buf = np.empty(array.nbytes + alignment, np.uint8)
    skip = -buf.ctypes.data % alignment
    out = buf[skip:skip + array.nbytes].view(array.dtype).reshape(array.shape)
    src, dst = array.reshape(-1), out.reshape(-1)
    base = array
    while base is not None and not isinstance(base, mmap_mod.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, 'base', None)
    start = array.ctypes.data - np.frombuffer(base, np.uint8).ctypes.data if base is not None else 0
    step = max(1, _COPY_CHUNK // max(1, array.itemsize))
    page = mmap_mod.PAGESIZE
    for i in range(0, src.size, step):
        dst[i:i + step] = src[i:i + step]
        if base is not None:
            lo = start + i * array.itemsize
            hi = start + min(src.size, i + step) * array.itemsize
            lo_page = -(-lo // page) * page  # only pages wholly inside this payload
            hi_page = hi // page * page
            if hi_page > lo_page:
                base.madvise(mmap_mod.MADV_DONTNEED, lo_page, hi_page - lo_page)
    return out


def place_all(requests: list[tuple[Any, Any, str, str | None]], *, host: bool, device: Any,
              file: str | None = None) -> list[Any]:
    """`place` for many `(array, target, where, key_impl)` at once.

    Arrays bound for one device go in a single batched `device_put` (one
    dispatch instead of one per array: 100,000 small arrays in a fraction of a
    second). On the CPU a payload the client could not alias in place (not
    64-byte aligned) is first copied to an aligned buffer, so it is copied once.
    """
    out: list[Any] = [None] * len(requests)
    batch: list[int] = []
    arrays: list[np.ndarray] = []
    dests: list[Any] = []
    for i, (array, target, where, key_impl) in enumerate(requests):
        dest = plain_target(array, target, host=host, device=device, key_impl=key_impl)
        if dest is None:
            out[i] = place(array, target, host=host, device=device, where=where,
                           key_impl=key_impl, file=file)
            continue
        if array.nbytes >= (1 << 16) and array.ctypes.data % CPU_ALIAS_ALIGNMENT and _is_cpu(dest):
            array = aligned_copy(array)
        batch.append(i)
        arrays.append(array)
        dests.append(dest)
    if arrays:
        for i, value in zip(batch, _put_grouped(arrays, dests)):
            out[i] = value
    return out


def _put_grouped(arrays: list[np.ndarray], dests: list[Any]) -> list[jax.Array]:
    """Small arrays bound for one accelerator travel packed (`jckpt.trees.packing`); the rest
    (and everything bound for the CPU, where arrays alias the file) go one by one."""
    accelerators: dict[Any, Any] = {}  # dest -> its accelerator device, or None
    groups: dict[Any, list[int]] = {}
    for i, (array, dest) in enumerate(zip(arrays, dests)):
        if dest not in accelerators:
            accelerators[dest] = _accelerator(dest)
        device = accelerators[dest]
        if device is not None and packing.packable(array):
            groups.setdefault(device, []).append(i)
    out: list[Any] = [None] * len(arrays)
    for device, indices in groups.items():
        if len(indices) >= packing.PACK_MIN:
            for i, value in zip(indices, packing.put_packed([arrays[i] for i in indices], device)):
                out[i] = value
    rest = [i for i, value in enumerate(out) if value is None]
    for i, value in zip(rest, _put_batch([arrays[i] for i in rest], [dests[i] for i in rest])):
        out[i] = value
    return out


def _accelerator(dest: Any) -> Any:
    """The device of a one-device destination in an accelerator's own memory; None otherwise."""
    if isinstance(dest, jax.sharding.Sharding):
        if type(dest) is not jax.sharding.SingleDeviceSharding or \
                dest.memory_kind not in (None, 'device'):
            return None
        (dest,) = dest.device_set
    return None if getattr(dest, 'platform', 'cpu') == 'cpu' else dest


def _transfer_target(dest: Any) -> tuple[Any, list | None]:
    """`(sharding, devices)` of a destination; devices None unless one plain device's memory."""
    sharding = dest if isinstance(dest, jax.sharding.Sharding) else jax.sharding.SingleDeviceSharding(dest)
    plain = type(sharding) is jax.sharding.SingleDeviceSharding and \
        sharding.memory_kind in (None, 'device')
    return sharding, list(sharding.device_set) if plain else None


def _put_batch(arrays: list[np.ndarray], dests: list[Any]) -> list[jax.Array]:
    """`jax.device_put(arrays, dests)` for one-device destinations, at a fraction of the cost.

    `jax.device_put` spends about 40 microseconds of Python per array (tree
    broadcasting, shape canonicalization, aval updates). With one cached aval
    per shape and dtype, JAX's own per-array transfer routine does the same
    work in about 6: 100,000 small arrays in well under a second. Falls back
    to `jax.device_put` if that routine is missing or answers unexpectedly.
    """
    try:
        from jax._src import core as jax_core
        from jax._src.interpreters import pxla
        transfer = pxla.batched_device_put
    except (ImportError, AttributeError):
        return jax.device_put(arrays, dests)
    avals: dict[tuple, Any] = {}
    targets: dict[Any, tuple[Any, list | None]] = {}  # dest -> (sharding, its devices if plain)
    out = []
    try:
        for array, dest in zip(arrays, dests):
            target = targets.get(dest)
            if target is None:
                target = targets[dest] = _transfer_target(dest)
            sharding, devices = target
            if devices is None:
                out.append(jax.device_put(array, sharding))
                continue
            key = (array.shape, array.dtype)
            aval = avals.get(key)
            if aval is None:
                aval = avals[key] = jax_core.ShapedArray(array.shape, array.dtype)
            value = transfer(aval, sharding, [array], devices, True)
            if value.shape != array.shape or value.dtype != array.dtype:
                raise TypeError('unexpected transfer result')
            out.append(value)
    except (TypeError, ValueError, AttributeError):
        return jax.device_put(arrays, dests)
    return out
