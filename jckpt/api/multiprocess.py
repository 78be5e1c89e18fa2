"""Multi-process saves: every process of a `jax.distributed` run writes one directory checkpoint.

When `jax.process_count() > 1`, `jckpt.save` calls `save_directory`:

1. every process writes one piece file (`process_NNNNN.jckpt`) holding the
   pieces of each array it owns (the shards whose replica 0 it holds, joined
   into one block where they touch), so each replicated piece is written once;
2. all processes meet at a barrier of JAX's distributed runtime (with a
   timeout, so a dead peer gives an error in bounded time, never a hang);
3. process 0 reads the piece headers, checks that the pieces of every array
   tile it exactly, writes `index.jckpt` and publishes the directory with
   one atomic rename; a second barrier returns everyone once it is published.
   In an object store the pieces carry the save's tag in their names and the
   index, one PUT over the previous one, is the commit
   (`jckpt.storage.object_directory`).

A directory without `index.jckpt` is never read as a checkpoint, so a
process that dies before the barrier leaves the previous checkpoint intact.
The directory form on disk (staging, index, publishing, reading) is
`jckpt.storage.directory`; this module is the part that needs JAX: the
save plan and the barriers.

>>> # in every process of a jax.distributed run:
>>> # jckpt.save(ctx, state, "ckpt")          # a directory
>>> # state = jckpt.restore(ctx, abstract_state, "ckpt")
>>> # jckpt.consolidate("ckpt", "ckpt.jckpt")  # one file, readable anywhere
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jckpt.errors import CheckpointError, DistributedError, InputError
from jckpt.format.boxes import Box, box_shape, coalesce, full_box, intersect
from jckpt.format.entries import Entry, KeyPath, entry_for
from jckpt.format.layout import written_header
from jckpt.format.limits import check_alignment
from jckpt.format.names import (
    DIRECTORY_LOCK_NAME,
    SAVE_KEY,
    STAGE_DIR_TAG,
    piece_name,
    tag_writer,
)
from jckpt.storage import object_directory
from jckpt.storage.backend import LOCAL, Backend, backend_for
from jckpt.storage.directory import (
    indexed_pieces,
    make_stage,
    publish_directory,
    reclaim_stage_dirs,
    write_index,
    write_index_file,
)
from jckpt.storage.regions import ShardedSource
from jckpt.storage.writer import ArraySource, write_checkpoint
from jckpt.trees import pytree as tree_mod
from jckpt.trees import to_host, transfers

#: Seconds a process waits at a barrier for the others (`JCKPT_BARRIER_TIMEOUT` overrides).
DEFAULT_BARRIER_TIMEOUT = 300.0
_SAVES = itertools.count()  # saves begun in this process
_SAVES_OF: collections.Counter[str] = collections.Counter()  # ... of each path
_SAVES_LOCK = threading.Lock()
_SAVING = 'jckpt/saving'  # key of each process's save in progress (for errors)


def next_save(path: str) -> tuple[str, int]:
    """This process's next save of `path`: its coordination tag (how many saves this
    process began before) and its place among the saves of `path` (3: the 4th), which
    process 0 shares and the others compare with their own (`_check_same_save`). A process whose save failed
    before its barriers still took its turn, and one that saved another path alone (a debug
    dump) is found out at the others' next save, where a mix of two states was published.
    A save of the same path made alone, of the same tree, cannot be told apart.

    >>> next_save('/ckpt/a')[1], next_save('/ckpt/a')[1]
    (0, 1)
    """
    with _SAVES_LOCK:
        k = _SAVES_OF[path]
        _SAVES_OF[path] = k + 1
        return f"jckpt/save/{next(_SAVES)}", k


def barrier_timeout() -> float:
    """The barrier timeout in seconds: `JCKPT_BARRIER_TIMEOUT` or the default."""
    raw = os.environ.get('JCKPT_BARRIER_TIMEOUT')
    try:
        return float(raw) if raw else DEFAULT_BARRIER_TIMEOUT
    except ValueError:
        raise InputError(f"JCKPT_BARRIER_TIMEOUT={raw!r} is not a number of seconds") from None


# --- the runtime: barriers and a key-value store through jax.distributed -------------------

class _Runtime:
    """Barriers and shared values through JAX's distributed client."""

    def __init__(self, tag: str, path: str, timeout: float, processes: int,
                 process: int) -> None:
        # JAX's client lives in a private module; imported here so a JAX that moves it
        # breaks only multi-process saves, not every import of jckpt.
        from jax._src import distributed as jdist
        self.client: Any = jdist.global_state.client
        self.local = processes == 1  # one process: nobody to wait for
        if self.client is None and not self.local:
            raise DistributedError("several processes but jax.distributed is not initialized",
                                   file=path, fix="call jax.distributed.initialize(...) in every "
                                                  "process before saving")
        self.tag = tag
        self.path = path
        self.timeout_ms = max(1, int(timeout * 1000))
        if self.client is not None and not self.local:  # what this process saves, for errors
            with contextlib.suppress(Exception):
                self.client.key_value_set(f"{_SAVING}/{process}", path, allow_overwrite=True)

    def _elsewhere(self) -> str:
        """What process 0 saves instead, when it is not this save's path ('' otherwise)."""
        try:
            theirs = self.client.key_value_try_get(f"{_SAVING}/0")
        except Exception:
            return ''
        return f"; process 0 is saving {theirs}" if theirs and theirs != self.path else ''

    def share(self, key: str, value: str | None) -> str:
        """Process 0 sets `key` to `value`; every process returns it."""
        full = f"{self.tag}/{key}"
        if self.local:
            return value or ''
        if value is not None:
            self.client.key_value_set(full, value)
            return value
        try:
            return self.client.blocking_key_value_get(full, self.timeout_ms)
        except Exception as e:
            raise DistributedError(f"process 0 did not start the save within "
                                   f"{self.timeout_ms / 1000:g} s ({_first_line(e)}"
                                   f"{self._elsewhere()})", file=self.path,
                                   fix="every process must save the same path, the same number "
                                       "of times; check process 0's log: it may have failed "
                                       "or died") from None

    def barrier(self, name: str, what: str) -> None:
        if self.local:
            return
        start = time.monotonic()
        try:
            self.client.wait_at_barrier(f"{self.tag}/{name}", self.timeout_ms)
        except Exception as e:
            reached = [ln.strip() for ln in str(e).splitlines() if 'reached the barrier' in ln]
            waited = time.monotonic() - start
            outcome = ("whether it was published is not known: check the checkpoint"
                       if name == 'published' else "nothing was published")
            raise DistributedError(f"not every process {what} (waited {waited:.0f} s of "
                                   f"{self.timeout_ms / 1000:g}); {outcome} "
                                   f"({'; '.join([_first_line(e), *reached])})", file=self.path,
                                   fix="check the other processes' logs (one may have died); "
                                       "raise JCKPT_BARRIER_TIMEOUT if they are only slow") from None

    def report(self, name: str, process: int, error: BaseException) -> None:
        if self.local:
            return
        try:
            self.client.key_value_set(f"{self.tag}/error/{name}/{process}",
                                      _first_line(error)[:2000])
        except Exception:
            pass

    def errors(self, name: str) -> list[str]:
        """What the processes reported failing at phase `name` (each phase has its own)."""
        if self.local:
            return []
        try:
            pairs = self.client.key_value_dir_get(f"{self.tag}/error/{name}/")
        except Exception:
            return []
        return [f"process {k.rsplit('/', 1)[-1]}: {v}" for k, v in sorted(pairs)]

    def check(self, name: str) -> None:
        errs = self.errors(name)
        if errs:
            raise DistributedError("the save failed in another process: " + "; ".join(errs),
                                   file=self.path, fix="see that process's error; nothing was "
                                   "published and the previous checkpoint is intact")

    def together(self, name: str, what: str, process: int,
                 step: Callable[[], None] | None) -> None:
        """Run `step` here (if any), meet every process at barrier `name`, raise if one failed.

        A failing step is reported to the others before this process reaches the barrier,
        so they fail at once instead of at their timeout, and raises its own error (not the
        barrier's). Errors are kept per phase: a peer that passed this barrier looks only at
        this phase's, and so still meets the others at the next one.
        """
        if step is not None:
            try:
                step()
            except BaseException as e:
                self.report(name, process, e)
                with contextlib.suppress(DistributedError):
                    self.barrier(name, what)
                raise
        self.barrier(name, what)
        self.check(name)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# --- the plan: what this process writes -----------------------------------------------------

