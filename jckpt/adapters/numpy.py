"""numpy `.npy` and `.npz` files, read and written without pickle.

`.npy` holds one array: it reads as `{'jckpt': array}` and a tree holding
exactly one leaf writes as that array. `.npz` holds named arrays: members are
named by key path joined with `.` (`params.dense.kernel.npy`) and the
exact paths and namespaces travel as JSON in the archive's comment, with the
nodes without arrays (optax's `EmptyState`, `None`, empty containers; they read as
`None`), so a tree comes back with its structure; an archive without that record
(from `np.savez`) reads as `{'jckpt': {name: array}}`.

ml_dtypes types (bfloat16, the float8s, int4, ...) are written with their
names as the `descr` (`'bfloat16'`), which `np.load` reads whenever
ml_dtypes is imported; `np.save` itself writes them as raw `'<V2'` bytes,
which this reader refuses with a message saying so. Object arrays (pickles)
are refused. Stored members and `.npy` files are mapped, not copied, when
their data is aligned (jckpt aligns what it writes to 64 bytes).

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), 'a.npz')
>>> write_npz({'jckpt': {'w': np.arange(4, dtype=np.int32), 'opt': [np.zeros(2)]}}, path)
>>> tree = read_npz(path)['jckpt']
>>> tree['w'].tolist(), tree['opt'][0].tolist()
([0, 1, 2, 3], [0.0, 0.0])
>>> sorted(np.load(path).files)
['opt.0', 'w']
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import itertools
import math
import os
import struct
import warnings
import zipfile
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np

from jckpt.adapters import _zip
from jckpt.adapters._common import (
    DEFAULT_NAMESPACE,
    abstract_items,
    array_view,
    check_namespaced,
    empty_record,
    flat_names,
    host_items,
    map_file,
    paths_json,
    published,
    tree_from_names,
    unsafe_member_name,
    warn_empty_namespaces,
    warn_key_data,
)
from jckpt.errors import FormatError, InputError
from jckpt.format import limits
from jckpt.format.entries import path_name
from jckpt.format.metadata import empty_nodes_table
from jckpt.format.payload import iter_payload_chunks, stored_dtype
from jckpt.format.sniff import ZIP_LOCAL

MAGIC = b'\x93NUMPY'
#: Longest .npy header read (numpy's own writer stays far below: a shape and a dtype).
MAX_NPY_HEADER = 1 << 20
_COMMENT_TAG = b'jckpt-paths:'
#: What follows the paths record in the comment when the tree has nodes without arrays.
_EMPTY_TAG = '\njckpt.empty_nodes:'
_ML_NAMES = {np.dtype(getattr(ml_dtypes, n)).name for n in (
    'bfloat16', 'float8_e5m2', 'float8_e4m3fn', 'float8_e4m3fnuz', 'float8_e5m2fnuz',
    'float8_e4m3b11fnuz', 'float8_e3m4', 'float8_e4m3', 'float8_e8m0fnu', 'float4_e2m1fn',
    'int4', 'uint4', 'int2', 'uint2')}


# --- .npy -------------------------------------------------------------------

def _dtype_from_descr(descr: Any, file: str, entry: str | None) -> np.dtype:
    if not isinstance(descr, str):
        raise FormatError(f"structured dtype {descr!r} is not supported", file=file, entry=entry,
                          fix="store plain arrays")
    if descr in _ML_NAMES:
        return np.dtype(descr)
    try:
        dtype = np.dtype(descr)
    except (TypeError, ValueError, SyntaxError, OverflowError, RecursionError):
        # numpy parses comma strings such as '<f8,02' with ast: a damaged descr raises any of these
        raise FormatError(f"unknown dtype {descr!r}", file=file, entry=entry,
                          fix="the file is damaged or uses a dtype jckpt does not know") from None
    if dtype.hasobject:
        raise FormatError("object arrays are pickles and are refused", file=file, entry=entry,
                          fix="save numeric arrays (np.save(..., allow_pickle=False))")
    if dtype.kind == 'V':
        raise FormatError(f"raw bytes dtype {descr!r}: np.save writes ml_dtypes arrays "
                          "(bfloat16, float8, ...) this way and loses their type", file=file,
                          entry=entry, fix="re-save it with jckpt's npy writer, or view the array "
                                           "as its real dtype before saving")
    return dtype


def _npy_header(buffer, offset: int, length: int, file: str, entry: str | None
                ) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """`(dtype, shape, fortran_order, data start)` of the `.npy` bytes at `offset`."""
    def bad(msg: str) -> FormatError:
        return FormatError(msg, file=file, entry=entry, fix="the file is truncated or not .npy")
    if length < 10 or bytes(buffer[offset:offset + 6]) != MAGIC:
        raise bad("not a .npy array (no \\x93NUMPY magic)")
    major = buffer[offset + 6]
    if major == 1:
        (hlen,) = struct.unpack_from('<H', buffer, offset + 8)
        start = offset + 10
    elif major in (2, 3):
        if length < 12:
            raise bad(".npy header is truncated")
        (hlen,) = struct.unpack_from('<I', buffer, offset + 8)
        start = offset + 12
    else:
        raise bad(f"unsupported .npy version {major}")
    if start + hlen > offset + length or hlen > MAX_NPY_HEADER:
        raise bad(".npy header extends past the end of the data")
    try:
        text = bytes(buffer[start:start + hlen]).decode('utf-8' if major == 3 else 'latin1')
        header = ast.literal_eval(text)
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        raise bad(".npy header is not a Python dict literal") from None
    if not (isinstance(header, dict) and set(header) == {'descr', 'fortran_order', 'shape'}):
        raise bad(".npy header must have exactly descr, fortran_order and shape")
    shape, fortran = header['shape'], header['fortran_order']
    if not (isinstance(shape, tuple) and isinstance(fortran, bool)):
        raise bad(f".npy shape {shape!r} / fortran_order {fortran!r} are invalid")
    dtype = _dtype_from_descr(header['descr'], file, entry)
    try:
        shape = limits.check_shape(shape, limits.check_itemsize(dtype).itemsize)
    except ValueError as e:
        raise bad(f".npy header: {e}") from None
    return dtype, shape, fortran, start + hlen


def parse_npy(buffer, offset: int, length: int, file: str, entry: str | None = None) -> np.ndarray:
    """The array of the `.npy` bytes at `buffer[offset:offset+length]` (a view when aligned)."""
    dtype, shape, fortran, data = _npy_header(buffer, offset, length, file, entry)
    count = math.prod(shape)
    if data + count * dtype.itemsize > offset + length:
        raise FormatError(f".npy data of {count * dtype.itemsize} bytes extends past the end of "
                          "the file", file=file, entry=entry, fix="the file is truncated or not .npy")
    if fortran:
        return array_view(buffer, dtype, tuple(reversed(shape)), data, file, entry).T
    return array_view(buffer, dtype, tuple(shape), data, file, entry)


def npy_size(head, file: str, entry: str | None = None) -> int:
    """How many bytes the `.npy` whose first bytes are `head` holds: header plus data.

    `head` needs at most the first 12 + `MAX_NPY_HEADER` bytes; an
    `.npz` reader bounds a compressed member's output by this.
    """
    dtype, shape, _fortran, data = _npy_header(head, 0, len(head), file, entry)
    return data + math.prod(shape) * dtype.itemsize


def _descr(dtype: np.dtype) -> str:
    if dtype.name in _ML_NAMES:
        return dtype.name
    return np.lib.format.dtype_to_descr(dtype)


def npy_header(array: np.ndarray) -> bytes:
    """The `.npy` header of `array` as jckpt writes it (little-endian, C order),
    padded so the data starts at a multiple of 64 bytes."""
    dtype = stored_dtype(array.dtype)
    text = f"{{'descr': {_descr(dtype)!r}, 'fortran_order': False, 'shape': {tuple(array.shape)!r}, }}"
    raw = text.encode('latin1')
    for major, prefix in ((1, 10), (2, 12)):
        total = -(-(prefix + len(raw) + 1) // 64) * 64
        if major == 2 or total - prefix < 1 << 16:
            break
    body = raw + b' ' * (total - prefix - len(raw) - 1) + b'\n'
    size = struct.pack('<H', len(body)) if major == 1 else struct.pack('<I', len(body))
    return MAGIC + bytes([major, 0]) + size + body


def sniff_npy(path: str, head: bytes | None) -> bool:
    return head is not None and head[:6] == MAGIC


def read_npy(path: str) -> dict[str, Any]:
    """A `.npy` file as `{'jckpt': array}` (zero-copy when aligned); one with more bytes after
    its array is refused (`_refuse_trailing`), not read in part."""
    path = os.fspath(path)
    buffer = map_file(path)
    array = parse_npy(buffer, 0, len(buffer), path)
    _refuse_trailing(buffer, npy_size(buffer, path), path)
    return {DEFAULT_NAMESPACE: array}


def _refuse_trailing(buffer: Any, end: int, path: str) -> None:
    """`FormatError` when bytes follow the first array, which `np.load` (and a reader of the
    first array alone) would leave unread: an equinox `tree_serialise_leaves` file, arrays
    `np.save`d one after another to one open file, or a damaged file. Converting one gave
    its first array alone, silently."""
    extra = len(buffer) - end
    if extra <= 0:
        return
    if bytes(buffer[end:end + len(MAGIC)]) == MAGIC:
        raise FormatError(f"the file holds more .npy arrays after its first ({extra} bytes "
                          "more), as equinox's tree_serialise_leaves and np.save to one open "
                          "file write them; a .npy file holds one", file=path,
                          fix="read it with eqx.tree_deserialise_leaves(path, like=model) (or "
                              "np.load once per array from one open file) and jckpt.save the tree")
    raise FormatError(f"{extra} bytes follow the .npy array", file=path,
                      fix="the file is damaged or not .npy: a .npy file holds one array")


#: Whether the code writing an `.npy` file tells of its name's loss itself (`name_loss_told`).
_NAME_LOSS_TOLD: contextvars.ContextVar[bool] = contextvars.ContextVar('npy_name_loss_told',
                                                                       default=False)


@contextlib.contextmanager
def name_loss_told() -> Iterator[None]:
    """Within it (in this thread), `write_npy` does not warn that the array's name is lost: the
    caller reads the file back its own way and says what is true of it (a manager's step: a
    target of one leaf takes the array, `jckpt.services.formats.check_model` warns once),
    where the writer's warning named the staged file and `read_npy`'s namespace.

    >>> import numpy as np, tempfile, os, warnings
    >>> with warnings.catch_warnings(record=True) as caught, name_loss_told():
    ...     warnings.simplefilter('always')
    ...     write_npy({'model': {'w': np.ones(2)}}, os.path.join(tempfile.mkdtemp(), 'm.npy'))
    >>> caught
    []
    """
    token = _NAME_LOSS_TOLD.set(True)
    try:
        yield
    finally:
        _NAME_LOSS_TOLD.reset(token)


def write_npy(tree: Any, path: str) -> None:
    """Write the only leaf of `tree` as a `.npy` file (its name, which the file has no place
    for, named in a warning unless the tree is `{'jckpt': array}`, what `read_npy` gives)."""
    path = os.fspath(path)
    items = host_items(check_namespaced(tree, path), path)
    _one_leaf(items, path)  # refused before the keys are warned of
    warn_key_data(tree, path, 'npy')
    warn_empty_namespaces(tree, {ns for ns, _, _ in items}, path, 'npy')
    ns, key_path, array = items[0]
    if (key_path or ns != DEFAULT_NAMESPACE) and not _NAME_LOSS_TOLD.get():  # read_npy: {'jckpt': array}
        warnings.warn(f"{path}: entry {ns}/{path_name(key_path) or '<root>'}: an .npy file holds one array "
                      f"and no name, so it reads back as the array of namespace "
                      f"{DEFAULT_NAMESPACE!r}, not under this name (write an .npz file to keep "
                      "it)", stacklevel=2)
    with published(path) as f:
        f.write(npy_header(array))
        for chunk in iter_payload_chunks(array):
            f.write(chunk)


# --- .npz -------------------------------------------------------------------

def sniff_npz(path: str, head: bytes | None) -> bool:
    if head is None or head[:4] not in (ZIP_LOCAL, _zip.ZIP_END):
        return False
    with zipfile.ZipFile(_zip.zip_source(path)) as zf:
        return all(n.endswith('.npy') for n in zf.namelist())


def read_npz(path: str) -> dict[str, Any]:
    """An `.npz` archive as `{namespace: subtree}` (zero-copy for aligned stored members)."""
    path = os.fspath(path)
    buffer = map_file(path)
    budget = _zip.Budget(len(buffer))
    with _zip.open_zip(path, buffer) as zf:
        arrays: dict[str, np.ndarray] = {}
        for info in zf.infolist():
            if info.filename.endswith('/'):  # a folder (`is_dir` fails on an empty name)
                continue
            if not info.filename.endswith('.npy'):
                raise FormatError(f"archive member {info.filename!r} is not a .npy array",
                                  file=path, fix="an .npz archive holds only .npy members")
            name = info.filename[:-4]
            if name in arrays:
                raise FormatError(f"archive holds {info.filename!r} twice", file=path,
                                  fix="the archive is damaged")
            arrays[name] = _npz_member(zf, buffer, info, path, name, budget)
        comment = zf.comment
    record, empty = None, None
    if comment.startswith(_COMMENT_TAG):
        record, _, empty = comment[len(_COMMENT_TAG):].decode('utf-8', 'replace').partition(
            _EMPTY_TAG)
    return tree_from_names(arrays, record, empty=empty or None)


def _npz_member(zf, buffer, info, path: str, name: str, budget: _zip.Budget) -> np.ndarray:
    """One member's array: a view of a stored member, else decompressed to at most the bytes
    its `.npy` header says it holds (a member that says little and expands a lot is refused)."""
    if info.compress_type == zipfile.ZIP_STORED:
        _zip.member_bytes(zf, buffer, info, path)  # its CRC-32
        start, length = _zip.member_span(buffer, info, path)
        return parse_npy(buffer, start, length, path, name)
    first = bytes(_zip.member_head(buffer, info, path, 12))  # magic, version, header length
    length = 12
    if first[6:7] == b'\x01' and len(first) >= 10:
        length = 10 + struct.unpack_from('<H', first, 8)[0]
    elif first[6:7] in (b'\x02', b'\x03') and len(first) >= 12:
        length = 12 + struct.unpack_from('<I', first, 8)[0]
    head = _zip.member_head(buffer, info, path, min(length, 12 + MAX_NPY_HEADER))
    need = npy_size(head, path, name)
    data = _zip.member_bytes(zf, buffer, info, path, limit=need, budget=budget)
    return parse_npy(data, 0, len(data), path, name)


def _one_leaf(items: list, path: str) -> None:
    if len(items) != 1:
        raise InputError(f".npy holds exactly one array; the tree has {len(items)} leaves",
                         file=path, fix="write an .npz archive instead")


def _member_names(items: list, path: str) -> list[str]:
    """The items' archive names: distinct, and none a member `read_npz` would refuse."""
    names = flat_names(items, path)
    for (ns, key_path, _), name in zip(items, names):
        if unsafe_member_name(name + '.npy'):  # read_npz refuses such members, as np.load may not
            raise InputError(f"leaf name {name!r} would be the unsafe archive member "
                             f"{name + '.npy'!r} (absolute or with '..')", file=path,
                             entry=f"{ns}/{path_name(key_path)}",
                             fix="rename the leaf, or convert to .jckpt or .safetensors")
    return names


