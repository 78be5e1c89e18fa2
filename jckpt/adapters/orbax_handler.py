"""Save and restore through jckpt inside orbax's `CheckpointManager`.

Importing this module registers `JckptSave` and `JckptRestore`
with `JckptCheckpointHandler`, so orbax builds the handler by itself
(it takes no arguments, and its type string `jckpt.adapters.orbax_handler.JckptCheckpointHandler`
imports back). Each item is one jckpt file, `<step>/<item>/checkpoint.jckpt`.
Saving is asynchronous where orbax runs handlers asynchronously: the call
copies the arrays to host memory (so training may change or donate them at
once) and the file is written in orbax's background commit. Restoring fills
a target tree (arrays, `jax.ShapeDtypeStruct`s with shardings, numbers)
through `jckpt.api.loading.restore_alone` (meeting no other process: orbax may restore
several items at once, in an order of its own), or returns the whole tree without one
(nested dicts and lists, `None` for a node without leaves, as orbax's own restore gives it).
`manager.item_metadata(step)[item]` is a `JckptItemMetadata` read from the
header alone: `.tree` holds a `jax.ShapeDtypeStruct` per array, in the saved
structure (as orbax's `TreeMetadata.tree` does). As for orbax's own items, a
manager made after the save is told the handler to get it:
`ocp.CheckpointManager(directory, item_handlers={'state': JckptCheckpointHandler()})`.

Example:
    ```python
    import orbax.checkpoint as ocp
    import jckpt.adapters.orbax_handler

    with ocp.CheckpointManager(directory) as manager:
        manager.save(step, args=ocp.args.Composite(state=jckpt.adapters.orbax_handler.JckptSave(state)))
        manager.wait_until_finished()
        restored = manager.restore(step, args=ocp.args.Composite(
            state=jckpt.adapters.orbax_handler.JckptRestore(abstract_state)))['state']
    ```

The item's directory may be in a bucket: orbax passes an `epath.Path`
whose string is a `gs://` (or `s3://`) URL, and the file is then an object
under it, written and read through jckpt's object store backend
(docs/object-storage.md).

With several processes, process 0 writes the file, so every array must be
fully addressable from it (replicated); sharded multi-process state needs
jckpt's own sharded checkpoints.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from jckpt.api.context import Context
from jckpt.api.loading import describe, load, restore_alone
from jckpt.api.saving import save_file
from jckpt.errors import InputError
from jckpt.format._gc import paused
from jckpt.format.entries import Entry, Header
from jckpt.format.metadata import empty_nodes
from jckpt.format.names import EMPTY_NODES_KEY
from jckpt.trees import image, to_host
from jckpt.trees import pytree as tree_mod
from jckpt.trees.nested import unflatten

#: The file each item is stored in, inside the item's directory.
FILENAME = 'checkpoint.jckpt'


@paused  # orbax's save waits for this: no cyclic collection in the middle of it
def _snapshot(tree: Any, namespace: str) -> Any:
    """`tree` as it is now, safe from the caller's later donation or mutation.

    jax arrays become an image on their device (a dispatched copy,
    `jckpt.trees.image`) when the devices have room, written from there in
    the background commit; everything else becomes a private host copy
    (typed PRNG keys stay keys; a device's arrays move as a snapshot's do,
    `jckpt.trees.transfers.start_host_copies`). Every leaf is checked now (an unstorable one
    raises `InputError` before orbax starts its commit), and every transfer is
    started before any is awaited.
    """
    items, treedef = tree_mod.flatten_with_treedef(tree)
    named = [(where, _local(leaf, where)) for where, leaf in
             ((tree_mod.leaf_name(namespace, p), leaf) for p, leaf in items)]
    devices = [i for i, (_, leaf) in enumerate(named) if image.imageable(leaf)]
    if devices and not image.has_room([named[i][1] for i in devices], None):
        devices = []
    imaged = set(devices)
    out: list[Any] = [None] * len(named)
    keys = to_host.host_leaves([named[i] for i in devices], fetch=False)
    for i, h, data in zip(devices, keys, image.take_image([named[i][1] for i in devices])
                          if devices else []):
        out[i] = data if h.key_impl is None else jax.random.wrap_key_data(data, impl=h.key_impl)
    rest = [i for i in range(len(named)) if i not in imaged]
    hosts = to_host.host_leaves([named[i] for i in rest], copy=True, snapshot=True)
    # a key array of copied data is a fresh array: safe from the caller's donation
    for i, h in zip(rest, hosts):
        out[i] = h.array if h.key_impl is None else jax.random.wrap_key_data(h.array, impl=h.key_impl)
    return jax.tree_util.tree_unflatten(treedef, out)


def _local(leaf: Any, where: str) -> Any:
    """A leaf this process can write whole: a jax array replicated over several processes
    (a global mesh's `P()`) is its copy on one of this process's devices; an array sharded
    across processes cannot be written by one process (process 0 writes the item)."""
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
        return leaf
    if leaf.is_fully_replicated:
        return leaf.addressable_shards[0].data
    raise InputError("the orbax handler writes an item from one process, and this array is "
                     "sharded across processes", entry=where,
                     fix="replicate it on every process, or save the state with jckpt.save or "
                         "jckpt.CheckpointManager, which write a multi-process checkpoint")


class JckptCheckpointHandler(ocp.AsyncCheckpointHandler):
    """An orbax handler that stores one pytree as one jckpt file (no constructor arguments)."""

    def __init__(self) -> None:
        self._context = Context()

    def _path(self, directory: Any) -> str:
        return os.path.join(os.fspath(directory), FILENAME)

    async def _write(self, tree: Any, directory: Any) -> None:
        if jax.process_index() == 0:  # one file, written by this process alone
            save_file(self._context, tree, self._path(directory))

    async def async_save(self, directory: Any, args: JckptSave | None = None) -> list | None:
        """Snapshot `args.tree` now (on its device, or in host memory); write it in the background."""
        if args is None:
            raise InputError("save needs args=jckpt.adapters.orbax_handler.JckptSave(tree)")
        host = _snapshot(args.tree, self._context.namespace)
        return [ocp.future.CommitFutureAwaitingContractedSignals(
            self._write(host, directory), name='jckpt_save')]

    def save(self, directory: Any, args: JckptSave | None = None) -> None:
        """Save synchronously."""
        for f in jax.tree_util.tree_leaves(_run(self.async_save(directory, args=args))):
            f.result()

    def restore(self, directory: Any, args: JckptRestore | Any = None) -> Any:
        """The saved tree: `target`'s structure when given, else nested dicts and lists with
        `None` where the tree had a node without leaves (as `metadata(directory).tree` has it,
        and as orbax's own restore without a target gives it).

        `args` may also be orbax's `ocp.args.StandardRestore(abstract)`, for code that
        restores with it and a manager whose `handler_registry` gives such an item to this
        handler (its `item` is the target; a restore here is always strict)."""
        path = self._path(directory)
        target, cast = _restore_args(args, path)
        if target is None:
            ctx, tree = load(self._context, path)
            recorded = describe(path).metadata_dict().get(EMPTY_NODES_KEY)
            return tree_mod.with_empty_nodes(tree.get(ctx.namespace, {}),
                                             empty_nodes(recorded, ctx.namespace))
        return restore_alone(self._context, target, path, cast=cast)

    def metadata(self, directory: Any) -> JckptItemMetadata:
        """What the item holds, from its header alone (no payload is read).

        orbax's `CheckpointManager.item_metadata(step)` returns this for a
        jckpt item, as it returns a `TreeMetadata` for a PyTree item: `.tree`
        is the saved tree's structure with a `jax.ShapeDtypeStruct` per
        array (an abstract target that `JckptRestore` accepts as it is).
        """
        return item_metadata(describe(self._path(directory)), self._context.namespace)

    def finalize(self, directory: Any) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class JckptItemMetadata:
    """The metadata of one jckpt item, as orbax's handlers give theirs.

    Attributes:
      tree: nested dicts and lists, by the stored key paths, of one
        `jax.ShapeDtypeStruct` (shape and dtype; typed PRNG keys with their key
        dtype) per saved array: `JckptRestore(target=metadata.tree)` restores it all.
      custom_metadata: the file's metadata (string pairs), as orbax names its own.
      header: the jckpt header itself (every entry, checksums, writer).
    """

    tree: Any
    custom_metadata: dict[str, str]
    header: Header


def item_metadata(header: Header, namespace: str) -> JckptItemMetadata:
    """The `JckptItemMetadata` of `header`'s entries in `namespace`."""
    items = [(e.path if e.path is not None else (('k', f"n{e.id}"),), _spec(e))
             for e in header.tensors if e.namespace == namespace]
    meta = header.metadata_dict()  # nodes without leaves (an optax EmptyState) come back as None
    tree = tree_mod.with_empty_nodes(unflatten(items) if items else {},
                                     empty_nodes(meta.get(EMPTY_NODES_KEY), namespace))
    return JckptItemMetadata(tree=tree, custom_metadata=meta, header=header)


def _spec(entry: Entry) -> jax.ShapeDtypeStruct:
    """The abstract array that `restore` takes for `entry`."""
    if entry.key_impl is None:
        return jax.ShapeDtypeStruct(entry.shape, entry.dtype)
    data = jax.ShapeDtypeStruct(entry.shape, entry.dtype)
    return jax.eval_shape(lambda d: jax.random.wrap_key_data(d, impl=entry.key_impl), data)


def _restore_args(args: Any, path: str) -> tuple[Any, bool]:
    """`(target, cast)` of a restore's `args`: `JckptRestore`, orbax's `StandardRestore`, or None."""
    if args is None:
        return None, False
    if isinstance(args, JckptRestore):
        return args.target, args.cast
    if isinstance(args, ocp.args.StandardRestore):
        return args.item, False
    raise InputError(f"a jckpt item restores with JckptRestore or ocp.args.StandardRestore, "
                     f"not {type(args).__name__}", file=path,
                     fix="restore it with jckpt.adapters.orbax_handler.JckptRestore(abstract_tree)")


def _run(coro):
    """Run `coro` to completion, also from inside a running event loop (in a thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@ocp.args.register_with_handler(JckptCheckpointHandler, for_save=True)
@dataclasses.dataclass
class JckptSave(ocp.args.CheckpointArgs):
    """Save `tree` (any pytree of arrays and numbers) as a jckpt file."""

    tree: Any


@ocp.args.register_with_handler(JckptCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class JckptRestore(ocp.args.CheckpointArgs):
    """Restore into `target`'s structure (None: the whole tree); `cast` converts dtypes."""

    target: Any = None
    cast: bool = False


__all__ = ['FILENAME', 'JckptCheckpointHandler', 'JckptItemMetadata', 'JckptRestore', 'JckptSave',
           'item_metadata']
