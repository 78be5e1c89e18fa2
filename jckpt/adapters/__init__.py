"""Format adapters: read and write other tools' checkpoint files, and convert between them.

A format is a name, a way to recognise a file by its first bytes (or a
directory by its layout), a reader and a writer. Every adapter reads to and
writes from the form `jckpt.load` returns, `{namespace: subtree}`
with host numpy arrays as leaves, so values round-trip bit-exactly:

* `jckpt`: this library's own files (all namespaces, exact paths).
* `safetensors`: `.safetensors` files and Hugging Face's sharded
  `model.safetensors.index.json` layout (`jckpt.adapters.safetensors`).
* `npz` / `npy`: numpy archives and single arrays (`jckpt.adapters.numpy`).
* `llmc`: llm.c GPT-2 model files (`jckpt.adapters.llmc`).
* `torch`: `torch.save` files, read without torch (`jckpt.adapters.torch`).
* `orbax`: orbax PyTree checkpoint directories (`jckpt.adapters.orbax`).
* `ocannl`: jckpt files limited to what OCANNL reads (`jckpt.adapters.ocannl`).

Formats without namespaces read into the namespace `jckpt` (the default
`Context`'s), and a tree of one namespace is written as that subtree alone.
Formats with flat tensor names (safetensors, npz) name a leaf by its key path
joined with `.` and also record the exact paths in the file's metadata, so a
jckpt tree converted there and back comes back with its structure; a foreign
file without that record reads as `{'jckpt': {name: array}}`.

>>> import numpy as np, tempfile, os
>>> d = tempfile.mkdtemp()
>>> write({'jckpt': {'w': np.arange(3.0)}}, os.path.join(d, 'w.npz'))
>>> convert(os.path.join(d, 'w.npz'), os.path.join(d, 'w.safetensors'))
('npz', 'safetensors')
>>> detect_format(os.path.join(d, 'w.safetensors'))
'safetensors'
>>> read(os.path.join(d, 'w.safetensors'))['jckpt']['w']
array([0., 1., 2.])

Users add their own formats with `register_format`.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import threading
import warnings
from collections.abc import Callable, Collection
from typing import Any

from jckpt.adapters._common import held_bytes, holding, map_file, nest_dotted
from jckpt.errors import FormatError, InputError, MissingEntryError
from jckpt.format.names import STEP_RE, is_format_step
from jckpt.storage.backend import (
    LOCAL,
    backend_for,
    checked_path,
    is_url,
    refuse_file_as_folder,
    refuse_foreign,
    same_place,
)
from jckpt.storage.checkpoint import register_directory_reader
from jckpt.storage.publish import refuse_special

PathLike = str | os.PathLike
#: How many leading bytes a sniffer sees.
SNIFF_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class Format:
    """One registered format.

    Attributes:
      name: the format's name (`'safetensors'`).
      read: `read(path) -> {namespace: subtree}`.
      write: `write(tree, path) -> None`, or None for a read-only format.
      sniff: `sniff(path, head) -> bool`: whether the file is in this format,
        from `head`, its first `SNIFF_BYTES` bytes (`None` when
        `path` is a directory). None: never detected, only chosen by name.
      extensions: file name endings that choose this format for a destination.
      read_metadata: `read_metadata(path) -> {key: str}`: what a file holds
        besides arrays (an orbax step's JSON items), which `convert` stores as
        the jckpt file's metadata; None: nothing.
      check: `check(tree, path)`: raise `InputError` for a `{namespace: subtree}` the
        writer cannot hold, from the leaves' shapes and dtypes alone (no data is read), so
        a manager refuses such a step when it is saved, not when it is written.
      keeps_metadata: whether `write` takes `metadata=` (string pairs) and stores them,
        so `convert` hands it what the source holds besides arrays (a jckpt file's
        metadata, a safetensors file's `__metadata__`).
      read_with_metadata: `read_with_metadata(path) -> (tree, metadata)`: `read` and
        `read_metadata` from one reading of the file, for a format whose metadata comes
        from the same parse as its arrays (a `.pt` file's pickle, a safetensors header);
        None: the two are called in turn (see `read_with_metadata`).
    """

    name: str
    read: Callable[[str], Any]
    write: Callable[[Any, str], None] | None = None
    sniff: Callable[[str, bytes | None], bool] | None = None
    extensions: tuple[str, ...] = ()
    read_metadata: Callable[[str], dict[str, str]] | None = None
    check: Callable[[Any, str], None] | None = None
    keeps_metadata: bool = False
    read_with_metadata: Callable[[str], tuple[Any, dict[str, str]]] | None = None


_LOCK = threading.RLock()
_FORMATS: dict[str, Format] = {}


def register_format(name: str, *, read: Callable[[str], Any],
                    write: Callable[[Any, str], None] | None = None,
                    sniff: Callable[[str, bytes | None], bool] | None = None,
                    extensions: tuple[str, ...] | list[str] = (),
                    replace: bool = False,
                    read_metadata: Callable[[str], dict[str, str]] | None = None,
                    check: Callable[[Any, str], None] | None = None,
                    keeps_metadata: bool = False,
                    read_with_metadata: Callable[[str], tuple[Any, dict[str, str]]] | None = None
                    ) -> Format:
    """Add a format to the registry (formats registered later are tried first).

    Args:
      name: the name that `convert(..., format=name)` and `detect_format` use.
      read: `read(path) -> {namespace: subtree}` (host numpy leaves).
      write: `write(tree, path)` taking that same form.
      sniff: `sniff(path, head) -> bool` recognising a file by its first bytes
        (`head` is None for a directory).
      extensions: destination name endings (`'.mine'`) that pick this format.
      replace: allow replacing a format of the same name.
      read_metadata: `read_metadata(path) -> {key: str}`, what a file holds
        besides arrays; `convert` keeps it as a jckpt file's metadata.
      check: `check(tree, path)` raising `InputError` for a tree `write` cannot hold,
        from shapes and dtypes alone (see `Format.check`).
      keeps_metadata: `write` takes `metadata=` string pairs and stores them.
      read_with_metadata: `read_with_metadata(path) -> (tree, metadata)`, what `read`
        and `read_metadata` give, from one reading of the file (see `Format`).

    Example:
        ```python
        jckpt.register_format('mine', read=read_mine, write=write_mine,
                              sniff=lambda path, head: head is not None and head[:4] == b'MINE',
                              extensions=('.mine',))
        ```
    """
    if not isinstance(name, str) or not name:
        raise InputError(f"format name must be a non-empty string, not {name!r}")
    _check_hooks(read=read, write=write, sniff=sniff, extensions=extensions)
    for what, hook in (('read_metadata', read_metadata), ('check', check),
                       ('read_with_metadata', read_with_metadata)):
        if hook is not None and not callable(hook):
            raise InputError(f"register_format's {what} must be a function, not {hook!r:.80}",
                             fix=f"pass {what}=a function or None")
    fmt = Format(name=name, read=read, write=write, sniff=sniff,
                 extensions=tuple(e.lower() for e in extensions), read_metadata=read_metadata,
                 check=check, keeps_metadata=bool(keeps_metadata),
                 read_with_metadata=read_with_metadata)
    with _LOCK:
        if name in _FORMATS and not replace:
            raise InputError(f"format {name!r} is already registered",
                             fix="pass replace=True to replace it")
        _FORMATS.pop(name, None)
        _FORMATS[name] = fmt
    return fmt


def _check_hooks(*, read: Any, write: Any, sniff: Any, extensions: Any) -> None:
    """Refuse hooks that are not callables and extensions that are not a list of strings."""
    for what, hook in (('read', read), ('write', write), ('sniff', sniff)):
        if not callable(hook) and not (hook is None and what != 'read'):
            raise InputError(f"register_format's {what} must be a function, not {hook!r:.80}",
                             fix=f"pass {what}=a function" + ("" if what == 'read' else " or None"))
    if (isinstance(extensions, str) or not isinstance(extensions, (tuple, list))
            or not all(isinstance(e, str) for e in extensions)):
        raise InputError(f"extensions must be a tuple or list of strings, not {extensions!r:.80}",
                         fix="for example extensions=('.mine',)")


def formats() -> dict[str, Format]:
    """The registered formats by name (a copy)."""
    _ensure_builtins()
    with _LOCK:
        return dict(_FORMATS)


#: Other names of registered formats, as their files' extensions name them (`model.pth`).
ALIASES = {'pth': 'torch', 'pt': 'torch'}


def format_name(name: str) -> str:
    """The registered name `name` stands for: itself, unless it is one of the `ALIASES` and
    no format registered under it (a name nothing registered is returned as it is).

    >>> format_name('pth'), format_name('safetensors'), format_name('raw')
    ('torch', 'safetensors', 'raw')
    """
    return name if name in formats() else ALIASES.get(name, name)


def get_format(name: str, file: str | None = None) -> Format:
    """The registered format called `name` (or one of its `ALIASES`: `'pth'` is `'torch'`);
    `InputError` naming the known ones (and `file`, the path it was asked for)."""
    known = formats()
    fmt = known.get(format_name(name))
    if fmt is None:
        raise InputError(f"unknown format {name!r}", file=file, fix=f"use one of {sorted(known)}")
    return fmt


_BUILTINS = ('jckpt.adapters.native', 'jckpt.adapters.ocannl', 'jckpt.adapters.numpy',
             'jckpt.adapters.safetensors', 'jckpt.adapters.llmc', 'jckpt.adapters.torch',
             'jckpt.adapters.orbax_writer')  # the orbax format: orbax reads, orbax_writer writes
_loaded = False


def _ensure_builtins() -> None:
    global _loaded
    if _loaded:
        return
    with _LOCK:
        if _loaded:
            return
        user = dict(_FORMATS)
        for module in _BUILTINS:
            importlib.import_module(module).register()
        for name, fmt in user.items():  # formats a user registered first win and stay first
            _FORMATS.pop(name, None)
            _FORMATS[name] = fmt
        _loaded = True


def detect_format(path: PathLike) -> str:
    """The name of the format of the file (or directory) at `path`, from its content.

    Raises:
        FormatError: naming the file when it does not exist or no registered
            format recognises it.
        InputError: for a URL no storage backend serves.

    Example:
        ```python
        jckpt.detect_format('model.safetensors')   # 'safetensors'
        ```
    """
    path = checked_path(path)
    backend = backend_for(path)
    refuse_file_as_folder(path, backend)
    known = formats()
    held = held_bytes(path)
    head = (bytes(held[:SNIFF_BYTES]) if held is not None
            else None if backend.isdir(path) else backend.head(path, SNIFF_BYTES))
    if head is None:
        _refuse_manager(path, backend.list(path))
    for fmt in reversed(list(known.values())):
        if fmt.sniff is None:
            continue
        try:
            if fmt.sniff(path, head):
                return fmt.name
        except Exception:  # a sniffer that fails does not recognise the file
            continue
    if held is None and not is_url(path):  # a zip or safetensors file cut short: say so
        from jckpt.adapters.cut_short import cut_short_error
        error = cut_short_error(path, head)
        if error is not None:
            raise error
    what = 'directory' if head is None else 'file'
    raise FormatError(f"{what} is in no format jckpt recognises", file=path,
                      fix=f"pass format= one of {sorted(n for n, f in known.items() if f.sniff)}, "
                          "or register_format() a reader for it")


def _refuse_manager(path: str, names: list[str]) -> None:
    """A checkpoint manager's directory, or one of its steps, is not one checkpoint of a format
    (a step holding `model.safetensors` would convert as that file alone, its optimizer lost)."""
    if is_format_step(path, names):
        raise FormatError("is one step of a checkpoint manager (its model, optimizer and trainer "
                          "state), not one checkpoint", file=path,
                          fix="restore it with jckpt.CheckpointManager(directory).restore(step), or "
                              "convert the one file of it that you want")
    if any(STEP_RE.match(n) for n in names):
        raise FormatError("is a checkpoint manager's directory, not one checkpoint", file=path,
                          fix="convert one of its steps (a step_NNNNNNNN.jckpt file in it), or "
                              "restore with jckpt.CheckpointManager(directory).restore()")


def format_for_destination(path: PathLike) -> str | None:
    """The format a destination's name asks for (by extension), or None."""
    name = checked_path(path).lower().rstrip('/')
    best: tuple[int, str] | None = None
    for fmt in formats().values():
        for ext in fmt.extensions:
            if name.endswith(ext) and (best is None or len(ext) > best[0]):
                best = (len(ext), fmt.name)
    return best[1] if best else None


def read(path: PathLike, format: str | None = None) -> dict[str, Any]:
    """Read `path` as `{namespace: subtree}`; the format is detected unless given."""
    path = checked_path(path)
    backend_for(path)  # a URL no backend serves is refused before any format looks at it
    return get_format(format or detect_format(path), path).read(path)


def read_with_metadata(path: PathLike, format: str | None = None
                       ) -> tuple[dict[str, Any], dict[str, str]]:
    """`(read(path), metadata)`: the tree and what the file holds besides arrays (the
    format's `read_metadata`; `{}` for a format without), the file read once where the
    format can (`Format.read_with_metadata`). What `convert` and `jckpt inspect` read.

    >>> import numpy as np, tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), 'w.safetensors')
    >>> write({'jckpt': {'w': np.ones(2)}}, p)
    >>> tree, meta = read_with_metadata(p)
    >>> list(tree['jckpt']), meta
    (['w'], {'format': 'pt'})
    """
    path = checked_path(path)
    backend_for(path)  # a URL no backend serves is refused before any format looks at it
    return _read_with_metadata(get_format(format or detect_format(path), path), path)


def _read_with_metadata(fmt: Format, path: str) -> tuple[Any, dict[str, str]]:
    if fmt.read_with_metadata is not None:
        return fmt.read_with_metadata(path)
    return fmt.read(path), (fmt.read_metadata(path) if fmt.read_metadata is not None else {})


def write(tree: Any, path: PathLike, format: str | None = None) -> None:
    """Write `{namespace: subtree}` to `path` in `format` (default: from its extension)."""
    path = checked_path(path)
    backend_for(path)  # a URL no backend serves is refused before anything is written
    name = format or format_for_destination(path)
    if name is None:
        raise InputError("cannot tell the format from the file name", file=path,
                         fix=f"pass format= one of {sorted(formats())}")
    fmt = get_format(name, path)
    if fmt.write is None:
        raise InputError(f"format {fmt.name!r} cannot be written, only read", file=path)
    fmt.write(tree, path)


def convert(src: PathLike, dst: PathLike, *, format: str | None = None,
            namespaces: str | Collection[str] | None = None, nest: bool = False
            ) -> tuple[str, str]:
    """Convert the checkpoint at `src` into `dst`; return `(source, destination)` formats.

    The source format is detected from the file's bytes (or the directory's
    layout). The destination format is `format` if given, else the one its
    name's extension says (`.jckpt`, `.safetensors`, `.npz`, `.npy`,
    `.bin`, `.pt`/`.pth`; `.safetensors.index.json` writes Hugging
    Face's sharded layout), else `jckpt` when the source is not a jckpt
    file. The destination is replaced atomically; values are copied bit-exactly.
    `namespaces` (a name or several) converts only those: a model's parameters out of a
    training checkpoint, named as they are when they are the only namespace
    (safetensors and npz prefix the names with the namespace when there are several).
    `nest=True` splits dotted names (a torch or safetensors `state_dict`'s
    `'dense.kernel'`) into nested dicts, the tree a JAX model holds
    (`jckpt.adapters._common.nest_dotted`).
    A URL no storage backend serves, as either path, is an
    `InputError` before anything is read or written.

    Example:
        ```python
        jckpt.convert('model.safetensors', 'model.jckpt')
        jckpt.convert('ckpt.jckpt', 'exported', format='orbax')
        jckpt.convert('train.jckpt', 'model.safetensors', namespaces='params')
        jckpt.convert('model.pth', 'model.jckpt', nest=True)   # {'dense': {'kernel': ...}}
        ```
    """
    src, dst = checked_path(src), checked_path(dst)
    for path in (src, dst):  # a URL no backend serves is refused before anything is read
        backend_for(path)
    source = detect_format(src)
    target = format or format_for_destination(dst)
    if target is None:
        if source == 'jckpt':
            raise InputError("cannot tell the destination format from its name", file=dst,
                             fix=f"pass format= one of {sorted(formats())}")
        target = 'jckpt'
    fmt = get_format(target, dst)
    target = fmt.name  # an alias ('pth') names the format it stands for
    if fmt.write is None:
        raise InputError(f"format {target!r} cannot be written, only read", file=dst)
    if same_place(src, dst):
        raise InputError("source and destination are the same file", file=dst,
                         fix="convert into another path")
    if target == 'orbax':  # a URL, a file, anything but an orbax step: before a byte is read
        importlib.import_module('jckpt.adapters.orbax_writer').check_destination(dst)
    else:
        refuse_replacing_other_files(dst, "converting")
    reader = get_format(source)
    tree, meta = _read_with_metadata(reader, src)
    if namespaces is not None:
        tree = _only(tree, namespaces, src)
    if nest:
        tree = {ns: nest_dotted(sub, src) for ns, sub in tree.items()}
    _write_converted(reader, src, fmt, tree, meta, dst)
    return source, target


def refuse_replacing_other_files(dst: str, what: str) -> None:
    """`refuse_foreign` with every format jckpt reads counted a checkpoint (`detect_format`):
    a conversion, a re-layout or a merge replaces a checkpoint, never a text file, a folder of
    other files or a manager's run. A FIFO, device or socket is refused as what it is
    (`publish.refuse_special`, which never opens it), with `overwrite` or without.

    >>> refuse_replacing_other_files('no/such/file.jckpt', 'converting')  # nothing there
    """
    if backend_for(dst) is LOCAL:
        refuse_special(dst)  # not "an existing checkpoint" where --overwrite is not given
    refuse_foreign(dst, what, _is_checkpoint, strays=_orbax_strays)


def _orbax_strays(path: str) -> list[str]:
    """What an orbax step holds that orbax did not write (`orbax.strays`), the one directory
    format a conversion replaces whole."""
    return importlib.import_module('jckpt.adapters.orbax').strays(path)


def _is_checkpoint(path: str) -> bool:
    try:
        detect_format(path)
    except FormatError:
        return False
    return True


def _only(tree: dict[str, Any], namespaces: str | Collection[str], src: str) -> dict[str, Any]:
    """The namespaces `namespaces` of a tree read, in that order; `MissingEntryError` naming
    the ones the checkpoint has for one it lacks."""
    from jckpt.api.loading import namespace_names  # JAX: imported only when a subset is asked

    names = namespace_names(namespaces, src)
    for n in names:
        if n not in tree:
            raise MissingEntryError(f"no namespace {n!r} in the checkpoint", file=src,
                                    fix=f"its namespaces are {sorted(tree)}")
    return {n: tree[n] for n in names}


def _write_converted(source: Format, src: str, target: Format, tree: Any, meta: dict[str, str],
                     dst: str) -> None:
    """Write `tree` with `meta`, what `src` holds besides arrays: a format with a place for
    string pairs keeps it (a jckpt file's metadata, safetensors' `__metadata__`); for
    another, a warning names what is left behind (never a silent drop)."""
    write = target.write
    assert write is not None  # convert refuses a format it cannot write before reading
    if meta and target.keeps_metadata:
        write(tree, dst, metadata=meta)  # type: ignore[call-arg]  # such a writer takes it
        return
    if meta:
        keep = ("the .jckpt file keeps it" if source.name == 'jckpt'
                else "convert to a .jckpt file to keep it as metadata")
        warnings.warn(f"{src}: {sorted(meta)} ({source.name}'s data besides arrays) is not kept in "
                      f"{target.name!r}; {keep}", stacklevel=3)
    write(tree, dst)


def _open_orbax(path: str) -> Any:
    """An orbax directory as a reader for `jckpt.storage.open_checkpoint`."""
    return importlib.import_module('jckpt.adapters.orbax_reader').OrbaxReader(path)


def _claims_orbax(path: str) -> bool:
    return importlib.import_module('jckpt.adapters.orbax').sniff(path, None)


# restore, load and describe read orbax directories without converting them (read-only); the
# module is imported, and so registers, with `jckpt` itself (see docs/design.md)
register_directory_reader('orbax', claims=_claims_orbax, open=_open_orbax)


__all__ = ['Format', 'convert', 'detect_format', 'format_for_destination', 'formats',
           'get_format', 'holding', 'map_file', 'read', 'read_with_metadata',
           'refuse_replacing_other_files', 'register_format', 'write']
