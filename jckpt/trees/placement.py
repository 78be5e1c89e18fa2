"""Host to device: placing restored host arrays onto their targets.

Restoring places each host array (usually a view of the mapped file) onto
the target's sharding, building each device's shard from its own slice so a
device reads only what it holds; `place_all` batches the arrays bound for
one device (`jckpt.trees.batched_put`: small ones travel packed). The way there,
leaf to host, is `jckpt.trees.to_host`; the two (and the batches of this one)
are the only modules that move array data between numpy and JAX.

>>> place(np.arange(3.0), None, host=True, device=None, where='jckpt/w').tolist()
[0.0, 1.0, 2.0]
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jckpt.errors import FormatError, InputError
from jckpt.storage.lazy import LazyArray
from jckpt.trees import sharding as sharding_mod
from jckpt.trees.batched_put import CPU_ALIAS_ALIGNMENT, aligned_copy, is_cpu, put_grouped

_PY_SCALARS = (bool, int, float, complex)
_warned_x64 = False

def _warn_x64(where: str) -> None:
    global _warned_x64
    if not _warned_x64:
        _warned_x64 = True
        warnings.warn(f"{where}: 64-bit entries stay host numpy arrays because jax_enable_x64 "
                      "is off (set jax.config.update('jax_enable_x64', True) to get device "
                      "arrays)", stacklevel=3)


def warn_unsharded_specs(specs: list[str], path: str, devices: list[Any] | None = None) -> None:
    """Warn that the named array specs without a sharding all go to one accelerator.

    `jax.eval_shape` gives specs without shardings, so a restore into it puts a
    sharded model on the first device: an out-of-memory error, or a model
    nobody notices is no longer sharded. Only where that device is one of
    several accelerators (on the CPU, every device shares host memory).
    """
    devices = jax.local_devices() if devices is None else devices
    if specs and len(devices) > 1 and devices[0].platform != 'cpu':
        warnings.warn(f"{path}: {len(specs)} target leaves ({specs[0]}, ...) are "
                      f"ShapeDtypeStructs without a sharding (jax.eval_shape gives none), so "
                      f"they go to one device, {devices[0]}, of the {len(devices)} here; give "
                      "the specs the shardings to restore onto (docs/sharding.md), or pass "
                      "jckpt.Context(device=...) to say where they go", stacklevel=5)  # restore's caller


def default_placement(device: Any):
    """The sharding or device loaded arrays go to when nothing else says."""
    return device if device is not None else jax.local_devices()[0]  # addressable in every process


def put(array: np.ndarray, placement: Any) -> jax.Array:
    """Place a host array on a device or sharding, each device reading only its slice, and
    each distinct slice read once: the devices holding replicas of it (a partially
    replicated sharding, `P('model')` on a data x model mesh) share that read."""
    if isinstance(placement, jax.sharding.Sharding) and len(placement.device_set) > 1:
        read: dict[Any, np.ndarray] = {}

        def shard(index: Any) -> np.ndarray:
            box = sharding_mod.box_of(index if isinstance(index, tuple) else (index,), array.shape)
            if box not in read:
                read[box] = sharding_mod.read_box(array, box)
            return read[box]
        # the dtype too: a process holding none of the array's devices (a pipeline stage
        # of other processes) calls `shard` for nothing, so JAX cannot infer it
        return jax.make_array_from_callback(array.shape, placement, shard, dtype=array.dtype)
    return jax.device_put(np.asarray(array), placement)


def place(array: np.ndarray, target: Any, *, host: bool, device: Any, where: str,
          key_impl: str | None = None, file: str | None = None) -> Any:
    """Turn a loaded host array into what `target` (a leaf, or None) asks for.

    Typed PRNG keys always come back as key arrays (numpy has no key dtype),
    even for host contexts; their raw data is `jax.random.key_data(key)`.
    """
    placement = getattr(target, 'sharding', None) if target is not None else None
    if key_impl is not None:  # key data has a trailing dim the key's sharding lacks
        data_placement = _key_data_sharding(placement, target)
        if placement is None and data_placement is None and not host:
            _check_context_fits(array.shape[:-1], device, file, where)
        try:  # `array` as it is: a lazily read one gives each device its box alone
            keys = jax.random.wrap_key_data(put(array, data_placement if data_placement is not None
                                                else default_placement(device)), impl=key_impl)
        except (ValueError, TypeError) as e:  # an unknown impl, or data of the wrong shape
            raise FormatError(f"cannot rebuild PRNG keys of {key_impl!r}: {e}", file=file,
                              entry=where, fix="the entry's key_impl or dims are damaged") from None
        if placement is None or keys.sharding.is_equivalent_to(placement, keys.ndim):
            return keys
        return jax.device_put(keys, placement)
    if isinstance(target, _PY_SCALARS) and not isinstance(target, np.generic):
        value = np.asarray(array).item()  # a narrower target's kind was refused unless cast
        return type(target)(value.real if isinstance(value, complex) and type(target) is not complex
                            else value)
    if isinstance(target, np.generic):
        return np.asarray(array)[()]  # a numpy scalar, as the target was
    if isinstance(target, np.ndarray):
        return np.asarray(array)
    if host and not isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        return np.asarray(array)
    if not sharding_mod.x64_ok(array.dtype):
        _warn_x64(where)
        return np.asarray(array)
    if placement is None:
        _check_context_fits(array.shape, device, file, where)
    placed = put(array, placement if placement is not None else default_placement(device))
    return _weakly_typed(placed) if getattr(target, 'weak_type', False) else placed


def _check_context_fits(shape: tuple[int, ...], device: Any, file: str | None, where: str) -> None:
    """An `InputError` naming the entry when the Context's `device`, a sharding, cannot split
    an array of `shape` (a dimension it does not divide, a scalar under `P('data')`): `load`
    places every array there, and JAX's own error named neither the entry nor the file."""
    if isinstance(device, jax.sharding.Sharding) and len(device.device_set) > 1:
        sharding_mod.check_fits(
            shape, device, file=file, where=where, whose="the Context's device sharding",
            error=InputError,
            fix="load with a device sharding that every array fits (NamedSharding(mesh, P()) "
                "replicates them), or restore into a target whose leaves carry their own shardings")


