"""Structure-aware fuzzing of every reader: the foreign formats, the directory index, OCANNL files.

``tests/system/fuzz_reader.py`` fuzzes the native file through its bytes and its
S-expression. This module does the same for the other readers, and mutates
*fields*, not only bytes: each case builds a small valid file of one format
from its parts (a safetensors JSON header, an ``.npy`` header dict, the
members of an ``.npz`` or ``.pth`` zip, the pickle ops of a ``.pth``, the
config ints of an llm.c model, the entries of an OCANNL header, the items of
an orbax step directory, the ``sharded`` field of a directory index), changes
zero to three of those parts to values chosen to hurt (huge, negative,
boolean, nested, missing, duplicated, out of range, unsafe names, wrong
compression, deep nesting), serialises it, and reads it through
``jckpt.adapters.read`` (or ``jckpt.load`` for a directory checkpoint) and
``jckpt.verify``.

Oracles:

* the only exception is a ``CheckpointError``, and it names the file or directory;
* ``verify`` never raises and reports a file that does not read as failed;
* a case with no mutation loads exactly the leaves it was built from;
* a load's leaves are numpy arrays whose bytes can all be read (no view past the
  end of a mapping), together at most 64 times the case's size plus 1 MiB,
  or 1100 times for a compressed archive.

The worker runs under ``RLIMIT_AS`` (its address space after warming up,
plus :data:`SPACE_BUDGET`; run it with ``MALLOC_ARENA_MAX=2`` so that malloc
arenas of new threads do not eat the budget) and a watchdog (``SIGALRM``)
that ends it with a traceback when one case takes more than
``--hard-limit`` seconds; a case slower than ``--soft-limit`` twice in a row
is a failure.

By hand, for longer::

    MALLOC_ARENA_MAX=2 python -m tests.system.fuzz_formats --cases 200000 --seed 7

It prints a JSON summary and exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import json
import os
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import warnings
import zipfile
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

SPACE_BUDGET = 512 << 20

INTS = [0, 1, -1, 2, 3, 7, 8, 255, 256, 65535, 2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1,
        2**63, 2**64, 10**30, -2**31, -2**63]
JSONS: list[Any] = [None, True, False, 0, -1, 1.5, 1e308, "", "x", "F32", [], [1], [[1]], {},
                    {"a": 1}, [True, 2], [-1, 4], [2**64, 0], "1" * 300, [0.5, 3]]
NAMES = ["w", "", "..", "../evil", "/abs", "a/../../b", "a.b", "a\u00e9", "\x1b[2J", "x" * 300,
         "__metadata__", "a\x00b", "0", "jckpt", "n0"]


class Case:
    """One fuzz case: where it is, its format, and what a correct load holds."""

    def __init__(self, fmt: str, expected: list | None, mutations: list[str],
                 compressed: bool = False) -> None:
        self.format = fmt
        self.expected = expected          # sorted leaf signatures, or None
        self.mutations = mutations
        self.compressed = compressed


def _signature(arrays: list[np.ndarray]) -> list:
    return sorted((str(a.dtype), tuple(a.shape), np.ascontiguousarray(a).tobytes()) for a in arrays)


def _small_arrays(rng: random.Random, kinds: list) -> dict[str, np.ndarray]:
    out = {}
    for i in range(rng.randrange(1, 4)):
        dtype = np.dtype(rng.choice(kinds))
        shape = tuple(rng.randrange(0, 4) for _ in range(rng.randrange(0, 3)))
        out[f"t{i}"] = (np.arange(int(np.prod(shape)), dtype=np.int64) % 7).astype(dtype).reshape(shape)
    return out


def _mutations(rng: random.Random, choices: dict[str, Callable[[], None]]) -> list[str]:
    """Apply zero (a tenth of the cases) to three of ``choices``; their names."""
    if rng.random() < 0.1:
        return []
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        name = rng.choice(sorted(choices))
        try:
            choices[name]()
        except (LookupError, TypeError, ValueError, AttributeError, OSError):
            continue  # the mutation does not apply to this case (the mutator's own limit)
        done.append(name)
    return done


def _deep_json(rng: random.Random) -> str:
    n = rng.choice([50, 99, 100, 101, 1000, 100000])
    return "[" * n + "]" * n


def paths_record(rng: random.Random, names: list[str]) -> str:
    """The ``jckpt.paths`` record (npz comment, safetensors metadata) of ``names``, its fields
    mutated: namespaces, key kinds and values, paths that clash or prefix one another."""
    record: dict[str, Any] = {n: ["jckpt", [["k", n]]] for n in names}
    for _ in range(rng.randrange(1, 4)):
        name = rng.choice(names)
        if not (isinstance(record[name], list) and len(record[name]) == 2):
            record[name] = ["jckpt", [["k", name]]]
        comps = record[name][1]
        what = rng.randrange(7)
        if what == 0:
            record[name][0] = rng.choice(["", "1x", "ok", None, 5, "jckpt"])
        elif what == 1:
            kind = rng.choice(["k", "ki", "i", "a", "f", "x", 3])
            record[name][1] = [[kind, rng.choice([*INTS[:12], 10**30, "a", "", True, None, 1.5])]]
        elif what == 2:  # a sibling of another kind: an int key next to a str key
            record[name][1] = [["ki", rng.choice([0, 1, -3])]]
        elif what == 3:
            record[name][1] = comps * rng.choice([2, 100, 300])
        elif what == 4:  # one path a prefix of another
            other = record[rng.choice(names)]
            base = other[1] if isinstance(other, list) and len(other) == 2 else []
            record[name][1] = [*base, ["k", "z"]]
        elif what == 5:
            record[name][1] = [["i", rng.choice([0, 5, 70000, 2**40])]]
        else:
            record[name] = rng.choice([None, [], ["jckpt"], "x", [["jckpt", []]]])
    return json.dumps(record)


# --- safetensors --------------------------------------------------------------

ST_DTYPES = {"F32": "<f4", "F16": "<f2", "I64": "<i8", "U8": "u1", "BOOL": "?", "I32": "<i4"}


def make_safetensors(rng: random.Random, path: str) -> Case:
    arrays = _small_arrays(rng, list(ST_DTYPES.values()))
    names = {np.dtype(v): k for k, v in ST_DTYPES.items()}
    header: dict[str, Any] = {}
    data, cursor = b"", 0
    for name, a in arrays.items():
        raw = a.tobytes()
        header[name] = {"dtype": names[a.dtype],
                        "shape": list(a.shape), "data_offsets": [cursor, cursor + len(raw)]}
        data += raw
        cursor += len(raw)
    if rng.random() < 0.5:
        header["__metadata__"] = {"format": "pt"}
    state = {"text": None, "data": data, "hlen": None}
    entries = [k for k in header if k != "__metadata__"]

    def field():
        info = header[rng.choice(entries)]
        info[rng.choice(["dtype", "shape", "data_offsets", "extra"])] = rng.choice(JSONS + INTS)

    def dim():
        info = header[rng.choice(entries)]
        shape = info["shape"] = list(info["shape"]) or [1]
        shape[rng.randrange(len(shape))] = rng.choice([*INTS, True, 1.0, "2"])
        if rng.random() < 0.3:
            info["shape"] = shape * rng.choice([10, 40, 70])

    def offsets():
        a, b = header[rng.choice(entries)], header[rng.choice(entries)]
        a["data_offsets"] = rng.choice([b["data_offsets"], list(reversed(a["data_offsets"])),
                                        [a["data_offsets"][0], rng.choice(INTS)],
                                        [rng.choice(INTS), rng.choice(INTS)]])

    def key():
        header[rng.choice(NAMES)] = rng.choice([dict(header[rng.choice(entries)]), rng.choice(JSONS)])

    def delete():
        header.pop(rng.choice(list(header)))

    def metadata():
        header["__metadata__"] = rng.choice([*JSONS, {"a": {"b": "c"}}, {"jckpt.paths": "[" * 200}])

    def record():
        header["__metadata__"] = {"jckpt.paths": paths_record(rng, entries)}

    def hlen():
        state["hlen"] = rng.choice([*INTS[:12], len(json.dumps(header)) + rng.randrange(-3, 4)])

    def deep():
        state["text"] = '{"w": ' + _deep_json(rng) + "}"

    def data_len():
        state["data"] = rng.choice([data[:rng.randrange(len(data) + 1)], data + b"\0" * rng.randrange(1, 64)])

    done = _mutations(rng, {"field": field, "dim": dim, "offsets": offsets, "key": key,
                            "delete": delete, "metadata": metadata, "hlen": hlen, "deep": deep,
                            "record": record,
                            "data_len": data_len})
    text = (state["text"] or json.dumps(header)).encode("utf-8", "surrogatepass")
    n = len(text) if state["hlen"] is None else state["hlen"] % 2**64
    _put(path, struct.pack("<Q", n) + text + state["data"])
    return Case("safetensors", None if done else _signature(list(arrays.values())), done)


# --- npy and npz ----------------------------------------------------------------

NPY_DESCRS = ["<f4", "<f2", "<i8", "|u1", "|b1", ">f8", "<U0", "|S0", "|O", "|V4", "bfloat16",
              "<c8", [("a", "<f4")], "<f4,<i4", "<M8[s]", "float8_e4m3fn", "xyz", 3, None]


def npy_bytes(descr: Any, fortran: Any, shape: Any, data: bytes, *, version: int = 1,
              extra: dict | None = None, text: str | None = None) -> bytes:
    header = {"descr": descr, "fortran_order": fortran, "shape": shape, **(extra or {})}
    body = (text if text is not None else repr(header)).encode("latin1", "replace")
    prefix = 10 if version == 1 else 12
    body += b" " * (-(prefix + len(body) + 1) % 64) + b"\n"
    size = struct.pack("<H", len(body) % 65536) if version == 1 else struct.pack("<I", len(body))
    return b"\x93NUMPY" + bytes([version, 0]) + size + body + data


def _npy_member(rng: random.Random, array: np.ndarray) -> tuple[bytes, list[str]]:
    """An array's .npy bytes, with zero or more of its header's fields mutated."""
    parts: dict[str, Any] = {"descr": array.dtype.str, "fortran": False, "shape": array.shape,
                             "data": array.tobytes(), "version": 1, "extra": None, "text": None}

    def descr():
        parts["descr"] = rng.choice(NPY_DESCRS)

    def fortran():
        parts["fortran"] = rng.choice([True, 1, None, "False"])

    def shape():
        dims = list(array.shape) or [1]
        dims[rng.randrange(len(dims))] = rng.choice([*INTS, True, 1.5])
        parts["shape"] = rng.choice([tuple(dims), tuple(dims) * rng.choice([20, 40]), list(dims), 5])

    def data():
        raw = parts["data"]
        parts["data"] = rng.choice([raw[:rng.randrange(len(raw) + 1)], raw + b"\1" * rng.randrange(1, 9)])

    def version():
        parts["version"] = rng.choice([0, 2, 3, 4, 255])

    def extra():
        parts["extra"] = {rng.choice(["x", "descr2"]): 1}

    def text():
        parts["text"] = rng.choice(["{", "{}", "[1]", "{'descr': " + "(" * 500 + ")" * 500 + "}",
                                    "__import__('os')", "{'descr': '<f4', 'fortran_order': False, "
                                    "'shape': (10**10**6,)}"])

    done = _mutations(rng, {"descr": descr, "fortran": fortran, "shape": shape, "data": data,
                            "version": version, "extra": extra, "text": text})
    try:
        raw = npy_bytes(parts["descr"], parts["fortran"], parts["shape"], parts["data"],
                        version=2 if parts["version"] == 2 else 1, extra=parts["extra"],
                        text=parts["text"])
    except (ValueError, OverflowError):
        raw = b"\x93NUMPY\x01\x00\x00\x00"
    if parts["version"] not in (1, 2):
        raw = raw[:6] + bytes([parts["version"]]) + raw[7:]
    return raw, [f"npy.{d}" for d in done]


def make_npy(rng: random.Random, path: str) -> Case:
    array = _small_arrays(rng, ["<f4", "<i8", "u1", "?"])["t0"]
    raw, done = _npy_member(rng, array)
    _put(path, raw)
    return Case("npy", None if done else _signature([array]), done)


def make_npz(rng: random.Random, path: str) -> Case:
    arrays = _small_arrays(rng, ["<f4", "<i8", "u1", "<f2"])
    members, done = {}, []
    for name, a in arrays.items():
        if rng.random() < 0.3:
            raw, d = _npy_member(rng, a)
        else:
            raw, d = npy_bytes(a.dtype.str, False, a.shape, a.tobytes()), []
        members[name + ".npy"] = raw
        done += d
    methods = [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA]
    method = rng.choice(methods)
    comment = b""

    def name():
        old = rng.choice(list(members))
        new = rng.choice(NAMES) + rng.choice([".npy", "", ".txt", "/"])
        if new and new not in members:
            members[new] = members.pop(old)

    def duplicate():
        members[next(iter(members)) + "#dup"] = members[next(iter(members))]

    def record():
        nonlocal comment
        comment = b"jckpt-paths:" + rng.choice([b"[", b"{}", b'{"t0": 1}', b"[" * 5000, b'"x"',
                                                 b"\xff", paths_record(rng, [m[:-4] for m in members
                                                                             if m.endswith(".npy")]
                                                                         or ["t0"]).encode()])

    def bomb():
        size = rng.choice([17, 64 << 10, 1 << 20])
        members[rng.choice(list(members))] = npy_bytes("<f4", False, (4,), bytes(size))

    choices = {"name": name, "duplicate": duplicate, "record": record, "bomb": bomb}
    done += [f"npz.{d}" for d in _mutations(rng, choices)] if rng.random() < 0.6 else []
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", method) as zf, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names, on purpose
        for member, data in members.items():
            zf.writestr(member.replace("#dup", ""), data)
        zf.comment = comment[:65535]
    raw = bytearray(out.getvalue())
    if rng.random() < 0.1:  # a field of the zip itself: CRC, sizes, method, flags
        done.append("zip.field")
        at = raw.rfind(b"PK\x01\x02")
        if at >= 0:
            field = rng.choice([(8, "<H"), (10, "<H"), (16, "<I"), (20, "<I"), (24, "<I"), (42, "<I")])
            value = rng.randrange(0, 2**(8 * struct.calcsize(field[1])))
            struct.pack_into(field[1], raw, at + field[0], value)
    _put(path, bytes(raw))
    return Case("npz", None if done else _signature(list(arrays.values())), done,
                compressed=method != zipfile.ZIP_STORED)


# --- llm.c ------------------------------------------------------------------------

def make_llmc(rng: random.Random, path: str) -> Case:
    from jckpt.adapters import llmc

    config = llmc.Config(max_seq_len=4, vocab_size=5, num_layers=rng.choice([1, 2]), num_heads=1,
                         channels=4, padded_vocab_size=8)
    dtype = rng.choice([np.float32, "bfloat16"])
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    header = bytearray(llmc.encode_header(config, dt))
    params = (np.arange(llmc.num_parameters(config)) % 5).astype(dt).tobytes()
    state = {"params": params}

    def config_int():
        struct.pack_into("<i", header, 4 * rng.randrange(0, 8), rng.choice([0, -1, 1, 2, 3, 5, 20240326,
                                                                             20240327, 2**31 - 1, 65536]))

    def reserved():
        struct.pack_into("<i", header, 4 * rng.randrange(8, 256), rng.randrange(-2**31, 2**31))

    def length():
        state["params"] = rng.choice([params[:rng.randrange(len(params) + 1)], params + b"\0" * 4])

    done = _mutations(rng, {"config": config_int, "reserved": reserved, "length": length})
    _put(path, bytes(header) + state["params"])
    return Case("llmc", None, done)


# --- PyTorch ------------------------------------------------------------------------

class _Ops:
    """A protocol-2 pickle written op by op."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")

    def str(self, s: str) -> None:
        raw = s.encode("utf-8", "surrogatepass")
        self.out += b"X" + struct.pack("<I", len(raw)) + raw

    def int(self, v: int) -> None:
        if 0 <= v < 2**31:
            self.out += b"J" + struct.pack("<i", v)
        else:
            raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(raw)]) + raw

    def glob(self, module: str, name: str) -> None:
        self.out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"

    def tuple(self, items: list[int]) -> None:
        self.out += b"("
        for v in items:
            self.int(v)
        self.out += b"t"