def check_npy(tree: Any, path: str) -> None:
    """Refuse a tree `write_npy` cannot hold (not one leaf), reading no data."""
    _one_leaf(abstract_items(tree, path), path)


def check_npz(tree: Any, path: str) -> None:
    """Refuse a tree `write_npz` cannot hold (names alike or unsafe), or whose key paths its
    comment cannot record (what a manager's step would not restore into), reading no data."""
    items = abstract_items(tree, path)
    names = _member_names(items, path)
    size = len(_COMMENT_TAG) + len(paths_json(items, names, path).encode('utf-8'))
    if size > 0xFFFF and not _reads_back_flat(items, names):
        ns, first, _ = items[0]
        raise InputError(f"the record of the tree's {len(items)} key paths takes {size:,} bytes, "
                         "more than the 65,535 an .npz comment holds: the file would read back "
                         "with flat names, not this tree", file=path,
                         entry=f"{ns}/{path_name(first)}",
                         fix="write the model as a .safetensors or .jckpt file")


def _reads_back_flat(items: list, names: list[str]) -> bool:
    """Whether the tree is a flat dict of its member names (a `state_dict`), which an archive
    without the paths record reads back as it was."""
    return all(len(p) == 1 and tuple(p[0]) == ('k', name) for (_, p, _), name in zip(items, names))