def context_placement(device: Any, host: bool) -> Any:
    """Where a target `ShapeDtypeStruct` without a sharding goes under `jax.set_mesh`:
    replicated over the mesh in context, as JAX puts what is made there (`jnp.zeros`, a
    Python number), so that a step jitted under that mesh takes it. None without a mesh in
    context, for host loads, or where `device` says where arrays go."""
    get_mesh = getattr(jax.sharding, 'get_mesh', None)
    mesh = get_mesh() if get_mesh is not None and device is None and not host else None
    if mesh is None or mesh.empty:
        return None
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def beyond_this_process(target: Any, *, host: bool, device: Any) -> bool:
    """Whether `place` puts what `target` asks for on devices of other processes too: a global
    array, which the processes of a run make together (a restore onto one meets the others).
    False for a host value, or an array on this process's devices; True where that cannot be
    told (a sharding on an abstract mesh, which may span every process's devices).

    >>> import numpy as np
    >>> beyond_this_process(np.zeros(3), host=False, device=None)
    False
    """
    if isinstance(target, (*_PY_SCALARS, np.ndarray, np.generic)) or (
            host and not isinstance(target, (jax.Array, jax.ShapeDtypeStruct))):
        return False
    dest = getattr(target, 'sharding', None)
    if dest is None and type(target) is jax.ShapeDtypeStruct:
        dest = context_placement(device, host)
    dest = dest if dest is not None else default_placement(device)
    if not isinstance(dest, jax.sharding.Sharding):
        return getattr(dest, 'process_index', jax.process_index()) != jax.process_index()
    try:
        return not dest.is_fully_addressable
    except Exception:  # an abstract mesh has no devices to ask
        return True


