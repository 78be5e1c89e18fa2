"""Mutation fuzzing of every reader, each case in a process of its own, outcomes classified.

``fuzz_reader.py`` and ``fuzz_formats.py`` run their cases one after another in one worker,
which stops at the first crash or hang. This fuzzer starts from a corpus of real files
(written by jckpt and, where installed, by numpy, torch, safetensors and orbax themselves),
mutates one file of a sample per case, and reads the case in a child forked for it, under
an address-space limit and a timeout, so that a segfault, a hang or a memory blow-up is one
classified outcome among thousands, not the end of the run.

Corpus (``FAMILIES``): a native file; a directory checkpoint (its index and piece files);
a manager directory of a file step and a step directory (``trainer_state.json``, the model
as ``.npz``, ``optimizer.jckpt``); safetensors; ``.npy``; ``.npz`` (stored and deflated);
a torch zip archive and a legacy torch pickle; llm.c; OCANNL; orbax step directories
(zarr and OCDBT, written by orbax through tensorstore).

Mutations (``MUTATORS``): bit flips, byte stores, truncations, appended junk, a splice of the
file over itself, length and size fields set to extremes (the native ``HLEN``, the safetensors
header length, the ``.npy`` header length, zip sizes and offsets, llm.c's config ints), numbers
in a text header (S-expression or JSON) replaced by huge, negative, NaN, infinite or fractional
ones, deeply nested S-expressions and JSON, duplicated list items and JSON keys. A header in
a container (the native header, safetensors' JSON, an ``.npy`` dict, a member of a zip) is
mutated as text and written back with its length, its checksum and its zip CRC made right, as
a crafted file's author would, so that the reader gets past its first check.

Each case's child opens the case as users do: ``jckpt inspect`` (and, below 4 MiB, ``jckpt
verify`` and ``jckpt diff`` of the case with itself), ``jckpt.info`` (rendered), ``jckpt.verify``, and
a full read of every array (``open_checkpoint`` and every entry decoded and touched for jckpt's
own files and directories, ``jckpt.adapters.read`` for the others, the manager's step records,
model and optimizer for a manager directory).

Outcome classes: ``ok`` (read in full), ``refused`` (a ``CheckpointError`` naming the case's
path), and the defects: ``unnamed`` (a ``CheckpointError`` naming no path of the case),
``escape:<type>`` (any other exception), ``memory`` (``MemoryError``, or the child grew by more
than ``--rss-limit`` or ``RSS_PER_CASE_BYTE`` times the case's size, whichever is more, beyond
what reading its family's unmutated sample grows it: a forked child faults the interpreter's
and the libraries' pages in again as it runs, 2 to 25 MiB by family, which is no reader's
doing, and a legitimate header of tens of MB takes several times its size to read),
``crash:<signal>`` (the child died), ``hang`` (past ``--timeout``) and
``verify-raised``. Run::

    python -m tests.system.fuzz_hostile --cases 3000 --seed 1 --json summary.json

It prints (and writes) a JSON summary: cases per family and mutator, outcome counts, and the
first cases of each defect class (kept under ``--keep``), and exits 1 on any defect.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import zipfile
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from tests.helpers import cli_in_process
from tests.system.fuzz_formats import leaves

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Address space a child may add to its parent's.
SPACE_BUDGET = 1 << 30
#: Memory a reader may take per byte of a case beyond `--rss-limit`: what a legitimate file
#: costs. Reading a header holds its bytes, its text and what is decoded from it: opening a
#: jckpt file of 400,000 entries (an 84 MiB header) grew a forked child by 480 MiB (5.7 times);
#: a crafted 65 MiB header of such entries, refused at its end, by 265 MiB (4.1 times).
RSS_PER_CASE_BYTE = 6
#: The families and where each sample's bytes are in its directory (a file, or a directory
#: and its members).
FAMILIES = ("native", "directory", "manager", "safetensors", "npy", "npz", "torch_zip",
            "torch_legacy", "llmc", "ocannl", "orbax_zarr", "orbax_ocdbt")
EXTREMES = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**40]
NUMBERS = ["-1", "0", "-0", "1.5", "NaN", "nan", "Infinity", "-Infinity", "1e309", "2147483648",
           "4294967296", "9223372036854775807", "9223372036854775808", "18446744073709551616",
           "9" * 30, "-9223372036854775808", "007", "0x10", "1_000", "65536", "281474976710656"]


# --- the corpus ------------------------------------------------------------------------------

def _tree() -> dict[str, np.ndarray]:
    import ml_dtypes

    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(3, dtype=np.int64),
            "h": np.arange(6, dtype=np.float16).reshape(2, 3),
            "bf": np.arange(4, dtype=np.float32).astype(ml_dtypes.bfloat16),
            "s": np.array(2.5, np.float64), "e": np.zeros((0, 3), np.float32)}


def _native(out: str) -> None:
    import jckpt

    jckpt.save(jckpt.Context(), _tree(), os.path.join(out, "c.jckpt"), metadata={"note": "x"})


def _directory(out: str) -> None:
    sys.path.insert(0, ROOT)
    from tests.helpers import write_directory

    tree = _tree()
    write_directory(os.path.join(out, "ck"), {k: tree[k] for k in ("w", "b", "h")}, processes=3,
                    metadata={"note": "x"})


def _manager(out: str) -> None:
    import jckpt
    from jckpt.services.formats import CheckpointOptions

    tree = _tree()
    with jckpt.CheckpointManager(os.path.join(out, "run")) as mgr:
        mgr.save(1, {"w": tree["w"], "b": tree["b"]}, metrics={"loss": 1.5})
    with jckpt.CheckpointManager(os.path.join(out, "run"),
                                 options=CheckpointOptions(format="npz")) as mgr:
        mgr.save(2, items={"model": {"w": tree["w"]}, "opt": {"m": tree["b"]}},
                 metrics={"loss": 0.5})


def _foreign(out: str, family: str) -> None:
    from jckpt.adapters import write

    tree = {k: v for k, v in _tree().items() if k != "bf"}
    if family == "safetensors":
        write(tree, os.path.join(out, "m.safetensors"), format="safetensors")
    elif family == "npy":
        np.save(os.path.join(out, "a.npy"), tree["w"])
    elif family == "npz":
        np.savez(os.path.join(out, "a.npz"), **tree)
        np.savez_compressed(os.path.join(out, "z.npz"), **tree)
    elif family in ("torch_zip", "torch_legacy"):
        _torch(out, family, tree)


def _torch(out: str, family: str, tree: dict[str, np.ndarray]) -> None:
    try:
        import torch
    except ImportError:  # the fixtures torch wrote, when torch is not installed here
        if family == "torch_zip":
            shutil.copy(os.path.join(ROOT, "tests", "fixtures", "torch_model_state_dict.pth"), out)
        return
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tree.items()}
    state["view"] = state["w"][1:]  # a view of shared storage
    name = "m.pth" if family == "torch_zip" else "legacy.pt"
    torch.save(state, os.path.join(out, name),
               _use_new_zipfile_serialization=family == "torch_zip")


def _llmc(out: str) -> None:
    from jckpt.adapters import llmc

    config = llmc.Config(max_seq_len=4, vocab_size=5, num_layers=1, num_heads=1, channels=4,
                         padded_vocab_size=8)
    params = (np.arange(llmc.num_parameters(config)) % 5).astype(np.float32)
    with open(os.path.join(out, "gpt2.bin"), "wb") as f:
        f.write(llmc.encode_header(config, np.dtype(np.float32)) + params.tobytes())


def _ocannl(out: str) -> None:
    sys.path.insert(0, ROOT)
    from tests.system.fuzz_formats import make_ocannl

    rng = random.Random(0)
    while True:  # an unmutated case (a tenth of them)
        case = make_ocannl(rng, os.path.join(out, "o.ckpt"))
        if not case.mutations:
            return


def _orbax(out: str, family: str) -> None:
    import orbax.checkpoint as ocp

    tree = {k: v for k, v in _tree().items() if k not in ("e", "bf")}
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=family == "orbax_ocdbt")
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(os.path.abspath(os.path.join(out, "step", "default")), args=ocp.args.PyTreeSave(tree))


def make_corpus(root: str) -> dict[str, str]:
    """Write one sample directory per family under `root`; `{family: why}` of those skipped."""
    skipped = {}
    for family in FAMILIES:
        out = os.path.join(root, family)
        os.makedirs(out)
        try:
            if family in ("native", "directory", "manager", "llmc", "ocannl"):
                {"native": _native, "directory": _directory, "manager": _manager,
                 "llmc": _llmc, "ocannl": _ocannl}[family](out)
            elif family.startswith("orbax"):
                _orbax(out, family)
            else:
                _foreign(out, family)
        except ImportError as e:
            skipped[family] = str(e)
        if not os.listdir(out):
            shutil.rmtree(out)
            skipped.setdefault(family, "nothing written")
    return skipped


# --- mutations -------------------------------------------------------------------------------

def _members(sample: str) -> list[str]:
    """The files of a sample (relative), those that describe arrays listed twice (chosen more)."""
    out = []
    for root, _dirs, files in os.walk(sample):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), sample)
            weight = 3 if re.search(r"index|METADATA|zarray|trainer_state|manifest|\.json$", f) \
                else 1
            out += [rel] * weight
    return sorted(out)


def _flip(rng: random.Random, raw: bytearray) -> None:
    for _ in range(rng.choice([1, 1, 2, 8])):
        at = rng.randrange(min(len(raw), rng.choice([64, 512, len(raw)])))
        raw[at] ^= 1 << rng.randrange(8)


def _store(rng: random.Random, raw: bytearray) -> None:
    for _ in range(rng.choice([1, 3])):
        at = rng.randrange(len(raw))
        raw[at] = rng.choice([0, 0xFF, 0x7F, 0x80, ord("("), ord(")"), ord('"'), rng.randrange(256)])


def _truncate(rng: random.Random, raw: bytearray) -> None:
    del raw[rng.randrange(min(len(raw), rng.choice([16, 256, len(raw)]))):]


def _append(rng: random.Random, raw: bytearray) -> None:
    raw += rng.choice([b"\0" * rng.randrange(1, 5000), bytes(rng.randrange(256) for _ in range(64)),
                       b"PK\x05\x06" + b"\xff" * 18])


def _splice(rng: random.Random, raw: bytearray) -> None:
    a, b = rng.randrange(len(raw)), rng.randrange(len(raw))
    n = rng.randrange(1, 256)
    raw[b:b + n] = raw[a:a + n]


def _field(rng: random.Random, raw: bytearray) -> None:
    """A length or size field (a 1, 2, 4 or 8-byte integer near the start, or one of a zip's
    records) set to an extreme."""
    zips = [m.start() for m in re.finditer(rb"PK\x01\x02|PK\x03\x04|PK\x05\x06", raw)]
    if zips and rng.random() < 0.6:
        at = rng.choice(zips) + rng.choice([8, 10, 14, 16, 18, 20, 22, 24, 26, 28, 30, 34, 42])
    else:
        at = rng.choice([0, 4, 8, 12, 16, 20, 24, 28]) if rng.random() < 0.7 else rng.randrange(64)
    width, order = rng.choice([(1, "<"), (2, "<"), (4, "<"), (4, ">"), (8, "<")])
    value = rng.choice(EXTREMES) % (1 << (8 * width))
    if at + width <= len(raw):
        raw[at:at + width] = value.to_bytes(width, "little" if order == "<" else "big")


def _numbers(rng: random.Random, text: str) -> str:
    found = list(re.finditer(r"-?[0-9]+(?:\.[0-9]+)?", text))
    if not found:
        raise ValueError("no number")
    for m in rng.sample(found, min(len(found), rng.choice([1, 1, 2, 5]))):
        new = rng.choice(NUMBERS)
        text = text[:m.start()] + new + text[m.start() + len(m[0]):]  # lengths drift: fine
    return text


def _nest(rng: random.Random, text: str) -> str:
    opens = [m.start() for m in re.finditer(r"[(\[{]", text)]
    if not opens:
        raise ValueError("no list")
    at = rng.choice(opens)
    o, c = ("(", ")") if text[at] == "(" else ("[", "]")
    n = rng.choice([63, 64, 65, 100, 101, 1000, 100000])
    inner = o * n + c * n if rng.random() < 0.8 else o * n  # unbalanced, a fifth of the time
    return text[:at + 1] + inner + " " + text[at + 1:]


def _matching(text: str, at: int) -> int:
    depth, close = 0, {"(": ")", "[": "]"}[text[at]]
    for i in range(at, min(len(text), at + 200000)):
        depth += text[i] == text[at]
        depth -= text[i] == close
        if depth == 0:
            return i
    raise ValueError("unbalanced")


def _random_list(rng: random.Random, text: str) -> tuple[int, int]:
    """Where a list (or JSON array) of `text` picked at random opens and closes."""
    opens = [m.start() for m in re.finditer(r"[(\[]", text)]
    if not opens:
        raise ValueError("no list")
    at = rng.choice(opens)
    return at, _matching(text, at)


def _duplicate(rng: random.Random, text: str) -> str:
    """A list item copied next to itself (an entry, a field, a piece), or a JSON key twice."""
    keys = list(re.finditer(r'"([^"\\]{1,80})"\s*:', text))
    if keys and rng.random() < 0.5:
        m = rng.choice(keys)
        value = rng.choice(['0', '-1', '"x"', '[]', '{}', 'null', '[1e309]', '"F32"'])
        return text[:m.start()] + f'"{m[1]}": {value}, ' + text[m.start():]
    at, end = _random_list(rng, text)
    item = text[at:end + 1]
    sep = ", " if text[at] == "[" else " "
    return text[:end + 1] + (sep + item) * rng.choice([1, 1, 1000]) + text[end + 1:]


def _amplify(rng: random.Random, text: str) -> str:
    """A list item repeated a hundred thousand times or more (a piece of an index, an entry,
    a dim), spaced as jckpt writes or not: what a few MB of crafted header can ask."""
    at, end = _random_list(rng, text)
    item = text[at:end + 1]
    if len(item) > 200:
        raise ValueError("too long an item to repeat")
    sep = (", " if text[at] == "[" else rng.choice([" ", "  ", "\n"]))
    return text[:end + 1] + (sep + item) * rng.choice([20000, 100000, 400000]) + text[end + 1:]


BYTE_MUTATORS: dict[str, Callable[[random.Random, bytearray], None]] = {
    "bitflip": _flip, "store": _store, "truncate": _truncate, "append": _append,
    "splice": _splice, "length_field": _field}
TEXT_MUTATORS: dict[str, Callable[[random.Random, str], str]] = {
    "numbers": _numbers, "nest": _nest, "duplicate": _duplicate, "amplify": _amplify}
MUTATORS = (*BYTE_MUTATORS, *TEXT_MUTATORS)


# --- text headers inside containers ----------------------------------------------------------

def _split(raw: bytes) -> tuple[str, str, Callable[[str], bytes]] | None:
    """The text header of a file, its kind and how to put a changed one back; None if none."""
    if raw[:6] == b"\x93NUMPY" and len(raw) > 10:
        n, start = (struct.unpack("<H", raw[8:10])[0], 10) if raw[6] == 1 else \
            (struct.unpack("<I", raw[8:12])[0], 12)
        rest = raw[start + n:]
        return raw[start:start + n].decode("latin1"), "npy", lambda t: _npy(raw[6], t, rest)
    if len(raw) >= 8 and 0 < struct.unpack("<Q", raw[:8])[0] < len(raw) and raw[8:9] == b"{":
        n = struct.unpack("<Q", raw[:8])[0]
        rest = raw[8 + n:]
        return (raw[8:8 + n].decode("utf-8", "replace"), "json",
                lambda t: struct.pack("<Q", len(t.encode())) + t.encode() + rest)
    if len(raw) >= 5 and raw[4:5] == b"(":
        n = struct.unpack(">I", raw[:4])[0]
        rest = raw[4 + n:]
        return raw[4:4 + n].decode("utf-8", "replace"), "sexp", lambda t: _native_bytes(t, rest)
    if raw[:1] in (b"{", b"["):
        return raw.decode("utf-8", "replace"), "json", lambda t: t.encode()
    return None


def _npy(version: int, text: str, rest: bytes) -> bytes:
    body = text.encode("latin1", "replace")
    if version == 1:
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body) % 65536) + body + rest
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack("<I", len(body)) + body + rest


def _native_bytes(text: str, rest: bytes) -> bytes:
    """A native header changed as text, resealed as a crafted file's author would."""
    from jckpt.format.header_seal import seal_header

    body = text.encode("utf-8", "surrogatepass")
    head = struct.pack(">I", len(body)) + body
    try:
        return seal_header(head) + rest
    except Exception:  # a header the sealer cannot find its field in: left as it is
        return head + rest


