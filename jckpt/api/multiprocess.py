"""Multi-process saves: every process of a `jax.distributed` run writes one directory checkpoint.

When `jax.process_count() > 1`, `jckpt.save` calls `save_directory`:

0. process 0 shares its claim of the save (`jckpt.api.pairing`: the path, the
   save's place, the line of the program making it, a digest of the leaves),
   and every other process refuses to go on with another save than process 0's;
1. every process writes one piece file (`process_NNNNN.jckpt`) holding the
   pieces of each array it owns (the shards whose replica 0 it holds, joined
   into one block where they touch), so each replicated piece is written once;
2. all processes meet at a barrier in the key-value store of JAX's distributed
   runtime (with a timeout, so a dead peer gives an error in bounded time, never
   a hang; at once where a peer waits at another meeting, `jckpt.api.meetings`);
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
save plan and the barriers (`jckpt.api.runtime`).

>>> # in every process of a jax.distributed run:
>>> # jckpt.save(ctx, state, "ckpt")          # a directory
>>> # state = jckpt.restore(ctx, abstract_state, "ckpt")
>>> # jckpt.consolidate("ckpt", "ckpt.jckpt")  # one file, readable anywhere
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jckpt.api import pairing
from jckpt.api.agreement import refusing
from jckpt.api.meetings import SAVING, alone, meeting
from jckpt.api.outcomes import described, first_line, own_error, refused_by
from jckpt.api.runtime import DEFAULT_BARRIER_TIMEOUT, barrier_timeout
from jckpt.api.runtime import Runtime as _Runtime
from jckpt.errors import CheckpointError, DistributedError, InputError
from jckpt.format.boxes import Box, box_shape, coalesce, full_box, intersect
from jckpt.format.entries import Entry, KeyPath, entry_for, path_name
from jckpt.format.index import IndexedArray
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
from jckpt.storage.backend import LOCAL, Backend, backend_for, refuse_others_files
from jckpt.storage.directory import (
    indexed_pieces,
    make_stage,
    publish_directory,
    reclaim_stage_dirs,
    write_index_file,
)
from jckpt.storage.regions import ShardedSource
from jckpt.storage.writer import ArraySource, write_checkpoint
from jckpt.trees import pytree as tree_mod
from jckpt.trees import to_host, transfers

# --- the plan: what this process writes -----------------------------------------------------

@dataclasses.dataclass
class _Leaf:
    ident: int
    path: KeyPath
    dtype: np.dtype
    shape: tuple[int, ...]
    key_impl: str | None
    blocks: list[tuple[Box, Any]]  # (box, source)
    value: Any = None  # the tree's leaf


def _plan(items: Sequence[tuple[KeyPath, Any]], namespace: str, first_id: int,
          process: int) -> list[_Leaf]:
    """Check every leaf, start every transfer to host, and decide what this process writes.

    Every process checks every leaf. A sharded array's distinct shards are
    written by the processes that own them; an array on this process's
    devices only, or a host value, is saved from process 0's copy (the other
    processes only describe it), unless process 0 holds none of it (`_adopt`).
    """
    hosts = to_host.host_leaves(items, namespace=namespace, pieces=True, spread=True,
                                  fetch=process == 0)
    return [_Leaf(first_id + n, p, h.dtype, h.shape, h.key_impl, _blocks(h), x)
            for n, ((p, x), h) in enumerate(zip(items, hosts))]


def _absent(leaves: list[_Leaf] | BaseException) -> list[int]:
    """Process 0: its leaves it holds no part of, which other processes hold (a pipeline
    stage on their devices): their holders write them (`_adopt`)."""
    if isinstance(leaves, BaseException):
        return []
    return [n for n, leaf in enumerate(leaves)
            if isinstance(leaf.value, jax.Array) and not leaf.value.addressable_shards]


def _adopt(leaves: list[_Leaf], absent: Sequence[int], namespace: str) -> None:
    """Write the leaves process 0 holds no part of (`_absent`) that this process holds
    whole: it only described them, as it does what process 0 writes from its own copy."""
    for n in absent:
        leaf = leaves[n] if 0 <= n < len(leaves) else None
        if leaf is None or leaf.blocks or not isinstance(leaf.value, jax.Array):
            continue
        if leaf.value.is_fully_addressable:
            (h,) = to_host.host_leaves([(leaf.path, leaf.value)], namespace=namespace,
                                       pieces=True, spread=True)
            leaf.blocks = _blocks(h)


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
            rt.share('stage', '!' + first_line(e))
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


def _facts(leaves: list[_Leaf] | BaseException, namespace: str) -> list[list[Any]] | None:
    """What every process must agree on of a save's leaves: their ids, paths, dtypes, shapes
    and PRNG implementations (a host value is written from process 0's copy alone, so a
    process whose copy differs in shape or dtype is found here or not at all)."""
    if isinstance(leaves, BaseException):
        return None  # raised at the barrier that follows
    return [pairing.leaf_facts(leaf.ident, f"{namespace}/{path_name(leaf.path)}", leaf.dtype,
                               leaf.shape, leaf.key_impl) for leaf in leaves]


def _named(rt: _Runtime, process: int, facts: list[list[Any]] | None,
           first: pairing.Claim | None, mine: pairing.Claim, error: BaseException) -> BaseException:
    """`error`, or where the processes disagree about the tree, an error naming the entry.

    A process whose leaves differ from process 0's puts its own in the key-value
    store before the first barrier; process 0, past it, reads them, names the first
    leaf they differ at and puts its own for them, which they read (a few seconds
    at most: it is there once process 0 is past the barrier they passed).
    """
    if facts is None or not isinstance(error, DistributedError):
        return error
    if process == 0:
        theirs = rt.listed('leaves')
        if not theirs:
            return error
        rt.put('leaves/0', json.dumps(facts))
        found = pairing.difference(facts, json.loads(theirs[0][1]), f"process {theirs[0][0]}")
    else:
        disagrees = first is not None and '-' != first.plan != mine.plan
        text = rt.get('leaves/0', min(30.0, rt.timeout_ms / 1000)) if disagrees else None
        found = None if text is None else pairing.difference(facts, json.loads(text), 'process 0')
    if found is None:
        return error
    return DistributedError(f"processes disagree about the tree they save: {found[1]}",
                            file=rt.path, entry=found[0],
                            fix="save the same tree in every process; a host value (numpy, a "
                                "number) must have the same shape and dtype in each, and is "
                                "saved from process 0's copy")


def _check_complete(stage: str, arrays: Sequence[IndexedArray], expected: Sequence[str]) -> None:
    """Refuse an index that would lack one of process 0's leaves: one no process wrote."""
    missing = set(expected) - {a.entry.name for a in arrays}
    if missing:
        name = next(n for n in expected if n in missing)
        raise DistributedError(f"no process wrote this array ({len(missing)} such in all)",
                               file=stage, entry=name,
                               fix="save a tree whose every array some process holds; report "
                                   "this if one did")


