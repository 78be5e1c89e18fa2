"""Rewriting checkpoint files without decoding them: re-laying out and merging.

Both operations build a new header and copy every payload verbatim from its
source file (`copy_file_range` where the OS has it), keeping each entry's
checksum; nothing is decoded or converted, so no value can change. The new
file is published atomically, like every save.

* `relayout` rewrites one file with a new alignment (and the canonical
  layout: zero-filled gaps, nothing after the last payload).
* `merge` is model surgery: it combines several files into one,
  optionally renaming each input's namespaces `ns -> prefix + "__" + ns`,
  e.g. a teacher and a student model into one file.

>>> import numpy as np, tempfile, os
>>> from jckpt.format import Entry, Header, lay_out
>>> from jckpt.storage import ArraySource, CheckpointReader, write_checkpoint
>>> d = tempfile.mkdtemp()
>>> src, dst = os.path.join(d, 'a.jckpt'), os.path.join(d, 'b.jckpt')
>>> e = Entry(id=0, namespace='jckpt', prec='Single_prec', dims=(3,), offset=0,
...           byte_length=12, path=(('k', 'w'),))
>>> _ = write_checkpoint(src, lay_out(Header(tensors=(e,))),
...                      [ArraySource(np.arange(3, dtype=np.float32))], durable=False)
>>> relayout(src, dst, alignment=4096, durable=False).alignment
4096
>>> CheckpointReader(dst).data_start
4096
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
from collections.abc import Sequence

from jckpt.adapters import refuse_replacing_other_files
from jckpt.api import progress as progress_mod
from jckpt.errors import ChecksumError, ClashError, FormatError, InputError
from jckpt.format.entries import check_prefix
from jckpt.format.header import DEFAULT_ALIGNMENT, Entry, Header
from jckpt.format.layout import WRITER, lay_out, written_header
from jckpt.format.limits import check_alignment
from jckpt.format.metadata import merged_empty_nodes, prefix_header
from jckpt.format.names import EMPTY_NODES_KEY
from jckpt.storage.backend import backend_for, occupied, same_place
from jckpt.storage.reader import CheckpointReader, reopen
from jckpt.storage.writer import CopySource, ReaderSource, write_checkpoint
from jckpt.trees.nested import check_one_tree


def _check_sources(reader: CheckpointReader) -> None:
    bad = reader.verify()
    if bad:
        first = bad[0]
        more = f" (and {len(bad) - 1} more entries)" if len(bad) > 1 else ''
        raise ChecksumError(f"{first.message}{more}; refusing to copy a corrupt payload",
                            file=reader.path, entry=first.entry,
                            fix="restore the input from a good copy, or pass verify=False "
                                "(--no-verify) to copy it as it is")


def _open_whole(path: str) -> CheckpointReader:
    """A checkpoint file holding whole arrays: a multi-process checkpoint's directory, or one
    of its piece files (one process's slices), is refused saying how to make one file of it."""
    from jckpt.tools.classify import DIRECTORY, FILE, MANAGER, classify
    kind = classify(path)
    if kind.name == MANAGER:
        raise FormatError("a checkpoint manager's directory; this rewrites single files", file=path,
                          fix="pass one of its steps (a step_NNNNNNNN.jckpt file in it)")
    if kind.name not in (DIRECTORY, FILE) and kind.error is not None:
        raise kind.error  # a foreign file, a step in another format, nothing: as inspect says
    reader = None if kind.name == DIRECTORY else backend_for(path).open(kind.path)  # found there
    if reader is None or any(e.global_dims is not None for e in reader.header.tensors):
        what = ("a multi-process checkpoint's directory" if reader is None else
                "a piece file of a multi-process checkpoint: one process's slices only")
        directory = path if reader is None else os.path.dirname(path) or '.'
        raise FormatError(f"{what}; this rewrites single files of whole arrays", file=path,
                          fix=f"make one file of the checkpoint first: jckpt convert "
                              f"{shlex.quote(directory)} whole.jckpt (jckpt.consolidate in Python)")
    return reader


def _copy_out(target: str, header: Header, copies: Sequence[tuple[CheckpointReader, Entry]],
              *, durable: bool, progress: bool, what: str) -> Header:
    """Write `header` to `target`, payload `i` copied from `copies[i]`."""
    with contextlib.ExitStack() as stack:
        fds: dict[str, int] = {}
        sources = []
        for reader, entry in copies:
            if getattr(reader, 'remote', False):  # an object: its payload is fetched by range
                sources.append(ReaderSource(reader, entry))
                continue
            fd = fds.get(reader.path)
            if fd is None:
                fd = fds[reader.path] = reopen(reader, "reading the payloads to copy")
                stack.callback(os.close, fd)
            sources.append(CopySource(fd, reader.data_start + entry.offset, entry.byte_length,
                                      entry.checksum))
        total = sum(e.byte_length for e in header.tensors)
        bar = stack.enter_context(progress_mod.bar(f"{what} {os.path.basename(target)}", total,
                                                   enabled=progress))
        return write_checkpoint(target, header, sources, durable=durable,
                                on_payload=lambda e: bar.advance(e.byte_length))


def _refuse_existing(target: str, what: str, allow: str) -> None:
    """Refuse to replace a checkpoint at `target`; `allow`: the options that would."""
    if occupied(target):
        raise InputError(f"{what} would replace an existing checkpoint", file=target,
                         fix=f"choose another output path, or pass {allow}")


def relayout(src: str | os.PathLike, dst: str | os.PathLike, *, alignment: int | None = None,
             overwrite: bool = False, verify: bool = True, durable: bool = True,
             progress: bool = False) -> Header:
    """Rewrite `src` to `dst` with payloads laid out at `alignment` (default: `src`'s).

    Entries, ids, metadata and checksums are kept; payloads are copied
    verbatim. `dst` may be `src` itself (rewritten atomically in place);
    another existing `dst` is refused unless `overwrite`. With `verify`
    (the default) every source checksum is checked first, so a corrupt payload
    is never copied. Returns the header written.

    Example:
        ```python
        jckpt.relayout("ocannl_model.ckpt", "model.jckpt", alignment=4096)
        ```
    """
    src, dst = os.fspath(src), os.fspath(dst)
    backend_for(dst)  # a URL no backend serves is refused before the source is read
    reader = _open_whole(src)
    alignment = None if alignment is None else check_alignment(alignment, dst)
    same = same_place(src, dst)
    if not same:
        refuse_replacing_other_files(dst, "writing the re-laid-out file")
    if not (overwrite or same):
        _refuse_existing(dst, "writing the re-laid-out file", "overwrite=True (--overwrite)")
    if verify:
        _check_sources(reader)
    old = reader.header
    header = lay_out(dataclasses.replace(
        old, alignment=old.alignment if alignment is None else alignment, writer=WRITER))
    return _copy_out(dst, header, [(reader, e) for e in old.tensors], durable=durable,
                     progress=progress, what='writing')


def merge(out: str | os.PathLike, inputs: Sequence[str | os.PathLike],
          prefixes: Sequence[str | None] | None = None, *, alignment: int | None = None,
          append: bool = False, overwrite: bool = False, verify: bool = True,
          durable: bool = True, progress: bool = False) -> Header:
    """Combine the entries of `inputs` into one file `out`, payloads copied verbatim.

    `prefixes[i]` (when given and not empty) renames every namespace `ns`
    of `inputs[i]` to `prefixes[i] + "__" + ns`, as
    `jckpt.load(..., prefix_namespace=...)` does, so two models with the
    same namespace can sit side by side. An entry whose `(namespace, path)`
    is already taken is refused (naming both files), and so are entries of one
    namespace that would not form one tree (`InputError`: a leaf of one input
    where another holds a node); an id already used in
    its namespace is renumbered above that namespace's largest id. Metadata
    is combined with the first file's values winning. Payloads are laid out
    at `alignment` (default 32, the writer's default).

    With `append`, the entries of an existing `out` are kept and come
    first; without it an existing `out` is refused unless `overwrite`.
    With `verify` (the default) every input checksum is checked first.
    Returns the header written.

    Example:
        ```python
        jckpt.merge("both.jckpt", ["teacher.jckpt", "student.jckpt"],
                            prefixes=["teacher", "student"])
        # namespaces teacher__jckpt and student__jckpt
        ```
    """
    out = os.fspath(out)
    inputs = [os.fspath(p) for p in inputs]
    for path in (out, *inputs):  # a URL no backend serves is refused before anything is read
        backend_for(path)
    prefixes = _merge_prefixes(out, inputs, prefixes, alignment)
    sources = _merge_sources(out, inputs, prefixes, append=append, overwrite=overwrite)
    if verify:
        for reader, _ in sources:
            _check_sources(reader)
    entries, copies = _merged_entries(sources)
    check_one_tree(entries, file=out, fix="give the inputs that share a namespace a prefix "
                                          "each (prefixes=..., --prefix on the command line)")
    header = written_header(entries, DEFAULT_ALIGNMENT if alignment is None else alignment,
                            metadata=_merged_metadata(sources), extra=sources[0][1].extra)
    return _copy_out(out, header, copies, durable=durable, progress=progress, what='merging into')


#: One input of a merge: its reader, and its header with the namespaces renamed.
_Source = tuple[CheckpointReader, Header]


def _merge_prefixes(out: str, inputs: Sequence[str], prefixes: Sequence[str | None] | None,
                    alignment: int | None) -> list[str | None]:
    """One checked prefix per input (None where none); the errors for bad arguments."""

    if not inputs:
        raise InputError("nothing to merge: no input files given", file=out,
                         fix="name at least one input checkpoint")
    prefixes = list(prefixes) if prefixes else [None] * len(inputs)
    if len(prefixes) != len(inputs):
        raise InputError(f"{len(prefixes)} prefixes for {len(inputs)} inputs", file=out,
                         fix="give one prefix per input (an empty one leaves that input alone)")
    for p in prefixes:
        check_prefix(p)
    if alignment is not None:
        check_alignment(alignment, out)
    return prefixes


def _merge_sources(out: str, inputs: Sequence[str], prefixes: Sequence[str | None], *,
                   append: bool, overwrite: bool) -> list[_Source]:
    """The files to merge, in order: `out` itself first when appending to it."""

    sources: list[_Source] = []
    if append and occupied(out):
        base = _open_whole(out)
        sources.append((base, base.header))
    else:  # what is no checkpoint is never replaced, `overwrite` or not
        refuse_replacing_other_files(out, "merging")
    if not (append or overwrite):
        _refuse_existing(out, "merging", "--append to add to it or --overwrite to replace it "
                                          "(append=True, overwrite=True)")
    for path, prefix in zip(inputs, prefixes):
        reader = _open_whole(path)
        sources.append((reader, prefix_header(reader.header, prefix or None)))
    return sources


def _merged_metadata(sources: Sequence[_Source]) -> tuple[tuple[str, str], ...]:
    """Every input's metadata, the first file's value winning for a key in several; the
    empty nodes recorded (`EMPTY_NODES_KEY`) are every input's, as their entries are."""
    metadata: dict[str, str] = {}
    for _, header in sources:
        for key, value in header.metadata:
            metadata.setdefault(key, value)
    empty = merged_empty_nodes(h.metadata_dict().get(EMPTY_NODES_KEY) for _, h in sources)
    metadata.pop(EMPTY_NODES_KEY, None)
    return tuple(metadata.items()) + (((EMPTY_NODES_KEY, empty),) if empty is not None else ())


def _id_plan(sources: Sequence[_Source]) -> tuple[dict[str, set[int]], dict[str, int]]:
    """`(fixed, ceiling)` per namespace: the ids path-less entries keep, and the largest id.

    A path-less (OCANNL) entry is named by its id, so it keeps it; an entry with a path
    whose id is taken in its namespace gets a fresh one above every id of the inputs.
    """
    fixed: dict[str, set[int]] = {}
    ceiling: dict[str, int] = {}
    for _, header in sources:
        for e in header.tensors:
            ceiling[e.namespace] = max(ceiling.get(e.namespace, -1), e.id)
            if e.path is None:
                fixed.setdefault(e.namespace, set()).add(e.id)
    return fixed, ceiling


def _merged_entries(sources: Sequence[_Source]) -> tuple[list[Entry],
                                                          list[tuple[CheckpointReader, Entry]]]:
    """The merged entries (ids renumbered where taken), and where each payload comes from.

    Raises `ClashError` for an entry two inputs both hold.
    """
    fixed, ceiling = _id_plan(sources)
    owners: dict[tuple, str] = {}
    used_ids: dict[str, set[int]] = {}
    entries: list[Entry] = []
    copies: list[tuple[CheckpointReader, Entry]] = []
    for reader, header in sources:
        for stored, e in zip(reader.header.tensors, header.tensors):
            owner = owners.get(e.identity)
            if owner is not None:
                raise ClashError(f"also present in {owner}", file=reader.path, entry=e.name,
                                 fix="give the inputs distinct prefixes (--prefix NAME per input)")
            owners[e.identity] = reader.path
            ids = used_ids.setdefault(e.namespace, set())
            if e.path is not None and (e.id in ids or e.id in fixed.get(e.namespace, ())):
                ceiling[e.namespace] += 1
                e = dataclasses.replace(e, id=ceiling[e.namespace])
            ids.add(e.id)
            entries.append(e)
            copies.append((reader, stored))
    return entries, copies


__all__ = ['merge', 'relayout']
