"""Sharded arrays on restore: reading one device's slice, and checking a sharding fits.

A *box* is a tuple of `(start, stop)` pairs, one per dimension: the part of
a global array a shard, a stored piece or a device holds (the arithmetic is in
`jckpt.format.boxes`, re-exported here). Restoring builds each device's
shard from the mapped file, reading only that device's box through a
`LazyArray`; saving's side (each distinct shard to
host once) is in `jckpt.trees.to_host`, and writing shards into place in
`jckpt.storage.regions`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jckpt.errors import CheckpointError, InputError, MismatchError
from jckpt.format.boxes import (  # noqa: F401  (box arithmetic, re-exported where it was)
    Box,
    box_of,
    box_shape,
    box_size,
    box_slices,
    check_tiling,
    coalesce,
    full_box,
    intersect,
)
from jckpt.format.entries import Entry
from jckpt.storage.lazy import LazyArray, note_read, record_reads
from jckpt.storage.regions import ShardedSource


def as_lazy(array: Any) -> LazyArray:
    """`array` (numpy or lazy) as a `LazyArray`."""
    if isinstance(array, LazyArray):
        return array
    return LazyArray(array.shape, array.dtype, lambda box: read_box(array, box))


def read_box(array: Any, box: Box, *, log: bool = True) -> np.ndarray:
    """Read `box` of `array` (a mapped view or a `LazyArray`), logging the bytes."""
    if isinstance(array, LazyArray):
        return array.read(box)
    out = np.asarray(np.asarray(array)[box_slices(box)])  # a 0-d index gives a numpy scalar
    if log:
        note_read(box, out.nbytes)
    return out


def x64_ok(dtype: np.dtype) -> bool:
    """Whether JAX holds arrays of `dtype` as they are (64-bit ones only with x64 on)."""
    import jax
    return dtype.itemsize < 8 or (dtype.kind == 'c' and dtype.itemsize == 8) or bool(
        jax.config.read('jax_enable_x64'))


def needed_boxes(target: Any, entry: Entry, *, host: bool, device: Any) -> list[Box] | None:
    """The distinct boxes of the stored array `entry` that placing it where `target` (or, for
    None, the context's `device`) says reads: this process's devices' slices of a sharding
    over several; None where it reads all of it (keys, host values, one device, a target of
    another shape, a sharding that cannot split it: placing refuses it, naming the entry).
    What a restore plans its reads by.

    >>> from jckpt.format.entries import Entry
    >>> e = Entry(id=0, namespace='n', prec='Single_prec', dims=(4,), offset=0, byte_length=16)
    >>> needed_boxes(None, e, host=True, device=None) is None
    True
    """
    if target is None:
        dest = None if host else device
    else:  # asked of every leaf of a restore: the commonest answer (no sharding) first
        dest = getattr(target, 'sharding', None)
    if dest is None or entry.key_impl is not None:
        return None
    import jax
    if type(dest) is jax.sharding.SingleDeviceSharding or \
            not isinstance(dest, jax.sharding.Sharding) or len(dest.device_set) == 1 or (
            target is not None and (not isinstance(target, (jax.Array, jax.ShapeDtypeStruct))
                                    or tuple(target.shape) != entry.shape)) or not x64_ok(entry.dtype):
        return None
    try:
        return _local_boxes(dest, entry.shape)
    except Exception:  # IndivisibleError, IndexError, ...: the plan is no place to refuse it
        return None


@functools.lru_cache(maxsize=1024)
def _local_boxes(dest: Any, shape: tuple[int, ...]) -> list[Box]:
    """The distinct boxes of an array of `shape` that this process's devices hold under the
    sharding `dest` (each array of a restore asks it: a model's are of few shapes)."""
    return list(dict.fromkeys(box_of(i if isinstance(i, tuple) else (i,), shape)
                              for i in dest.addressable_devices_indices_map(shape).values()))


#: What to do about a target's sharding that does not fit the stored shape.
_FITS_FIX = "choose a PartitionSpec whose mesh axes divide every sharded dimension, or pad the array"


def check_fits(shape: Sequence[int], sharding: Any, *, file: str | None, where: str,
               whose: str = "the target's sharding", error: type[CheckpointError] = MismatchError,
               fix: str = _FITS_FIX) -> None:
    """Raise `error` (`MismatchError`) when `shape` cannot be split by `sharding` (`whose`).

    JAX refuses arrays whose dims do not divide evenly by the mesh axes that
    shard them; this says so naming the leaf, before any byte is read.
    """
    import jax
    if type(sharding) is jax.sharding.SingleDeviceSharding or \
            not isinstance(sharding, jax.sharding.Sharding):
        return  # one device takes any shape: asked of every leaf of a restore, answered first
    spec = getattr(sharding, 'spec', None)
    if spec is not None and len(spec) > len(shape):  # JAX's own error: an IndexError
        raise error(f"shape {tuple(shape)} has {len(shape)} axes, fewer than the {len(spec)} "
                    f"that {whose} {spec} splits", file=file, entry=where, fix=fix)
    try:
        sharding.shard_shape(tuple(shape))
    except Exception as e:  # IndivisibleError / ValueError, depending on the JAX version
        raise error(
            f"shape {tuple(shape)} is not divisible by {whose}"
            + (f" {spec}" if spec is not None else "") + f": {str(e).splitlines()[0][:1000]}",
            file=file, entry=where, fix=fix) from None


def with_concrete_mesh(leaf: Any, cache: dict[Any, Any], *, file: str | None, where: str) -> Any:
    """`leaf` (a target `ShapeDtypeStruct`) with its abstract mesh made concrete.

    `nnx.eval_shape` under `jax.set_mesh` gives targets whose
    `NamedSharding` names an `AbstractMesh` (axis names and sizes, no
    devices); restore places them on the mesh `concrete_mesh` finds.
    Any other leaf comes back unchanged. `cache` maps abstract meshes to
    concrete ones, so a tree is resolved once per mesh.
    """
    import jax
    spec = leaf.sharding
    if not isinstance(spec, jax.sharding.NamedSharding) or \
            not isinstance(spec.mesh, jax.sharding.AbstractMesh):
        return leaf
    mesh = cache.get(spec.mesh)
    if mesh is None:
        mesh = cache[spec.mesh] = concrete_mesh(spec.mesh, file=file, where=where)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=leaf.weak_type,
                                sharding=jax.sharding.NamedSharding(mesh, spec.spec,
                                                                    memory_kind=spec.memory_kind))


def concrete_mesh(abstract: Any, *, file: str | None = None, where: str | None = None) -> Any:
    """The concrete `jax.sharding.Mesh` that `abstract` (an `AbstractMesh`) stands for.

    The mesh in context (set by `jax.set_mesh`) when its axis names and
    sizes are the abstract mesh's; else, when the abstract mesh spans exactly
    the devices JAX has, `jax.make_mesh` of its axes over them (the mesh
    `jax.make_mesh` would have given the code that built the target). The
    result has the abstract mesh's axis types. Refuses, with
    `InputError`, when neither applies.
    """
    import jax
    names, sizes = tuple(abstract.axis_names), tuple(abstract.axis_sizes)
    types = getattr(abstract, 'axis_types', None)
    get_mesh = getattr(jax.sharding, 'get_mesh', None)
    current = get_mesh() if get_mesh is not None else None
    if current is not None and not current.empty and (
            tuple(current.axis_names), tuple(current.axis_sizes)) == (names, sizes):
        return current if types is None else jax.sharding.Mesh(current.devices, names,
                                                               axis_types=types)
    if int(np.prod(sizes, dtype=np.int64)) == jax.device_count():
        return jax.make_mesh(sizes, names, **({} if types is None else {'axis_types': types}))
    axes = ', '.join(f"{n!r}: {s}" for n, s in zip(names, sizes))
    raise InputError(f"the target's sharding names an abstract mesh ({axes}) and no concrete mesh "
                     f"of these axes is in context (JAX has {jax.device_count()} devices)",
                     file=file, entry=where,
                     fix="restore inside `with jax.set_mesh(mesh):` for a mesh of these axes, or "
                         "give the target NamedShardings on a concrete jax.sharding.Mesh")


__all__ = ['Box', 'LazyArray', 'ShardedSource', 'box_of', 'check_fits', 'coalesce', 'concrete_mesh',
           'intersect', 'needed_boxes', 'read_box', 'record_reads', 'with_concrete_mesh', 'x64_ok']
