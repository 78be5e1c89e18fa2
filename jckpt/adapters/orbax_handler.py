"""Save and restore through jckpt inside orbax's ``CheckpointManager``.

Importing this module registers :class:`JckptSave` and :class:`JckptRestore`
with :class:`JckptCheckpointHandler`, so orbax builds the handler by itself
(it takes no arguments, and its type string ``jckpt.adapters.orbax_handler.JckptCheckpointHandler``
imports back). Each item is one jckpt file, ``<step>/<item>/checkpoint.jckpt``.
Saving is asynchronous where orbax runs handlers asynchronously: the call
copies the arrays to host memory (so training may change or donate them at
once) and the file is written in orbax's background commit. Restoring fills
a target tree (arrays, ``jax.ShapeDtypeStruct``s with shardings, numbers)
through :func:`jckpt.restore`, or returns the whole tree without one.

Example::

    import orbax.checkpoint as ocp
    import jckpt.adapters.orbax_handler

    with ocp.CheckpointManager(directory) as manager:
        manager.save(step, args=ocp.args.Composite(state=jckpt.adapters.orbax_handler.JckptSave(state)))
        manager.wait_until_finished()
        restored = manager.restore(step, args=ocp.args.Composite(
            state=jckpt.adapters.orbax_handler.JckptRestore(abstract_state)))['state']

With several processes, process 0 writes the file, so every array must be
fully addressable from it (replicated); sharded multi-process state needs
jckpt's own sharded checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

import jckpt
from jckpt.trees import placement
from jckpt.trees import pytree as tree_mod

#: The file each item is stored in, inside the item's directory.
FILENAME = 'checkpoint.jckpt'


def _snapshot(tree: Any) -> Any:
    """Host copies of every leaf (typed PRNG keys stay keys), safe from later mutation."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=tree_mod.is_leaf)
    placement.start_host_copies(leaves)
    out = []
    for leaf in leaves:
        if placement.is_prng_key(leaf):  # a fresh key array of copied data: safe from donation
            data = np.array(jax.random.key_data(leaf), copy=True)
            out.append(jax.random.wrap_key_data(data, impl=jax.random.key_impl(leaf)))
        elif isinstance(leaf, jax.Array):
            out.append(np.array(leaf, copy=True))
        elif isinstance(leaf, np.ndarray):
            out.append(leaf.copy())
        else:
            out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


class JckptCheckpointHandler(ocp.AsyncCheckpointHandler):
    """An orbax handler that stores one pytree as one jckpt file (no constructor arguments)."""

    def __init__(self) -> None:
        self._context = jckpt.Context()

    def _path(self, directory: Any) -> str:
        return os.path.join(os.fspath(directory), FILENAME)

    async def _write(self, tree: Any, directory: Any) -> None:
        if jax.process_index() == 0:
            jckpt.save(self._context, tree, self._path(directory))

    async def async_save(self, directory: Any, args: JckptSave | None = None) -> list | None:
        """Copy ``args.tree`` to host memory now; write the file in the background commit."""
        if args is None:
            raise jckpt.InputError("save needs args=jckpt.adapters.orbax_handler.JckptSave(tree)")
        host = _snapshot(args.tree)
        return [ocp.future.CommitFutureAwaitingContractedSignals(
            self._write(host, directory), name='jckpt_save')]

    def save(self, directory: Any, args: JckptSave | None = None) -> None:
        """Save synchronously."""
        for f in jax.tree_util.tree_leaves(_run(self.async_save(directory, args=args))):
            f.result()

    def restore(self, directory: Any, args: JckptRestore | None = None) -> Any:
        """The saved tree: ``target``'s structure when given, else nested dicts and lists."""
        path = self._path(directory)
        target = None if args is None else args.target
        if target is None:
            _, tree = jckpt.load(self._context, path)
            return tree.get(self._context.namespace, {})
        return jckpt.restore(self._context, target, path, cast=args.cast)

    def metadata(self, directory: Any) -> Any:
        """The jckpt header of the item (no payload is read)."""
        return jckpt.describe(self._path(directory))

    def finalize(self, directory: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _run(coro):
    import asyncio
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@ocp.args.register_with_handler(JckptCheckpointHandler, for_save=True)
@dataclasses.dataclass
class JckptSave(ocp.args.CheckpointArgs):
    """Save ``tree`` (any pytree of arrays and numbers) as a jckpt file."""

    tree: Any


@ocp.args.register_with_handler(JckptCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class JckptRestore(ocp.args.CheckpointArgs):
    """Restore into ``target``'s structure (None: the whole tree); ``cast`` converts dtypes."""

    target: Any = None
    cast: bool = False


__all__ = ['FILENAME', 'JckptCheckpointHandler', 'JckptRestore', 'JckptSave']
