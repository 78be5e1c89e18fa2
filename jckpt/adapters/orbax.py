"""orbax PyTree checkpoints (directories), to and from `{namespace: subtree}`.

Reading accepts an orbax PyTree item directory (it holds `_METADATA`),
which reads as `{'jckpt': tree}`, or a step directory of a
`CheckpointManager` (`<root>/<step>`), whose items read as
`{item: tree}`; items saved through `jckpt.adapters.orbax_handler` (one jckpt file each)
are read too. Every leaf comes back as a host numpy array, bit-exact, except
typed PRNG keys, which orbax stores as key data plus their implementation
and which come back as key arrays. A step's JSON items (`ocp.args.JsonSave`)
hold no arrays: `json_metadata` gives them as metadata under
`jckpt.format.names.ORBAX_JSON_KEY`, which `jckpt.convert` keeps in the jckpt file.
`jckpt.restore` and `jckpt.load` read these directories directly too
(`jckpt.adapters.orbax_reader`).

Writing (`jckpt.adapters.orbax_writer`) makes a step-style directory with one
PyTree item per namespace, which `ocp.CheckpointManager`/`ocp.Checkpointer` and
this reader open;
typed PRNG keys are handed to orbax as keys (orbax stores them itself), and
nodes without leaves that the tree holds (optax's `EmptyState`, `None`)
are kept, as orbax keeps them. A jckpt file records the key paths of such
nodes at save time (`jckpt.format.names.EMPTY_NODES_KEY`), so converting a
file brings them back too.

orbax records a NamedTuple's or a dataclass's fields as dict keys, so a
converted file holds dict keys where the saved tree had attributes;
`jckpt.restore` matches a path that differs only in such key kinds.

orbax-checkpoint is an optional dependency, imported only when a directory
is read or written (`pip install 'jckpt[orbax]'`).

Example:
    ```python
    jckpt.convert('ckpts/1000', 'step1000.jckpt')           # orbax -> jckpt
    jckpt.convert('step1000.jckpt', 'exported', format='orbax')
    ```
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import stat
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jckpt.adapters._common import (
    DEFAULT_NAMESPACE,
    inside,
)
from jckpt.adapters.zarr_meta import memory_bytes, small_json, zarray_claim
from jckpt.errors import FormatError, InputError
from jckpt.format import strict_json
from jckpt.format.header import NAMESPACE_RE
from jckpt.format.limits import MAX_DECOMPRESSION_RATIO
from jckpt.format.names import ORBAX_JSON_KEY
from jckpt.storage.backend import backend_for, is_url

_ITEM_MARKERS = ('_METADATA', 'manifest.ocdbt')
_STEP_MARKER = '_CHECKPOINT_METADATA'
_JCKPT_ITEM = 'checkpoint.jckpt'
#: The file a JSON item (`ocp.args.JsonSave`) keeps its value in, and the most of it read.
_JSON_ITEM = 'metadata'
_MAX_JSON_BYTES = 64 << 20


def import_orbax() -> Any:
    """`orbax.checkpoint`, or an `InputError` saying what to install."""
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise InputError("reading or writing orbax checkpoints needs orbax-checkpoint",
                         fix="pip install 'jckpt[orbax]'") from None
    return ocp


class _QuietHere(logging.Filter):
    """Drops orbax's (absl's) warnings logged by the threads reading for jckpt, and only
    theirs: the logger's level, shared by every thread, stays as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: dict[int, int] = {}  # thread id -> depth of `_quiet` blocks in it

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.thread not in self.threads


_QUIET = _QuietHere()
logging.getLogger('absl').addFilter(_QUIET)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hold back orbax's warnings while this thread reads for jckpt ("Metadata file does not
    exist" for the optional files of a step): they are not the user's to act on."""
    me = threading.get_ident()
    _QUIET.threads[me] = _QUIET.threads.get(me, 0) + 1
    try:
        yield
    finally:
        if _QUIET.threads[me] == 1:
            del _QUIET.threads[me]
        else:
            _QUIET.threads[me] -= 1


def _is_item(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, m)) for m in _ITEM_MARKERS) or \
        os.path.exists(os.path.join(path, _JCKPT_ITEM))


