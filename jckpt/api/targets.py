"""How a target leaf takes a stored entry: its shape, its dtype, weak types and PRNG keys.

`restore` matches each leaf of its target with an entry of the file
(`jckpt.api.loading`); this module decides, before any payload is read, whether
the leaf takes that entry and in what form, and converts what was read:

* The shape must be the stored one (a typed PRNG key's: less its data's dim).
* Another dtype is refused unless the caller casts; a weakly typed target
  (`jax.eval_shape` of a Python number, which jckpt stored as 64-bit) takes
  the value as JAX takes the number itself.
* Typed PRNG keys come back as keys into a key target of their
  implementation, as their raw data into any other target; plain `uint32`
  key data comes back as keys into a key target whose data has its shape.

>>> from jckpt.format.entries import entry_for
>>> keys = entry_for('jckpt', (('k', 'rng'),), np.dtype('uint32'), (4,), id=0, key_impl='rbg')
>>> as_target_takes(keys, np.zeros(4, np.uint32), 'f.jckpt', 'jckpt/rng').key_impl is None
True
"""

from __future__ import annotations

import dataclasses
import reprlib
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jckpt.api.context import Context
from jckpt.errors import InputError, MismatchError
from jckpt.format import precs
from jckpt.format.entries import Entry
from jckpt.format.payload import stored_dtype
from jckpt.storage.lazy import LazyArray
from jckpt.trees import sharding, to_host


def as_target_takes(entry: Entry, leaf: Any, path: str, where: str) -> Entry:
    """`entry` as the target `leaf` takes it: a typed key's entry for a key target (of its
    implementation) or as raw data for another target; plain key data as keys for a key target."""
    if entry.key_impl is not None:
        return _as_key_target_takes(entry, leaf, path, where)
    if entry.prec == 'Uint32_prec' and _is_key_target(leaf):
        return _as_keys(entry, leaf)
    return entry


def _as_key_target_takes(entry: Entry, leaf: Any, path: str, where: str) -> Entry:
    """A typed PRNG key's entry as the target `leaf` takes it: keys of the stored implementation
    for a typed-key target (another implementation refused), else the raw key data as stored
    (`jax.random.key_data` of the keys: an old-style `PRNGKey`'s form)."""
    if not _is_key_target(leaf):
        want_shape, want_dtype = _target_spec(leaf, path, where)
        if want_shape is not None and tuple(want_shape) != tuple(entry.shape):
            raise _keys_into_plain(entry, want_shape, want_dtype, path, where)
        return dataclasses.replace(entry, key_impl=None)
    want = _key_impl_of(leaf)
    if want is not None and want != entry.key_impl:
        raise MismatchError(
            f"PRNG key implementation mismatch: file has {entry.key_impl} keys, target has "
            f"{want} keys", file=path, entry=where,
            fix=f"restore into keys of {entry.key_impl!r} (jax.random.key(0, impl="
                f"{entry.key_impl!r})), or into jax.ShapeDtypeStruct({tuple(entry.shape)}, "
                f"jnp.{entry.dtype}) for the raw key data")
    return entry


def _keys_into_plain(entry: Entry, want_shape: Sequence[int], want_dtype: Any, path: str,
                     where: str) -> MismatchError:
    """The error for typed PRNG keys restored into a plain target that is not their key data's
    shape: named as the keys `inspect` shows (`key<threefry2x32>` of shape `()`), not as a
    shape mismatch against the `(2,)` of their data, which the file's listing never shows."""
    what = f"{np.dtype(want_dtype)}{list(want_shape)}" if want_dtype is not None else \
        "a Python number"
    return MismatchError(
        f"the file holds typed PRNG keys key<{entry.key_impl}>{list(entry.array_shape)}, the "
        f"target is {what}", file=path, entry=where,
        fix=f"restore into keys (jax.random.key(0, impl={entry.key_impl!r}), or jax.eval_shape "
            f"of them), or into jax.ShapeDtypeStruct({tuple(entry.shape)}, jnp.uint32) for the "
            "raw key data")


def _as_keys(entry: Entry, leaf: Any) -> Entry:
    """Plain `uint32` data for a typed-key target (an old-style `PRNGKey`, or keys that went
    through a format without key types): read as keys of the target's implementation when
    its shape is their data's (`jax.random.wrap_key_data`), else as it is (and refused)."""
    try:
        impl = leaf.dtype._impl  # the key dtype's implementation: its name and data shape
        fits = tuple(entry.shape) == tuple(leaf.shape) + tuple(impl.key_shape)
        name = str(impl.name)
    except Exception:  # a JAX that keeps it elsewhere: refused as plain data
        return entry
    return dataclasses.replace(entry, key_impl=name) if fits else entry


