"""`Context`: the immutable value that carries defaults and what has been loaded.

Every operation takes a context and none changes it; `load` returns a new
one whose registry includes what it loaded, so loading the same entry twice
into one model is caught, and ids saved later in a namespace stay above every
id already loaded into it.

>>> ctx = Context()
>>> ctx.namespace, ctx.alignment, ctx.mmap, ctx.durable
('jckpt', 32, True, True)
>>> ctx.replace(namespace='student').namespace
'student'
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from jckpt.errors import InputError
from jckpt.format.entries import check_namespace
from jckpt.format.header import DEFAULT_ALIGNMENT, Entry
from jckpt.format.limits import check_alignment


@dataclasses.dataclass(frozen=True)
class Registry:
    """Identities `(namespace, path-or-id)` loaded so far, and the largest id per namespace."""

    identities: frozenset = frozenset()
    max_ids: tuple[tuple[str, int], ...] = ()

    def __contains__(self, identity: object) -> bool:
        return identity in self.identities

    def __len__(self) -> int:
        return len(self.identities)

    def max_id(self, namespace: str) -> int:
        """The largest id loaded into `namespace` (-1 if none)."""
        return dict(self.max_ids).get(namespace, -1)

    def add(self, entries: Iterable[Entry]) -> Registry:
        """A registry that also holds `entries`."""
        ids = set(self.identities)
        maxima = dict(self.max_ids)
        for e in entries:
            ids.add(e.identity)
            maxima[e.namespace] = max(maxima.get(e.namespace, -1), e.id)
        return Registry(frozenset(ids), tuple(sorted(maxima.items())))

    def __repr__(self) -> str:
        namespaces = ', '.join(ns for ns, _ in self.max_ids)
        n = len(self.identities)
        return f"Registry({n} {'entry' if n == 1 else 'entries'} in [{namespaces}])"


@dataclasses.dataclass(frozen=True)
class Context:
    """Defaults for save, load and restore, and the registry of loaded entries.

    Attributes:
      namespace: where `save` writes and `restore` reads (default `"jckpt"`).
      alignment: payload alignment in bytes for new files (default 32).
      mmap: map payloads instead of copying them when loading (default True).
      durable: fsync files and directories when publishing (default True).
      host: return host numpy arrays instead of `jax.Array` (default False).
      device: where loaded arrays go: a `jax.Device` or `jax.sharding.Sharding`;
        `None` means JAX's default device.
      registry: what has been loaded through this context (managed by `load`).
    """

    namespace: str = 'jckpt'
    alignment: int = DEFAULT_ALIGNMENT
    mmap: bool = True
    durable: bool = True
    host: bool = False
    device: Any = None
    registry: Registry = dataclasses.field(default_factory=Registry)

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        object.__setattr__(self, 'alignment', check_alignment(self.alignment))
        for name in ('mmap', 'durable', 'host'):  # numpy's bools become bools
            object.__setattr__(self, name, check_flag(getattr(self, name), f"Context's {name}",
                                                      optional=False))
        if self.device is not None and not _is_placement(self.device):
            raise InputError(f"Context's device must be a jax.Device or a jax.sharding.Sharding, "
                             f"not {type(self.device).__name__} {self.device!r:.80}",
                             fix="pass e.g. device=jax.devices()[0], or None for JAX's default")
        if not isinstance(self.registry, Registry):
            raise InputError(f"Context's registry must be a Registry, not "
                             f"{type(self.registry).__name__}",
                             fix="leave registry out: load fills it in the context it returns")

    def __repr__(self) -> str:
        """The namespace, the fields that differ from the defaults, and what was loaded.

        >>> Context(namespace='student', host=True)
        Context(namespace='student', host=True)
        """
        parts = [f"namespace={self.namespace!r}"]
        for f in dataclasses.fields(self):
            if f.name in ('namespace', 'registry'):
                continue
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{f.name}={value!r}")
        if len(self.registry):
            parts.append(f"registry={self.registry!r}")
        return f"Context({', '.join(parts)})"

    def replace(self, **changes: Any) -> Context:
        """A copy with `changes` applied (the context itself never changes)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise InputError(f"Context has no field {unknown[0]!r}",
                             fix=f"use one of {[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)


def _is_placement(device: Any) -> bool:
    """Whether `device` is a `jax.Device` or a `jax.sharding.Sharding` (JAX is loaded if it is one)."""
    jax = sys.modules.get('jax')
    return jax is not None and isinstance(device, (jax.Device, jax.sharding.Sharding))


def check_flag(value: Any, name: str, file: str | None = None, *,
               optional: bool = True) -> bool | None:
    """`value` as a bool if it is one (numpy's too), or None if `optional`; `InputError` otherwise.

    An option such as `mmap="no"` is truthy, so taking it would silently do
    the opposite of what was meant.

    >>> check_flag(True, 'mmap'), check_flag(None, 'verify')
    (True, None)
    >>> check_flag('no', 'mmap')
    Traceback (most recent call last):
    ...
    jckpt.errors.InputError: mmap must be True or False, not str 'no' (fix: ...)
    """
    if isinstance(value, bool) or (value is None and optional):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise InputError(f"{name} must be True or False, not {type(value).__name__} {value!r:.80}",
                     file=file, fix=f"pass {name.split()[-1]}=True or {name.split()[-1]}=False")


def check_context(ctx: object, file: str | None = None, **flags: Any) -> Context:
    """`ctx` if it is a `Context`, and each of `flags` a bool or None; `InputError` otherwise.

    >>> check_context('jckpt')
    Traceback (most recent call last):
    ...
    jckpt.errors.InputError: ctx must be a jckpt.Context, not str 'jckpt' (fix: ...)
    """
    if not isinstance(ctx, Context):
        raise InputError(f"ctx must be a jckpt.Context, not {type(ctx).__name__} {ctx!r:.80}",
                         file=file, fix="pass jckpt.Context(), or the context jckpt.load returned")
    for name, value in flags.items():
        check_flag(value, name, file)
    return ctx