def _items(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n))
                  and _is_item(os.path.join(path, n)))


def is_one_checkpoint(path: str) -> bool:
    """Whether the local directory `path` is one orbax checkpoint, an item or a step: what an
    export may replace (not a `CheckpointManager`'s root of many steps, nor other files)."""
    return _is_item(path) or os.path.exists(os.path.join(path, _STEP_MARKER))


#: The files orbax writes in a step directory beside its items (`commit_success.txt`: on GCS).
_STEP_FILES = frozenset({_STEP_MARKER, 'commit_success.txt'})


def strays(path: str) -> list[str]:
    """The files of the local orbax step `path` that orbax does not write there (a user's note
    put in it), which replacing the step would delete; `[]` for anything else. Its
    directories are its items (orbax's JSON items, metrics among them, too).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> for name in ('_CHECKPOINT_METADATA', 'notes.txt'):
    ...     open(os.path.join(d, name), 'w').close()
    >>> strays(d)
    ['notes.txt']
    """
    if is_url(path) or not os.path.isfile(os.path.join(path, _STEP_MARKER)):
        return []
    return sorted(n for n in os.listdir(path)
                  if n not in _STEP_FILES and not os.path.isdir(os.path.join(path, n)))


def sniff(path: str, head: bytes | None) -> bool:
    """A directory laid out as an orbax item, step, or `CheckpointManager` root (refused
    with a message naming a step); in an object store, a prefix laid out so."""
    if is_url(path):
        return head is None and _in_store(path)
    return head is None and (_is_item(path) or os.path.exists(os.path.join(path, _STEP_MARKER))
                             or bool(_items(path)) or bool(_steps(path)))


def _in_store(url: str) -> bool:
    """Whether the prefix `url` holds an orbax item or step, or steps (the last one is listed)."""
    backend = backend_for(url)
    names = set(backend.list(url))
    if names & {*_ITEM_MARKERS, _STEP_MARKER}:
        return True
    steps = sorted((n for n in names if _step_number(n) is not None), key=_step_number)
    return bool(steps) and _STEP_MARKER in backend.list(os.path.join(url, steps[-1]))


def _refuse_url(path: str) -> None:
    """orbax reads local directories here: one in an object store is an error saying what to do."""
    if is_url(path):
        raise FormatError("an orbax checkpoint in an object store is not read in place: jckpt reads "
                          "orbax directories through orbax, from a local directory", file=path,
                          fix=f"copy it to a local directory first (gcloud storage cp -r {path} DIR, "
                              f"or aws s3 cp --recursive {path} DIR), then restore from that directory "
                              "or convert it: jckpt.convert(DIR, 'state.jckpt'); an item saved by "
                              f"jckpt's orbax handler is one jckpt file, <item>/{_JCKPT_ITEM}, which "
                              "restores in place")


#: A step directory's name as orbax's `CheckpointManager` writes it: the step, zero-padded
#: with `step_format_fixed_length`, after `<step_prefix>_` when there is one (`ckpt_000100`).
_STEP_NAME = re.compile(r'(?:[^/]*_)?([0-9]+)\Z')


def _step_number(name: str) -> int | None:
    m = _STEP_NAME.match(name)
    return int(m.group(1)) if m else None


def _steps(path: str) -> list[str]:
    """The names of the step directories under `path`, by step."""
    return sorted((n for n in os.listdir(path) if _step_number(n) is not None
                   and os.path.exists(os.path.join(path, n, _STEP_MARKER))), key=_step_number)


def manager_step_names(root: str) -> list[str]:
    """The step directories of an orbax `CheckpointManager` under the local directory `root`
    (`100`, `000100`, `ckpt_100`), by step (`[]` for anything else): each
    `<root>/<name>` reads with `jckpt.restore` as it is."""
    try:
        return _steps(root) if not is_url(root) else []
    except OSError:
        return []


def manager_steps(root: str) -> list[int]:
    """The steps of an orbax `CheckpointManager` under the local directory `root`, ascending
    (`[]` for anything else); `manager_step_names` gives their directories."""
    return [int(_step_number(n) or 0) for n in manager_step_names(root)]


