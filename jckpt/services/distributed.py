"""Multi-process checkpoints: the directory form, written by every process of a ``jax.distributed`` run.

When ``jax.process_count() > 1``, :func:`jckpt.save` calls :func:`save_directory`:

1. every process writes one piece file (``process_NNNNN.jckpt``) holding the
   pieces of each array it owns (the shards whose replica 0 it holds, joined
   into one block where they touch), so each replicated piece is written once;
2. all processes meet at a barrier of JAX's distributed runtime (with a
   timeout, so a dead peer gives an error in bounded time, never a hang);
3. process 0 reads the piece headers, checks that the pieces of every array
   tile it exactly, writes ``index.jckpt`` and publishes the directory with
   one atomic rename; a second barrier returns everyone once it is published.

A directory without ``index.jckpt`` is never read as a checkpoint, so a
process that dies before the barrier leaves the previous checkpoint intact.
Any process can read a directory (:class:`DirectoryReader`, used by
``load`` and ``restore``), reading only the pieces that overlap the boxes it
asks for; :func:`consolidate` turns a directory into one file.

>>> # in every process of a jax.distributed run:
>>> # jckpt.save(ctx, state, "ckpt")          # a directory
>>> # state = jckpt.restore(ctx, abstract_state, "ckpt")
>>> # jckpt.consolidate("ckpt", "ckpt.jckpt")  # one file, readable anywhere
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import itertools
import math
import os
import re
import secrets
import shutil
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jckpt.errors import CheckpointError, FormatError, InputError, StorageError
from jckpt.format import precs
from jckpt.format.header import Entry, Header, KeyPath, path_name
from jckpt.format.layout import lay_out
from jckpt.format.names import (
    DIRECTORY_LOCK_NAME,
    INDEX_NAME,
    LAYOUT_VERSION,
    PIECE_RE,
    STAGE_DIR_TAG,
    piece_name,
)
from jckpt.storage.publish import STALE_AFTER, fsync_dir, storage_error
from jckpt.storage.reader import CheckpointReader
from jckpt.storage.writer import ArraySource, write_checkpoint
from jckpt.trees import sharding as sh
from jckpt.version import __version__

#: Seconds a process waits at a barrier for the others (``JCKPT_BARRIER_TIMEOUT`` overrides).
DEFAULT_BARRIER_TIMEOUT = 300.0
_saves = itertools.count()


class DistributedError(CheckpointError):
    """A multi-process save could not complete: a peer failed, died or timed out.

    Nothing was published; the previous checkpoint at the path is intact.
    """



def barrier_timeout() -> float:
    """The barrier timeout in seconds: ``JCKPT_BARRIER_TIMEOUT`` or the default."""
    raw = os.environ.get('JCKPT_BARRIER_TIMEOUT')
    try:
        return float(raw) if raw else DEFAULT_BARRIER_TIMEOUT
    except ValueError:
        raise InputError(f"JCKPT_BARRIER_TIMEOUT={raw!r} is not a number of seconds") from None


# --- the runtime: barriers and a key-value store through jax.distributed -------------------

class _Runtime:
    """Barriers and shared values through JAX's distributed client."""

    def __init__(self, tag: str, path: str, timeout: float, processes: int) -> None:
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

    def share(self, key: str, value: str | None) -> str:
        """Process 0 sets ``key`` to ``value``; every process returns it."""
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
                                   f"{self.timeout_ms / 1000:g} s ({_first_line(e)})",
                                   file=self.path, fix="check process 0's log; it may have "
                                   "failed or died") from None

    def barrier(self, name: str, what: str) -> None:
        if self.local:
            return
        try:
            self.client.wait_at_barrier(f"{self.tag}/{name}", self.timeout_ms)
        except Exception as e:
            reached = [ln.strip() for ln in str(e).splitlines() if 'reached the barrier' in ln]
            raise DistributedError(f"not every process {what} within {self.timeout_ms / 1000:g} s; "
                                   f"nothing was published ({'; '.join([_first_line(e), *reached])})",
                                   file=self.path,
                                   fix="check the other processes' logs (one may have died); "
                                       "raise JCKPT_BARRIER_TIMEOUT if they are only slow") from None

    def report(self, process: int, error: BaseException) -> None:
        if self.local:
            return
        try:
            self.client.key_value_set(f"{self.tag}/error/{process}", _first_line(error)[:2000])
        except Exception:
            pass

    def errors(self) -> list[str]:
        if self.local:
            return []
        try:
            pairs = self.client.key_value_dir_get(f"{self.tag}/error/")
        except Exception:
            return []
        return [f"process {k.rsplit('/', 1)[-1]}: {v}" for k, v in sorted(pairs)]

    def check(self) -> None:
        errs = self.errors()
        if errs:
            raise DistributedError("the save failed in another process: " + "; ".join(errs),
                                   file=self.path, fix="see that process's error; nothing was "
                                   "published and the previous checkpoint is intact")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# --- saving -------------------------------------------------------------------------------

