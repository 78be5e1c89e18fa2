"""Fuzzing the checkpoint reader: mutated valid files and random bytes.

The reader is a security boundary: whatever a file holds, reading it may only
give a correct load or an error from the :class:`jckpt.CheckpointError`
hierarchy. No other exception, no hang, and no allocation sized by numbers in
the file rather than by the file's size.

Each case is one file, made in memory from a valid file of a small corpus by
one or more mutations (bit flips, truncations, random header length, byte
edits of the header text, structural edits of its S-expression: deleted,
duplicated, swapped, re-nested and replaced nodes, huge dims, overlapping
offsets, deep nesting; most edited headers get their header checksum
recomputed, as a crafted file's would) or from random bytes. It is written to a fresh file
and read through ``jckpt.describe``, ``jckpt.load`` (mapped and decoded),
``jckpt.restore`` into the original's structure, and ``CheckpointReader``'s
``verify`` and per-entry decoding. The corpus also holds the index of a
directory checkpoint (each mutated index is read as the directory's) and,
for about 15% of the cases, safetensors, npz, PyTorch and OCANNL files whose
bytes are mutated and read through ``jckpt.adapters``.

Oracles, beyond "only a CheckpointError":

* a case whose header bytes are the original's and whose checksums all verify
  loads exactly the original's values, bit for bit;
* a flipped bit inside a payload (header untouched) is reported by
  ``verify()``, by a decoding load and by a mapped load with ``verify=True``;
* mapped and decoded loads of the same file agree;
* every error names the file.

The process runs under ``RLIMIT_AS`` (its address space when the run starts
plus a budget that grows with the largest case file, not with anything read
from a file), and a watchdog ends it with a traceback if one case takes longer
than ``--hard-limit`` seconds; a case slower than ``--soft-limit`` twice in a
row (once may be a stall of a busy machine) is a failure too.

Run it by hand for longer::

    python -m tests.system.fuzz_reader --cases 1000000 --seed 7 --jobs 2

It prints a JSON summary (cases, outcomes per mutation, failures with the
seed, case number and the file that reproduces each) and exits non-zero on
any failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import random
import resource
import shutil
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from typing import Any

import numpy as np

#: Address space granted beyond what the worker holds when it starts, plus
#: ``SPACE_PER_FILE_BYTE`` per byte of the largest case file.
SPACE_BUDGET = 384 << 20
SPACE_PER_FILE_BYTE = 256
MAX_CASE_BYTES = 1 << 20


# --- recording counts --------------------------------------------------------

RESULTS_ENV = "JCKPT_RELIABILITY_RESULTS"


def record(name: str, **counts: Any) -> None:
    """Add ``counts`` under ``name`` to the JSON file named by ``$JCKPT_RELIABILITY_RESULTS``.

    The reliability tests call this so a run can report its figures
    (``docs/reliability.md`` quotes them). Without the variable it does
    nothing. Several test processes may record at once: each appends one
    JSON line.
    """
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    line = json.dumps({"name": name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       **counts}, sort_keys=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


# --- the corpus of valid files -----------------------------------------------

@dataclasses.dataclass
class Seed:
    """A valid file, its header's extent, its values, and a target to restore into."""

    name: str
    data: bytes
    header_end: int                      # 4 + HLEN
    values: dict                         # namespace -> tree, as loaded (numpy)
    spans: list[tuple[int, int]]         # absolute [start, end) of each payload with a checksum
    target: Any = None                   # a numpy tree for jckpt.restore, or None
    directory: str | None = None         # for a directory checkpoint's index: its directory
    format: str | None = None            # another format, read through jckpt.adapters