def _publish(backend: Backend, stage: _Stage, path: str, count: int, alignment: int,
             metadata: Mapping[str, str] | None, durable: bool, expected: Sequence[str]) -> None:
    """Process 0: index the pieces, publish the directory, then let go of its lock.

    In an object store the index replaces the one there with one PUT (the
    commit), then the pieces no index names any more are deleted.
    """
    assert stage.path is not None
    if backend is LOCAL:
        names, arrays = indexed_pieces(stage.path, count)
        _check_complete(stage.path, arrays, expected)
        write_index_file(stage.path, names, count, arrays, alignment, dict(metadata or {}),
                         durable=durable)
        publish_directory(stage.path, path, durable=durable)
        stage.path = None
        backend.remove(os.path.join(path, DIRECTORY_LOCK_NAME))  # held until now: never a lockless stage
        return
    names, arrays = indexed_pieces(path, count, stage.tag)
    _check_complete(path, arrays, expected)
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


def _checked_write(first: pairing.Claim, mine: pairing.Claim, absent: Sequence[int], where: str,
                   leaves: list[_Leaf] | BaseException, namespace: str, *pieces: Any) -> None:
    """Check that process 0 makes this process's save (`pairing.check_claims`), then write
    this process's pieces (or raise the error its plan met, now that the others hear of it),
    those of the leaves process 0 holds none of (`absent`) included."""
    pairing.check_claims(first, mine)
    if isinstance(leaves, BaseException):
        raise leaves
    _adopt(leaves, absent, namespace)
    _write_pieces(where, leaves, namespace, *pieces)