@dataclasses.dataclass
class _Leaf:
    ident: int
    path: KeyPath
    dtype: np.dtype
    shape: tuple[int, ...]
    key_impl: str | None
    blocks: list[tuple[sh.Box, Any]]  # (box, source)


def _plan(items: Sequence[tuple[KeyPath, Any]], namespace: str, first_id: int,
          process: int) -> list[_Leaf]:
    """Check every leaf, start every transfer to host, and decide what this process writes."""
    import jax

    from jckpt.trees import placement

    staged: list[Any] = []
    for n, (p, leaf) in enumerate(items):
        where = f"{namespace}/{path_name(p) or '<root>'}"
        key_impl = None
        if placement.is_prng_key(leaf):
            key_impl = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        spread = isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
        if spread or placement.is_sharded(leaf):
            dtype = np.dtype(leaf.dtype)
            if not precs.is_supported(dtype):
                raise InputError(f"dtype {dtype} cannot be stored", entry=where,
                                 fix="cast to a supported dtype (see the format's prec table)")
            # an array on this process's devices only is saved from process 0's copy
            shards = placement.owned_shards(leaf) if spread or process == 0 else []
            placement.start_transfers(shards)
            staged.append((first_id + n, p, where, leaf, key_impl, shards))
        else:  # a host value or a process-local array: process 0's copy is the one saved
            if isinstance(leaf, jax.Array) and process == 0:
                placement.start_host_copies([leaf])
            staged.append((first_id + n, p, where, leaf, key_impl, None))
    out = []
    for ident, p, where, leaf, key_impl, shards in staged:
        if shards is None:
            array, impl = placement.to_host(leaf, where)  # checks the leaf in every process
            blocks: list[tuple[sh.Box, Any]] = (
                [(sh.full_box(array.shape), ArraySource(array))] if process == 0 else [])
            out.append(_Leaf(ident, p, array.dtype, tuple(array.shape), key_impl or impl, blocks))
            continue
        dtype = np.dtype(leaf.dtype)
        blocks = []
        for block in sh.coalesce([b for b, _ in shards]):
            inside = [(tuple((a - o, z - o) for (a, z), (o, _) in zip(b, block)),
                       functools.partial(placement.await_host, d))
                      for b, d in shards if sh.intersect(b, block) == b]
            blocks.append((block, sh.ShardedSource(sh.box_shape(block), dtype, inside)))
        out.append(_Leaf(ident, p, dtype, tuple(leaf.shape), key_impl, blocks))
    return out


def _piece_entry(leaf: _Leaf, namespace: str, box: sh.Box) -> Entry:
    dims = sh.box_shape(box)
    return Entry(id=leaf.ident, namespace=namespace, prec=precs.prec_of(leaf.dtype), dims=dims,
                 offset=0, byte_length=math.prod(dims) * leaf.dtype.itemsize,
                 label=tuple(str(v) for _, v in leaf.path), path=leaf.path,
                 key_impl=leaf.key_impl, slice=box, global_dims=leaf.shape)