def _raw(text: str, data: bytes = b"", align: int = 1) -> bytes:
    body = text.encode()
    size = 4 + len(body)
    if align > 1:
        size = -(-size // align) * align
    body += b" " * (size - 4 - len(body))
    return struct.pack(">I", len(body)) + body + data


def build_corpus(directory: str) -> list[Seed]:
    """Write the valid files the mutations start from, and read them back."""
    import jax
    import ml_dtypes

    import jckpt
    from jckpt.format.header import Entry, Header
    from jckpt.format.layout import lay_out
    from jckpt.storage.reader import CheckpointReader
    from jckpt.storage.writer import ArraySource, write_checkpoint

    rng = np.random.default_rng(0)
    made: list[tuple[str, str, Any]] = []
    ctx = jckpt.Context(durable=False)

    def save(name, tree, **kw):
        path = os.path.join(directory, name + ".jckpt")
        jckpt.save(kw.pop("ctx", ctx), tree, path, **kw)
        made.append((name, path, tree))

    save("mixed", {"params": {"dense": {"kernel": rng.standard_normal((4, 3)).astype(np.float32),
                                        "bias": np.zeros(3, np.float32)}},
                   "opt": [np.arange(5, dtype=np.int64), np.float16(1.5)],
                   "step": np.int32(7), "empty": np.zeros((0, 3), np.float32)},
         metadata={"step": "7", "trainer": '{"lr": 0.1}'})
    save("dtypes", {"bf16": np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3),
                    "f8": np.arange(4, dtype=ml_dtypes.float8_e4m3fn),
                    "i4": np.array([1, -2, 3], dtype=ml_dtypes.int4),
                    "c64": np.array([1 + 2j], np.complex64), "b": np.array([True, False]),
                    "u16": np.arange(3, dtype=np.uint16), "f64": np.float64(3.25)},
         alignment=1)
    save("keys", {"key": jax.random.key(3), "x": np.ones(2, np.float32)})
    save("scalar", np.float32(2.5))
    save("appended", {"a": np.arange(3, dtype=np.uint8)})
    save("appended", {"b": np.arange(4, dtype=np.int16)}, appending=True,
         ctx=ctx.replace(namespace="other"))
    made[-2:] = [made[-1]]

    # Sharded pieces (slice and global_dims), written through the storage layer.
    path = os.path.join(directory, "pieces.jckpt")
    piece = np.arange(8, dtype=np.float32).reshape(2, 4)
    entries = (Entry(id=0, namespace="jckpt", prec="Single_prec", dims=(2, 4), offset=0,
                     byte_length=32, label=("w",), path=(("k", "w"),), slice=((2, 4), (0, 4)),
                     global_dims=(8, 4)),)
    write_checkpoint(path, lay_out(Header(tensors=entries, alignment=16)), [ArraySource(piece)],
                     durable=False)
    made.append(("pieces", path, None))

    # OCANNL-style files by hand: path-less entries, padding, no alignment, Uint4x32, Void.
    ocannl = _raw("((version 1) (tensors (((id 0) (namespace \"\") (label (a)) (prec Single_prec) "
                  "(dims (3 4)) (padding (((1 1) (1 1)) 0.)) (offset 0) (byte_length 8)) "
                  "((id 1) (namespace ocannl) (label (k)) (prec Uint4x32_prec) (dims (2)) "
                  "(padding none) (offset 8) (byte_length 32)) "
                  "((id 2) (namespace ocannl) (label (v)) (prec Void_prec) (dims (5)) "
                  "(padding none) (offset 40) (byte_length 0)))))",
                  np.arange(2, dtype="<f4").tobytes() + np.arange(8, dtype="<u4").tobytes())
    path = os.path.join(directory, "ocannl.jckpt")
    with open(path, "wb") as f:
        f.write(ocannl)
    made.append(("ocannl", path, None))

    seeds = []
    # A directory checkpoint (two piece files): its index is a seed, mutated like any file.
    from jckpt.api.multiprocess import save_directory

    dtree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "s": np.int32(3),
             "n": {"k": np.arange(5, dtype=np.int64)}}
    ddir = os.path.join(directory, "dir.jckpt")
    save_directory(ctx, dtree, ddir)
    with open(os.path.join(ddir, "index.jckpt"), "rb") as f:
        index = f.read()
    _, dvalues = jckpt.load(jckpt.Context(host=True), ddir, mmap=False)
    seeds.append(Seed("index", index, 4 + struct.unpack(">I", index[:4])[0], dvalues, [],
                      jax.tree_util.tree_map(np.asarray, dtree), directory=ddir))
    # Files of other formats, read through the adapters (byte mutations only).
    from jckpt.adapters import read as read_format
    from jckpt.adapters import write as write_format

    atree = {"jckpt": {"w": np.arange(12, dtype=np.float32).reshape(3, 4),
                       "b": np.arange(5, dtype=np.int64), "h": np.ones(3, np.float16)}}
    for fmt, ext in (("safetensors", ".safetensors"), ("npz", ".npz"), ("torch", ".pth"),
                     ("ocannl", ".ckpt")):
        path = os.path.join(directory, "adapter" + ext)
        try:
            write_format(atree, path, format=fmt)
            read_format(path, format=fmt)
        except Exception:  # a format whose optional package is missing
            continue
        with open(path, "rb") as f:
            seeds.append(Seed(fmt, f.read(), 0, None, [], format=fmt))
    for name, path, tree in made:
        with open(path, "rb") as f:
            data = f.read()
        reader = CheckpointReader(path)
        spans = [(reader.data_start + e.offset, reader.data_start + e.offset + e.byte_length)
                 for e in reader.header.tensors if e.checksum is not None and e.byte_length]
        values = None
        if name != "ocannl":  # a Void entry cannot be loaded: only restore/decode apply
            _, values = jckpt.load(jckpt.Context(host=True), path, mmap=False)
        target = None
        if tree is not None and name not in ("keys", "appended"):
            target = jax.tree_util.tree_map(np.asarray, tree)
        seeds.append(Seed(name, data, reader.data_start, values, spans, target))
    return seeds