@dataclasses.dataclass
class _Leaf:
    ident: int
    path: KeyPath
    dtype: np.dtype
    shape: tuple[int, ...]
    key_impl: str | None
    blocks: list[tuple[Box, Any]]  # (box, source)


def _plan(items: Sequence[tuple[KeyPath, Any]], namespace: str, first_id: int,
          process: int) -> list[_Leaf]:
    """Check every leaf, start every transfer to host, and decide what this process writes.

    Every process checks every leaf. A sharded array's distinct shards are
    written by the processes that own them; an array on this process's
    devices only, or a host value, is saved from process 0's copy (the other
    processes only describe it).
    """
    hosts = to_host.host_leaves(items, namespace=namespace, pieces=True, spread=True,
                                  fetch=process == 0)
    return [_Leaf(first_id + n, p, h.dtype, h.shape, h.key_impl, _blocks(h))
            for n, ((p, _), h) in enumerate(zip(items, hosts))]


def _blocks(h: to_host.HostLeaf) -> list[tuple[Box, Any]]:
    """`(box, source)` of what this process writes of `h`: its shards joined where they touch."""
    if h.array is not None:
        return [(full_box(h.shape), ArraySource(h.array))]
    blocks: list[tuple[Box, Any]] = []
    for block in coalesce([b for b, _ in h.shards]):
        inside = [(tuple((a - o, z - o) for (a, z), (o, _) in zip(b, block)),
                   functools.partial(transfers.await_host, d))
                  for b, d in h.shards if intersect(b, block) == b]
        blocks.append((block, ShardedSource(box_shape(block), h.dtype, inside)))
    return blocks


