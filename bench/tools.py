"""The compared tools, each behind one small adapter with the same five operations.

Every adapter takes the same pytree of ``jax.Array``s (what a JAX user saves)
and a path of its own, and offers:

* ``save(tree, path, durable)``: the tool's own save. With ``durable`` on,
  tools that do not fsync by themselves get every file they wrote and their
  directories fsynced afterwards, so durable saves compare like with like.
* ``save_async(tree, path)``: start a save, return a function that waits for
  it (only tools with an asynchronous save; the runner times the call).
* ``load_host(path, spec)``: the arrays as host numpy arrays, in ``spec``'s
  leaf order (``None`` where the tool has no host loader).
* ``restore(path, spec)``: a tree of ``jax.Array``s of ``spec``'s structure.

``spec`` is the abstract tree (``jax.ShapeDtypeStruct`` leaves).

>>> sorted(TOOLS)[:3]
['flax-msgpack', 'jckpt', 'mmap']
"""

from __future__ import annotations

import mmap
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

# --------------------------------------------------------------------------- helpers


def keyed_leaves(tree: Any) -> list[tuple[str, Any]]:
    """``[(flat name, leaf)]`` in JAX's leaf order; names join key parts with ``/``."""
    out = []
    for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = []
        for k in kp:
            parts.append(str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k)))))
        out.append(('/'.join(parts), leaf))
    return out


