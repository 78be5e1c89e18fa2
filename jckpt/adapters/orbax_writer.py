"""Writing `{namespace: subtree}` as an orbax step directory (the `orbax` format's writer).

One PyTree item per namespace, written by orbax itself through its
`CompositeCheckpointHandler`, in a staging directory beside the destination
and renamed into place, so `ocp.CheckpointManager`/`ocp.Checkpointer` and
`jckpt.adapters.orbax` read it. `check` refuses, naming the leaf and before
anything is written, what orbax would lose or fail on.

Example:
    ```python
    jckpt.convert('step1000.jckpt', 'exported', format='orbax')
    ```
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import warnings
from typing import Any

import numpy as np

from jckpt.adapters import orbax
from jckpt.adapters._common import abstract_items, check_namespaced, flat_names, host_items
from jckpt.errors import InputError
from jckpt.format.header import path_name
from jckpt.storage.backend import LOCAL, backend_for, refuse_foreign
from jckpt.storage.publish import refuse_special, storage_error


def write(tree: Any, path: str) -> None:
    """Write `{namespace: subtree}` as an orbax step directory, one PyTree item per namespace.

    The directory is built beside `path` and renamed into place; an
    existing directory at `path` is replaced only after the new one is complete.
    """
    path = check_destination(path)
    tree = _without_empty_items(check_namespaced(tree, path), path)
    check(tree, path)
    host_items(tree, path)  # refuse unstorable leaves before writing anything
    ocp = orbax.import_orbax()
    import jax

    hosts = {ns: jax.tree_util.tree_map(_for_orbax, sub) for ns, sub in tree.items()}
    parent = os.path.dirname(os.path.abspath(path))
    staging = os.path.join(parent, f".{os.path.basename(path)}.jckpt-orbax.{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            checkpointer.save(staging, ocp.args.Composite(**{
                ns: ocp.args.PyTreeSave(sub) for ns, sub in hosts.items()}))
        if os.path.isdir(path):
            old = staging + '.old'
            os.rename(path, old)
            os.rename(staging, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, path)
    except InputError:
        raise
    except Exception as e:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, OSError):
            raise storage_error(e, "writing the orbax checkpoint", path) from e
        raise InputError(f"orbax could not save the tree ({type(e).__name__}: {str(e)[:300]})",
                         file=path, fix="cast leaves to dtypes orbax stores") from None


def check_destination(path: str | os.PathLike) -> str:
    """The absolute local path an export to `path` writes, reading nothing; `InputError` for
    a URL (orbax writes local directories) and for what the export would replace that is not
    one orbax checkpoint (`refuse_foreign`): a file, a user's folder, a manager's run of many
    steps. `convert` calls it before reading its source, so a wrong destination fails at once.

    >>> check_destination('s3://bucket/exported')
    Traceback (most recent call last):
    jckpt.errors.InputError: s3://bucket/exported: orbax checkpoints are written to a local directory, ...
    """
    if backend_for(os.fspath(path)) is not LOCAL:  # before abspath, which made the URL a path
        raise InputError("orbax checkpoints are written to a local directory, not an object "
                         "store", file=os.fspath(path),
                         fix="write a local directory, then upload it (gcloud storage cp -r DIR "
                             "URL, or aws s3 cp --recursive DIR URL); or convert to a .jckpt URL")
    path = os.path.abspath(os.fspath(path))
    refuse_foreign(path, "exporting to orbax", orbax.is_one_checkpoint, kind="an orbax checkpoint",
                   strays=orbax.strays)
    refuse_special(path)
    return path


def _without_empty_items(tree: dict[str, Any], path: str) -> dict[str, Any]:
    """`tree` less its namespaces that are one node without leaves (`optax.identity()`'s
    bare `EmptyState()`), with a warning naming them: orbax saves no such item ("Found empty
    item"), so an export leaves them out, and a restore takes them from its target."""
    from jckpt.trees.pytree import is_empty_node

    empty = [ns for ns, sub in tree.items() if is_empty_node(sub)]
    if empty and len(empty) < len(tree):
        warnings.warn(f"{path}: namespaces {empty} hold no arrays (an empty optimizer state) and "
                      "are left out: orbax saves no item without arrays; a restore with a target "
                      "takes them from it", stacklevel=3)
        return {ns: sub for ns, sub in tree.items() if ns not in empty}
    return tree


def check(tree: Any, path: str) -> None:
    """Refuse a tree orbax cannot hold, naming the leaf and reading no data: two leaves of a
    namespace whose `.`-joined names agree, or agree but for a trailing `/` (orbax would
    store one array under both names, and one value would be lost), an array with no
    elements, a dtype tensorstore lacks.

    >>> check({'jckpt': {'a.b': np.ones(2), 'a': {'b': np.ones(2)}}}, 'out')
    Traceback (most recent call last):
    ...
    jckpt.errors.InputError: out: entry jckpt/a.b: two leaves would both be stored as 'a.b' ...
    """
    path = os.fspath(path)
    orbax.import_orbax()  # missing: the InputError that says what to install, before tensorstore
    items = abstract_items(tree, path)
    for ns in dict.fromkeys(ns for ns, _, _ in items):  # one orbax item per namespace
        mine = [item for item in items if item[0] == ns]
        _distinct_in_store(mine, flat_names(mine, path), path)
    for ns, p, spec in items:
        if math.prod(spec.shape) == 0:
            raise InputError(f"orbax cannot store an array with no elements (shape "
                             f"{tuple(spec.shape)})", file=path, entry=f"{ns}/{path_name(p)}",
                             fix="drop the leaf, or write a jckpt, safetensors or npz file")
        if not _tensorstore_has(np.dtype(spec.dtype)):
            raise InputError(f"dtype {spec.dtype} has no tensorstore equivalent, so orbax "
                             "cannot store it", file=path, entry=f"{ns}/{path_name(p)}",
                             fix="cast it, or write a jckpt file")


def _distinct_in_store(items: list, names: list[str], path: str) -> None:
    """Refuse two leaves whose names tensorstore stores under one key: its zarr driver ends
    a name without a trailing `/` with one, so `a` and `a/` (and `''` and `/`) share an
    array, and the value written last would be read back for both.

    >>> _distinct_in_store([('jckpt', (('k', 'a'),), None), ('jckpt', (('k', 'a/'),), None)],
    ...                    ['a', 'a/'], 'out')
    Traceback (most recent call last):
    ...
    jckpt.errors.InputError: out: entry jckpt/a/: leaves 'a' and 'a/' would be one array ...
    """
    seen: dict[str, str] = {}
    for (ns, p, _), name in zip(items, names):
        key = name if name.endswith('/') else name + '/'
        if key in seen:
            raise InputError(f"leaves {seen[key]!r} and {name!r} would be one array in orbax's "
                             "store (a trailing '/' is dropped)", file=path,
                             entry=f"{ns}/{path_name(p)}",
                             fix="rename one of them, or write a jckpt or safetensors file")
        seen[key] = name


@functools.lru_cache(maxsize=64)
def _tensorstore_has(dtype: np.dtype) -> bool:
    """Whether tensorstore (orbax's array store) has `dtype`."""
    import tensorstore as ts

    try:
        ts.dtype(dtype.name)
    except ValueError:
        return False
    return True


def _for_orbax(leaf: Any) -> Any:
    """A leaf as orbax is given it: host numpy, but typed PRNG keys as keys (orbax stores
    their data and implementation; numpy has no key dtype)."""
    from jckpt.trees.to_host import is_prng_key

    return leaf if is_prng_key(leaf) else np.asarray(leaf)



def register() -> None:
    """Register the `orbax` format: `jckpt.adapters.orbax` reads, this module writes."""
    from jckpt.adapters import register_format

    register_format('orbax', read=orbax.read, write=write, sniff=orbax.sniff,
                    read_metadata=orbax.json_metadata, check=check, replace=True,
                    read_with_metadata=orbax.read_with_metadata)


__all__ = ['check', 'check_destination', 'register', 'write']