# --- mutations -----------------------------------------------------------------

INTERESTING_INTS = ["0", "1", "-1", "2", "3", "4", "7", "8", "31", "32", "33", "255", "256",
                    "65535", "2147483647", "2147483648", "4294967295", "4294967296",
                    "9223372036854775807", "9223372036854775808", "-9223372036854775808",
                    "18446744073709551615", "18446744073709551616", "1" + "0" * 40,
                    "-0", "+1", "1e3", "0x10", "01", "1_000", "\u0661", "\u00b2", "-\u00b2"]
INTERESTING_ATOMS = ["", "none", "nan", "inf", "-inf", "0.", "1.5", "k", "ki", "i", "a", "f",
                     "Single_prec", "Void_prec", "Uint4x32_prec", "Quad_prec", "xxh3_64",
                     "threefry2x32", "jckpt", "ocannl", "..", "/etc/passwd", "a\u00e9",
                     "\x00", "(", ")", '"', "\\", ";", "x" * 300, "version", "tensors"]
HUGE = [2**31, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64, 10**30]


def _rand_atom(rng: random.Random) -> str:
    pick = rng.random()
    if pick < 0.5:
        return rng.choice(INTERESTING_INTS)
    if pick < 0.9:
        return rng.choice(INTERESTING_ATOMS)
    return str(rng.randrange(-2**70, 2**70))


def _rand_sexp(rng: random.Random, depth: int = 0) -> Any:
    if depth > 6 or rng.random() < 0.4:
        return _rand_atom(rng)
    return [_rand_sexp(rng, depth + 1) for _ in range(rng.randrange(0, 4))]


def _nodes(tree: Any, out: list, parent=None, index=None, depth=0):
    """Every node with its parent list and index (pre-order)."""
    out.append((tree, parent, index, depth))
    if isinstance(tree, list) and depth < 80:
        for i, child in enumerate(tree):
            _nodes(child, out, tree, i, depth + 1)
    return out


def _entries(tree: Any) -> list[list]:
    """The entry nodes (lists of (key value) pairs) of a parsed header, if it has them."""
    if not isinstance(tree, list):
        return []
    for field in tree:
        if isinstance(field, list) and len(field) == 2 and field[0] == "tensors" \
                and isinstance(field[1], list):
            return [e for e in field[1] if isinstance(e, list)]
    return []


def _field(entry: list, key: str) -> list | None:
    for f in entry:
        if isinstance(f, list) and len(f) == 2 and f[0] == key:
            return f
    return None