def make_torch(rng: random.Random, path: str) -> Case:
    arrays = _small_arrays(rng, ["<f4", "<i8"])
    storage_of = {np.dtype("<f4"): "FloatStorage", np.dtype("<i8"): "LongStorage"}
    knobs: dict[str, Any] = {}

    def pick(name, make):
        if name in knobs:
            return make()
        return None

    choices = {k: (lambda k=k: knobs.__setitem__(k, True)) for k in (
        "storage_key", "numel", "size", "stride", "offset", "global", "memo", "nest", "opcode",
        "byteorder", "member", "compress", "shared", "deep", "truncate_pkl")}
    done = _mutations(rng, choices)
    ops = _Ops()
    ops.out += b"}("
    storages = {}
    for i, (name, a) in enumerate(arrays.items()):
        ops.str(name)
        ops.glob("torch._utils", "_rebuild_tensor_v2")
        ops.out += b"(("
        ops.str("storage")
        kind = pick("global", lambda: rng.choice([("os", "system"), ("torch", "NoStorage"),
                                                   ("builtins", "eval"), ("torch", "FloatStorage")]))
        ops.glob(*(kind or ("torch", storage_of[a.dtype])))
        key = str(0 if "shared" in knobs else i)
        ops.str(pick("storage_key", lambda: rng.choice(["../x", "", "99", "a/b"])) or key)
        ops.str("cpu")
        ops.int(pick("numel", lambda: rng.choice(INTS[:20])) if "numel" in knobs else a.size)
        ops.out += b"tQ"
        ops.int(pick("offset", lambda: rng.choice([1, 3, 2**40])) or 0)
        size = list(a.shape)
        stride = [int(np.prod(size[j + 1:])) for j in range(len(size))]
        if "size" in knobs:
            size = [rng.choice(INTS[:18]) for _ in range(rng.randrange(0, 4))] * rng.choice([1, 30])
        if "stride" in knobs:
            stride = [rng.choice([0, 1, 2, 2**40]) for _ in range(len(size))]
        ops.tuple(size)
        ops.tuple(stride)
        ops.out += b"\x89"
        ops.glob("collections", "OrderedDict")
        ops.out += b")RtR"
        storages[key] = a.tobytes()
    if "nest" in knobs:  # a list of shared sub-lists, many levels
        ops.str("nest")
        ops.out += b"]K\x01aq\x00"
        for level in range(1, rng.choice([5, 30, 45])):
            below = bytes([(level - 1) % 256])
            ops.out += b"](h" + below + b"h" + below + b"eq" + bytes([level % 256])
    if "deep" in knobs:
        n = rng.choice([50, 101, 5000])
        ops.str("deep")
        ops.out += b"]" * n + b"a" * (n - 1)
    if "memo" in knobs:
        ops.str("memo")
        ops.out += b"h" + bytes([rng.randrange(256)])
    if "opcode" in knobs:
        at = rng.randrange(2, len(ops.out))
        ops.out[at:at] = bytes([rng.choice(b"bRci.0(tuesQ\x81\x85\x93\x94")])
    ops.out += b"u."
    pkl = bytes(ops.out)
    if "truncate_pkl" in knobs:
        pkl = pkl[:rng.randrange(len(pkl))]
    method = zipfile.ZIP_DEFLATED if "compress" in knobs else zipfile.ZIP_STORED
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", method) as zf:
        zf.writestr("archive/data.pkl", pkl)
        zf.writestr("archive/byteorder", rng.choice(["big", "middle", "", "l" * 100]) if "byteorder" in knobs
                    else "little")
        for key, raw in storages.items():
            if "member" in knobs and rng.random() < 0.5:
                raw = raw[:rng.randrange(len(raw) + 1)]
            zf.writestr(f"archive/data/{key}", raw)
        zf.writestr("archive/version", "3\n")
    _put(path, out.getvalue())
    return Case("torch", None if done else _signature(list(arrays.values())), done,
                compressed="compress" in knobs)