def _claimed(rt: _Runtime, process: int, mine: pairing.Claim, facts: list[list[Any]] | None,
             values: dict[str, str], absent: list[int]
             ) -> tuple[pairing.Claim, dict[str, str], list[int]]:
    """Process 0's claim, `values` and `absent`, shared with every process; a process whose
    leaves differ from process 0's puts its own where process 0 reads them (`_named`)."""
    text = rt.share('path', json.dumps([mine.encode(), values, absent]) if process == 0 else None)
    claim, theirs, absent = json.loads(text)
    first = pairing.Claim.decode(claim)
    if process and facts is not None and '-' != first.plan != mine.plan:
        rt.put(f"leaves/{process}", json.dumps(facts))
    return first, theirs, absent


def _begin(path: str, timeout: float, count: int, process: int,
           failure: Exception | None) -> tuple[_Runtime, pairing.Claim]:
    """Take this save's turn (`pairing.next_save`, from the caller's line of the program):
    the runtime it meets the others through, and its claim (the plan's digest still to come).
    An argument refused (`failure`, an `InputError`) is posted, for `outcomes.refused_by`."""
    site = pairing.call_site()
    tag, place, site_place = pairing.next_save(path, site)
    here = meeting(SAVING, '')  # counted as the saves are: the place a waiting process looks at
    rt = _Runtime(tag, path, timeout, count, process, announce=f"{path} from {site[0] if site else '?'}",
                  here=here)
    rt.post()
    if isinstance(failure, InputError):
        rt.put(f"refused/{process}", json.dumps(described(failure)))
    return rt, pairing.Claim(path, place, site, site_place, '-')


def _planned(ctx: Any, tree: Any, process: int, mine: pairing.Claim, failure: Exception | None
             ) -> tuple[list[_Leaf] | BaseException, list[list[Any]] | None, pairing.Claim]:
    """This process's plan (or the error it met, or `failure`, the caller's, raised at the
    first barrier, which the others are told of), its leaves' facts, and its claim with
    their digest."""
    namespace = ctx.namespace
    try:
        if failure is not None:
            raise failure
        leaves: list[_Leaf] | BaseException = _plan(
            tree_mod.flatten(tree), namespace, ctx.registry.max_id(namespace) + 1, process)
    except Exception as e:
        leaves = e
    facts = _facts(leaves, namespace)
    return leaves, facts, dataclasses.replace(
        mine, plan='-' if facts is None else pairing.plan_digest(facts))


def _after(rt: _Runtime, process: int, then: Callable[[], None] | None,
           failed: list[BaseException]) -> None:
    """Run `then` in this process, before the last barrier: its error goes to the others (phase
    `then`, apart from the publish's own) and to `failed`, to be raised once all have met."""
    if then is None:
        return
    try:
        then()
    except Exception as e:
        rt.report('then', process, e)
        failed.append(e)


def _finish(rt: _Runtime, process: int, then: Callable[[], None] | None,
            publish: Callable[[], None] | None) -> None:
    """The save's last phase: process 0 publishes, every process runs `then` (`_after`), and
    all meet; then this process's error of `then` is raised, or one naming the others', so
    that every process raises at this save (the checkpoint published all the same)."""
    failed: list[BaseException] = []

    def last() -> None:
        if publish is not None:
            publish()
        _after(rt, process, then, failed)

    rt.together('published', 'saw the checkpoint published', process,
                last if publish is not None or then is not None else None)
    if failed:
        raise failed[0]
    errs = rt.errors('then')
    if errs:
        raise DistributedError("the checkpoint is published, but failed after it in another "
                               "process: " + "; ".join(errs), file=rt.path,
                               fix="see that process's error; the checkpoint is intact")


def _arguments(ctx: Any, path: str | os.PathLike, alignment: int | None, timeout: float | None,
               failure: Exception | None, process: int, count: int
               ) -> tuple[Backend, str, int, float, Exception | None]:
    """`save_directory`'s backend, path, alignment, timeout and `failure`, checked before the
    save takes its turn: a refusal takes it all the same and is posted (`refused_save`).
    An `alignment` refused joins `failure`, which fails the save once it took its turn."""
    with refusing(functools.partial(pairing.refused_save, path), process=process, processes=count):
        backend = backend_for(path)  # before abspath, which would take a URL for a relative path
        path = os.path.abspath(os.fspath(path)) if backend is LOCAL else os.fspath(path)
        refuse_others_files(path)  # publishing swaps the whole directory: not a folder of others'
        timeout = barrier_timeout() if timeout is None else float(timeout)
    try:
        alignment = check_alignment(ctx.alignment if alignment is None else alignment, path)
    except InputError as e:
        alignment, failure = ctx.alignment, failure or e
    return backend, path, alignment, timeout, failure