def _mutate_tree(rng: random.Random, tree: Any) -> str:
    """Apply one structural edit to a parsed header in place; return its name."""
    nodes = _nodes(tree, [])
    children = [n for n in nodes if n[1] is not None]
    entries = _entries(tree)
    kind = rng.choice(["delete", "duplicate", "swap", "replace_atom", "replace_random",
                       "splice", "wrap", "unwrap", "deep", "huge_dims", "overlap",
                       "number", "number", "padding", "alignment", "slice", "path"])
    if kind in ("huge_dims", "overlap", "padding", "number", "slice", "path") and not entries:
        kind = "replace_atom"
    if not children:
        return "none"
    node, parent, index, _ = rng.choice(children)
    if kind == "delete":
        del parent[index]
    elif kind == "duplicate":
        parent.insert(index, _copy(node))
    elif kind == "swap":
        other = rng.choice(children)
        other[1][other[2]], parent[index] = node, other[0]
    elif kind == "replace_atom":
        atoms = [n for n in children if isinstance(n[0], str)]
        n = rng.choice(atoms) if atoms else rng.choice(children)
        n[1][n[2]] = _rand_atom(rng)
    elif kind == "replace_random":
        parent[index] = _rand_sexp(rng)
    elif kind == "splice":
        parent[index] = _copy(rng.choice(nodes)[0])
    elif kind == "wrap":
        parent[index] = [node]
    elif kind == "unwrap":
        lists = [n for n in children if isinstance(n[0], list) and n[0]]
        if lists:
            n = rng.choice(lists)
            n[1][n[2]] = n[0][rng.randrange(len(n[0]))]
    elif kind == "deep":
        deep = node
        for _ in range(rng.choice([10, 50, 63, 64, 65, 100, 1000])):
            deep = [deep]
        parent[index] = deep
    elif kind == "huge_dims":
        e = rng.choice(entries)
        dims, length = _field(e, "dims"), _field(e, "byte_length")
        if dims is not None:
            new = [str(rng.choice(HUGE)) if rng.random() < 0.5 else str(rng.randrange(0, 5))
                   for _ in range(rng.randrange(1, 4))]
            dims[1] = new
            if length is not None and rng.random() < 0.7:  # make it consistent
                total = 1
                for d in new:
                    total *= int(d)
                length[1] = str(total * rng.choice([1, 2, 4, 8]))
    elif kind == "overlap":
        a, b = rng.choice(entries), rng.choice(entries)
        fa, fb = _field(a, "offset"), _field(b, "offset")
        if fa is not None and fb is not None:
            fa[1] = fb[1] if rng.random() < 0.5 else str(max(0, int(_num(fb[1])) + rng.randrange(-8, 8)))
    elif kind == "number":
        e = rng.choice(entries)
        f = _field(e, rng.choice(["id", "offset", "byte_length", "dims"]))
        if f is not None:
            if isinstance(f[1], list) and f[1]:
                i = rng.randrange(len(f[1]))
                f[1][i] = _bump(rng, f[1][i])
            elif isinstance(f[1], str):
                f[1] = _bump(rng, f[1])
    elif kind == "padding":
        e = rng.choice(entries)
        f, dims = _field(e, "padding"), _field(e, "dims")
        if f is not None and dims is not None and isinstance(dims[1], list):
            big = rng.random() < 0.5
            f[1] = [[[str(rng.choice(HUGE) if big else rng.randrange(0, 3)),
                      str(rng.randrange(0, 3))] for _ in dims[1]], rng.choice(["0.", "nan", "1e400", "x"])]
            if big:
                dims[1] = [str(int(_num(d)) + 2**40) for d in dims[1]]
    elif kind == "alignment":
        if isinstance(tree, list):
            tree.insert(1, ["alignment", rng.choice(INTERESTING_INTS)])
    elif kind == "slice":
        e = rng.choice(entries)
        dims = _field(e, "dims")
        n = len(dims[1]) if dims is not None and isinstance(dims[1], list) else 1
        e.append(["slice", [[rng.choice(INTERESTING_INTS), rng.choice(INTERESTING_INTS)]
                            for _ in range(n)]])
        if rng.random() < 0.8:
            e.append(["global_dims", [rng.choice(INTERESTING_INTS) for _ in range(n)]])
    elif kind == "path":
        e = rng.choice(entries)
        comps = [[rng.choice(["k", "ki", "i", "a", "f", "x"]), _rand_atom(rng)]
                 for _ in range(rng.randrange(0, 4))]
        f = _field(e, "path")
        if f is not None:
            f[1] = comps
        else:
            e.append(["path", comps])
    return kind


def _num(atom: Any) -> int:
    try:
        return int(atom)
    except (TypeError, ValueError):
        return 0


def _bump(rng: random.Random, atom: Any) -> str:
    v = _num(atom)
    return str(rng.choice([v + 1, v - 1, v * 2, -v, v + 2**32, v + 2**63, 2**64 - 1, 0,
                           v + rng.randrange(-64, 64)]))


def _copy(x: Any) -> Any:
    return [_copy(v) for v in x] if isinstance(x, list) else x