def _key_impl_of(leaf: Any) -> str | None:
    """The name of a typed-key target's implementation (`jax.random.key_impl`'s), if it says."""
    try:
        if isinstance(leaf, jax.Array):
            return str(jax.random.key_impl(leaf))
        return str(leaf.dtype._impl.name)  # a ShapeDtypeStruct's key dtype knows its impl
    except Exception:  # a JAX that keeps it elsewhere: the stored impl is taken as it is
        return None


def check_leaf(ctx: Context, entry: Entry, leaf: Any, path: str, where: str) -> Any:
    """Check `entry` against the target `leaf` before anything is read; the dtype it wants."""
    want_shape, want_dtype = _target_spec(leaf, path, where)
    if want_dtype is None and entry.key_impl is None and _is_key_target(leaf):
        raise _raw_key_data(entry, want_shape, path, where)
    _check_shape(entry, want_shape, path, where)
    target_sharding = getattr(leaf, 'sharding', None) or (
        ctx.device if not ctx.host and not isinstance(leaf, (np.ndarray, np.generic)) else None)
    sharding.check_fits(want_shape if want_shape is not None else entry.shape, target_sharding,
                        file=path, where=where)
    return want_dtype


def as_stored_for(array: Any, entry: Entry, leaf: Any, want_dtype: Any, path: str, where: str, *,
                   cast: bool) -> Any:
    """The array read for `entry`, in the dtype the target wants (lazily for sharded targets)."""
    if type(leaf) in _PYTHON_KINDS and not cast and entry.key_impl is None:
        _check_python_kind(array.dtype, leaf, path, where)
    if want_dtype is not None and entry.key_impl is None and stored_dtype(want_dtype) != array.dtype:
        if cast:  # per shard, as read
            lazy, dtype = sharding.as_lazy(array), np.dtype(want_dtype)
            return LazyArray(lazy.shape, dtype,
                             lambda box: cast_values(lazy.read(box), dtype, path, where))
        if getattr(leaf, 'weak_type', False) and _takes_kind(_kind(want_dtype), _kind(array.dtype)):
            return _exactly(array, np.dtype(want_dtype), path, where)
        raise MismatchError(f"dtype mismatch: file has {array.dtype}, target has "
                            f"{np.dtype(want_dtype)}", file=path, entry=where,
                            fix="pass cast=True to convert, or fix the target's dtype"
                            + _x64_hint(array.dtype, np.dtype(want_dtype), leaf))
    return array


def take(ctx: Context, entry: Entry, array: Any, leaf: Any, path: str, where: str, *,
         cast: bool, meshes: dict[Any, Any] | None = None) -> tuple[Any, Any, str, str | None]:
    """For an array already read (a foreign file's, described by `entry`): what
    `jckpt.trees.placement.place_all` is asked, `(array, leaf, where, key_impl)`, by the
    rules `restore` applies to a jckpt file's entries, a spec's abstract mesh made concrete
    among them (`meshes` caches them across a tree's leaves)."""
    if type(leaf) is jax.ShapeDtypeStruct and leaf.sharding is not None:
        leaf = sharding.with_concrete_mesh(leaf, {} if meshes is None else meshes, file=path,
                                           where=where)
    entry = as_target_takes(entry, leaf, path, where)
    want_dtype = check_leaf(ctx, entry, leaf, path, where)
    return as_stored_for(array, entry, leaf, want_dtype, path, where, cast=cast), leaf, where, \
        entry.key_impl


def _x64_hint(stored: np.dtype, wanted: np.dtype, leaf: Any) -> str:
    """Why a 64-bit entry meets a JAX target of its kind in 32 bits when this process runs with
    `jax_enable_x64` off (a file saved with it on, restored into `jax.eval_shape`'s specs)."""
    if jax.config.read('jax_enable_x64') or not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) or \
            _kind(stored) != _kind(wanted) or \
            (stored.itemsize, wanted.itemsize) not in ((8, 4), (16, 8)):
        return ''
    return (f" (the file holds {stored}, as a process with jax_enable_x64 on saves it, and with "
            f"x64 off here JAX makes the target {wanted}: cast=True narrows the values, "
            "jax.config.update('jax_enable_x64', True) before building the target keeps them)")


_KINDS = (('bool', np.bool_), ('integer', np.integer), ('floating', np.floating),
          ('complex', np.complexfloating))


def _kind(dtype: Any) -> str | None:
    """Which of bool, integer (signed or not), floating and complex `dtype` is."""
    return next((name for name, t in _KINDS if jax.dtypes.issubdtype(dtype, t)), None)


#: A Python number target's kind, and the stored kinds it takes without a cast (each takes
#: the kinds before it: a stored int becomes a float target's float, never the reverse).
_PYTHON_KINDS = {bool: 0, int: 1, float: 2, complex: 3}