def check_tree(path: str, items: Sequence[str] = ()) -> list[int]:
    """Refuse what orbax and tensorstore would follow or block on, before they see `path`;
    the bytes of its files, then of each of `items` (names of its entries: a step's items).

    orbax writes no symbolic links: one inside a checkpoint could lead out of it, or to
    `/dev/zero`, and a FIFO or device would block or never end; both are refused. So is a
    zarr array (`.zarray`, `zarr.json`) tensorstore would abort on (`jckpt.adapters.zarr_meta`), or whose
    shape claims more bytes than the files of its item (one of `items`, else all of `path`)
    could decompress to (`MAX_DECOMPRESSION_RATIO`): tensorstore allocates it whole.
    One walk checks a step and each of its items.
    """
    sizes: dict[str, int] = {}
    zarrays: list[tuple[str, str]] = []
    for root, dirs, files in os.walk(path):  # links to directories are listed, not entered
        top = os.path.relpath(root, path).split(os.sep)[0]
        for name in dirs + files:
            full = os.path.join(root, name)
            st = os.lstat(full)
            mode = st.st_mode
            if stat.S_ISLNK(mode):
                raise FormatError("a symbolic link inside an orbax checkpoint", file=full,
                                  fix="copy what it points to into the checkpoint: jckpt does "
                                      "not follow links in a checkpoint")
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise FormatError("not a regular file (a FIFO, a device or a socket) inside an "
                                  "orbax checkpoint", file=full, fix="the checkpoint is damaged")
            if stat.S_ISREG(mode):
                group = name if top == os.curdir else top
                sizes[group] = sizes.get(group, 0) + st.st_size
                if name in ('.zarray', 'zarr.json'):
                    zarrays.append((group, full))
    total = sum(sizes.values())
    for group, z in zarrays:
        _check_claim(zarray_claim(z), sizes[group] if group in items else total, z)
    return [total, *(sizes.get(n, 0) for n in items)]


def _check_claim(nbytes: int, total: int, file: str) -> None:
    """Refuse arrays of `nbytes` from a checkpoint of `total` bytes of files that could not
    hold them (a decompression bomb, or damaged metadata) and that would take more than half
    this machine's memory. tensorstore stores no chunk that is all fill value: an array of
    zeros (an optimizer's moments at step 0) takes no file at all, yet is a checkpoint."""
    if nbytes > MAX_DECOMPRESSION_RATIO * total + (1 << 20) and nbytes > memory_bytes() // 2:
        raise FormatError(f"arrays of {nbytes} bytes claimed by a checkpoint of {total} bytes "
                          f"(more than {MAX_DECOMPRESSION_RATIO} times), more than half this "
                          f"machine's memory ({memory_bytes()} bytes)", file=file,
                          fix="the checkpoint's metadata is damaged; do not read it (or read it "
                              "on a machine with the memory its arrays need)")


def _key_name(key: Any) -> str:
    """One element of orbax's parameter name of a leaf (its key path joined by `.`)."""
    for attr in ('key', 'idx', 'name'):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _key_impls(item: str) -> dict[str, str]:
    """`{parameter name: PRNG implementation}` for the typed keys orbax stored in `item`.

    orbax keeps a typed key's implementation in the item's array metadata
    (`array_metadatas/process_<n>`, JSON); anything missing or unreadable
    there means no keys (their data then reads as plain integers).
    """
    found: dict[str, str] = {}
    folder = os.path.join(item, 'array_metadatas')
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return found
    for name in names:
        try:
            records = small_json(os.path.join(folder, name)).get('array_metadatas', [])
            for record in records:
                meta = record.get('array_metadata', {})
                impl = (meta.get('ext_metadata') or {}).get('random_key_impl')
                if isinstance(impl, str) and isinstance(meta.get('param_name'), str):
                    found[meta['param_name']] = impl
        except (OSError, ValueError, AttributeError, TypeError):
            continue
    return found


def _host_or_key(impls: dict[str, str]):
    """The function that turns each restored leaf into a host array, or a key where orbax
    stored one."""
    import jax

    def convert(keypath: Any, leaf: Any) -> Any:
        impl = impls.get('.'.join(_key_name(k) for k in keypath))
        if impl is None:
            return np.asarray(leaf)
        return jax.random.wrap_key_data(np.asarray(leaf), impl=impl)
    return convert