def _mutate_zip(rng: random.Random, raw: bytes, name: str) -> tuple[bytes, str]:
    """One member of a zip archive mutated, the archive written again with right CRCs."""
    src = zipfile.ZipFile(io.BytesIO(raw))
    infos = src.infolist()
    target = rng.choice([i for i in infos if not i.is_dir()] or infos)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in infos:
            data = src.read(info)
            if info is target:
                data, name = mutate_bytes(rng, bytearray(data), name)
            dst.writestr(info, bytes(data), compress_type=info.compress_type)
    return out.getvalue(), f"{name}@member"


#: Text mutators left out of a run (`--skip amplify`, for a quicker one).
SKIPPED: set[str] = set()


def mutate_bytes(rng: random.Random, raw: bytearray, name: str = "") -> tuple[bytes, str]:
    """`raw` after one mutation; the mutation's name."""
    if raw[:2] == b"PK" and rng.random() < 0.5:
        try:
            return _mutate_zip(rng, bytes(raw), name)
        except Exception:  # not a zip Python reads (a mutation before this one): bytes then
            pass
    split = _split(bytes(raw)) if rng.random() < 0.5 else None
    if split is not None:
        text, _kind, put = split
        mutator = rng.choice([m for m in TEXT_MUTATORS if m not in SKIPPED])
        try:
            return put(TEXT_MUTATORS[mutator](rng, text)), mutator
        except ValueError:
            pass
    mutator = rng.choice(list(BYTE_MUTATORS))
    if not raw:
        raw += b"\0"
    BYTE_MUTATORS[mutator](rng, raw)
    return bytes(raw), mutator