def save_directory(ctx: Any, tree: Any, path: str | os.PathLike, *, alignment: int | None = None,
                   metadata: Mapping[str, str] | None = None, timeout: float | None = None,
                   returning: Sequence[str] = (), failure: Exception | None = None,
                   then: Callable[[], None] | None = None) -> dict[str, str]:
    """Save `tree` from every process of a `jax.distributed` run as a directory checkpoint.

    Call it (or `jckpt.save`, which calls it when `jax.process_count() > 1`)
    from every process with the same tree structure and the same `path`, from
    the same line of the program, on a filesystem (or object store) every
    process sees; a single process may call it too, to write the directory form.
    Returns in every process once the directory is published; raises
    `DistributedError` in the surviving processes when a peer fails or does not
    reach a barrier within `timeout` seconds (default `barrier_timeout`), and then
    nothing is published. A failing process raises its own jckpt error, or a
    `DistributedError` raised from another (a `ValueError` of the tree's code);
    `failure` (the caller's, a manager's metrics) fails the save once it took its turn; `then`
    (a manager's lease check) fails it in every process once published (`_finish`). It records
    process 0's `metadata`, and returns in every process its keys in `returning`.

    Example:
        ```python
        jckpt.save(ctx, {"params": sharded_params, "step": step}, "ckpt")  # every process
        ```
    """
    with alone(SAVING, str(path), jax.process_count()):  # one thread of this process at a time
        return _save(ctx, tree, path, alignment=alignment, metadata=metadata, timeout=timeout,
                     returning=returning, failure=failure, then=then)


def _save(ctx: Any, tree: Any, path: str | os.PathLike, *, alignment: int | None = None,
         metadata: Mapping[str, str] | None = None, timeout: float | None = None,
         returning: Sequence[str] = (), failure: Exception | None = None,
         then: Callable[[], None] | None = None) -> dict[str, str]:
    """`save_directory`, made by one thread of this process at a time."""
    process, count = jax.process_index(), jax.process_count()
    backend, path, alignment, timeout, failure = _arguments(ctx, path, alignment, timeout, failure,
                                                            process, count)
    rt, mine = _begin(path, timeout, count, process, failure)  # a failed save still takes its turn
    leaves, facts, mine = _planned(ctx, tree, process, mine, failure)
    values = {k: (metadata or {})[k] for k in returning if k in (metadata or {})}
    stage = _Stage(tag=object_directory.new_tag() if backend is not LOCAL and process == 0 else '')
    first: pairing.Claim | None = None
    try:
        with object_directory.saving(stage.tag):
            first, values, absent = _claimed(rt, process, mine, facts, values,
                                             _absent(leaves) if process == 0 else [])
            where = _open_stage(rt, path, process, stage, backend)
            save = stage.tag or os.path.basename(where)  # the same in every process
            rt.together('written', 'wrote its pieces', process, functools.partial(
                _checked_write, first, mine, absent, where, leaves, ctx.namespace, alignment, process,
                ctx.durable, stage.tag, save))
            _finish(rt, process, then, None if process else functools.partial(
                _publish, backend, stage, path, count, alignment,
                {**(metadata or {}), SAVE_KEY: save}, ctx.durable, [f[1] for f in facts or ()]))
    except BaseException as e:
        named = (refused_by(rt.listed('refused'), path, e, failure)
                 or _named(rt, process, facts, first, mine, own_error(e, path, count)))
        if process == 0:
            _discard(backend, stage)
        if isinstance(named, CheckpointError) and stage.path:
            named.published_as(stage.path, path)  # the staging directory is gone
        if named is e:
            raise
        raise named from (e if named.__cause__ is e else None)
    finally:
        if stage.lock_fd >= 0:
            os.close(stage.lock_fd)
    return values


__all__ = ['DEFAULT_BARRIER_TIMEOUT', 'barrier_timeout', 'save_directory']