def _is_string(metadata: Any) -> bool:
    """Whether orbax's metadata of a leaf is a string's (kept in `_strings.json`, not an array)."""
    return type(metadata).__name__ == 'StringMetadata'


def _without_strings(tree: Any, item: str) -> Any:
    """`tree` with its string leaves left out (they are not arrays), with a warning naming them."""
    import jax

    found = [kp for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if isinstance(leaf, str)]
    if not found:
        return tree
    names = ['.'.join(_key_name(k) for k in kp) for kp in found]
    warnings.warn(f"{item}: orbax string leaves {names[:5]}{' ...' if len(names) > 5 else ''} "
                  "are not arrays and are left out (orbax's restore reads them)", stacklevel=2)
    return jax.tree_util.tree_map(lambda leaf: None if isinstance(leaf, str) else leaf, tree)


def read_item(item: str, checked: int | None = None) -> Any:
    """One item directory's tree: host numpy arrays, and typed PRNG keys as keys. `checked`:
    the bytes of files of a directory holding the item that `check_tree` has passed (the
    item is then not walked again), else None."""
    if os.path.lexists(os.path.join(item, _JCKPT_ITEM)) and not os.path.exists(
            os.path.join(item, '_METADATA')):
        from jckpt.adapters import native
        single = os.path.join(item, _JCKPT_ITEM)
        if not inside(item, single):
            raise FormatError(f"{_JCKPT_ITEM} is a symbolic link or lies outside its item",
                              file=single, fix="put the file itself in the item directory")
        return native.read(single).get(DEFAULT_NAMESPACE, {})
    specs = item_specs(item)  # what the metadata says, checked before tensorstore allocates it
    if specs:
        _check_claim(sum(math.prod(shape) * dtype.itemsize for _, shape, dtype, _ in specs),
                     check_tree(item)[0] if checked is None else checked, item)
    ocp = import_orbax()
    import jax
    checkpointer = ocp.PyTreeCheckpointer()
    item = os.path.abspath(item)  # orbax wants absolute paths
    try:
        with _quiet():
            metadata = _metadata(item)
            tree = getattr(metadata, 'item_metadata', metadata)
            tree = getattr(tree, 'tree', tree)
            restore_args = jax.tree_util.tree_map(  # a string leaf is restored as orbax stored it
                lambda m: ocp.RestoreArgs(restore_type=str if _is_string(m) else np.ndarray), tree)
            restored = _without_strings(checkpointer.restore(item, args=ocp.args.PyTreeRestore(
                restore_args=restore_args)), item)
    except FormatError:
        raise
    except Exception as e:  # orbax and tensorstore raise many types for damaged data
        raise FormatError(f"orbax could not read this PyTree checkpoint "
                          f"({type(e).__name__}: {str(e)[:300]})", file=item,
                          fix="the checkpoint is incomplete or damaged") from None
    try:
        return jax.tree_util.tree_map_with_path(_host_or_key(_key_impls(item)), restored)
    except (TypeError, ValueError) as e:  # key data that does not fit its implementation
        raise FormatError(f"orbax's PRNG key data cannot be rebuilt as keys: {e}", file=item,
                          fix="the checkpoint's array metadata is damaged") from None


def read(path: str) -> dict[str, Any]:
    """An orbax item or step directory as `{namespace: subtree}` of host numpy arrays."""
    return {ns: read_item(item, checked) for ns, item, checked in checked_items(path)}