def save_directory(ctx: Any, tree: Any, path: str | os.PathLike, *, alignment: int | None = None,
                   metadata: Mapping[str, str] | None = None,
                   timeout: float | None = None) -> None:
    """Save ``tree`` from every process of a ``jax.distributed`` run as a directory checkpoint.

    Call it (or :func:`jckpt.save`, which calls it when ``jax.process_count() > 1``)
    from every process with the same tree structure; a single process may call
    it too, to write the directory form. Returns in every process
    once the directory is published; raises :class:`DistributedError` in the
    surviving processes when a peer fails or does not reach a barrier within
    ``timeout`` seconds (default :func:`barrier_timeout`), and then nothing is
    published.

    Example::

        jckpt.save(ctx, {"params": sharded_params, "step": step}, "ckpt")  # every process
    """
    import jax

    from jckpt.trees import pytree as tree_mod

    path = os.path.abspath(os.fspath(path))
    namespace = ctx.namespace
    alignment = ctx.alignment if alignment is None else alignment
    if not isinstance(alignment, int) or alignment < 1:
        raise InputError(f"alignment must be a positive integer, not {alignment!r}", file=path)
    process, count = jax.process_index(), jax.process_count()
    timeout = barrier_timeout() if timeout is None else float(timeout)
    items = tree_mod.flatten(tree)
    leaves = _plan(items, namespace, ctx.registry.max_id(namespace) + 1, process)
    rt = _Runtime(f"jckpt/save/{next(_saves)}", path, timeout, count)

    lock_fd = -1
    stage = None
    try:
        if process == 0:
            try:
                reclaim_stage_dirs(path)
                stage, lock_fd = _make_stage(path)
            except BaseException as e:  # tell the others at once rather than at their timeout
                rt.share('stage', '!' + _first_line(e))
                raise
            rt.share('stage', os.path.basename(stage))
        else:
            name = rt.share('stage', None)
            if name.startswith('!'):
                raise DistributedError(f"process 0 could not start the save: {name[1:]}", file=path,
                                       fix="see process 0's error")
            if STAGE_DIR_TAG not in name or os.sep in name:
                raise DistributedError(f"unexpected staging name {name!r}", file=path)
            stage = os.path.join(os.path.dirname(path), name)
        try:
            _write_pieces(stage, leaves, namespace, alignment, process, ctx.durable)
        except BaseException as e:
            rt.report(process, e)
            rt.barrier('written', 'wrote its pieces')
            raise
        rt.barrier('written', 'wrote its pieces')
        rt.check()
        if process == 0:
            try:
                write_index(stage, count, alignment, dict(metadata or {}), durable=ctx.durable)
                publish_directory(stage, path, durable=ctx.durable)
                stage = None
                _unlink(os.path.join(path, DIRECTORY_LOCK_NAME))  # held until now: never a lockless stage
            except BaseException as e:
                rt.report(process, e)
                rt.barrier('published', 'saw the checkpoint published')
                raise
        rt.barrier('published', 'saw the checkpoint published')
        rt.check()
    except BaseException:
        if process == 0 and stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)


def _write_pieces(stage: str, leaves: list[_Leaf], namespace: str, alignment: int, process: int,
                  durable: bool) -> None:
    layers = max([len(leaf.blocks) for leaf in leaves] + [1])
    for layer in range(layers):
        entries, sources = [], []
        for leaf in leaves:
            if layer < len(leaf.blocks):
                box, source = leaf.blocks[layer]
                entries.append(_piece_entry(leaf, namespace, box))
                sources.append(source)
        header = lay_out(Header(tensors=tuple(entries), alignment=alignment,
                                writer=f"jckpt {__version__}"))
        write_checkpoint(os.path.join(stage, piece_name(process, layer)), header, sources,
                         durable=durable)


def _make_stage(path: str) -> tuple[str, int]:
    parent = os.path.dirname(path)
    for _ in range(100):
        stage = f"{path}{STAGE_DIR_TAG}{secrets.token_hex(8)}"
        try:
            os.mkdir(stage)
        except FileExistsError:
            continue
        except OSError as e:
            raise storage_error(e, "creating the staging directory", path) from e
        lock = os.path.join(stage, DIRECTORY_LOCK_NAME)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except FileNotFoundError:  # reclaimed by another save before the lock existed: retry
            continue
        except OSError as e:
            raise storage_error(e, "creating the staging directory's lock", path) from e
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:  # still the lock of a directory in place (not reclaimed between open and flock)
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return stage, fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise StorageError("could not create a unique staging directory", file=parent)