def _rebuild(seed: Seed, text: str, rng: random.Random) -> bytes:
    """A file with ``text`` as header and the seed's data, realigned so offsets still fit."""
    body = text.encode("utf-8", "surrogatepass")
    old_hlen = seed.header_end - 4
    if len(body) <= old_hlen and rng.random() < 0.7:
        body += b" " * (old_hlen - len(body))
    else:
        body += b" " * ((-(4 + len(body))) % 32)
    return struct.pack(">I", len(body)) + body + seed.data[seed.header_end:]


def _header_text(seed: Seed) -> str:
    return seed.data[4:seed.header_end].decode("utf-8")


def mutate(rng: random.Random, seeds: list[Seed]) -> tuple[bytes, str, Seed | None, dict]:
    """One fuzz case: ``(file bytes, mutation name, the seed it came from, facts for oracles)``."""
    from jckpt.format.sexp import SexpError, dumps, parse

    others = [s for s in seeds if s.format is not None]
    if others and rng.random() < 0.15:
        seed = rng.choice(others)
    else:
        seed = rng.choice([s for s in seeds if s.format is None])
    data = bytearray(seed.data)
    if seed.format is not None:  # another format: its bytes, mutated
        kind = rng.choice(["bitflip", "bitflip", "truncate", "extend", "format_bytes"])
        if kind == "format_bytes" and data:
            pos = rng.randrange(min(len(data), 512))  # where the headers and directories are
            data[pos] = rng.choice(b'\x00\xff\x7f09-"[{}:,')
        else:
            data, kind, _, _ = _bytes_mutation(rng, data, seed, kind)
        return bytes(data), "format", seed, {}
    kind = rng.choice(["bitflip", "bitflip", "payload_flip", "header_flip", "truncate",
                       "hlen", "header_bytes", "structural", "structural", "structural",
                       "structural", "extend", "splice", "random", "random_sexp", "multi"])
    facts: dict = {}
    if kind == "multi":
        for _ in range(rng.randrange(2, 6)):
            data, _, _, _ = _bytes_mutation(rng, data, seed, rng.choice(
                ["bitflip", "truncate", "hlen", "header_bytes", "extend"]))
        return bytes(data), kind, seed, facts
    if kind == "structural":
        tree = parse(_header_text(seed))
        what = "none"
        try:
            for _ in range(rng.choice([1, 1, 1, 2, 3])):
                what = _mutate_tree(rng, tree)
                if what == "deep":
                    break
            text = dumps(tree)
        except RecursionError:  # the mutator's own limit, not the reader's
            return bytes(data), "structural:none", seed, facts
        return _resealed(rng, _rebuild(seed, text, rng)), f"structural:{what}", seed, facts
    if kind == "random":
        n = rng.choice([0, 1, 3, 4, 5, 8, 64, 512, 4096])
        out = bytearray(rng.randbytes(n))
        if n >= 4 and rng.random() < 0.5:
            out[:4] = struct.pack(">I", rng.randrange(0, n))
        return bytes(out), kind, None, facts
    if kind == "random_sexp":
        try:
            text = dumps(["version", "1"]) if rng.random() < 0.1 else dumps(
                [["version", "1"], ["tensors", [_rand_sexp(rng) for _ in range(rng.randrange(3))]],
                 *[_rand_sexp(rng) for _ in range(rng.randrange(3))]])
        except (TypeError, SexpError):
            text = "()"
        body = text.encode()
        return struct.pack(">I", len(body)) + body + rng.randbytes(rng.randrange(0, 64)), kind, \
            None, facts
    if kind == "splice":
        other = rng.choice([s for s in seeds if s.format is None]).data
        cut = rng.randrange(len(data) + 1)
        return bytes(data[:cut]) + other[rng.randrange(len(other) + 1):], kind, seed, facts
    data, kind, seed, facts = _bytes_mutation(rng, data, seed, kind)
    if kind == "header_bytes":
        data = _resealed(rng, bytes(data))
    return bytes(data), kind, seed, facts


def _resealed(rng: random.Random, data: bytes) -> bytes:
    """Most of the time, ``data`` with its header checksum recomputed, as a crafted file's
    author would: else the checksum alone would refuse nearly every edited header."""
    from jckpt.format.header_seal import seal_header

    if rng.random() < 0.2 or len(data) < 4:
        return data
    end = 4 + struct.unpack(">I", data[:4])[0]
    return seal_header(data[:end]) + data[end:] if end <= len(data) else data