def make_case(rng: random.Random, sample: str, dest: str) -> tuple[str, str]:
    """A copy of `sample` at `dest` with one of its files mutated (none in one case of 20);
    `(member, mutation)`."""
    shutil.copytree(sample, dest, symlinks=True)
    if rng.random() < 0.05:
        return "", "none"
    members, mutations = [], []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):  # stacked: a crafted file changes several
        member = rng.choice(_members(dest))
        path = os.path.join(dest, member)
        with open(path, "rb") as f:
            raw = bytearray(f.read())
        data, mutation = mutate_bytes(rng, raw)
        with open(path, "wb") as f:
            f.write(data)
        members.append(member)
        mutations.append(mutation)
    return "+".join(members), "+".join(mutations)


# --- reading a case (in the child) -------------------------------------------------------------

def _touch(tree: Any) -> None:
    for leaf in leaves(tree):
        if isinstance(leaf, np.ndarray):
            np.ascontiguousarray(leaf).tobytes()


def _read_native(path: str) -> None:
    from jckpt.storage.checkpoint import open_checkpoint

    reader = open_checkpoint(path)
    for e in reader.header.tensors:
        a = reader.decode(e, verify=True)
        _touch(a.read(tuple((0, d) for d in a.shape)) if hasattr(a, "read") else a)