def _takes_kind(target: str | None, stored: str | None) -> bool:
    """Whether a number target of kind `target` (a Python number, or a weakly typed value
    standing for one) takes a stored value of kind `stored`: its own, or a narrower one (a
    stored int fills a float target, never the reverse).

    >>> _takes_kind('floating', 'integer'), _takes_kind('integer', 'floating')
    (True, False)
    """
    names = [name for name, _ in _KINDS]
    return target in names and stored in names and names.index(stored) <= names.index(target)


def _check_python_kind(dtype: Any, leaf: Any, path: str, where: str) -> None:
    """Refuse a stored value a Python number target would narrow (a float into an `int`)."""
    stored = _kind(dtype)
    if stored is not None and not _takes_kind(_KINDS[_PYTHON_KINDS[type(leaf)]][0], stored):
        kind = list(_PYTHON_KINDS)[[name for name, _ in _KINDS].index(stored)].__name__
        raise MismatchError(f"dtype mismatch: file has {np.dtype(dtype)}, the target is the "
                            f"Python {type(leaf).__name__} {leaf!r}", file=path, entry=where,
                            fix=f"make the target leaf a {kind} (or a spec of dtype "
                                f"{np.dtype(dtype)}), or pass cast=True to convert (the value "
                                "changes)")


def cast_values(values: np.ndarray, dtype: np.dtype, path: str, where: str) -> np.ndarray:
    """`values` converted to `dtype` for `cast=True`, as JAX's `astype` converts them: a
    float into an integer dtype is truncated and saturates (NaN becomes 0, 1e10 the dtype's
    largest value), where numpy's cast gives values that depend on the machine.

    A value the target's dtype cannot hold (NaN or out of range into an integer, finite into
    inf for a narrower float, a complex number's imaginary part into a real dtype) is a
    warning naming the entry and the first such value, not numpy's bare `RuntimeWarning` or
    `ComplexWarning`: the restore goes on, as `cast=True` asked.

    >>> cast_values(np.array([1.5, np.nan, 300.0]), np.dtype(np.int8), 'a.jckpt', 'jckpt/x')
    array([  1,   0, 127], dtype=int8)
    """
    values = _real_part(values, dtype, path, where)
    with np.errstate(all='ignore'):
        if _kind(dtype) == 'integer' and _kind(values.dtype) == 'floating':
            info = jax.numpy.iinfo(dtype)
            wide = np.trunc(values.astype(np.float64))
            lost = np.isnan(wide) | (wide < info.min) | (wide >= float(info.max) + 1)
            out = np.clip(np.nan_to_num(wide, nan=0.0), info.min, info.max).astype(dtype)
            out[wide >= info.max] = info.max  # float64 rounds int64's largest up, past it
        else:
            out = values.astype(dtype)
            lost = (np.isfinite(values) & ~np.isfinite(out) if _kind(dtype) == 'floating'
                    and _kind(values.dtype) == 'floating' else np.zeros(values.shape, bool))
    if np.any(lost):
        warnings.warn(f"{path}: entry {where}: cast=True converted {int(np.sum(lost))} value(s) "
                      f"that {dtype} cannot hold as JAX's astype does (the first: "
                      f"{values[lost].flat[0].item()!r} became {out[lost].flat[0].item()!r}); "
                      f"restore into a target of a wider dtype to keep them", stacklevel=2)
    return out


def _real_part(values: np.ndarray, dtype: np.dtype, path: str, where: str) -> np.ndarray:
    """The real part of complex `values` cast into a real number `dtype` (as JAX's `astype`
    takes it), with one warning naming the entry and the first value whose imaginary part is
    dropped; other `values` as they are (into bool, a complex number is True when not 0).

    >>> _real_part(np.array([1 + 0j]), np.dtype(np.float32), 'a.jckpt', 'jckpt/x')
    array([1.])
    """
    if _kind(values.dtype) != 'complex' or _kind(dtype) not in ('integer', 'floating'):
        return values
    lost = values.imag != 0
    if np.any(lost):
        warnings.warn(f"{path}: entry {where}: cast=True dropped the imaginary part of "
                      f"{int(np.sum(lost))} value(s) converting {values.dtype} to {dtype} (the "
                      f"first: {values[lost].flat[0].item()!r} became "
                      f"{values[lost].flat[0].real.item()!r}); restore into a complex target to "
                      f"keep them", stacklevel=3)
    return values.real


