"""PyTorch `torch.save` files (`.pt`, `.pth`), read and written without importing torch.

A `torch.save` file is an uncompressed zip with one root folder holding
`data.pkl` (the pickled structure, tensors as references to storages),
`data/<key>` (each storage's raw bytes, 64-byte aligned) and `byteorder`.
Reading maps the archive and unpickles `data.pkl` with an allow-list
(`jckpt.adapters._torch_unpickle`): any global but the tensor rebuild functions,
storage types, dtypes and `OrderedDict` (`os.system`, a model class, ...) is
refused with `FormatError` before anything is called, so a malicious file
cannot run code. Tensors come back as numpy views of the mapped storages
(shared storages stay shared), parameters as their data; ints, floats, bools
and strings as themselves. A legacy file (`_use_new_zipfile_serialization=False`)
is read the same way (`jckpt.adapters._torch_legacy`).

Writing emits the same archive and a pickle that uses only what
`torch.load(..., weights_only=True)` accepts (no torch needed).

Tree form: what is written is a flat `state_dict`, each leaf under its key
path joined by `.`, with the exact paths and the nodes without arrays (an optax
`EmptyState`, `None`, empty containers) recorded in the archive so reading gives the
tree back, those nodes as `None` (`write(..., flat=False)` pickles the tree as it is).
A file without that record reads as `{'jckpt': obj}`, the pickled object as
it is; `read(path, nest=True)` splits its dotted keys into nested dicts.

>>> import numpy as np, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), 'm.pt')
>>> write({'jckpt': {'dense': {'w': np.arange(4, dtype=np.float32)}, 'epoch': 3}}, path)
>>> sorted(read(path)['jckpt'])
['dense', 'epoch']
>>> tree = read(path)['jckpt']
>>> tree['dense']['w'].tolist(), tree['epoch']
([0.0, 1.0, 2.0, 3.0], 3)
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from typing import Any

import numpy as np

from jckpt.adapters import _torch_legacy, _zip
from jckpt.adapters._common import (
    DEFAULT_NAMESPACE,
    abstract_items,
    check_namespaced,
    empty_record,
    flat_name,
    flat_names,
    inside,
    map_file,
    nest_dotted,
    paths_json,
    published,
    record_covers,
    refuse_dtypes,
    single_content,
    tree_from_names,
    unsafe_member_name,
    warn_key_data,
)
from jckpt.adapters._torch_legacy import LEGACY_MAGIC
from jckpt.adapters._torch_pickle import Pickler, has_torch_dtype
from jckpt.adapters._torch_scalars import SCALARS_KEY, scalar_record, with_scalars
from jckpt.adapters._torch_unpickle import StorageType, to_tree, unpickle
from jckpt.adapters.hf_index import shard_path, weight_map
from jckpt.errors import CheckpointError, FormatError, InputError
from jckpt.format.limits import json_loads
from jckpt.format.payload import iter_payload_chunks
from jckpt.format.sniff import ZIP_LOCAL
from jckpt.storage.backend import is_url
from jckpt.storage.regular import open_regular

# --- reading ----------------------------------------------------------------

def _root(zf: zipfile.ZipFile, path: str) -> str:
    names = zf.namelist()
    pkls = [n for n in names if n.split('/')[-1] == 'data.pkl' and n.count('/') <= 1]
    if len(pkls) != 1:
        raise FormatError("archive holds no single <root>/data.pkl", file=path,
                          fix="pass a file written by torch.save")
    root = pkls[0][:-len('data.pkl')]
    if root + 'constants.pkl' in names or any(n.startswith(root + 'code/') for n in names):
        raise FormatError("a TorchScript archive (torch.jit.save), which holds code, not a "
                          "torch.save file", file=path,
                          fix="save its weights in torch: torch.save(torch.jit.load(path)"
                              ".state_dict(), 'weights.pt')")
    return root


def sniff(path: str, head: bytes | None) -> bool:
    if head is not None and head.startswith(LEGACY_MAGIC):
        return True
    if head is not None and head[:1] == b'{' and b'"weight_map"' in head:
        return _shard_names(path) is not None
    if head is None or head[:4] != ZIP_LOCAL:
        return False
    with zipfile.ZipFile(_zip.zip_source(path)) as zf:
        return any(n.endswith('/data.pkl') and n.count('/') == 1 for n in zf.namelist())


def read(path: str, *, nest: bool = False) -> dict[str, Any]:
    """A `torch.save` file as `{'jckpt': obj}`, tensors as numpy views; no code runs.

    A file `write` made gives back the tree it was written from (its recorded key
    paths). Another file's object comes back as pickled. With `nest=True` the dotted
    keys of its dicts are split into nested dicts, so a `state_dict` reads as the tree a
    JAX model holds (`{'dense.kernel': k}` as `{'dense': {'kernel': k}}`).

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), 'sd.pt')
    >>> write({'jckpt': {'dense.kernel': np.ones(2, np.float32)}}, path)
    >>> list(read(path)['jckpt']), list(read(path, nest=True)['jckpt']['dense'])
    (['dense.kernel'], ['kernel'])
    """
    path = os.fspath(path)
    return _namespaced(*_read_parts(path)[:2], path, nest)


def read_with_metadata(path: str, *, nest: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
    """`(read(path, nest=nest), read_metadata(path))` from one reading of the file (a
    `.pt` file is parsed whole for either, so `convert` and `jckpt inspect` read it once)."""
    path = os.fspath(path)
    tree, records, text = _read_parts(path)
    return _namespaced(tree, records, path, nest), _metadata(tree, records, text, path)


#: A file's records of the tree it was written from: its paths record (`PATHS_MEMBER`) and
#: the record of its nodes without arrays (`EMPTY_MEMBER`), each None where the file has none.
Records = tuple[str | None, str | None]


def _read_parts(path: str) -> tuple[Any, Records, str | None]:
    """The tree a file (or a sharded index's shards: flat, no record) holds, its records
    and its metadata's JSON (None: none)."""
    shards = _shard_names(path) if path.endswith('.json') else None
    return (_read_sharded(path, shards), (None, None), None) if shards else _read_file(path)


def _namespaced(tree: Any, records: Records, path: str, nest: bool) -> dict[str, Any]:
    """`{namespace: subtree}` of what a file holds (see `read`)."""
    out = (tree_from_names(tree, records[0], empty=records[1]) if _recorded(tree, records)
           else {DEFAULT_NAMESPACE: tree})
    return {ns: nest_dotted(sub, path) for ns, sub in out.items()} if nest else out


#: How torch shards' names end (`pytorch_model-00001-of-00002.bin`).
_SHARD_ENDINGS = ('.bin', '.pt', '.pth')


def _shard_names(path: str) -> dict[str, str] | None:
    """A Hugging Face index's `weight_map` (tensor name -> shard file), when `path` is the
    index of torch shards (`pytorch_model.bin.index.json`); None for another file."""
    if is_url(path):
        return None
    try:
        found = weight_map(path)
    except CheckpointError:
        return None
    if not found or any(unsafe_member_name(v) for v in found.values()):
        return None
    directory = os.path.dirname(os.path.abspath(path))
    shard = os.path.join(directory, min(found.values()))
    if not os.path.lexists(shard) and all(v.endswith(_SHARD_ENDINGS) for v in found.values()):
        return found  # a torch index whose shards are missing: reading it names them
    try:
        if not inside(directory, shard):
            return None
        with open_regular(shard) as f:
            head = f.read(len(LEGACY_MAGIC))
    except (OSError, CheckpointError):
        return None
    return found if head[:4] == ZIP_LOCAL or head == LEGACY_MAGIC else None


def _read_sharded(path: str, weight_map: dict[str, str]) -> dict[str, Any]:
    """The flat `state_dict` of a sharded torch checkpoint, each tensor from the shard the
    index names (shards must lie beside the index)."""
    out: dict[str, Any] = {}
    names: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        names.setdefault(shard, []).append(name)
    for shard in sorted(names):
        tree = _read_file(shard_path(path, shard))[0]
        for name in names[shard]:
            if not isinstance(tree, dict) or name not in tree:
                raise FormatError(f"the index places {name!r} in {shard}, which lacks it",
                                  file=path, entry=name, fix="the shards are incomplete")
            out[name] = tree[name]
    return out


def read_metadata(path: str) -> dict[str, str]:
    """The string pairs a file `write` made keeps (a jckpt file's metadata), and
    `{LAYOUT_KEY: 'nested'}` for a file holding more than a flat `state_dict` (a checkpoint
    dict, an optimizer's), and where its Python numbers and tuples are (`SCALARS_KEY`): `convert`
    hands them on, so such a file converted to jckpt and back, or to another `.pt` file,
    keeps its structure, its numbers (not 0-d tensors) and its tuples."""
    return read_with_metadata(path)[1]


def _metadata(tree: Any, records: Records, text: str | None, path: str) -> dict[str, str]:
    """`read_metadata` of a file holding `tree`, its `records` and metadata JSON `text`."""
    try:
        meta = json_loads(text) if text is not None else {}
    except ValueError:
        meta = None
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise FormatError(f"archive member {METADATA_MEMBER} is not a JSON object of strings",
                          file=path, fix="the file is damaged")
    if _recorded(tree, records):
        return meta
    if not (isinstance(tree, dict) and not any(isinstance(v, (dict, list, tuple))
                                               for v in tree.values())):
        meta[LAYOUT_KEY] = 'nested'
    numbers = scalar_record(tree)
    if numbers is not None:
        meta[SCALARS_KEY] = numbers
    return meta


def _recorded(tree: Any, records: Records) -> bool:
    """Whether the records rebuild `tree` (a flat dict written by `write`; an empty one
    reads as `{'jckpt': {}}`, as it did, unless it records nodes without arrays)."""
    return isinstance(tree, dict) and (bool(tree) or records[1] is not None) \
        and record_covers(records[0], tree)


def _read_file(path: str) -> tuple[Any, Records, str | None]:
    """The tree a file holds, its records and its metadata's JSON (None: none)."""
    buffer = map_file(path)
    if bytes(buffer[:len(LEGACY_MAGIC)]) == LEGACY_MAGIC:
        return _torch_legacy.read(buffer, path), (None, None), None
    return _read_zip(buffer, path)


def _read_zip(buffer: Any, path: str) -> tuple[Any, Records, str | None]:
    """The tree a zip `torch.save` file holds, its records and metadata (None: none)."""
    budget = _zip.Budget(len(buffer))
    with _zip.open_zip(path, buffer) as zf:
        root = _root(zf, path)
        infos = {i.filename: i for i in zf.infolist()}
        # torch.serialization.set_crc32_options(False) writes every CRC-32 as 0: none to check
        crc = any(i.CRC for i in infos.values())
        order = bytes(_zip.member_bytes(zf, buffer, infos[root + 'byteorder'], path, limit=16,
                                        budget=budget, check_crc=crc)).decode(
            'ascii', 'replace').strip() if root + 'byteorder' in infos else 'little'
        if order not in ('little', 'big'):
            raise FormatError(f"unknown byteorder {order!r}", file=path, fix="the file is damaged")
        cache: dict[str, np.ndarray] = {}

        def storage(kind: StorageType, key: str, numel: int) -> np.ndarray:
            name = f"{root}data/{key}"
            info = infos.get(name)
            if info is None or '/' in key or key in ('', '.', '..'):
                raise ValueError(f"storage {key!r} is not in the archive")
            if name not in cache:
                data = _zip.member_bytes(zf, buffer, info, path, budget=budget, check_crc=crc)
                cache[name] = np.frombuffer(data, dtype=np.uint8)
            raw = cache[name]
            dtype = np.dtype(np.uint8) if kind.dtype is None else kind.dtype
            if order == 'big':
                dtype = dtype.newbyteorder('>')
            if numel * dtype.itemsize > raw.size:
                raise ValueError(f"storage {key!r} holds {raw.size} bytes, fewer than "
                                 f"{numel} x {dtype.itemsize}")
            return raw[:numel * dtype.itemsize].view(dtype)

        pickled = bytes(_zip.member_bytes(zf, buffer, infos[root + 'data.pkl'], path,
                                          budget=budget, check_crc=crc))
        obj = unpickle(io.BytesIO(pickled), storage, path)
        record, empty, meta = (_text(zf, buffer, infos.get(root + name), path, budget)
                               for name in (PATHS_MEMBER, EMPTY_MEMBER, METADATA_MEMBER))
    return to_tree(obj, len(pickled), len(buffer), path), (record, empty), meta


def _text(zf: zipfile.ZipFile, buffer: Any, info: zipfile.ZipInfo | None, path: str,
          budget: _zip.Budget) -> str | None:
    if info is None:
        return None
    return bytes(_zip.member_bytes(zf, buffer, info, path, budget=budget)).decode('utf-8', 'replace')


#: The archive member (beside `data.pkl`) recording each flat name's namespace and key path.
PATHS_MEMBER = '.data/jckpt_paths.json'
#: The archive member recording the nodes without arrays of a flat file's tree (an optax
#: `EmptyState`, `None`, empty containers), as a jckpt file records them (`EMPTY_NODES_KEY`).
EMPTY_MEMBER = '.data/jckpt_empty_nodes.json'
#: The archive member holding the string pairs `write(..., metadata=)` was given.
METADATA_MEMBER = '.data/jckpt_metadata.json'
#: The metadata key saying a file holds more than a flat `state_dict` (see `read_metadata`).
LAYOUT_KEY = 'torch.layout'


def _flat_items(node: Any, prefix: tuple, out: list) -> None:
    """`(key path, leaf)` pairs of `node` in its own order (a dict's insertion order, as a
    `state_dict`'s); nodes other than plain dicts, lists and tuples through JAX."""
    if type(node) is dict:
        for k, v in node.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise InputError(f"dict key {k!r} cannot be saved", entry=_name(prefix) or None,
                                 fix="use str or int keys")
            _flat_items(v, (*prefix, ('k' if isinstance(k, str) else 'ki', k)), out)
    elif type(node) in (list, tuple):
        for i, v in enumerate(node):
            _flat_items(v, (*prefix, ('i', i)), out)
    elif node is not None:
        from jckpt.trees import pytree  # JAX: a custom node (a dataclass, a FrozenDict)

        out.extend(((*prefix, *p), leaf) for p, leaf in pytree.flatten(node))


def _name(path: tuple) -> str:
    return '/'.join(str(v) for _, v in path)


def _content(tree: Any, path: str, flat: bool) -> tuple[Any, Records]:
    """What is pickled (the tree, or `{dotted name: leaf}`) and, of a flat one, the records
    of its paths and of its nodes without arrays (which a flat `state_dict` cannot hold)."""
    tree = check_namespaced(tree, path)
    several = len(tree) > 1  # every leaf torch cannot hold refused before the keys are warned of
    refuse_dtypes([(flat_name(ns, p, several), leaf.dtype) for ns, p, leaf in abstract_items(tree, path)
                   if leaf.dtype.kind not in 'OSU' and not has_torch_dtype(leaf.dtype)], path, 'torch')
    warn_key_data(tree, path, 'torch')
    if not flat:
        return single_content(tree), (None, None)
    items = []
    try:
        for ns, sub in tree.items():
            found: list = []
            _flat_items(sub, (), found)
            items.extend((ns, p, leaf) for p, leaf in found)
    except InputError as e:
        raise InputError(e.message, file=path, entry=e.entry, fix=e.fix) from None
    if len(items) == 1 and not items[0][1] and len(tree) == 1:
        return items[0][2], (None, None)  # a lone tensor (torch.save(t)) is pickled as itself
    names = flat_names(items, path)
    return (dict(zip(names, (leaf for _, _, leaf in items))),
            (paths_json(items, names, path), empty_record(tree)))


def check(tree: Any, path: str, *, flat: bool = True) -> None:
    """Refuse a tree `write` cannot hold (a dtype torch lacks, a key that is not a str or an
    int, a leaf that is not an array or a number, two leaves whose flat names are alike),
    reading no data.

    >>> check({'jckpt': {'w': np.ones(2, 'int4')}}, 'm.pt')
    Traceback (most recent call last):
    ...
    jckpt.errors.InputError: m.pt: entry w: dtype int4 has no torch equivalent ...
    """
    path = os.fspath(path)
    Pickler(path, fetch=False).value(_content(tree, path, flat)[0], '')


def write(tree: Any, path: str, *, flat: bool | None = None,
          metadata: dict[str, str] | None = None) -> None:
    """Write `{namespace: subtree}` as a file `torch.load(path, weights_only=True)` reads.

    By default (`flat=True`) the file holds a flat `state_dict`: each leaf under its key
    path joined by `.` (`{'params': {'dense': {'kernel': k}}}` is saved as
    `{'params.dense.kernel': k}`, names prefixed by the namespace when there are several),
    what `model.load_state_dict(torch.load(path, weights_only=True))` takes. The exact
    namespaces and key paths are recorded beside the pickle (`PATHS_MEMBER`, which torch
    ignores), and the nodes without arrays that a flat dict cannot hold (`EMPTY_MEMBER`),
    so `read` gives the nested tree back, those nodes as `None`. `flat=False` pickles the tree as it is
    (a checkpoint dict `{'model': ..., 'optimizer': ...}`, an optimizer's `state_dict`);
    left out, it is `True` unless `metadata` says the tree came nested from a torch file
    (`LAYOUT_KEY`, see `read_metadata`). `metadata` (string pairs) is kept in the archive;
    where it lists a torch file's Python numbers (`SCALARS_KEY`), the 0-d arrays there are
    written as numbers again.

    Containers (dict, list, tuple), Python numbers, strings and None are
    pickled as themselves; arrays (numpy, JAX) become CPU tensors, one storage for a
    leaf that appears twice (tied weights) and for numpy views of one memory (`w`, `w[0]`,
    `w.T`; see `jckpt.adapters._torch_pickle.overlapping_views`).
    """
    path = os.fspath(path)
    meta = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise InputError("torch file metadata must map strings to strings", file=path,
                         fix="convert the values with str() or json.dumps()")
    if flat is None:
        flat = meta.get(LAYOUT_KEY) != 'nested'
    if SCALARS_KEY in meta and len(tree) == 1:  # numbers the torch file held as numbers
        tree = {ns: with_scalars(sub, meta[SCALARS_KEY]) for ns, sub in tree.items()}
    content, (record, empty) = _content(tree, path, flat)
    pickler = Pickler(path)
    pickler.share(content)
    pickler.value(content, '')
    pickler.out += b'.'
    root = 'archive/'
    with published(path) as f, zipfile.ZipFile(f, 'w', zipfile.ZIP_STORED, allowZip64=True) as zf:
        def small(name: str, data: bytes) -> None:
            _zip.write_member(zf, root + name, [data], len(data))
        small('data.pkl', bytes(pickler.out))
        small('.format_version', b'1')
        small('.storage_alignment', b'64')
        small('byteorder', b'little')
        for key, array in enumerate(pickler.storages):
            _zip.write_member(zf, f"{root}data/{key}", iter_payload_chunks(array), array.nbytes)
        small('version', b'3\n')
        small('.data/serialization_id', b'%040d' % (int.from_bytes(os.urandom(16), 'little') % 10**40))
        if record is not None:
            small(PATHS_MEMBER, record.encode('utf-8'))
        if empty is not None:
            small(EMPTY_MEMBER, empty.encode('utf-8'))
        if meta:
            small(METADATA_MEMBER, json.dumps(meta, separators=(',', ':')).encode('utf-8'))


def register() -> None:
    from jckpt.adapters import register_format

    register_format('torch', read=read, write=write, sniff=sniff, check=check,
                    extensions=('.pt', '.pth'), replace=True, read_metadata=read_metadata,
                    keeps_metadata=True, read_with_metadata=read_with_metadata)