def _read_manager(path: str) -> None:
    from jckpt.adapters import read
    from jckpt.format.names import OPTIMIZER_NAME, STEP_RE, TRAINER_STATE_NAME
    from jckpt.storage import step_directory

    for name in sorted(os.listdir(path)):
        m = STEP_RE.match(name)
        step = os.path.join(path, name)
        if not m:
            continue
        if os.path.isdir(step):
            step_directory.read_record(step, int(m.group(1)))
            for member in sorted(os.listdir(step)):
                if member not in (TRAINER_STATE_NAME, OPTIMIZER_NAME):
                    _touch(read(os.path.join(step, member)))
            _read_native(os.path.join(step, OPTIMIZER_NAME))
        else:
            _read_native(step)


def _restore_steps(path: str) -> None:
    """Every step through `CheckpointManager.restore`, as a resuming run reads it."""
    import jckpt

    with jckpt.CheckpointManager(path, ctx=jckpt.Context(host=True)) as mgr:
        for step in mgr.all_steps():
            _touch(mgr.restore(step).tree)


def read_case(family: str, path: str, *, with_jax: bool = True) -> None:
    """Open the case as a user does: info, verify (which must not raise), a full read
    (`with_jax`: `load`, and a manager's `restore`, too, which start JAX's runtime)."""
    import jckpt
    from jckpt.adapters import read

    target = _target(family, path)
    _cli("inspect", target)
    if _tree_size(target) < CLI_ALL_BELOW:  # an amplified header is read often enough already
        _cli("verify", target)
        _cli("diff", target, target)
    jckpt.info(target).render()
    try:
        jckpt.verify(target)
    except Exception as e:  # verify reports, never raises
        raise VerifyRaised(f"{type(e).__name__}: {e}") from e
    if family in ("native", "directory"):
        _read_native(target)
        if with_jax:
            _touch(jckpt.load(jckpt.Context(host=True), target)[1])
    elif family == "manager":
        _read_manager(target)
        if with_jax:
            _restore_steps(target)
    else:
        _touch(read(target))
        if family.startswith("orbax") and with_jax:
            _touch(jckpt.load(jckpt.Context(host=True), target)[1])