def fsync_tree(path: str) -> None:
    """fsync ``path`` (a file, or every file and folder under a directory) and its parent."""
    def sync(p: str, directory: bool) -> None:
        fd = os.open(p, (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    if os.path.isdir(path):
        for root, _dirs, files in os.walk(path):
            for f in files:
                sync(os.path.join(root, f), False)
            sync(root, True)
    else:
        sync(path, False)
    sync(os.path.dirname(os.path.abspath(path)), True)


def disk_size(path: str) -> int:
    """Bytes of the files at ``path`` (a file or a directory tree)."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def remove(path: str) -> None:
    """Delete ``path`` whatever it is (and any jckpt staging files beside it)."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def _device_put(leaves: list[np.ndarray]) -> list[jax.Array]:
    """One batched host-to-device transfer of every leaf (the fastest form JAX offers)."""
    return jax.device_put(leaves, jax.devices()[0])


def _as_dtype(array: np.ndarray, dtype: Any) -> np.ndarray:
    """``array`` reinterpreted as ``dtype`` where a tool lost it (``.npz`` stores bfloat16 as ``V2``)."""
    return array if array.dtype == dtype else array.view(dtype)


# --------------------------------------------------------------------------- adapters


class Tool:
    """One compared tool. Subclasses override what they support."""

    name = ''
    label = ''
    ext = ''
    #: fsyncs its files by itself when saving durably
    syncs = False
    #: the runner times saves (False for a baseline that shares another's writer)
    timed_save = True
    has_async = False
    #: modules the tool needs (optional extras: a tool whose module is missing is left out)
    requires: tuple[str, ...] = ()

    @classmethod
    def available(cls) -> bool:
        import importlib.util
        try:
            return all(importlib.util.find_spec(m) is not None for m in cls.requires)
        except ModuleNotFoundError:  # 'orbax.checkpoint' without 'orbax'
            return False

    def path(self, base: str) -> str:
        return os.path.join(base, f"{self.name}{self.ext}")

    def save(self, tree: Any, path: str, durable: bool) -> None:
        self._save(tree, path)
        if durable:
            fsync_tree(path)

    def _save(self, tree: Any, path: str) -> None:
        raise NotImplementedError

    def open_async(self, path: str) -> None:
        """Set up what a training loop creates once, before its first asynchronous save."""

    def save_async(self, tree: Any, path: str) -> Callable[[], None]:
        raise NotImplementedError

    def load_host(self, path: str, spec: Any) -> list[np.ndarray] | None:
        return None

    def restore(self, path: str, spec: Any) -> Any:
        treedef = jax.tree.structure(spec)
        return jax.tree.unflatten(treedef, _device_put(self.load_host(path, spec)))

    def close(self) -> None:
        pass


class Raw(Tool):
    """The baseline: every array's bytes back to back in one file; loaded with ``readinto``."""

    name, label, ext, syncs = 'raw', 'raw file (write+fsync / readinto)', '.bin', True

    def save(self, tree: Any, path: str, durable: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for leaf in jax.tree.leaves(tree):
                view = memoryview(np.ascontiguousarray(np.asarray(leaf)).reshape(-1).view(np.uint8))
                while view:
                    view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if durable:
            fsync_tree(os.path.dirname(os.path.abspath(path)))

    @staticmethod
    def _views(buffer: Any, spec: Any) -> list[np.ndarray]:
        out, offset = [], 0
        for s in jax.tree.leaves(spec):
            count = int(np.prod(s.shape, dtype=np.int64))
            out.append(np.frombuffer(buffer, s.dtype, count, offset).reshape(s.shape))
            offset += count * np.dtype(s.dtype).itemsize
        return out

    def load_host(self, path: str, spec: Any) -> list[np.ndarray]:
        with open(path, 'rb', buffering=0) as f:
            buffer = np.empty(os.fstat(f.fileno()).st_size, np.uint8)
            view = memoryview(buffer)
            while view:
                view = view[f.readinto(view):]
        return self._views(buffer, spec)


class Mmap(Raw):
    """The baseline's file read as ``np.frombuffer`` views over a private mapping."""

    name, label, timed_save = 'mmap', 'raw file (np.frombuffer over mmap)', False

    def load_host(self, path: str, spec: Any) -> list[np.ndarray]:
        with open(path, 'rb') as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._views(m, spec)


class Jckpt(Tool):
    """jckpt: one file, written and published atomically; loads map it."""

    name, label, ext, syncs = 'jckpt', 'jckpt', '.jckpt', True

    def __init__(self) -> None:
        import jckpt
        self.jckpt = jckpt
        self.ctx = jckpt.Context()

    has_async = True

    def save(self, tree: Any, path: str, durable: bool) -> None:
        self.jckpt.save(self.ctx.replace(durable=durable), tree, path)

    def open_async(self, path: str) -> None:
        self.mirror = self.jckpt.Mirror(path, ctx=self.ctx, new_lineage=True)

    def save_async(self, tree: Any, path: str) -> Callable[[], None]:
        """``Mirror.submit``: blocks for the snapshot to host; the file is written behind."""
        self.mirror.submit(tree)
        return self.mirror.close  # every snapshot durable, then the path released

    def load_host(self, path: str, spec: Any) -> list[np.ndarray]:
        _, tree = self.jckpt.load(self.ctx.replace(host=True), path)
        return jax.tree.leaves(tree['jckpt'])

    def restore(self, path: str, spec: Any) -> Any:
        return self.jckpt.restore(self.ctx, spec, path)


class OrbaxStandard(Tool):
    """orbax-checkpoint's ``StandardCheckpointer`` with its default options (async, zstd, OCDBT)."""

    requires = ('orbax.checkpoint',)

    name, label, ext, has_async = 'orbax', 'orbax StandardCheckpointer', '.orbax', True

    def __init__(self) -> None:
        import orbax.checkpoint as ocp
        self.ocp = ocp
        self.ckptr = ocp.StandardCheckpointer()

    def _save(self, tree: Any, path: str) -> None:
        self.save_async(tree, path)()

    def save_async(self, tree: Any, path: str) -> Callable[[], None]:
        self.ckptr.save(path, tree)
        return self.ckptr.wait_until_finished

    def load_host(self, path: str, spec: Any) -> list[np.ndarray]:
        target = jax.tree.map(lambda s: np.empty(s.shape, s.dtype), spec)
        return jax.tree.leaves(self.ckptr.restore(path, target))

    def restore(self, path: str, spec: Any) -> Any:
        return self.ckptr.restore(path, spec)

    def close(self) -> None:
        self.ckptr.close()


class OrbaxRaw(OrbaxStandard):
    """orbax's PyTree handler with compression off (the same OCDBT store, no zstd)."""

    name, label = 'orbax-nozstd', 'orbax PyTree, no compression'
    ext = '.orbax-nz'

    def __init__(self) -> None:
        import orbax.checkpoint as ocp
        self.ocp = ocp
        self.ckptr = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_compression=False))

    def save_async(self, tree: Any, path: str) -> Callable[[], None]:
        self.ckptr.save(path, args=self.ocp.args.PyTreeSave(tree))
        return self.ckptr.wait_until_finished

    def _restore(self, path: str, spec: Any, restore_type: Any) -> Any:
        args = jax.tree.map(lambda s: self.ocp.RestoreArgs(restore_type=restore_type) if
                            restore_type is np.ndarray else
                            self.ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape,
                                                      dtype=s.dtype), spec)
        return self.ckptr.restore(path, args=self.ocp.args.PyTreeRestore(item=spec, restore_args=args))

    def load_host(self, path: str, spec: Any) -> list[np.ndarray]:
        return jax.tree.leaves(self._restore(path, spec, np.ndarray))

    def restore(self, path: str, spec: Any) -> Any:
        return self._restore(path, spec, jax.Array)