def read_with_metadata(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """`(read(path), json_metadata(path))`, the step's files walked and checked once (not
    once for the step and again for each item), for `convert` and `jckpt inspect`."""
    return read(path), json_metadata(path)


def checked_items(path: str, *, per_item: bool = False) -> list[tuple[str, str, int]]:
    """`[(namespace, item directory, checked bytes)]` of an orbax item (`jckpt`) or step
    directory (one per item), its files walked and checked once (`check_tree`).

    The checked bytes are what bounds the sizes an item claims (`read_item`'s `checked`):
    the step's, or with `per_item` each item's own, against which its `.zarray` files are
    then checked too, as `check_tree` of the item alone would. A `CheckpointManager` root,
    or a directory with no item, is a `FormatError` naming a step to pass instead.
    """
    path = os.fspath(path)
    backend_for(path)  # a URL of an unsupported scheme is refused, never read as a local path
    _refuse_url(path)
    if not os.path.isdir(path):
        raise FormatError("an orbax checkpoint is a directory", file=path,
                          fix="pass the step or item directory")
    item = _is_item(path)
    names = [] if item else _items(path)
    total, *own = check_tree(path, names if per_item else ())
    bound = dict(zip(names, own))
    if item:
        return [(DEFAULT_NAMESPACE, path, total)]
    if not names:
        steps = _steps(path)
        raise FormatError("directory holds no orbax checkpoint item", file=path,
                          fix=f"pass one step's directory, e.g. {os.path.join(path, steps[-1])}"
                          if steps else "pass an orbax step or item directory")
    bad = [n for n in names if not NAMESPACE_RE.match(n)]
    if bad:
        raise FormatError(f"item names {bad} are not valid namespaces", file=path,
                          fix="pass the item's own directory to read it alone")
    return [(n, os.path.join(path, n), bound.get(n, total)) for n in names]


def _metadata(item: str) -> Any:
    """orbax's metadata of a PyTree item, asked once per version of its `_METADATA` file: it
    costs a second or more for a few thousand leaves, and opening, checking and reading an
    item each asked for it (three times a restore)."""
    path = os.path.abspath(item)
    st = os.stat(os.path.join(path, '_METADATA'))
    return _metadata_of(path, st.st_mtime_ns, st.st_size, st.st_ino)


@functools.lru_cache(maxsize=4)
def _metadata_of(path: str, *version: int) -> Any:
    with _quiet():
        return import_orbax().PyTreeCheckpointer().metadata(path)


def item_specs(item: str) -> list[tuple[Any, tuple[int, ...], np.dtype, str | None]] | None:
    """`[(JAX key path, shape, dtype, PRNG implementation or None)]` of an orbax PyTree item,
    from its metadata alone (no array is read); None for an item jckpt saved (a jckpt file)
    or metadata that cannot be read (the caller then reads the item)."""
    if not os.path.exists(os.path.join(item, '_METADATA')):
        return None
    import_orbax()  # orbax missing: an InputError saying what to install
    import jax

    try:
        metadata = _metadata(item)
        tree = getattr(getattr(metadata, 'item_metadata', metadata), 'tree', None)
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0] if tree is not None else None
        impls = _key_impls(item)
        return None if leaves is None else [
            (kp, tuple(int(d) for d in m.shape), np.dtype(m.dtype),
             impls.get('.'.join(_key_name(k) for k in kp))) for kp, m in leaves
            if not _is_string(m)]  # strings are not arrays (read_item leaves them out)
    except Exception:  # metadata orbax cannot give: read the item instead
        return None


def json_metadata(path: str) -> dict[str, str]:
    """A step's JSON items as `{ORBAX_JSON_KEY: '{"item": value, ...}'}`; `{}` when it has none.

    A JSON item is a directory of the step that holds orbax's `metadata` file
    and no PyTree; one that is not valid JSON is a `FormatError` naming it.
    """
    path = os.fspath(path)
    if _is_item(path) or not os.path.isdir(path):
        return {}
    found: dict[str, Any] = {}
    for name in sorted(os.listdir(path)):
        item = os.path.join(path, name)
        single = os.path.join(item, _JSON_ITEM)
        if not os.path.isdir(item) or _is_item(item) or not os.path.isfile(single):
            continue
        if not inside(item, single) or os.path.getsize(single) > _MAX_JSON_BYTES:
            raise FormatError(f"JSON item {name!r} is a link outside its item or over "
                              f"{_MAX_JSON_BYTES} bytes", file=single,
                              fix="keep the item's JSON small and inside its directory")
        try:
            found[name] = small_json(single, _MAX_JSON_BYTES)
        except (OSError, ValueError) as e:
            raise FormatError(f"JSON item {name!r} cannot be read: {e}", file=single,
                              fix="the step is damaged; save it again") from None
    return {ORBAX_JSON_KEY: strict_json.dumps(found, sort_keys=True)} if found else {}