def _target(family: str, path: str) -> str:
    names = sorted(os.listdir(path))
    if family.startswith("orbax"):
        return os.path.join(path, "step")
    return os.path.join(path, names[0]) if names else path


#: Cases smaller than this go through `jckpt verify` and `jckpt diff` (against themselves) too.
CLI_ALL_BELOW = 4 << 20


def _tree_size(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path) if os.path.exists(path) else 0
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path)
               for f in files if os.path.isfile(os.path.join(root, f)))


def _cli(*args: str) -> None:
    """`jckpt ARGS`: an error must be one line naming what failed, never "unexpected"."""
    rc, err = cli_in_process(*args)
    if "error: unexpected " in err or rc not in (0, 1, 2):
        raise CliEscaped(f"jckpt {' '.join(args)}: exit {rc}: {err[-600:]}")


class CliEscaped(Exception):
    """The command line reported an unexpected error."""


class VerifyRaised(Exception):
    """`jckpt.verify` raised instead of reporting."""


def _vm_hwm_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _child(family: str, path: str, out: int) -> None:
    """In the forked child: read the case, write `{class, detail, rss_mib}` to `out`, exit."""
    from jckpt.errors import CheckpointError

    start = _vm_hwm_kib()
    try:
        read_case(family, path)
        result = {"class": "ok", "detail": ""}
    except CheckpointError as e:
        named = path in str(e) or (e.file is not None and path in e.file)
        result = {"class": "refused" if named else "unnamed", "detail": repr(e)[:400]}
    except VerifyRaised as e:
        result = {"class": "verify-raised", "detail": str(e)[:400]}
    except MemoryError as e:
        result = {"class": "memory", "detail": repr(e)[:200]}
    except BaseException as e:  # the defect the fuzzer looks for
        tb = traceback.format_exc(limit=-4)
        result = {"class": f"escape:{type(e).__name__}", "detail": f"{e!r}"[:300] + "\n" + tb[-1500:]}
    result["rss_mib"] = max(0, _vm_hwm_kib() - start) / 1024
    os.write(out, json.dumps(result).encode())
    os._exit(0)