def _exactly(array: Any, dtype: np.dtype, path: str, where: str) -> np.ndarray:
    """`array` as `dtype` for a weakly typed target: only if every value converts as JAX
    would convert the Python number itself.

    A weakly typed target stands for a Python number (`jax.eval_shape` of a
    tree holding `step=0` or `lr=0.1`), which jckpt stored as 64-bit. An
    integer (or bool) is accepted when the target's dtype holds it exactly; a
    float or complex number is rounded to the target's precision, as JAX
    rounds the Python number 0.1 to float32, unless it overflows. Never
    narrowed silently otherwise.
    """
    values = np.asarray(array)
    with np.errstate(all='ignore'):
        out = values.astype(dtype)
        if _kind(values.dtype) in ('floating', 'complex'):
            same = np.isfinite(out) | ~np.isfinite(values)  # rounded, but never overflowed
        else:
            same = out.astype(values.dtype) == values
    if not np.all(same):
        bad = values[~same].flat[0].item()
        raise MismatchError(f"dtype mismatch: the file's {values.dtype} value {bad!r} does not fit "
                            f"the target's weakly typed {dtype}", file=path, entry=where,
                            fix=f"restore into a target of dtype {values.dtype} (64-bit needs "
                                f"jax_enable_x64), or pass cast=True to convert anyway (the value "
                                f"changes)")
    return out


def _check_shape(entry: Entry, want_shape: Sequence[int] | None, path: str, where: str) -> None:
    """Refuse a target shape other than the stored one (a PRNG key's: less its trailing dim)."""
    if entry.padding is not None and want_shape is not None and \
            tuple(want_shape) == entry.logical_dims and entry.logical_dims != entry.dims:
        raise MismatchError(f"padding mismatch: the stored entry is padded {entry.padding.pairs} "
                            f"to dims {entry.dims}; the target has the unpadded shape "
                            f"{tuple(want_shape)}", file=path, entry=where,
                            fix="give the target the padded shape")
    stored_shape = entry.array_shape
    if want_shape is not None and tuple(want_shape) != tuple(stored_shape) and not (
            entry.key_impl is not None and tuple(want_shape) == entry.shape[:len(want_shape)]):
        raise MismatchError(f"shape mismatch: file has {entry.shape}, target has "
                            f"{tuple(want_shape)}", file=path, entry=where,
                            fix="restore into a target of the stored shape")


def _is_key_target(leaf: Any) -> bool:
    return to_host.is_prng_key(leaf) or (isinstance(leaf, jax.ShapeDtypeStruct) and
                                            jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))


def _raw_key_data(entry: Entry, want_shape: Any, path: str, where: str) -> MismatchError:
    """The error for a typed-key target whose entry holds plain integers that are not its
    implementation's key data (`_as_keys` takes those)."""
    dtype = precs.dtype_of(entry.prec)
    return MismatchError(
        f"the file holds plain {dtype}{list(entry.shape)} data, not the key data of the "
        f"target's typed PRNG keys (shape {tuple(want_shape)})",
        file=path, entry=where,
        fix=f"restore into jax.ShapeDtypeStruct({tuple(entry.shape)}, jnp.{dtype}) and wrap the "
            f"result with jax.random.wrap_key_data(data); to store typed keys, save "
            f"jax.random.key(...) (jax.random.key_data(key) unwraps one)")


def _target_spec(leaf: Any, path: str, where: str) -> tuple[tuple[int, ...] | None, Any]:
    """`(shape, dtype)` a target leaf asks for (None where it does not say)."""
    if not is_target(leaf):
        raise not_a_target(leaf, path, where)
    if not isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        return (), None  # a Python number (np.float64 is a float too, and says its dtype)
    if to_host.is_key_dtype(leaf.dtype):
        return tuple(leaf.shape), None
    return tuple(leaf.shape), leaf.dtype


def is_target(leaf: Any) -> bool:
    """Whether `leaf` can stand for a stored array: an array, a `jax.ShapeDtypeStruct` or a number."""
    return isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic,
                             bool, int, float, complex))


def not_a_target(leaf: Any, path: str | None, where: str | None) -> InputError:
    """The error for a target leaf no checkpoint stores (a function, a string).

    An equinox module's abstract tree keeps its activation functions and its
    non-static strings as leaves; such a leaf is never in a file (`save`
    refuses it), so it is named as what it is, with the split that restores
    the arrays alone, not reported as an entry missing from the file.

    >>> not_a_target("batch", "m.jckpt", "jckpt/bn/axis_name").message
    "target leaf of type str ('batch') is not an array, a spec or a number"
    """
    name = getattr(leaf, '__name__', None) if callable(leaf) else None  # a function: its name
    shown = name if isinstance(name, str) else reprlib.repr(leaf)
    return InputError(
        f"target leaf of type {type(leaf).__name__} ({shown}) is not an array, "
        "a spec or a number", file=path, entry=where,
        fix="restore the arrays alone and put the rest back, e.g. for equinox: arrays, rest = "
            "eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct)); "
            "eqx.combine(jckpt.restore(ctx, arrays, path), rest)")


__all__ = ['as_stored_for', 'as_target_takes', 'check_leaf', 'is_target', 'not_a_target']