class SafetensorsNumpy(Tool):
    """``safetensors.numpy``: ``save_file`` / ``load_file`` (no fsync of its own)."""

    requires = ('safetensors',)

    name, label, ext = 'st-numpy', 'safetensors (numpy API)', '.safetensors'

    def _save(self, tree: Any, path: str) -> None:
        from safetensors.numpy import save_file
        save_file({k: np.asarray(v) for k, v in keyed_leaves(tree)}, path)

    def load_host(self, path: str, spec: Any) -> list[np.ndarray]:
        from safetensors.numpy import load_file
        loaded = load_file(path)
        return [loaded[k] for k, _ in keyed_leaves(spec)]


class SafetensorsFlax(Tool):
    """``safetensors.flax``: saves and loads ``jax.Array``s directly."""

    requires = ('safetensors', 'flax')

    name, label, ext = 'st-flax', 'safetensors (flax API)', '.st-flax'

    def _save(self, tree: Any, path: str) -> None:
        from safetensors.flax import save_file
        save_file(dict(keyed_leaves(tree)), path)  # a fresh dict: it rewrites values in place

    def restore(self, path: str, spec: Any) -> Any:
        from safetensors.flax import load_file
        loaded = load_file(path)
        return jax.tree.unflatten(jax.tree.structure(spec), [loaded[k] for k, _ in keyed_leaves(spec)])

    def load_host(self, path: str, spec: Any) -> None:
        return None


class FlaxMsgpack(Tool):
    """``flax.serialization.to_bytes`` written to one file; ``msgpack_restore`` to read."""

    requires = ('flax',)

    name, label, ext = 'flax-msgpack', 'flax msgpack', '.msgpack'

    def _save(self, tree: Any, path: str) -> None:
        from flax import serialization
        data = serialization.to_bytes(tree)
        with open(path, 'wb') as f:
            f.write(data)

    def load_host(self, path: str, spec: Any) -> list[np.ndarray]:
        from flax import serialization
        with open(path, 'rb') as f:
            state = serialization.msgpack_restore(f.read())
        return [np.asarray(x) for x in jax.tree.leaves(state)]


class Npz(Tool):
    """``np.savez`` (uncompressed zip of ``.npy`` members)."""

    name, label, ext = 'npz', 'np.savez', '.npz'

    def _save(self, tree: Any, path: str) -> None:
        np.savez(path, **{k: np.asarray(v) for k, v in keyed_leaves(tree)})

    def load_host(self, path: str, spec: Any) -> list[np.ndarray]:
        with np.load(path) as z:
            return [_as_dtype(z[k], s.dtype) for k, s in keyed_leaves(spec)]


TOOLS: dict[str, type[Tool]] = {t.name: t for t in (
    Jckpt, Raw, Mmap, OrbaxStandard, OrbaxRaw, SafetensorsNumpy, SafetensorsFlax, FlaxMsgpack, Npz)}