def run_case(family: str, path: str, timeout: float, rss_limit_mib: float,
             slow: float = 5.0, baseline_mib: float = 0.0) -> dict[str, Any]:
    """Fork a child to read the case under the limits; its classified outcome. `rss_mib` is
    the child's growth less `baseline_mib` (its family's unmutated sample's, `baselines`): what
    the case cost the readers, which `rss_limit_mib` bounds; `child_rss_mib` the growth whole."""
    rfd, wfd = os.pipe()
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    pid = os.fork()
    if pid == 0:  # the child
        os.close(rfd)
        quiet = os.open(os.devnull, os.O_WRONLY)  # orbax's and absl's chatter, per case
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        try:
            resource.setrlimit(resource.RLIMIT_AS, (vm + SPACE_BUDGET, resource.RLIM_INFINITY))
            _child(family, path, wfd)
        finally:
            os._exit(3)
    os.close(wfd)
    started = time.monotonic()
    status = None
    while status is None:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
        elif time.monotonic() - started > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(rfd)
            return {"class": "hang", "detail": f"past {timeout} s", "seconds": timeout}
        else:
            time.sleep(0.002)
    raw = b""
    while chunk := os.read(rfd, 65536):
        raw += chunk
    os.close(rfd)
    seconds = time.monotonic() - started
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        return {"class": f"crash:{sig}", "detail": "the child died", "seconds": seconds}
    if not raw:
        return {"class": "crash:exit", "detail": f"exit {os.WEXITSTATUS(status)}",
                "seconds": seconds}
    result = json.loads(raw)
    result["child_rss_mib"] = result["rss_mib"]
    result["rss_mib"] = max(0.0, result["rss_mib"] - baseline_mib)
    limit = max(rss_limit_mib, RSS_PER_CASE_BYTE * _size(path) / 2**20)
    if result["class"] in ("ok", "refused") and result["rss_mib"] > limit:
        result = {**result, "class": "memory", "detail": f"grew {result['rss_mib']:.0f} MiB over "
                  f"its family's {baseline_mib:.0f} (limit {limit:.0f}); " + result["detail"]}
    elif result["class"] in ("ok", "refused") and seconds > slow:
        result = {**result, "class": "slow", "detail": f"took {seconds:.1f} s; " + result["detail"]}
    return {**result, "seconds": seconds}


