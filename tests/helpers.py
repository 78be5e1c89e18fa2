"""Test helpers: write raw checkpoint files by hand, independently of the writer, and small
checkpoint files of named arrays through the storage writer (no JAX)."""

import io
import math
import os
import struct
import subprocess
import sys

import numpy as np

from jckpt.format import Entry, Header, lay_out, prec_of
from jckpt.format.header_seal import seal_header
from jckpt.format.names import piece_name
from jckpt.storage import ArraySource, CheckpointReader, write_checkpoint
from jckpt.storage.directory import write_index


def raw_file(text: str | bytes, data: bytes = b"", *, align: int = 1,
             hlen: int | None = None) -> bytes:
    """A file from header text and data bytes, padding the header to ``align``.

    A header that ends with a ``header_checksum`` field (text cut from a written file and
    edited) gets its checksum recomputed, as a crafted file's author would.
    """
    body = text.encode("utf-8") if isinstance(text, str) else text
    size = 4 + len(body)
    if align > 1:
        size = -(-size // align) * align
    body = body + b" " * (size - 4 - len(body))
    head = struct.pack(">I", len(body) if hlen is None else hlen) + body
    return (seal_header(head) if hlen is None else head) + data


def reseal(path) -> None:
    """Recompute the header checksum of the file at ``path`` after its header was edited."""
    raw = open(path, "rb").read()
    (hlen,) = struct.unpack(">I", raw[:4])
    with open(path, "r+b") as f:
        f.write(seal_header(raw[:4 + hlen]))


def entry_text(*, id=0, ns="jckpt", prec="Single_prec", dims="(1)", offset=0, length=4,
               padding="none", extra="") -> str:
    return (f"((id {id}) (namespace {ns}) (label (x)) (prec {prec}) (dims {dims}) "
            f"(padding {padding}) (offset {offset}) (byte_length {length}){extra})")


def header_text(*entries: str, version=1, alignment="(alignment 1)") -> str:
    return f"((version {version}) {alignment} (tensors ({' '.join(entries)})))"


def write_arrays(path, arrays, *, namespace="jckpt", alignment=32, metadata=None) -> str:
    """A checkpoint file of ``{'a/b': array}`` (ids in order, writer ``jckpt test``); its path."""
    entries, sources = [], []
    for i, (name, a) in enumerate(arrays.items()):
        a = np.asarray(a)
        entries.append(Entry(id=i, namespace=namespace, prec=prec_of(a.dtype), dims=a.shape,
                             offset=0, byte_length=a.nbytes, label=tuple(name.split("/")),
                             path=tuple(("k", p) for p in name.split("/"))))
        sources.append(ArraySource(a))
    header = lay_out(Header(tensors=tuple(entries), alignment=alignment, writer="jckpt test",
                            metadata=tuple((metadata or {}).items())))
    write_checkpoint(path, header, sources, durable=False)
    return str(path)


def write_directory(path, arrays, *, processes=2, metadata=None) -> str:
    """A directory checkpoint written by hand: each array of ``{'a/b': array}`` split along
    axis 0 over ``processes`` piece files, and the index; its path."""
    os.makedirs(path)
    pieces = {p: ([], []) for p in range(processes)}
    for i, (name, a) in enumerate(arrays.items()):
        a = np.asarray(a)
        bounds = np.linspace(0, a.shape[0], processes + 1).astype(int)
        for p in range(processes):
            lo, hi = int(bounds[p]), int(bounds[p + 1])
            part = np.ascontiguousarray(a[lo:hi])
            pieces[p][0].append(Entry(
                id=i, namespace="jckpt", prec=prec_of(a.dtype), dims=part.shape, offset=0,
                byte_length=part.nbytes, label=tuple(name.split("/")),
                path=tuple(("k", x) for x in name.split("/")),
                slice=((lo, hi), *((0, d) for d in a.shape[1:])), global_dims=a.shape))
            pieces[p][1].append(ArraySource(part))
    for p, (entries, sources) in pieces.items():
        write_checkpoint(os.path.join(path, piece_name(p)), lay_out(Header(tensors=tuple(entries))),
                         sources, durable=False)
    write_index(str(path), processes, 32, metadata or {}, durable=False)
    return str(path)


def corrupt_payload(path, name) -> None:
    """Flip every bit of the first byte of entry ``name``'s payload in the file, in place."""
    reader = CheckpointReader(path)
    entry = next(e for e in reader.header.tensors if e.name == name)
    where = reader.data_start + entry.offset
    del reader
    with open(path, "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0xFF]))


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def on_terminal(monkeypatch):
    """Replace sys.stderr by an in-memory terminal, outside CI (call it in the test body:
    pytest's output capture would undo it if done by a fixture)."""
    monkeypatch.delenv('CI', raising=False)
    monkeypatch.setenv('TERM', 'xterm-256color')
    fake = FakeTerminal()
    monkeypatch.setattr('sys.stderr', fake)
    return fake


def cpu_devices(n: int = 8) -> list:
    """The first ``n`` CPU devices (conftest gives the CPU 8 virtual ones).

    Tests that build meshes ask for CPU devices by platform, so they run the same whatever
    JAX's default backend is: with `JAX_PLATFORMS=cuda,cpu` a single GPU is the default.
    """
    import jax  # lazy: the format and storage tests use these helpers without JAX

    devices = jax.devices("cpu")
    assert len(devices) >= n, f"{n} CPU devices needed, JAX has {len(devices)}: see tests/conftest.py"
    return devices[:n]


def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """`jax.make_mesh(shape, names)` over the first CPU devices, whatever the default backend."""
    import jax

    return jax.make_mesh(tuple(shape), tuple(names), devices=cpu_devices(math.prod(shape)))


#: How `laid_out` may lay an array out in memory.
LAYOUTS = ("c", "f", "big", "strided")


def laid_out(array: np.ndarray, layout: str) -> np.ndarray:
    """`array`'s values in another memory layout: C order, Fortran order, big-endian, or a
    strided view (each but "c" leaves a copy that is not in stored form)."""
    if layout == "f" and array.ndim > 1:
        return np.asfortranarray(array)
    if layout == "big" and array.dtype.byteorder == "<":
        return array.astype(array.dtype.newbyteorder(">"))
    if layout == "strided" and array.ndim:
        return np.repeat(array, 2, axis=0)[::2]
    return array


def peak_bytes(call) -> int:
    """The most memory ``call()`` held at once (numpy's buffers included), even when it raises
    a `CheckpointError` (a hostile input's refusal); any other exception propagates."""
    import tracemalloc

    from jckpt.errors import CheckpointError
    tracemalloc.start()
    try:
        call()
    except CheckpointError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def cli_in_process(*args: str) -> tuple[object, str]:
    """`(exit status, stderr)` of `jckpt ARGS` run in this process, its output discarded: how
    the fuzzers hold the command line to its promise (an error is one line, never a traceback)."""
    import contextlib

    from jckpt.tools.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc: object = main(list(args))
        except SystemExit as e:
            rc = e.code
    return rc, err.getvalue()


def run_fuzzer(module: str, tmp_path, seed: int, cases: int, timeout: float) -> dict:
    """One run of the structure-aware fuzzer `module` (``tests.system.fuzz_formats`` or one
    built on its harness) in a subprocess under its caps: its summary, once no case failed."""
    import json
    import subprocess
    import sys

    out = tmp_path / "summary.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path), MALLOC_ARENA_MAX="2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", module, "--cases", str(cases),
         "--seed", str(seed), "--json", str(out), "--keep", str(tmp_path / "failing"),
         "--soft-limit", "5", "--hard-limit", "60"],
        cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.exists(), f"the fuzz worker died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    run = json.loads(out.read_text())["runs"][0]
    assert run["failures"] == [], json.dumps(run["failures"][:5], indent=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert run["cases"] == cases
    return run


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter on one CPU device, from the repository's root (so it
    imports this jckpt), with `args` as its argv; its output captured as text."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=root)