def _bytes_mutation(rng, data: bytearray, seed: Seed, kind: str):
    facts: dict = {}
    if kind == "payload_flip" and seed.spans:
        start, end = rng.choice(seed.spans)
        pos = rng.randrange(start, end)
        data[pos] ^= 1 << rng.randrange(8)
        facts["payload_flip"] = pos
    elif kind == "header_flip" or (kind == "payload_flip" and not seed.spans):
        pos = rng.randrange(0, seed.header_end)
        data[pos] ^= 1 << rng.randrange(8)
        kind = "header_flip"
    elif kind == "bitflip" and data:
        for _ in range(rng.choice([1, 1, 2, 8])):
            pos = rng.randrange(len(data))
            data[pos] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        data = data[:rng.randrange(len(data) + 1)]
    elif kind == "hlen" and len(data) >= 4:
        hlen = struct.unpack(">I", data[:4])[0]
        data[:4] = struct.pack(">I", rng.choice([
            0, 1, 2, 4, 0xFFFFFFFF, 0x7FFFFFFF, len(data), len(data) - 4, len(data) - 3,
            hlen + rng.randrange(-40, 40) % 2**32, rng.randrange(2**32)]) % 2**32)
    elif kind == "header_bytes" and seed.header_end > 4:
        pos = rng.randrange(4, seed.header_end)
        op = rng.random()
        junk = bytes(rng.choice(b"()\" \\;#|\x00\xff\xc3\n0123456789-az") for _ in range(
            rng.randrange(1, 6)))
        if op < 0.4:
            data[pos:pos + len(junk)] = junk
        elif op < 0.7:
            data[pos:pos] = junk
        else:
            del data[pos:pos + rng.randrange(1, 8)]
    elif kind == "extend":
        data += rng.choice([bytes(rng.randrange(1, 100)), rng.randbytes(rng.randrange(1, 100))])
    return data, kind, seed, facts


# --- running one case ------------------------------------------------------------

class Disallowed(Exception):
    """A case broke the contract (the message says how)."""