# --- the run -----------------------------------------------------------------------------------

def _warm(corpus: str) -> None:
    """Import what the readers import (and read each sample once) before any fork, so that a
    child costs a fork, not imports; every sample must read. Orbax's samples are only
    imported for: reading starts JAX's and tensorstore's threads, and a forked child
    inherits their locks but not the threads (each orbax child starts its own)."""
    import threading

    from jckpt.errors import CheckpointError

    for family in sorted(os.listdir(corpus)):
        if family.startswith("orbax"):
            import orbax.checkpoint  # noqa: F401
        elif family == "torch_legacy":  # refused by design (jckpt reads torch's zip format)
            try:
                read_case(family, os.path.join(corpus, family), with_jax=False)
            except CheckpointError:
                pass
        else:
            read_case(family, os.path.join(corpus, family), with_jax=False)
    import jax  # imported, its runtime not started (each child that needs it starts it)

    if jax._src.xla_bridge._backends:
        raise RuntimeError("reading the corpus started JAX's runtime, whose threads a fork loses")
    if threading.active_count() != 1:
        raise RuntimeError(f"reading the corpus left {threading.active_count() - 1} threads: "
                           "children forked now could hang on their locks")


def _size(path: str) -> int:
    """Bytes of the files under `path` (a case's directory)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path)
               for f in files if not os.path.islink(os.path.join(d, f)))


def baselines(corpus: str, families: list[str], work: str, timeout: float) -> dict[str, float]:
    """What reading each family's unmutated sample grows a forked child by (MiB), the most of
    two reads: the interpreter's and the libraries' pages faulted in again, and the sample's
    own reading, which a case's growth is measured beyond."""
    out = {}
    for family in families:
        grown = []
        for i in range(2):
            dest = os.path.join(work, f"baseline-{family}-{i}")
            shutil.copytree(os.path.join(corpus, family), dest, symlinks=True)
            grown.append(run_case(family, dest, timeout, float("inf"))["child_rss_mib"])
            shutil.rmtree(dest, ignore_errors=True)
        out[family] = round(max(grown), 1)
    return out