def write_npz(tree: Any, path: str) -> None:
    """Write `{namespace: subtree}` as an uncompressed `.npz` archive (members 64-byte aligned)."""
    path = os.fspath(path)
    items = host_items(check_namespaced(tree, path), path)
    names = _member_names(items, path)  # refused before the keys are warned of
    warn_key_data(tree, path, 'npz')
    record = _comment(paths_json(items, names, path), empty_record(tree), path,
                      _reads_back_flat(items, names))
    with published(path) as f, zipfile.ZipFile(f, 'w', zipfile.ZIP_STORED,
                                               allowZip64=True) as zf:
        for (_, _, array), name in zip(items, names):
            header = npy_header(array)
            # one chunk at a time: a strided array's chunks are copies (a list held them all)
            chunks = itertools.chain([header], iter_payload_chunks(array))
            _zip.write_member(zf, name + '.npy', chunks, len(header) + array.nbytes)
        zf.comment = record


def _comment(paths: str, empty: str | None, path: str, flat: bool = False) -> bytes:
    """The archive comment recording the tree's structure: `jckpt-paths:` and the paths
    record, then, when the tree has nodes without arrays, a line `jckpt.empty_nodes:` and
    their record (a reader of the paths alone reads up to it). A zip comment holds at most
    65,535 bytes: past that, what does not fit is left out with a warning (names stay flat
    without the paths; the nodes without arrays are dropped)."""
    record = _COMMENT_TAG + paths.encode('utf-8')
    if len(record) > 0xFFFF and not flat:
        warnings.warn(f"{path}: the record of the tree's key paths takes {len(record):,} bytes, "
                      "more than the 65,535 an .npz comment holds: it is left out, and the file "
                      "reads back with flat names ('a.b'), not the tree (to keep it, write a "
                      ".safetensors or .jckpt file)", stacklevel=3)
    if len(record) > 0xFFFF:
        record = b''
    if empty is not None:
        whole = record + (_EMPTY_TAG + empty).encode('utf-8')
        if record and len(whole) <= 0xFFFF:
            return whole
        ns, paths = next(iter(empty_nodes_table(empty).items()))
        first = paths[0]
        warnings.warn(f"{path}: entry {ns}/{path_name(first) or '<root>'} and the tree's other "
                      "nodes without arrays are left out: the .npz comment, where jckpt records "
                      "them, holds at most 65,535 bytes, so this file reads back without them "
                      "(to keep them, write a .safetensors or .jckpt file)", stacklevel=3)
    return record


def register() -> None:
    from jckpt.adapters import register_format

    register_format('npy', read=read_npy, write=write_npy, sniff=sniff_npy, check=check_npy,
                    extensions=('.npy',), replace=True)
    register_format('npz', read=read_npz, write=write_npz, sniff=sniff_npz, check=check_npz,
                    extensions=('.npz',), replace=True)