# --- OCANNL -----------------------------------------------------------------------------

PRECS = ["Single_prec", "Double_prec", "Half_prec", "Byte_prec", "Uint4x32_prec", "Void_prec",
         "Bfloat16_prec", "Fp8_prec", "Quad_prec", "Int32_prec"]


def make_ocannl(rng: random.Random, path: str) -> Case:
    """An OCANNL-written file: path-less entries, padding, the legacy namespace, no checksums."""
    arrays = _small_arrays(rng, ["<f4"])
    fields, data, expected = [], b"", []
    for i, a in enumerate(arrays.values()):
        pad = rng.random() < 0.4 and a.ndim > 0
        dims = [d + 2 for d in a.shape] if pad else list(a.shape)
        entry = {"id": str(i), "namespace": rng.choice(['""', "ocannl"]), "label": f"(l{i})",
                 "prec": "Single_prec", "dims": "(" + " ".join(map(str, dims)) + ")",
                 "padding": ("((" + " ".join("(1 1)" for _ in dims) + ") 0.)") if pad else "none",
                 "offset": str(len(data)), "byte_length": str(a.nbytes)}
        fields.append(entry)
        data += a.tobytes()
        expected.append(np.pad(a, 1) if pad else a)

    def pick() -> dict:
        return rng.choice(fields)

    def value():
        e = pick()
        e[rng.choice(list(e))] = rng.choice([str(v) for v in INTS] + ["()", "(1 1)", "x", '""', "nan"])

    def dims():
        e = pick()
        e["dims"] = "(" + " ".join(str(rng.choice(INTS[:16])) for _ in range(rng.randrange(0, 5))) + ")"

    def padding():
        e = pick()
        n = e["dims"].count(" ") + 1
        e["padding"] = "((" + " ".join(f"({rng.choice(INTS[:10])} {rng.choice(INTS[:10])})"
                                       for _ in range(rng.choice([n, n + 1]))) + ") " + rng.choice(
            ["0.", "nan", "-inf", "1e400", "x"]) + ")"

    def prec():
        pick()["prec"] = rng.choice(PRECS)

    def duplicate_id():
        if len(fields) > 1:
            fields[1]["id"] = fields[0]["id"]
            fields[1]["namespace"] = fields[0]["namespace"]

    done = _mutations(rng, {"value": value, "dims": dims, "padding": padding, "prec": prec,
                            "duplicate_id": duplicate_id})
    order = ["id", "namespace", "label", "prec", "dims", "padding", "offset", "byte_length"]
    text = "((version 1) (tensors (" + " ".join(
        "(" + " ".join(f"({k} {e[k]})" for k in order if k in e) + ")" for e in fields) + ")))"
    body = text.encode()
    _put(path, struct.pack(">I", len(body)) + body + data)
    return Case("ocannl", None if done else _signature(expected), done)