def reclaim_stage_dirs(path: str | os.PathLike, *, stale_after: float = STALE_AFTER) -> list[str]:
    """Remove staging directories of ``path`` left by a save whose process 0 is gone.

    A staging directory is reclaimed when its lock file is missing (its
    writer died before creating it: a live save holds it until the directory
    is renamed) or free (the writer died), or when it is older than
    ``stale_after`` seconds (for filesystems without ``flock``).
    """
    path = os.fspath(path)
    parent = os.path.dirname(path) or '.'
    pattern = re.compile(re.escape(os.path.basename(path)) + re.escape(STAGE_DIR_TAG)
                         + r'[0-9a-f]{16}\Z')
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if not pattern.match(name):
            continue
        stage = os.path.join(parent, name)
        try:
            old = time.time() - os.lstat(stage).st_mtime > stale_after
        except OSError:
            continue
        try:
            fd = os.open(os.path.join(stage, DIRECTORY_LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            free = True
        except OSError:
            free = False
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                free = True
            except OSError:
                free = False
            finally:
                os.close(fd)
        if free or old:
            shutil.rmtree(stage, ignore_errors=True)
            removed.append(stage)
    return removed


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux ``renameat2``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: the filesystem cannot swap
        return False
    raise OSError(err, os.strerror(err), b)


def publish_directory(stage: str, path: str, *, durable: bool = True) -> None:
    """Make the complete directory ``stage`` appear at ``path`` with one atomic rename.

    An existing checkpoint (file or directory) at ``path`` is swapped out in
    the same step (``renameat2(RENAME_EXCHANGE)``) and then removed; where the
    filesystem cannot swap, it is renamed aside first.
    """
    try:
        if durable:
            fsync_dir(stage)
        if not os.path.lexists(path):
            os.rename(stage, path)
        elif _exchange(stage, path):
            _remove(stage)
        else:
            aside = f"{path}.jckpt-old.{secrets.token_hex(8)}"
            os.rename(path, aside)
            os.rename(stage, path)
            _remove(aside)
        if durable:
            fsync_dir(os.path.dirname(path))
    except OSError as e:
        raise storage_error(e, "publishing the checkpoint directory", path) from e


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        _unlink(path)


# --- the index ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """One array of a directory checkpoint: its global entry and where its pieces are."""

    entry: Entry
    pieces: tuple[tuple[int, sh.Box], ...]  # (file number, box)


def write_index(stage: str, process_count: int, alignment: int, metadata: dict[str, str], *,
                durable: bool = True) -> Header:
    """Read every piece file's header in ``stage``, check the tiling, write ``index.jckpt``."""
    names = sorted(n for n in os.listdir(stage) if PIECE_RE.match(n))
    for p in range(process_count):
        if piece_name(p) not in names:
            raise DistributedError(f"process {p} wrote no piece file", file=stage,
                                   fix="check that process's log")
    arrays: dict[tuple[str, Any], tuple[Entry, list[tuple[int, sh.Box]]]] = {}
    for fi, name in enumerate(names):
        reader = CheckpointReader(os.path.join(stage, name))
        for e in reader.header.tensors:
            if e.slice is None:
                raise FormatError("piece entry without slice", file=reader.path, entry=e.name)
            g = _global_entry(e)
            have = arrays.setdefault(e.identity, (g, []))
            if have[0] != g:
                raise DistributedError(f"processes disagree about this array: {have[0]} vs {g}",
                                       file=stage, entry=e.name,
                                       fix="save the same tree structure from every process")
            have[1].append((fi, e.slice))
    infos = []
    for g, pieces in sorted(arrays.values(), key=lambda v: (v[0].namespace, v[0].id)):
        why = sh.check_tiling([b for _, b in pieces], g.dims)
        if why:
            raise DistributedError(f"pieces do not tile the array: {why}", file=stage, entry=g.name,
                                   fix="every process must save the same global arrays")
        infos.append(ArrayInfo(g, tuple(sorted(pieces, key=lambda p: p[1]))))
    header = index_header(names, process_count, infos, alignment, metadata)
    write_checkpoint(os.path.join(stage, INDEX_NAME), header, [], durable=durable)
    return header


def _global_entry(e: Entry) -> Entry:
    dims = tuple(e.global_dims or ())
    return Entry(id=e.id, namespace=e.namespace, prec=e.prec, dims=dims, offset=0,
                 byte_length=math.prod(dims) * precs.element_size(e.prec), label=e.label,
                 path=e.path, key_impl=e.key_impl)


def index_header(files: Sequence[str], process_count: int, infos: Sequence[ArrayInfo],
                 alignment: int, metadata: Mapping[str, str]) -> Header:
    """The index as a header with no tensors and a ``sharded`` field (see docs/format.md)."""
    arrays = []
    for info in infos:
        e = info.entry
        fields: list[Any] = [['id', e.id], ['namespace', e.namespace], ['label', list(e.label)],
                             ['prec', e.prec], ['global_dims', list(e.dims)]]
        if e.path is not None:
            fields.append(['path', [[k, v] for k, v in e.path]])
        if e.key_impl is not None:
            fields.append(['key_impl', e.key_impl])
        fields.append(['pieces', [[fi, [[a, b] for a, b in box]] for fi, box in info.pieces]])
        arrays.append(fields)
    sharded = ['sharded', [['layout', LAYOUT_VERSION], ['process_count', process_count],
                           ['files', list(files)], ['arrays', arrays]]]
    return Header(tensors=(), alignment=alignment, writer=f"jckpt {__version__}",
                  metadata=tuple(metadata.items()), extra=(_freeze(sharded),))


def _freeze(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return str(x) if isinstance(x, int) else x


# --- reading ----------------------------------------------------------------------------------

def _fail(msg: str, file: str, entry: str | None = None) -> FormatError:
    return FormatError(msg, file=file, entry=entry,
                       fix="the directory's index is damaged; re-save or consolidate a good copy")


def _int(x: Any, what: str, file: str, entry: str | None = None) -> int:
    if isinstance(x, str) and x.isascii() and x.isdigit():  # str.isdigit alone admits '²'
        return int(x)
    raise _fail(f"{what} must be a non-negative integer, got {x!r}", file, entry)


def _pairs(node: Any, what: str, file: str, entry: str | None = None) -> dict[str, Any]:
    if not isinstance(node, tuple):
        raise _fail(f"{what} must be a list of (key value) pairs", file, entry)
    out = {}
    for f in node:
        if not (isinstance(f, tuple) and len(f) == 2 and isinstance(f[0], str)):
            raise _fail(f"{what}: a field is not a (key value) pair", file, entry)
        out[f[0]] = f[1]
    return out


def parse_index(header: Header, file: str) -> tuple[list[str], list[ArrayInfo]]:
    """The piece file names and arrays of an index header; raises :class:`FormatError`."""
    field = next((f for f in header.extra if isinstance(f, tuple) and f and f[0] == 'sharded'),
                 None)
    if field is None or len(field) != 2:
        raise _fail("index has no sharded field", file)
    top = _pairs(field[1], 'sharded', file)
    layout = _int(top.get('layout'), 'layout', file)
    if layout != LAYOUT_VERSION:
        raise FormatError(f"unsupported directory layout {layout}", file=file,
                          fix="read it with the jckpt release that wrote it")
    files = top.get('files')
    if not (isinstance(files, tuple) and all(isinstance(n, str) and PIECE_RE.match(n)
                                             for n in files)):
        raise _fail("files must be a list of process_NNNNN[.K].jckpt names", file)
    arrays = top.get('arrays')
    if not isinstance(arrays, tuple):
        raise _fail("arrays must be a list", file)
    infos = []
    seen = set()
    for n, node in enumerate(arrays):
        f = _pairs(node, f"array #{n}", file, f"#{n}")
        namespace = f.get('namespace')
        if not isinstance(namespace, str):
            raise _fail("namespace missing", file, f"#{n}")
        ident = _int(f.get('id'), 'id', file, f"#{n}")
        path = None
        if 'path' in f:
            comps = f['path']
            if not isinstance(comps, tuple):
                raise _fail("path must be a list", file, f"#{n}")
            parts: list[tuple[str, str | int]] = []
            for c in comps:
                if not (isinstance(c, tuple) and len(c) == 2 and c[0] in ('k', 'ki', 'i', 'a', 'f')
                        and isinstance(c[1], str)):
                    raise _fail("bad path component", file, f"#{n}")
                parts.append((c[0], int(c[1]) if c[0] in ('ki', 'i', 'f') and c[1].isascii()
                              and c[1].lstrip('-').isdigit() else c[1]))
            path = tuple(parts)
        where = f"{namespace}/{path_name(path) if path is not None else f'n{ident}'}"
        prec = f.get('prec')
        if prec not in precs.ALL_PRECS or prec == precs.VOID:
            raise _fail(f"bad prec {prec!r}", file, where)
        gd = f.get('global_dims')
        if not isinstance(gd, tuple):
            raise _fail("global_dims must be a list", file, where)
        dims = tuple(_int(d, 'global_dims', file, where) for d in gd)
        label = f.get('label', ())
        if not (isinstance(label, tuple) and all(isinstance(x, str) for x in label)):
            raise _fail("label must be a list of atoms", file, where)
        key_impl = f.get('key_impl')
        pieces = []
        for p in f.get('pieces', ()):
            if not (isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], tuple)
                    and len(p[1]) == len(dims)):
                raise _fail("piece must be (FILE ((START STOP) ...))", file, where)
            fi = _int(p[0], 'piece file', file, where)
            if fi >= len(files):
                raise _fail(f"piece file number {fi} is not in files", file, where)
            box = []
            for pair in p[1]:
                if not (isinstance(pair, tuple) and len(pair) == 2):
                    raise _fail("piece slice must be ((START STOP) ...)", file, where)
                box.append((_int(pair[0], 'slice', file, where), _int(pair[1], 'slice', file, where)))
            pieces.append((fi, tuple(box)))
        if math.prod(dims) > 2**62:
            raise _fail(f"global_dims {dims} are absurdly large", file, where)
        why = sh.check_tiling([b for _, b in pieces], dims)
        if why:
            raise _fail(f"pieces do not tile the array: {why}", file, where)
        entry = Entry(id=ident, namespace=namespace, prec=prec, dims=dims, offset=0,
                      byte_length=math.prod(dims) * precs.element_size(prec), label=label,
                      path=path, key_impl=key_impl if isinstance(key_impl, str) else None)
        if entry.identity in seen:
            raise _fail("duplicate array", file, where)
        seen.add(entry.identity)
        infos.append(ArrayInfo(entry, tuple(pieces)))
    return list(files), infos


class DirectoryReader:
    """An open directory checkpoint: the global entries, read piece by piece on demand.

    ``header`` lists one entry per array (dims = the global dims), so code
    written for :class:`~jckpt.storage.reader.CheckpointReader` works on it;
    :meth:`decode` returns a :class:`~jckpt.trees.sharding.LazyArray` that reads
    only the pieces overlapping the boxes asked of it.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        index = os.path.join(self.path, INDEX_NAME)
        if not os.path.exists(index):
            raise FormatError(f"directory has no {INDEX_NAME}: not a checkpoint, or one whose "
                              "save did not finish", file=self.path,
                              fix="restore from a complete checkpoint")
        self.index = CheckpointReader(index, follow_symlinks=False)
        self.files, infos = parse_index(self.index.header, index)
        self.arrays = {info.entry.identity: info for info in infos}
        ih = self.index.header
        self.header = Header(tensors=tuple(info.entry for info in infos), alignment=ih.alignment,
                             writer=ih.writer, metadata=ih.metadata)
        self._readers: dict[int, CheckpointReader] = {}
        self._verified: set[tuple[int, Any]] = set()

    def _reader(self, fi: int) -> CheckpointReader:
        reader = self._readers.get(fi)
        if reader is None:
            reader = self._readers[fi] = CheckpointReader(os.path.join(self.path, self.files[fi]),
                                                          follow_symlinks=False)
            reader.pieces = {e.identity: e for e in reader.header.tensors}  # type: ignore[attr-defined]
        return reader

    def piece(self, fi: int, info: ArrayInfo, box: sh.Box, *, verify: bool) -> np.ndarray:
        """The stored piece ``box`` of ``info``'s array in file ``fi`` (a mapped view)."""
        reader = self._reader(fi)
        e = reader.pieces.get(info.entry.identity)  # type: ignore[attr-defined]
        if e is None or e.slice != box or e.prec != info.entry.prec:
            raise FormatError(f"piece {box} is not in {self.files[fi]} as the index says",
                              file=reader.path, entry=info.entry.name,
                              fix="the directory is damaged; restore it from a good copy")
        if verify and (fi, e.identity) not in self._verified:
            reader.verify_entry(e)
            self._verified.add((fi, e.identity))
        return reader.decode(e, mmap=True, count=False)

    def read_box(self, info: ArrayInfo, box: sh.Box, *, verify: bool = False) -> np.ndarray:
        """Assemble ``box`` of an array from the pieces that overlap it."""
        e = info.entry
        out = np.empty(sh.box_shape(box) + (e.shape[len(e.dims):]), dtype=e.dtype)
        copied = 0
        for fi, pbox in info.pieces:
            common = sh.intersect(box, pbox)
            if common is None or (sh.box_size(common) == 0 and common != ()):
                continue
            src = self.piece(fi, info, pbox, verify=verify)
            out[sh.box_slices(common, box)] = src[sh.box_slices(common, pbox)]
            copied += sh.box_size(common) * e.dtype.itemsize
        sh.note_read(box, copied)
        return out

    def decode(self, entry: Entry, *, mmap: bool = True, verify: bool = False,
               count: bool = True) -> sh.LazyArray:
        """A lazy view of the array ``entry`` (one of :attr:`header`'s entries)."""
        info = self.arrays[entry.identity]
        return sh.LazyArray(entry.shape, entry.dtype,
                            functools.partial(self.read_box, info, verify=verify))

    def verify(self, entries: Any = None) -> list[CheckpointError]:
        """Check every piece's checksum; return the failures."""
        bad: list[CheckpointError] = []
        for fi, _name in enumerate(self.files):
            bad.extend(self._reader(fi).verify())
        return bad


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader | DirectoryReader:
    """Open a checkpoint file, or a directory checkpoint, for reading."""
    return DirectoryReader(path) if os.path.isdir(path) else CheckpointReader(path)


def consolidate(directory: str | os.PathLike, file: str | os.PathLike, *, durable: bool = True,
                verify: bool = True, alignment: int | None = None) -> Header:
    """Write the directory checkpoint ``directory`` as one checkpoint file ``file``.

    Each array is assembled in place from its pieces (never whole in memory);
    pieces are checked against their checksums first (``verify=True``) so a
    damaged piece is reported rather than sealed under a new checksum. Ids,
    paths, key implementations and metadata are kept. Returns the header written.

    Example::

        jckpt.consolidate("ckpt", "ckpt.jckpt")
    """
    reader = DirectoryReader(directory)
    entries, sources = [], []
    for info in reader.arrays.values():
        e = info.entry
        pieces = [(pbox, functools.partial(reader.piece, fi, info, pbox, verify=verify))
                  for fi, pbox in info.pieces]
        entries.append(e)
        sources.append(sh.ShardedSource(e.dims, e.dtype, pieces))
    header = lay_out(Header(tensors=tuple(entries),
                            alignment=reader.header.alignment if alignment is None else alignment,
                            writer=f"jckpt {__version__}", metadata=reader.header.metadata))
    return write_checkpoint(file, header, sources, durable=durable)


__all__ = ['DirectoryReader', 'DistributedError', 'INDEX_NAME', 'consolidate', 'open_checkpoint',
           'piece_name', 'publish_directory', 'save_directory']