def _key_data_sharding(placement: Any, target: Any) -> Any:
    """Where the data of keys bound for `placement` goes, each device reading only its slice
    (a sharding over several processes cannot take keys put on one device), and keys bound
    for one device going straight there with the target's sharding. None for a placement
    that is neither a `NamedSharding` nor a sharding of one device.

    A key array's `sharding` does not say how its data is laid out: keys put with `P()` and
    with `P(None)` show the same sharding over data sharded `P(None)` and `P(None, None)`, and
    a jitted step compiled for one compiles again for the other. So the data goes where the
    target keys' own data is, and only for a target without data (a `ShapeDtypeStruct`) where
    JAX puts the data of keys at `placement`: the keys' spec, the data's trailing axis whole.
    """
    if not isinstance(placement, jax.sharding.NamedSharding):
        return placement if isinstance(placement, jax.sharding.Sharding) and \
            len(placement.device_set) == 1 else None
    if isinstance(target, jax.Array) and not target.is_deleted():
        return jax.random.key_data(target).sharding
    if len(placement.device_set) == 1:  # JAX puts keys' data there with the keys' spec as given
        return placement
    return jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec(*placement.spec, None),
                                      memory_kind=placement.memory_kind)


def _weakly_typed(array: jax.Array) -> jax.Array:
    """`array` weakly typed, as its target was (a Linen `TrainState`'s `step=0`): a strong
    value where the traced function saw a weak one would compile the step function again.
    JAX offers no public way; where its private one moved, the value stays strong.

    That way is an operation, run outside any mesh in context (JAX refuses it for an array
    off that mesh); its result, which JAX puts in device memory and specs its own way
    (`P()` as `P(None)`), is put back where `array` is, so the target's sharding is kept.
    """
    try:
        from jax._src.lax.lax import _convert_element_type
        with _outside_any_mesh():
            weak = _convert_element_type(_in_device_memory(array), weak_type=True)
    except (ImportError, TypeError):  # pragma: no cover - another JAX
        return array
    except (ValueError, jax.errors.JaxRuntimeError):  # pragma: no cover - a JAX that refuses it
        return array
    return weak if weak.sharding == array.sharding else jax.device_put(weak, array.sharding)


def _in_device_memory(array: jax.Array) -> jax.Array:
    """`array`, copied to device memory if it is in host memory: JAX 0.9 fails inside XLA
    to run an operation on a replicated array in host memory."""
    kind = getattr(array.sharding, 'memory_kind', None)
    if kind in (None, 'device'):
        return array
    return jax.device_put(array, array.sharding.with_memory_kind('device'))


def _outside_any_mesh() -> Any:
    """A context without the mesh `jax.set_mesh` put in context (none to leave: a no-op).

    JAX before 0.10 refuses `set_mesh(None)`; there the meshes in context are swapped for
    the empty ones by hand, as `set_mesh(None)` does since.
    """
    set_mesh = getattr(jax, 'set_mesh', None)
    try:
        return set_mesh(None) if set_mesh is not None else contextlib.nullcontext()
    except (TypeError, ValueError):  # a JAX whose set_mesh needs a mesh
        return _without_meshes()


@contextlib.contextmanager
def _without_meshes() -> Iterator[None]:
    try:
        from jax._src import config, mesh
        abstract = config.abstract_mesh_context_manager.swap_local(mesh.empty_abstract_mesh)
        concrete = config.device_context.swap_local(mesh.empty_concrete_mesh)
    except (ImportError, AttributeError):  # pragma: no cover - another JAX
        yield
        return
    try:
        yield
    finally:
        config.abstract_mesh_context_manager.set_local(abstract)
        config.device_context.set_local(concrete)