def _piece_entry(leaf: _Leaf, namespace: str, box: Box) -> Entry:
    return entry_for(namespace, leaf.path, leaf.dtype, box_shape(box), id=leaf.ident,
                     key_impl=leaf.key_impl, slice=box, global_dims=leaf.shape)


def _write_pieces(stage: str, leaves: list[_Leaf], namespace: str, alignment: int, process: int,
                  durable: bool, tag: str, save: str) -> None:
    """Write this process's piece files: one per layer of blocks (most arrays have one block),
    each recording the save it belongs to (`SAVE_KEY`)."""
    layers = max([len(leaf.blocks) for leaf in leaves] + [1])
    for layer in range(layers):
        entries, sources = [], []
        for leaf in leaves:
            if layer < len(leaf.blocks):
                box, source = leaf.blocks[layer]
                entries.append(_piece_entry(leaf, namespace, box))
                sources.append(source)
        header = written_header(entries, alignment, metadata=[(SAVE_KEY, save)])
        write_checkpoint(os.path.join(stage, piece_name(process, layer, tag)), header, sources,
                         durable=durable)


# --- the save: stage, write, publish ------------------------------------------------------------

@dataclasses.dataclass
class _Stage:
    """Where one save writes its pieces, and (in process 0) the lock held on it.

    `path` is the staging directory (the URL itself in an object store) while
    a failure must delete what was written, None once that must stay; `tag`
    names the pieces in an object store (`jckpt.storage.object_directory`).
    """

    path: str | None = None
    lock_fd: int = -1
    tag: str = ''


def _shared_stage(rt: _Runtime, path: str, process: int, make: Callable[[], str]) -> str:
    """Process 0 makes the stage's name (`make`) and tells the others; they receive it."""
    if process == 0:
        try:
            name = make()
        except BaseException as e:  # tell the others at once rather than at their timeout
            rt.share('stage', '!' + _first_line(e))
            raise
        return rt.share('stage', name)
    name = rt.share('stage', None)
    if name.startswith('!'):
        raise DistributedError(f"process 0 could not start the save: {name[1:]}", file=path,
                               fix="see process 0's error")
    return name