# --- orbax directories -------------------------------------------------------------------

def make_orbax(rng: random.Random, path: str) -> Case:
    """An orbax step directory whose items are jckpt items (``checkpoint.jckpt``)."""
    from tests.helpers import write_arrays

    step = os.path.join(path, "step")
    os.makedirs(step)
    _put(os.path.join(step, "_CHECKPOINT_METADATA"), b"{}")
    names = rng.sample(["params", "opt", "extra"], rng.randrange(1, 3))
    leaves = []
    for name in names:
        os.mkdir(os.path.join(step, name))
        arrays = _small_arrays(rng, ["<f4", "<i8"])
        write_arrays(os.path.join(step, name, "checkpoint.jckpt"), arrays)
        leaves += arrays.values()

    def item_name():
        old = os.path.join(step, rng.choice(names))
        new = os.path.join(step, rng.choice(["1x", "a-b", "\u00e9", "ok_name", "_METADATA"]))
        if os.path.exists(old) and not os.path.exists(new):
            os.rename(old, new)

    def item_file():
        item = os.path.join(step, rng.choice(names))
        if not os.path.isdir(item):
            return
        target = os.path.join(item, "checkpoint.jckpt")
        choice = rng.randrange(4)
        if choice == 0 and os.path.exists(target):
            data = bytearray(open(target, "rb").read())
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            _put(target, bytes(data))
        elif choice == 1:
            os.remove(target) if os.path.exists(target) else None
            os.symlink(os.path.join(path, "outside.jckpt"), target)
        elif choice == 2:
            os.remove(target) if os.path.exists(target) else None
            os.mkdir(target)
        else:
            _put(os.path.join(item, "_METADATA"), rng.choice([b"{", b"[]", b"{}"]))

    def markers():
        os.remove(os.path.join(step, "_CHECKPOINT_METADATA"))

    done = _mutations(rng, {"item_name": item_name, "item_file": item_file, "markers": markers})
    _put(os.path.join(path, "outside.jckpt"), b"\0\0\0\x10((version 1) ())")
    return Case("orbax", None if done else _signature(leaves), done)