def plain_target(array: Any, target: Any, *, host: bool, device: Any,
                 key_impl: str | None = None) -> Any:
    """The one device (or one-device sharding) a plain `device_put` puts `array` on.

    `None` when `place` has more to do: keys, scalars, host results,
    64-bit values without x64, weakly typed targets, multi-device shardings, lazily read pieces.
    """
    if key_impl is not None or not isinstance(array, np.ndarray) or (
            isinstance(target, (*_PY_SCALARS, np.ndarray, np.generic))) or (
            getattr(target, 'weak_type', False)):
        return None
    if host and not isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        return None
    if not sharding_mod.x64_ok(array.dtype):
        return None
    dest = getattr(target, 'sharding', None) if target is not None else None
    dest = dest if dest is not None else default_placement(device)
    if isinstance(dest, jax.sharding.Sharding) and len(dest.device_set) != 1:
        return None
    return dest


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
    # a request's kind -> plain_target's answer. Its sharding by value: a target built from
    # arrays gives each leaf a sharding object of its own, all equal, and one destination
    # object for them all keeps the later checks by identity (equality is Python code)
    known: dict[tuple, Any] = {}
    unsharded: list[str] = []  # array specs that say nowhere to go (`warn_unsharded_specs`)
    on_mesh = context_placement(device, host)
    deferred: list[tuple[int, Callable[[], Any]]] = []  # `place` calls, made after the loop
    for i, (array, target, where, key_impl) in enumerate(requests):
        if host and target is None and key_impl is None and type(array) is np.ndarray:
            out[i] = array  # what `place` gives: a host load takes the array as read
            continue
        sharding = getattr(target, 'sharding', None) if target is not None else None
        if sharding is None and type(target) is jax.ShapeDtypeStruct and on_mesh is not None:
            sharding = on_mesh
            target = jax.ShapeDtypeStruct(target.shape, target.dtype, sharding=on_mesh,
                                          weak_type=target.weak_type)
        if sharding is None and type(target) is jax.ShapeDtypeStruct and target.ndim:
            unsharded.append(where)
        kind = (type(array), getattr(array, 'dtype', None), type(target), sharding, key_impl,
                getattr(target, 'weak_type', False))
        dest = known.get(kind, known)
        if dest is known:
            dest = known[kind] = plain_target(array, target, host=host, device=device,
                                              key_impl=key_impl)
        if dest is None:
            deferred.append((i, functools.partial(place, array, target, host=host, device=device,
                                                   where=where, key_impl=key_impl, file=file)))
            continue
        if array.nbytes >= (1 << 16) and array.ctypes.data % CPU_ALIAS_ALIGNMENT and is_cpu(dest):
            array = aligned_copy(array)
        batch.append(i)
        arrays.append(array)
        dests.append(dest)
    for i, value in zip([i for i, _ in deferred], _call_all(
            [call for _, call in deferred], [type(requests[i][0]) is LazyArray for i, _ in deferred])):
        out[i] = value
    if unsharded and device is None and not host:
        warn_unsharded_specs(unsharded, file or '')
    if arrays:
        for i, value in zip(batch, put_grouped(arrays, dests)):
            out[i] = value
    return out


#: Lazily read arrays (an object store's payloads) placed at once: each waits on its reads.
LAZY_WORKERS = 8


def _call_all(calls: list[Callable[[], Any]], lazy: list[bool]) -> list[Any]:
    """Each of `calls`' result, in order; those that read a `LazyArray` (`lazy`) run
    `LAZY_WORKERS` at a time when there are several: one array's reads (each a request to the
    store, box by box) were waited for before the next array's were made.

    >>> _call_all([lambda: 1, lambda: 2], [True, True])
    [1, 2]
    """
    if sum(lazy) < 2:
        return [call() for call in calls]
    with concurrent.futures.ThreadPoolExecutor(min(LAZY_WORKERS, sum(lazy))) as pool:
        futures = {i: pool.submit(call) for i, call in enumerate(calls) if lazy[i]}
        return [futures[i].result() if i in futures else call() for i, call in enumerate(calls)]