def _open_stage(rt: _Runtime, path: str, process: int, stage: _Stage, backend: Backend) -> str:
    """Process 0 creates the staging directory (or the save's tag) and tells the others its name;
    where this process writes its pieces (also kept as `stage.path`).

    In an object store there is no directory to rename: the pieces are
    written under the URL with the save's tag in their names, beside those of
    the checkpoint there, and the index, written last, is the commit.
    """
    if backend is not LOCAL:
        tag = stage.tag
        stage.tag = _shared_stage(rt, path, process, lambda: tag)
        if tag_writer(stage.tag) is None:
            raise DistributedError(f"unexpected save tag {stage.tag!r}", file=path)
        stage.path = path
        return path

    def make() -> str:
        reclaim_stage_dirs(path)
        stage.path, stage.lock_fd = make_stage(path)
        return os.path.basename(stage.path)

    name = _shared_stage(rt, path, process, make)
    if STAGE_DIR_TAG not in name or os.sep in name:
        raise DistributedError(f"unexpected staging name {name!r}", file=path)
    stage.path = os.path.join(os.path.dirname(path), name)
    return stage.path


def _plan_digest(leaves: list[_Leaf] | BaseException) -> str:
    """What every process must agree on of a save's leaves: their ids, paths, dtypes, shapes
    and PRNG implementations (a host value is written from process 0's copy alone, so a
    process whose copy differs in shape or dtype is found here or not at all)."""
    if isinstance(leaves, BaseException):
        return '-'  # raised at the barrier that follows
    h = hashlib.sha256()
    for leaf in leaves:
        h.update(repr((leaf.ident, leaf.path, leaf.dtype.str, leaf.shape, leaf.key_impl))
                 .encode('utf-8', 'surrogatepass'))
    return h.hexdigest()[:32]


def _check_same_save(first: str, mine: str) -> None:
    """Refuse to write pieces for another save than process 0's (`'3 <digest> /ckpt'`: the
    place `next_save` gives, `_plan_digest`'s digest, the path): its directory is the one
    published, and a piece of another path, of another save of this path or of another
    tree would land there."""
    (n, their_plan, theirs), (k, plan, path) = first.split(' ', 2), mine.split(' ', 2)
    if path != theirs:
        raise DistributedError(f"process 0 saves to {theirs}, this process to {path}", file=path,
                               fix="pass every process the same path, on a filesystem (or "
                                   "object store) every process sees")
    if n != k:
        raise DistributedError(f"process 0 is at its save {int(n) + 1} of this path, this process "
                               f"at its save {int(k) + 1}", file=path,
                               fix="every process must make the same saves in the same order "
                                   "(a save made by one process alone shifts them); restart "
                                   "the run's processes together")
    if '-' not in (plan, their_plan) and plan != their_plan:
        raise DistributedError("processes disagree about the tree they save: a leaf's path, "
                               "dtype, shape, id or PRNG implementation differs from process "
                               "0's", file=path,
                               fix="save the same tree in every process; a host value (numpy, "
                                   "a number) must have the same shape and dtype in each, and "
                                   "is saved from process 0's copy")


def _publish(backend: Backend, stage: _Stage, path: str, count: int, alignment: int,
             metadata: Mapping[str, str] | None, durable: bool) -> None:
    """Process 0: index the pieces, publish the directory, then let go of its lock.

    In an object store the index replaces the one there with one PUT (the
    commit), then the pieces no index names any more are deleted.
    """
    assert stage.path is not None
    if backend is LOCAL:
        write_index(stage.path, count, alignment, dict(metadata or {}), durable=durable)
        publish_directory(stage.path, path, durable=durable)
        stage.path = None
        backend.remove(os.path.join(path, DIRECTORY_LOCK_NAME))  # held until now: never a lockless stage
        return
    names, arrays = indexed_pieces(path, count, stage.tag)
    replaced = object_directory.current_files(path)
    stage.path = None  # the index may be in from here on, whatever the PUT says: keep the pieces
    write_index_file(path, names, count, arrays, alignment, dict(metadata or {}), durable=durable)
    object_directory.clean_after_commit(path, names, replaced)