# --- directory index ---------------------------------------------------------------------

def make_index(rng: random.Random, path: str) -> Case:
    """A directory checkpoint whose index's ``sharded`` field is mutated (and resealed)."""
    from jckpt.format.header_seal import seal_header
    from jckpt.format.sexp import dumps, parse
    from tests.helpers import write_directory

    arrays = {f"a{i}": (np.arange(12) % 5).astype(np.float32).reshape(4, 3)[:rng.randrange(2, 5)]
              for i in range(rng.randrange(1, 3))}
    ck = write_directory(os.path.join(path, "ck"), arrays, processes=rng.choice([1, 2]))
    index = os.path.join(ck, "index.jckpt")
    raw = open(index, "rb").read()
    (hlen,) = struct.unpack(">I", raw[:4])
    tree = parse(raw[4:4 + hlen].decode())
    sharded = next(f for f in tree if f[0] == "sharded")[1]
    top = {f[0]: f for f in sharded}
    arrays_node = top["arrays"][1]

    def files():
        top["files"][1] = rng.choice([[], ["process_00000.jckpt"] * 2, ["../process_00000.jckpt"],
                                      ["process_00009.jckpt"], "process_00000.jckpt",
                                      top["files"][1] + ["process_00007.jckpt"]])

    def pieces():
        a = {f[0]: f for f in rng.choice(arrays_node)}
        ps = a["pieces"][1]
        p = rng.choice(ps)
        what = rng.randrange(5)
        if what == 0:
            ps.append([p[0], [list(b) for b in p[1]]])  # a duplicate piece
        elif what == 1:
            p[0] = str(rng.choice(INTS[:12]))
        elif what == 2 and p[1]:
            pair = rng.choice(p[1])
            pair[rng.randrange(2)] = str(rng.choice([*INTS[:16], 2 ** 33]))
        elif what == 3:
            ps.remove(p)
        else:
            p[1] = p[1] + [["0", "1"]]

    def global_dims():
        a = {f[0]: f for f in rng.choice(arrays_node)}
        a["global_dims"][1] = [str(rng.choice(INTS[:18])) for _ in range(rng.randrange(0, 3))]

    def field():
        a = rng.choice(arrays_node)
        f = rng.choice(a)
        f[1] = rng.choice(["x", [], ["1"], "Void_prec", "Quad_prec", "-5", str(2**64), [["k", "a"]]])

    def layout():
        top["layout"][1] = rng.choice(["0", "2", "x", "-1"])

    def duplicate_array():
        arrays_node.append(arrays_node[0])

    done = _mutations(rng, {"files": files, "pieces": pieces, "global_dims": global_dims,
                            "field": field, "layout": layout, "duplicate_array": duplicate_array})
    text = dumps(tree).encode()
    head = struct.pack(">I", len(text) + (-(4 + len(text)) % 32)) + text + b" " * (-(4 + len(text)) % 32)
    if not done or rng.random() < 0.9:  # a crafted index carries a valid checksum, a damaged one not
        head = seal_header(head)
    _put(index, head)
    return Case("index", None if done else _signature(list(arrays.values())), done)