def _same(a: Any, b: Any) -> bool:
    """Trees equal, array leaves bit for bit (dtype, shape and bytes)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if a is None or b is None:
        return a is b
    a, b = _plain(a), _plain(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _plain(x: Any) -> np.ndarray:
    """A numpy array of ``x`` (a typed PRNG key becomes its key data)."""
    import jax

    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def check_directory_case(directory: str, data: bytes, seed: Seed) -> str:
    """A directory checkpoint whose index is the case: read it every way."""
    import jckpt
    from jckpt.errors import CheckpointError
    from jckpt.storage.directory import DirectoryReader

    try:
        reader = DirectoryReader(directory)
    except CheckpointError as e:
        _names_file(e, directory)
        return "refused:" + type(e).__name__
    try:
        bad = reader.verify()
    except CheckpointError as e:  # a piece file the index names is missing or damaged
        _names_file(e, directory)
        bad = [e]
    del reader
    header_same = data[:seed.header_end] == seed.data[:seed.header_end]
    outcome = "loaded"
    ctx = jckpt.Context(host=True)
    for mm, verify in ((False, None), (True, True)):
        try:
            _, tree = jckpt.load(ctx, directory, mmap=mm, verify=verify)
        except CheckpointError as e:
            _names_file(e, directory)
            outcome = "refused:" + type(e).__name__
            continue
        if header_same and not bad and not _same(tree, seed.values):
            raise Disallowed("a directory with its index intact loaded other values")
        del tree
    try:
        jckpt.restore(ctx, seed.target, directory, mmap=False)
    except CheckpointError as e:
        _names_file(e, directory)
    try:
        jckpt.describe(directory)
    except CheckpointError as e:
        _names_file(e, directory)
    return outcome


def check_case(path: str, data: bytes, seed: Seed | None, facts: dict) -> str:
    """Read the case every way; return its outcome or raise :class:`Disallowed`."""
    import jckpt
    from jckpt.errors import CheckpointError, ChecksumError
    from jckpt.storage.reader import CheckpointReader

    if seed is not None and seed.directory is not None:
        return check_directory_case(os.path.dirname(path), data, seed)
    if seed is not None and seed.format is not None:
        from jckpt.adapters import detect_format
        from jckpt.adapters import read as read_format

        try:
            detect_format(path)
            read_format(path, format=seed.format)
        except CheckpointError as e:
            _names_file(e, path)
            return "refused:" + type(e).__name__
        return "loaded"
    outcome = "loaded"
    try:
        reader = CheckpointReader(path)
    except CheckpointError as e:
        _names_file(e, path)
        return "refused:" + type(e).__name__
    header_same = seed is not None and data[:seed.header_end] == seed.data[:seed.header_end]
    bad = reader.verify()
    for err in bad:
        _names_file(err, path)
    if "payload_flip" in facts and header_same and not bad:
        raise Disallowed("verify() missed a flipped payload bit")
    decoded = {}
    for e in reader.header.tensors:
        for mm in (False, True):
            try:
                a = reader.decode(e, mmap=mm, verify=not mm, count=False)
                decoded.setdefault(e.identity, []).append(a)
            except ChecksumError as err:
                _names_file(err, path)
                outcome = "checksum"
            except CheckpointError as err:
                _names_file(err, path)
                outcome = "refused:" + type(err).__name__
            else:
                if a.shape != e.shape or a.dtype != e.dtype:
                    raise Disallowed(f"decoded {a.shape} {a.dtype} for {e.shape} {e.dtype}")
    for arrays in decoded.values():
        if len(arrays) == 2 and arrays[0].tobytes() != arrays[1].tobytes():
            raise Disallowed("mapped and decoded payloads differ")
    del decoded, reader

    ctx = jckpt.Context(host=True)
    for mm, verify in ((False, None), (True, False), (True, True)):
        try:
            _, tree = jckpt.load(ctx, path, mmap=mm, verify=verify)
        except ChecksumError as e:
            _names_file(e, path)
            outcome = "checksum"
            continue
        except CheckpointError as e:
            _names_file(e, path)
            outcome = outcome if outcome == "checksum" else "refused:" + type(e).__name__
            continue
        if "payload_flip" in facts and header_same and (verify or not mm):
            raise Disallowed(f"load(mmap={mm}, verify={verify}) missed a flipped payload bit")
        if header_same and not bad and seed.values is not None and not _same(tree, seed.values):
            raise Disallowed("loaded values differ from the original's with the header intact "
                             "and every checksum verified")
        del tree
    if seed is not None and seed.target is not None:
        try:
            jckpt.restore(ctx, seed.target, path, mmap=False)
        except CheckpointError as e:
            _names_file(e, path)
    try:
        jckpt.describe(path)
    except CheckpointError as e:
        _names_file(e, path)
    return outcome


def _names_file(err: Exception, path: str) -> None:
    if path not in str(err):
        raise Disallowed(f"error does not name the file: {err}")


# --- the worker --------------------------------------------------------------

def _limit_memory(largest_file: int) -> int:
    """Cap the address space at what is mapped now plus a budget sized by the file size."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = vm + SPACE_BUDGET + SPACE_PER_FILE_BYTE * largest_file
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return limit