def _discard(backend: Backend, stage: _Stage) -> None:
    """Process 0 after a failure: delete what this save wrote (nothing is published)."""
    if stage.path is None:
        return
    if backend is LOCAL:
        backend.remove(stage.path)
    else:
        object_directory.discard(stage.path, stage.tag)


def _checked_write(first: str, which: str, where: str, leaves: list[_Leaf] | BaseException,
                   *pieces: Any) -> None:
    """Check that process 0 makes this process's save (`next_save`), then write this
    process's pieces (or raise the error its plan met, now that the others hear of it)."""
    _check_same_save(first, which)
    if isinstance(leaves, BaseException):
        raise leaves
    _write_pieces(where, leaves, *pieces)


def save_directory(ctx: Any, tree: Any, path: str | os.PathLike, *, alignment: int | None = None,
                   metadata: Mapping[str, str] | None = None,
                   timeout: float | None = None) -> None:
    """Save `tree` from every process of a `jax.distributed` run as a directory checkpoint.

    Call it (or `jckpt.save`, which calls it when `jax.process_count() > 1`)
    from every process with the same tree structure and the same `path`, on a
    filesystem (or object store) every process sees; a single process may call
    it too, to write the directory form. Returns in every process
    once the directory is published; raises `DistributedError`
    in the surviving processes when a peer fails or does not reach a barrier within
    `timeout` seconds (default `barrier_timeout`), and then nothing is
    published.

    Example:
        ```python
        jckpt.save(ctx, {"params": sharded_params, "step": step}, "ckpt")  # every process
        ```
    """
    backend = backend_for(path)  # before abspath, which would take a URL for a relative path
    path = os.path.abspath(os.fspath(path)) if backend is LOCAL else os.fspath(path)
    namespace = ctx.namespace
    alignment = ctx.alignment if alignment is None else alignment
    alignment = check_alignment(alignment, path)
    process, count = jax.process_index(), jax.process_count()
    timeout = barrier_timeout() if timeout is None else float(timeout)
    tag, place = next_save(path)  # first: a save that fails here still takes its turn
    rt = _Runtime(tag, path, timeout, count, process)
    try:
        leaves: list[_Leaf] | BaseException = _plan(
            tree_mod.flatten(tree), namespace, ctx.registry.max_id(namespace) + 1, process)
    except Exception as e:  # raised at the first barrier, which the others are told of
        leaves = e
    which = f"{place} {_plan_digest(leaves)} {path}"  # what process 0 shares, and others compare

    stage = _Stage(tag=object_directory.new_tag() if backend is not LOCAL and process == 0 else '')
    try:
        with object_directory.saving(stage.tag):
            first = rt.share('path', which if process == 0 else None)  # process 0's
            where = _open_stage(rt, path, process, stage, backend)
            save = stage.tag or os.path.basename(where)  # the same in every process
            rt.together('written', 'wrote its pieces', process, functools.partial(
                _checked_write, first, which, where, leaves, namespace, alignment, process,
                ctx.durable, stage.tag, save))
            rt.together('published', 'saw the checkpoint published', process, None if process else (
                lambda: _publish(backend, stage, path, count, alignment,
                                 {**(metadata or {}), SAVE_KEY: save}, ctx.durable)))
    except BaseException as e:
        if process == 0:
            _discard(backend, stage)
        if isinstance(e, CheckpointError) and stage.path:
            e.published_as(stage.path, path)  # the staging directory is gone
        raise
    finally:
        if stage.lock_fd >= 0:
            os.close(stage.lock_fd)


__all__ = ['DEFAULT_BARRIER_TIMEOUT', 'barrier_timeout', 'save_directory']