MAKERS: dict[str, Callable[[random.Random, str], Case]] = {
    "safetensors": make_safetensors, "npy": make_npy, "npz": make_npz, "llmc": make_llmc,
    "torch": make_torch, "ocannl": make_ocannl, "orbax": make_orbax, "index": make_index,
}
EXTENSIONS = {"safetensors": ".safetensors", "npy": ".npy", "npz": ".npz", "llmc": ".bin",
              "torch": ".pth", "ocannl": ".ckpt", "orbax": "", "index": ""}


# --- running a case ----------------------------------------------------------------------

class Disallowed(Exception):
    """An outcome the oracles forbid."""


def _put(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def leaves(tree: Any) -> list:
    """Every leaf of a tree of dicts, lists and tuples (no JAX: a child may run without it)."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        else:
            out.append(node)
    return out


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _dirs, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files
                     if not os.path.islink(os.path.join(root, f)))
    return total


def _read(case: Case, path: str) -> Any:
    import jckpt
    from jckpt.adapters import read

    if case.format == "index":
        return jckpt.load(jckpt.Context(host=True), os.path.join(path, "ck"), mmap=False)[1]
    if case.format == "orbax":
        return read(os.path.join(path, "step"), format="orbax")
    return read(path, format=case.format)


def _writable(tree: Any, path: str) -> None:
    """A tree a reader returned can be handed to a writer (``convert``): flattening it and
    bringing its leaves to host raise nothing but a CheckpointError (a str leaf, say)."""
    from jckpt.adapters._common import host_items
    from jckpt.errors import CheckpointError

    try:
        host_items(tree, path)
    except CheckpointError:
        pass


def check_case(case: Case, path: str) -> str:
    """Read the case; the outcome (``loaded`` or ``refused:<error type>``), or Disallowed."""
    import jckpt
    from jckpt.errors import CheckpointError

    target = path if case.format not in ("index", "orbax") else os.path.dirname(path)
    try:
        tree = _read(case, path)
    except CheckpointError as e:
        if target not in str(e):
            raise Disallowed(f"error does not name the file: {e}") from None
        outcome = "refused:" + type(e).__name__
    else:
        outcome = "loaded"
        arrays = [np.asarray(x) for x in leaves(tree) if isinstance(x, np.ndarray)]
        total = 0
        for a in arrays:
            total += a.nbytes
            np.ascontiguousarray(a).tobytes()  # every byte readable
        bound = (1100 if case.compressed else 64) * _size(path) + (1 << 20)
        if total > bound:
            raise Disallowed(f"loaded {total} bytes of leaves from {_size(path)} bytes")
        if case.expected is not None and _signature(arrays) != case.expected:
            raise Disallowed("an unmutated file did not load the arrays it was built from")
        if case.format not in ("npy", "llmc"):  # their trees' shapes do not come from the file
            _writable(tree, path)
        del tree, arrays
    if case.format in ("index", "orbax"):
        where = os.path.join(path, "ck" if case.format == "index" else "step")
    else:
        where = path
    report = jckpt.verify(where)  # never raises
    if case.format == "index" and outcome != "loaded" and report.ok:
        raise Disallowed("verify() passed a directory checkpoint that does not load")
    return outcome


# --- the worker -------------------------------------------------------------------------

def _limit_memory() -> int:
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + SPACE_BUDGET
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return limit


def _fresh(workdir: str, n: int) -> str:
    where = os.path.join(workdir, f"c{n % 2}")
    shutil.rmtree(where, ignore_errors=True)
    os.mkdir(where)
    return where


def run(seed: int, cases: int, workdir: str, *, formats: list[str] | None = None,
        soft_limit: float = 2.0, hard_limit: float = 30.0, keep: str | None = None,
        limit_memory: bool = True, makers: dict[str, Callable] | None = None,
        check: Callable[[Case, str], str] | None = None) -> dict:
    """Run ``cases`` cases from ``seed``, cycling through ``formats``; the summary dict.
    ``makers`` and ``check`` stand in for this module's (another fuzzer's cases, same harness)."""
    makers, check = makers or MAKERS, check or check_case
    formats = formats or sorted(makers)
    rng = random.Random(seed)
    # The watchdog is a timer signal, not faulthandler's thread: a thread per case would need
    # address space (a stack, perhaps a malloc arena) that the cap below may no longer grant.
    faulthandler.register(signal.SIGALRM, all_threads=True, chain=True)
    for i, fmt in enumerate(formats):  # warm every reader before capping memory
        for _ in range(3):
            where = _fresh(workdir, i)
            path = os.path.join(where, "case" + EXTENSIONS.get(fmt, ""))
            check(makers[fmt](random.Random(i), path), path)
    if "orbax" in formats:  # orbax's own reader (a step with _METADATA) starts thread pools
        for i in range(3):
            where = _fresh(workdir, i)
            case = make_orbax(random.Random(i), where)
            if not os.path.exists(os.path.join(where, "step", "_METADATA")):
                _put(os.path.join(where, "step", "_METADATA"), b"{}")
            check_case(case, where)
    limit = _limit_memory() if limit_memory else None
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes: Counter = Counter()
    mutations: Counter = Counter()
    failures: list[dict] = []
    slowest = 0.0
    started = time.perf_counter()
    for n in range(cases):
        fmt = formats[n % len(formats)]
        where = _fresh(workdir, n)
        path = os.path.join(where, "case" + EXTENSIONS.get(fmt, ""))
        case_seed = rng.randrange(2**32)
        signal.setitimer(signal.ITIMER_REAL, hard_limit)  # a stuck case: traceback, then exit
        case = None
        t0 = time.perf_counter()
        try:
            case = makers[fmt](random.Random(case_seed), path)
            t0 = time.perf_counter()  # the reader's time, not the making of the case
            outcome = check(case, path)
        except Exception as e:  # anything but a CheckpointError escaping is the finding
            outcome = "FAIL"
            failures.append(_failure(seed, n, fmt, case_seed, case, e, where, keep))
        elapsed = time.perf_counter() - t0
        if elapsed > soft_limit and outcome != "FAIL":  # a stall of a busy machine, or slow?
            t0 = time.perf_counter()
            try:
                check(case, path)
            except Exception:
                pass
            elapsed = time.perf_counter() - t0
        signal.setitimer(signal.ITIMER_REAL, 0)
        slowest = max(slowest, elapsed)
        if elapsed > soft_limit:
            failures.append({"seed": seed, "case": n, "format": fmt, "case_seed": case_seed,
                             "error": f"took {elapsed:.2f} s (limit {soft_limit} s)"})
        outcomes[f"{fmt} -> {outcome.split(':')[0]}"] += 1
        for m in (case.mutations if case is not None else []) or ["none"]:
            mutations[f"{fmt}.{m}"] += 1
    return {"seed": seed, "cases": cases, "seconds": round(time.perf_counter() - started, 2),
            "slowest_case_s": round(slowest, 4), "address_space_limit": limit,
            "peak_rss_growth_mib": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                          - rss_before) / 1024, 1),
            "outcomes": dict(sorted(outcomes.items())), "mutations": dict(sorted(mutations.items())),
            "loaded": sum(v for k, v in outcomes.items() if k.endswith("-> loaded")),
            "refused": sum(v for k, v in outcomes.items() if k.endswith("-> refused")),
            "failures": failures}


def _special_files(directory: str, names: list[str]) -> list[str]:
    """The FIFOs, sockets and devices of a case (a mutator's), which no copy takes."""
    return [n for n in names if not os.path.islink(os.path.join(directory, n))
            and not os.path.isfile(os.path.join(directory, n))
            and not os.path.isdir(os.path.join(directory, n))]


def _failure(seed, n, fmt, case_seed, case, exc, where, keep) -> dict:
    kept = None
    if keep is not None:
        kept = os.path.join(keep, f"fuzz-{fmt}-{seed}-{n}")
        shutil.copytree(where, kept, symlinks=True, dirs_exist_ok=True, ignore=_special_files)
    return {"seed": seed, "case": n, "format": fmt, "case_seed": case_seed,
            "mutations": case.mutations if case is not None else None,
            "error": f"{type(exc).__name__}: {exc}"[:500],
            "traceback": "".join(traceback.format_exception(exc))[-2500:], "kept": kept}


def main(argv: list[str] | None = None, *, makers: dict[str, Callable] | None = None,
         check: Callable[[Case, str], str] | None = None, doc: str | None = None) -> int:
    makers = makers or MAKERS
    parser = argparse.ArgumentParser(description=(doc or __doc__).split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10_000, help="cases per seed")
    parser.add_argument("--seed", type=int, action="append", help="repeatable (default 1)")
    parser.add_argument("--format", action="append", choices=sorted(makers),
                        help="only these formats (repeatable; default all)")
    parser.add_argument("--soft-limit", type=float, default=2.0)
    parser.add_argument("--hard-limit", type=float, default=30.0)
    parser.add_argument("--keep", help="directory for the files of failing cases")
    parser.add_argument("--json", help="write the summary here too")
    parser.add_argument("--no-memory-limit", action="store_true")
    args = parser.parse_args(argv)
    results = []
    for seed in args.seed or [1]:
        workdir = tempfile.mkdtemp(prefix="jckpt-fuzzf-",
                                   dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
        try:
            results.append(run(seed, args.cases, workdir, formats=args.format,
                               soft_limit=args.soft_limit, hard_limit=args.hard_limit,
                               keep=args.keep, limit_memory=not args.no_memory_limit,
                               makers=makers, check=check))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    summary = {"cases": sum(r["cases"] for r in results),
               "failures": sum(len(r["failures"]) for r in results), "runs": results}
    text = json.dumps(summary, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import logging
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on each damaged item
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