def run(seed: int, cases: int, workdir: str, *, soft_limit: float = 2.0,
        hard_limit: float = 30.0, keep: str | None = None, limit_memory: bool = True) -> dict:
    """Run ``cases`` fuzz cases from ``seed``; return the summary dict."""
    corpus_dir = tempfile.mkdtemp(prefix="corpus-", dir=workdir)
    seeds = build_corpus(corpus_dir)
    rng = random.Random(seed)
    file_case = os.path.join(workdir, "case.jckpt")
    # A directory case: the seed's piece files, and the case as its index.
    dir_case = os.path.join(workdir, "dircase")
    os.mkdir(dir_case)
    for s in seeds:
        if s.directory is not None:
            for name in os.listdir(s.directory):
                if name != "index.jckpt":
                    shutil.copyfile(os.path.join(s.directory, name), os.path.join(dir_case, name))
    index_case = os.path.join(dir_case, "index.jckpt")

    def where(origin: Seed | None) -> str:
        return index_case if origin is not None and origin.directory is not None else file_case

    # Warm every code path once before capping memory, so lazy imports are not counted.
    for s in seeds:
        _write(where(s), s.data)
        check_case(where(s), s.data, s, {})
    limit = _limit_memory(MAX_CASE_BYTES) if limit_memory else None
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    kinds: Counter = Counter()
    outcomes: Counter = Counter()
    failures = []
    slowest = 0.0
    started = time.perf_counter()
    for n in range(cases):
        data, kind, origin, facts = mutate(rng, seeds)
        data = data[:MAX_CASE_BYTES]
        kinds[kind.split(":")[0]] += 1
        path = where(origin)
        _write(path, data)
        faulthandler.dump_traceback_later(hard_limit, exit=True)
        t0 = time.perf_counter()
        try:
            outcome = check_case(path, data, origin, facts)
        except Exception as e:  # anything but a CheckpointError escaping is the finding
            outcome = "FAIL"
            failures.append(_failure(seed, n, kind, e, data, keep))
        elapsed = time.perf_counter() - t0
        if elapsed > soft_limit and outcome != "FAIL":  # a stall of a shared machine, or slow?
            t0 = time.perf_counter()
            try:
                check_case(path, data, origin, facts)
            except Exception:
                pass
            elapsed = time.perf_counter() - t0
        faulthandler.cancel_dump_traceback_later()
        slowest = max(slowest, elapsed)
        if elapsed > soft_limit:
            failures.append({"seed": seed, "case": n, "kind": kind,
                             "error": f"took {elapsed:.2f} s (limit {soft_limit} s)",
                             "file": _keep(data, keep, seed, n)})
        outcomes[f"{kind.split(':')[0]} -> {outcome}"] += 1
    return {"seed": seed, "cases": cases, "seconds": round(time.perf_counter() - started, 2),
            "slowest_case_s": round(slowest, 4), "address_space_limit": limit,
            "peak_rss_growth_mib": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                          - rss_before) / 1024, 1),
            "kinds": dict(sorted(kinds.items())), "outcomes": dict(sorted(outcomes.items())),
            "loaded": sum(v for k, v in outcomes.items() if k.endswith("-> loaded")),
            "refused": sum(v for k, v in outcomes.items() if "-> refused" in k),
            "checksum": sum(v for k, v in outcomes.items() if k.endswith("-> checksum")),
            "failures": failures}


def _write(path: str, data: bytes) -> None:
    # A fresh inode per case: arrays still mapping the previous case keep their own file.
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _keep(data: bytes, keep: str | None, seed: int, n: int) -> str | None:
    if keep is None:
        return None
    os.makedirs(keep, exist_ok=True)
    out = os.path.join(keep, f"fuzz-{seed}-{n}.jckpt")
    with open(out, "wb") as f:
        f.write(data)
    return out


def _failure(seed, n, kind, exc, data, keep) -> dict:
    return {"seed": seed, "case": n, "kind": kind, "error": f"{type(exc).__name__}: {exc}"[:500],
            "traceback": "".join(traceback.format_exception(exc))[-2000:],
            "file": _keep(data, keep, seed, n)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=20_000, help="cases per seed")
    parser.add_argument("--seed", type=int, action="append", help="repeatable (default 1)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes, one per seed")
    parser.add_argument("--soft-limit", type=float, default=2.0, help="seconds a case may take")
    parser.add_argument("--hard-limit", type=float, default=30.0,
                        help="seconds after which a stuck case kills the worker with a traceback")
    parser.add_argument("--keep", help="directory for the files of failing cases")
    parser.add_argument("--json", help="write the summary here too")
    parser.add_argument("--no-memory-limit", action="store_true")
    args = parser.parse_args(argv)
    seeds = args.seed or [1]
    if args.jobs > 1 and len(seeds) > 1:
        import concurrent.futures as cf
        import multiprocessing as mp
        with cf.ProcessPoolExecutor(min(args.jobs, len(seeds)),
                                    mp_context=mp.get_context("spawn")) as pool:
            results = list(pool.map(_run_one, [(s, args) for s in seeds]))
    else:
        results = [_run_one((s, args)) for s in seeds]
    summary = {"cases": sum(r["cases"] for r in results),
               "failures": sum(len(r["failures"]) for r in results), "runs": results}
    text = json.dumps(summary, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    return 1 if summary["failures"] else 0


def _run_one(job) -> dict:
    seed, args = job
    workdir = tempfile.mkdtemp(prefix="jckpt-fuzz-",
                               dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    try:
        return run(seed, args.cases, workdir, soft_limit=args.soft_limit,
                   hard_limit=args.hard_limit, keep=args.keep,
                   limit_memory=not args.no_memory_limit)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(main())
