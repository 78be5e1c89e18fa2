"""llm.c GPT-2 model files (`gpt2_124M.bin`): to and from a GPT-2 parameter pytree.

The file: 256 little-endian int32 (`[0]` magic 20240326, `[1]` version:
3 for float32 parameters, 5 for bfloat16; `[2]` max sequence length T,
`[3]` vocabulary size V, `[4]` layers L, `[5]` heads, `[6]` channels
C, `[7]` padded vocabulary size Vp), then the parameters back to back,
grouped by kind across layers: wte (Vp, C), wpe (T, C), ln1w, ln1b (L, C),
qkvw (L, 3C, C), qkvb (L, 3C), attprojw (L, C, C), attprojb (L, C), ln2w,
ln2b (L, C), fcw (L, 4C, C), fcb (L, 4C), fcprojw (L, C, 4C), fcprojb (L, C),
lnfw, lnfb (C). The language-model head is tied to wte.

The tree (under namespace `jckpt`) uses GPT-2's own names:

```python
{'wte': (Vp, C), 'wpe': (T, C),
 'h': [{'ln_1': {'weight', 'bias'},
        'attn': {'c_attn': {'weight': (3C, C), 'bias': (3C,)},
                 'c_proj': {'weight': (C, C), 'bias': (C,)}},
        'ln_2': {'weight', 'bias'},
        'mlp': {'c_fc': {'weight': (4C, C), 'bias': (4C,)},
                'c_proj': {'weight': (C, 4C), 'bias': (C,)}}}, ...],   # one per layer
 'ln_f': {'weight': (C,), 'bias': (C,)},
 'config': {'max_seq_len', 'vocab_size', 'num_layers', 'num_heads', 'channels',
            'padded_vocab_size'}}                                          # int32 scalars
```

Matrices keep llm.c's (out_features, in_features) layout, as `torch.nn.Linear`
stores them (Hugging Face's GPT-2 `Conv1D` stores the transpose). Reading
maps the file: every parameter is a zero-copy view.

>>> config = Config(max_seq_len=1024, vocab_size=50257, num_layers=12, num_heads=12,
...                 channels=768, padded_vocab_size=50304)
>>> num_parameters(config)
124475904
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

from jckpt.adapters._common import (
    DEFAULT_NAMESPACE,
    abstract_items,
    host_items,
    map_file,
    published,
    single_content,
)
from jckpt.errors import FormatError, InputError
from jckpt.format.payload import iter_payload_chunks, stored_dtype

MAGIC = 20240326
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
VERSIONS = {3: np.dtype('<f4'), 5: np.dtype(ml_dtypes.bfloat16)}
#: Other llm.c files, recognised so that reading one says what it is.
OTHER_MAGICS = {20240327: 'debug state', 20240328: 'tokenizer', 20240527: 'optimizer state'}


@dataclasses.dataclass(frozen=True)
class Config:
    """The model dimensions in the header."""

    max_seq_len: int
    vocab_size: int
    num_layers: int
    num_heads: int
    channels: int
    padded_vocab_size: int


#: Parameter kinds in file order: (llm.c name, path inside a layer or at the top, per layer).
KINDS = (
    ('wte', ('wte',), False), ('wpe', ('wpe',), False),
    ('ln1w', ('ln_1', 'weight'), True), ('ln1b', ('ln_1', 'bias'), True),
    ('qkvw', ('attn', 'c_attn', 'weight'), True), ('qkvb', ('attn', 'c_attn', 'bias'), True),
    ('attprojw', ('attn', 'c_proj', 'weight'), True), ('attprojb', ('attn', 'c_proj', 'bias'), True),
    ('ln2w', ('ln_2', 'weight'), True), ('ln2b', ('ln_2', 'bias'), True),
    ('fcw', ('mlp', 'c_fc', 'weight'), True), ('fcb', ('mlp', 'c_fc', 'bias'), True),
    ('fcprojw', ('mlp', 'c_proj', 'weight'), True), ('fcprojb', ('mlp', 'c_proj', 'bias'), True),
    ('lnfw', ('ln_f', 'weight'), False), ('lnfb', ('ln_f', 'bias'), False),
)


def plausible(config: Config) -> bool:
    """Whether a header may hold `config`: every dimension a positive int32, and the padded
    vocabulary no smaller than the vocabulary (what `read` accepts, so `write` checks it too).

    >>> plausible(Config(1024, 50257, 12, 12, 768, 50304)), plausible(Config(8, 9, 1, 1, 4, 8))
    (True, False)
    """
    dims = dataclasses.astuple(config)
    return (all(0 < d < 2 ** 31 for d in dims)
            and config.vocab_size <= config.padded_vocab_size)


def param_shapes(config: Config) -> list[tuple[str, tuple[int, ...]]]:
    """`(kind, shape of one layer's or the whole parameter)` in file order."""
    c, vp, t = config.channels, config.padded_vocab_size, config.max_seq_len
    one = {'wte': (vp, c), 'wpe': (t, c), 'ln1w': (c,), 'ln1b': (c,), 'qkvw': (3 * c, c),
           'qkvb': (3 * c,), 'attprojw': (c, c), 'attprojb': (c,), 'ln2w': (c,), 'ln2b': (c,),
           'fcw': (4 * c, c), 'fcb': (4 * c,), 'fcprojw': (c, 4 * c), 'fcprojb': (c,),
           'lnfw': (c,), 'lnfb': (c,)}
    return [(kind, one[kind]) for kind, _, _ in KINDS]


def num_parameters(config: Config) -> int:
    """How many parameters the file holds for `config`."""
    return sum(math.prod(shape) * (config.num_layers if per_layer else 1)
               for (_, shape), (_, _, per_layer) in zip(param_shapes(config), KINDS))


def encode_header(config: Config, dtype: np.dtype) -> bytes:
    """The 1024 header bytes for `config` and a parameter dtype (float32 or bfloat16)."""
    version = {v: k for k, v in VERSIONS.items()}.get(np.dtype(dtype))
    if version is None:
        raise InputError(f"llm.c stores float32 or bfloat16 parameters, not {np.dtype(dtype)}",
                         fix="cast the parameters to float32 or bfloat16")
    ints = [MAGIC, version, config.max_seq_len, config.vocab_size, config.num_layers,
            config.num_heads, config.channels, config.padded_vocab_size]
    return struct.pack(f'<{HEADER_INTS}i', *ints, *[0] * (HEADER_INTS - len(ints)))


def decode_header(raw, file: str) -> tuple[Config, np.dtype]:
    """`(config, parameter dtype)` from the first 1024 bytes; `FormatError` if invalid."""
    def fail(msg: str, fix: str = "the file is truncated or not an llm.c GPT-2 model") -> FormatError:
        return FormatError(msg, file=file, fix=fix)
    if len(raw) < HEADER_BYTES:
        raise fail(f"file is {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header")
    ints = struct.unpack_from('<8i', raw, 0)
    if ints[0] in OTHER_MAGICS:
        raise fail(f"this is an llm.c {OTHER_MAGICS[ints[0]]} file (magic {ints[0]}), "
                   f"not a model file (magic {MAGIC})", fix="pass the model's .bin file")
    if ints[0] != MAGIC:
        raise fail(f"bad magic {ints[0]} (an llm.c GPT-2 model has {MAGIC})")
    if ints[1] not in VERSIONS:
        raise fail(f"unsupported version {ints[1]} (3 is float32, 5 is bfloat16)",
                   fix="re-export the model with a current llm.c")
    config = Config(*ints[2:8])
    if not plausible(config):
        raise fail(f"implausible dimensions {config}")
    return config, VERSIONS[ints[1]]


def sniff(path: str, head: bytes | None) -> bool:
    if head is None or len(head) < 4:
        return False
    (magic,) = struct.unpack_from('<i', head, 0)
    return magic == MAGIC or magic in OTHER_MAGICS


def read(path: str) -> dict[str, Any]:
    """An llm.c GPT-2 model file as `{'jckpt': gpt2 params}` (zero-copy views of the file)."""
    path = os.fspath(path)
    buffer = map_file(path)
    config, dtype = decode_header(buffer, path)
    expected = HEADER_BYTES + num_parameters(config) * dtype.itemsize
    if len(buffer) != expected:
        raise FormatError(f"file is {len(buffer)} bytes; the header's dimensions need {expected}",
                          file=path, fix="the file is truncated or damaged"
                          if len(buffer) < expected else "the file has trailing bytes")
    layers: list[dict[str, Any]] = [{} for _ in range(config.num_layers)]
    tree: dict[str, Any] = {}
    offset = HEADER_BYTES
    for (_kind, shape), (_, where, per_layer) in zip(param_shapes(config), KINDS):
        full = (config.num_layers, *shape) if per_layer else shape
        array = np.frombuffer(buffer, dtype=dtype, count=math.prod(full), offset=offset).reshape(full)
        offset += array.nbytes
        for layer, part in (enumerate(array) if per_layer else [(None, array)]):
            node = tree if layer is None else layers[layer]
            for key in where[:-1]:
                node = node.setdefault(key, {})
            node[where[-1]] = part
    tree['h'] = layers
    tree['config'] = {f.name: np.int32(getattr(config, f.name)) for f in dataclasses.fields(Config)}
    return {DEFAULT_NAMESPACE: tree}


def _get(tree: Any, where: tuple, what: str, file: str) -> np.ndarray:
    node = tree
    for key in where:
        if not isinstance(node, dict) or key not in node:
            raise InputError(f"the GPT-2 tree has no {what}", file=file,
                             fix="use the names jckpt.adapters.llmc documents")
        node = node[key]
    return node


def _plan(items: list, path: str) -> tuple[Config, np.dtype, list]:
    """`(config, dtype, leaves in file order)` of a GPT-2 tree's `[(namespace, path, leaf)]`.

    Looks only at shapes and dtypes (and the `config` integers), so it
    serves `check` with abstract leaves as well as `write` with host arrays.
    """
    rebuilt: dict = {}
    for ns, p, array in items:
        node = rebuilt.setdefault(ns, {})
        for _, key in p[:-1]:
            node = node.setdefault(key, {})
        node[p[-1][1] if p else None] = array
    model = single_content(rebuilt)
    if not isinstance(model, dict) or 'h' not in model:
        raise InputError("the tree is not a GPT-2 parameter tree (no 'h' layers)", file=path,
                         fix="use the form jckpt.adapters.llmc.read returns")
    h = model['h']
    layers = [h[k] for k in sorted(h)] if isinstance(h, dict) else list(h)
    if sorted(h) != list(range(len(layers))):
        raise InputError("'h' must hold layers 0..L-1", file=path,
                         fix="number the layers 0, 1, ... without gaps")
    config = _config(model, len(layers), path)
    dtype = stored_dtype(np.dtype(_get(model, ('wte',), 'wte', path).dtype))  # '>f4' is float32
    if dtype not in VERSIONS.values():
        raise InputError(f"llm.c stores float32 or bfloat16 parameters, not {dtype}", file=path,
                         entry='wte', fix="cast the parameters to float32 or bfloat16")
    leaves = []
    for (kind, shape), (_, where, per_layer) in zip(param_shapes(config), KINDS):
        name = '/'.join(where)
        sources = [(f"h/{i}/{name}", layer) for i, layer in enumerate(layers)] if per_layer \
            else [(name, model)]
        for entry, node in sources:
            leaf = _get(node, where, entry, path)
            if tuple(leaf.shape) != shape or stored_dtype(np.dtype(leaf.dtype)) != dtype:
                raise InputError(f"{kind} is {np.dtype(leaf.dtype)}{list(leaf.shape)}, expected "
                                 f"{dtype}{list(shape)}", file=path, entry=entry,
                                 fix="every parameter must have GPT-2's shape and one dtype")
            leaves.append(leaf)
    return config, dtype, leaves


def _config(model: dict, num_layers: int, path: str) -> Config:
    """The dimensions the parameters' shapes give, checked against the tree's `config`."""
    cfg = model.get('config', {})
    wte = _get(model, ('wte',), 'wte', path)
    wpe = _get(model, ('wpe',), 'wpe', path)
    try:
        config = Config(max_seq_len=wpe.shape[0], vocab_size=int(cfg['vocab_size']),
                        num_layers=num_layers, num_heads=int(cfg['num_heads']),
                        channels=wte.shape[1], padded_vocab_size=wte.shape[0])
    except (KeyError, IndexError, TypeError) as e:
        raise InputError(f"cannot tell the model's dimensions ({e!r})", file=path,
                         fix="give config.num_heads and config.vocab_size, and 2-D wte and wpe") \
            from None
    for field in dataclasses.fields(Config):
        if field.name in cfg and int(cfg[field.name]) != getattr(config, field.name):
            raise InputError(f"config.{field.name} is {int(cfg[field.name])} but the parameters "
                             f"say {getattr(config, field.name)}", file=path,
                             entry=f"config/{field.name}", fix=f"drop config.{field.name} or "
                             "make it match the parameters")
    if not plausible(config):  # llm.c (and `read`) would refuse the file
        raise InputError(f"llm.c cannot hold the dimensions {config}", file=path,
                         fix="every dimension must be positive and under 2**31, and wte must "
                             "have at least config.vocab_size rows")
    return config


def check(tree: Any, path: str) -> None:
    """Refuse a tree `write` cannot hold (not GPT-2's names, shapes or one dtype), reading no data.

    >>> check({'jckpt': {'wte': np.zeros((4, 2))}}, 'model.bin')
    Traceback (most recent call last):
    ...
    jckpt.errors.InputError: model.bin: the tree is not a GPT-2 parameter tree (no 'h' layers) ...
    """
    _plan(abstract_items(tree, os.fspath(path)), os.fspath(path))


def write(tree: Any, path: str) -> None:
    """Write a GPT-2 parameter tree (the form `read` returns) as an llm.c model file.

    `config` needs at least `num_heads` and `vocab_size`; the other
    dimensions come from the parameters' shapes and are checked against it.
    """
    path = os.fspath(path)
    config, dtype, arrays = _plan(host_items(tree, path), path)
    header = encode_header(config, dtype)
    with published(path) as f:
        f.write(header)
        for array in arrays:
            for chunk in iter_payload_chunks(array):
                f.write(chunk)


def register() -> None:
    from jckpt.adapters import register_format

    register_format('llmc', read=read, write=write, sniff=sniff, check=check, extensions=('.bin',),
                    replace=True)


__all__ = ['Config', 'KINDS', 'MAGIC', 'check', 'decode_header', 'encode_header', 'num_parameters',
           'param_shapes', 'read', 'write']