def run(seed: int, cases: int, corpus: str, work: str, *, timeout: float, rss_limit_mib: float,
        keep: str | None, families: list[str] | None = None, slow: float = 5.0) -> dict[str, Any]:
    rng = random.Random(seed)
    present = sorted(f for f in os.listdir(corpus) if families is None or f in families)
    outcomes: Counter[str] = Counter()
    by_family: dict[str, Counter[str]] = {f: Counter() for f in present}
    by_mutation: Counter[str] = Counter()
    defects: dict[str, list[dict[str, Any]]] = {}
    slowest, started = 0.0, time.monotonic()
    baseline = baselines(corpus, present, work, timeout)
    largest: dict[str, Any] = {"rss_mib": 0.0}
    for n in range(cases):
        family = present[n % len(present)]
        case_seed = rng.randrange(2**32)
        dest = os.path.join(work, f"case{n}")
        member, mutation = make_case(random.Random(case_seed), os.path.join(corpus, family), dest)
        result = run_case(family, dest, timeout, rss_limit_mib, slow, baseline[family])
        cls = result["class"]
        if result.get("rss_mib", 0.0) > largest["rss_mib"]:
            largest = {"rss_mib": round(result["rss_mib"], 1), "family": family,
                       "case_seed": case_seed, "mutation": mutation}
        outcomes[cls] += 1
        by_family[family][cls] += 1
        by_mutation.update(m.replace("@member", "") for m in mutation.split("+"))
        slowest = max(slowest, result["seconds"])
        if cls not in ("ok", "refused"):
            found = defects.setdefault(cls, [])
            if len(found) < 5:
                found.append({"family": family, "case_seed": case_seed, "member": member,
                              "mutation": mutation, "detail": result["detail"]})
                if keep:
                    shutil.copytree(dest, os.path.join(keep, f"{cls.replace(':', '-')}-{n}"),
                                    symlinks=True)
        shutil.rmtree(dest, ignore_errors=True)
    return {"seed": seed, "cases": cases, "seconds": round(time.monotonic() - started, 1),
            "slowest_case_s": round(slowest, 2), "outcomes": dict(outcomes),
            "baseline_rss_mib": baseline, "largest_rss_growth": largest,
            "families": {f: dict(c) for f, c in by_family.items()},
            "mutations": dict(by_mutation), "defects": defects,
            "defect_count": sum(v for k, v in outcomes.items() if k not in ("ok", "refused"))}


def replay(family: str, sample: str, case_seed: int, dest: str) -> dict[str, Any]:
    """One case again, from its family's sample and its seed (what a defect's record gives)."""
    base = baselines(os.path.dirname(sample), [family], os.path.dirname(dest), 60)[family]
    member, mutation = make_case(random.Random(case_seed), sample, dest)
    return {"member": member, "mutation": mutation,
            **run_case(family, dest, 60, 1 << 20, baseline_mib=base)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=1200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--families", default="", help="comma-separated (default: all)")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds a case may take")
    p.add_argument("--rss-limit", type=float, default=256.0,
                   help="MiB a case's child may grow beyond its family's unmutated sample's "
                        f"(or {RSS_PER_CASE_BYTE} times the case's size, if more)")
    p.add_argument("--slow", type=float, default=5.0, help="seconds past which a case is slow")
    p.add_argument("--json", help="write the summary here too")
    p.add_argument("--keep", help="copy the first cases of each defect class here")
    p.add_argument("--corpus", help="use (or make) the corpus here")
    p.add_argument("--replay", nargs=2, metavar=("FAMILY", "CASE_SEED"))
    p.add_argument("--skip", default="", help="comma-separated text mutators to leave out")
    args = p.parse_args(argv)
    SKIPPED.update(m for m in args.skip.split(",") if m)
    work = tempfile.mkdtemp(prefix="jckpt-fuzz-hostile-")
    try:
        corpus = args.corpus or os.path.join(work, "corpus")
        if not os.path.isdir(corpus):
            skipped = _make_corpus_apart(corpus)
        else:
            skipped = {}
        _warm(corpus)
        if args.replay:
            print(json.dumps(replay(args.replay[0], os.path.join(corpus, args.replay[0]),
                                    int(args.replay[1]), os.path.join(work, "replay")), indent=1))
            return 0
        families = [f for f in args.families.split(",") if f] or None
        summary = run(args.seed, args.cases, corpus, work, timeout=args.timeout,
                      rss_limit_mib=args.rss_limit, keep=args.keep, families=families,
                      slow=args.slow)
        summary["skipped_families"] = skipped
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 1 if summary["defect_count"] else 0


def _make_corpus_apart(corpus: str) -> dict[str, str]:
    """The corpus, written by a process of its own: writing it starts JAX, orbax and
    tensorstore threads, and a process with threads must not fork children that read."""
    import subprocess

    os.makedirs(corpus)
    code = ("import json, sys; from tests.system.fuzz_hostile import make_corpus; "
            "print(json.dumps(make_corpus(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", code, corpus], cwd=ROOT, check=True,
                         capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu")).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
