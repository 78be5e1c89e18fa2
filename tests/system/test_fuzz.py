"""The reader as a security boundary: fuzzing, checksums, and the bugs fuzzing found.

The fuzz cases run in a subprocess (``tests/system/fuzz_reader.py``) under an
address-space limit and a per-case watchdog; see that module for the
mutations and oracles. Four seeds of 2,500 cases each: 10,000 per run, with 10,000 more of
the other readers in ``test_fuzz_formats.py``; ``JCKPT_FUZZ_SCALE=10`` runs ten times as many.
"""

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jckpt
from jckpt.errors import ChecksumError, FormatError
from jckpt.storage.reader import CheckpointReader
from tests.helpers import header_text, raw_file
from tests.system.fuzz_reader import record

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEEDS = (101, 202, 303, 404)
#: ``JCKPT_FUZZ_SCALE`` multiplies the cases (by hand: ``JCKPT_FUZZ_SCALE=20 pytest tests/system -k fuzz``).
SCALE = float(os.environ.get("JCKPT_FUZZ_SCALE", "1"))
CASES_PER_SEED = max(1, int(2500 * SCALE))


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_reader(tmp_path, seed):
    """Only a correct load or a CheckpointError, within a time and memory bound, per case."""
    out = tmp_path / "summary.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.system.fuzz_reader", "--cases", str(CASES_PER_SEED),
         "--seed", str(seed), "--json", str(out), "--keep", str(tmp_path / "failing"),
         "--soft-limit", "5", "--hard-limit", "60"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400 * max(1.0, SCALE))
    assert out.exists(), f"the fuzz worker died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    summary = json.loads(out.read_text())
    run = summary["runs"][0]
    assert run["failures"] == [], json.dumps(run["failures"][:5], indent=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert run["cases"] == CASES_PER_SEED
    # No case grew the process by 64 MiB (the case files are a few KiB; numbers in them are huge).
    assert run["peak_rss_growth_mib"] < 64, run["peak_rss_growth_mib"]
    # The corpus and mutations are not degenerate: every outcome and every mutation occurs.
    assert run["loaded"] > 0 and run["refused"] > 0 and run["checksum"] > 0
    assert set(run["kinds"]) >= {"bitflip", "payload_flip", "header_flip", "truncate", "hlen",
                                 "header_bytes", "structural", "random", "random_sexp"}
    record("fuzz", seed=seed, cases=run["cases"], loaded=run["loaded"], refused=run["refused"],
           checksum=run["checksum"], failures=len(run["failures"]),
           slowest_case_s=run["slowest_case_s"], seconds=run["seconds"],
           peak_rss_growth_mib=run["peak_rss_growth_mib"])


# --- checksums: a flipped payload bit is reported three ways ----------------------


def _payload_file(path):
    rng = np.random.default_rng(5)
    tree = {"w": rng.standard_normal((5, 7)).astype(np.float32), "b": np.arange(3, dtype=np.int8),
            "s": np.float64(2.5), "h": np.arange(9, dtype=np.float16)}
    jckpt.save(jckpt.Context(), tree, path)
    return tree


def test_every_flipped_payload_bit_is_reported(tmp_path):
    path = tmp_path / "c.jckpt"
    _payload_file(path)
    reader = CheckpointReader(path)
    good = path.read_bytes()
    rng = np.random.default_rng(0)
    flips = 0
    for e in reader.header.tensors:
        start = reader.data_start + e.offset
        for pos in range(start, start + e.byte_length):  # every byte, one random bit of each
            bad = bytearray(good)
            bad[pos] ^= 1 << int(rng.integers(8))
            path.write_bytes(bad)
            errors = CheckpointReader(path).verify()
            assert [err.entry for err in errors] == [e.name]
            with pytest.raises(ChecksumError, match=e.name):
                jckpt.load(jckpt.Context(host=True), path, mmap=False)
            with pytest.raises(ChecksumError, match=e.name):
                jckpt.load(jckpt.Context(host=True), path, mmap=True, verify=True)
            flips += 1
    path.write_bytes(good)
    assert CheckpointReader(path).verify() == []
    record("checksum_flips", flips=flips, detected_by_verify=flips, detected_by_decoding_load=flips,
           detected_by_verified_mapped_load=flips)


def test_flipped_bit_in_alignment_gap_changes_nothing(tmp_path):
    path = tmp_path / "c.jckpt"
    tree = _payload_file(path)
    reader = CheckpointReader(path)
    spans = sorted((reader.data_start + e.offset, reader.data_start + e.offset + e.byte_length)
                   for e in reader.header.tensors)
    gaps = [p for (_, end), (start, _) in itertools.pairwise(spans) for p in range(end, start)]
    assert gaps
    data = bytearray(path.read_bytes())
    for p in gaps:
        data[p] ^= 0xFF
    path.write_bytes(data)
    _, loaded = jckpt.load(jckpt.Context(host=True), path, mmap=False)
    for k, v in tree.items():
        assert np.asarray(loaded["jckpt"][k]).tobytes() == np.asarray(v).tobytes()


# --- regressions: what the fuzzer found -------------------------------------------

E = ("((id 0) (namespace jckpt) (label (x)) (prec Single_prec) (dims {dims}) (padding none) "
     "(offset 0) (byte_length {length}){extra})")


@pytest.mark.parametrize("name, entry, data, message", [
    ("list_as_path_kind", E.format(dims="(1)", length=4, extra=" (path (((k) a)))"), b"\0" * 4,
     "is not"),
    ("too_many_dims", E.format(dims="(" + " ".join(["1"] * 70) + ")", length=4, extra=""),
     b"\0" * 4, "beyond what numpy can represent"),
    ("empty_but_unrepresentable", E.format(dims="(0 4611686018427387904 2)", length=0, extra=""),
     b"", "beyond what numpy can represent"),
    ("huge_sequence_index", E.format(dims="(1)", length=4, extra=" (path ((i 100000000000)))"),
     b"\0" * 4, "too many empty slots"),
    ("negative_sequence_index", E.format(dims="(1)", length=4, extra=" (path ((k a) (i -1)))"),
     b"\0" * 4, "negative"),
    ("unknown_key_impl", E.format(dims="(1)", length=4, extra=" (key_impl thbeefry2x32)")
     .replace("Single_prec", "Uint32_prec"), b"\0" * 4, "cannot rebuild PRNG keys"),
])
def test_found_by_fuzzing(tmp_path, name, entry, data, message):
    path = tmp_path / f"{name}.jckpt"
    path.write_bytes(raw_file(header_text(entry), data))
    with pytest.raises(FormatError, match=message) as info:
        jckpt.load(jckpt.Context(host=True), path)
    assert str(path) in str(info.value)


def test_padded_entry_allocation_is_bounded_by_file_size(tmp_path):
    """A tiny padded payload cannot ask for a buffer far larger than the file."""
    entry = ("((id 0) (namespace jckpt) (label (x)) (prec Single_prec) (dims (1000001 1000001)) "
             "(padding (((500000 500000) (500000 500000)) 0.)) (offset 0) (byte_length 4))")
    path = tmp_path / "pad.jckpt"
    path.write_bytes(raw_file(header_text(entry), b"\0" * 4))
    with pytest.raises(FormatError, match="far more than the file holds"):
        jckpt.load(jckpt.Context(host=True), path, mmap=False)


def test_deep_nesting_is_refused_not_recursed(tmp_path):
    path = tmp_path / "deep.jckpt"
    path.write_bytes(raw_file("((version 1) (tensors ()) (x " + "(" * 200_000 + ")" * 200_000
                              + "))"))
    with pytest.raises(FormatError, match="nesting deeper"):
        jckpt.load(jckpt.Context(host=True), path)


# --- names read from a file cannot reach outside the checkpoint ----------------------

ESCAPES = ["../process_00000.jckpt", "/tmp/process_00000.jckpt", "sub/../../process_00000.jckpt",
           "process_00000.jckpt/../../x.jckpt", "process_00000.jckpt\0", ""]


def _directory_checkpoint(tmp_path):
    from jckpt.api.multiprocess import save_directory

    base = tmp_path / "run"
    base.mkdir()
    save_directory(jckpt.Context(), {"w": np.arange(10.0), "s": np.int32(3)}, str(base / "ck"))
    return base / "ck"


def _rewrite_index(index, old: str, new: str) -> None:
    data = index.read_bytes()
    hlen = int.from_bytes(data[:4], "big")
    text = data[4:4 + hlen].decode().rstrip(" ")
    assert old in text
    index.write_bytes(raw_file(text.replace(old, new), data[4 + hlen:], align=32))


@pytest.mark.parametrize("name", ESCAPES)
def test_directory_index_names_cannot_escape(tmp_path, name):
    ck = _directory_checkpoint(tmp_path)
    outside = tmp_path / "process_00000.jckpt"  # what an escaping name would reach
    outside.write_bytes((ck / "process_00000.jckpt").read_bytes())
    _rewrite_index(ck / "index.jckpt", "(files (process_00000.jckpt))",
                   f"(files ({jckpt.format.sexp.quote(name)}))")
    with pytest.raises(FormatError, match="files must be"):
        jckpt.load(jckpt.Context(host=True), ck)


@pytest.mark.parametrize("member", ["process_00000.jckpt", "index.jckpt"])
def test_directory_member_symlink_is_refused(tmp_path, member):
    ck = _directory_checkpoint(tmp_path)
    outside = tmp_path / f"outside-{member}"
    os.rename(ck / member, outside)
    os.symlink(outside, ck / member)
    with pytest.raises(FormatError, match="symbolic link"):
        jckpt.load(jckpt.Context(host=True), ck)


def _sharded_safetensors(tmp_path, shard_name="model-00001-of-00001.safetensors"):
    from safetensors.numpy import save_file

    d = tmp_path / "hf"
    d.mkdir()
    save_file({"w": np.arange(4, dtype=np.float32)}, str(d / "model-00001-of-00001.safetensors"))
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"w": shard_name}}))
    return d, index


@pytest.mark.parametrize("name", ["../model-00001-of-00001.safetensors",
                                  "/tmp/model-00001-of-00001.safetensors",
                                  "a/../../model-00001-of-00001.safetensors", "C:/x.safetensors"])
def test_safetensors_index_names_cannot_escape(tmp_path, name):
    pytest.importorskip("safetensors")
    from jckpt.adapters import read

    d, index = _sharded_safetensors(tmp_path, name)
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(
        (d / "model-00001-of-00001.safetensors").read_bytes())
    with pytest.raises(FormatError, match="unsafe|escapes"):
        read(str(index))


def test_safetensors_shard_symlink_is_refused(tmp_path):
    pytest.importorskip("safetensors")
    from jckpt.adapters import read

    d, index = _sharded_safetensors(tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    os.rename(d / "model-00001-of-00001.safetensors", outside)
    os.symlink(outside, d / "model-00001-of-00001.safetensors")
    with pytest.raises(FormatError, match="symbolic link"):
        read(str(index))


@pytest.mark.parametrize("member", ["../w.npy", "/abs/w.npy", "a/../../w.npy", "C:\\w.npy"])
def test_archive_member_names_cannot_escape(tmp_path, member):
    import io
    import zipfile

    from jckpt.adapters import read

    buf = io.BytesIO()
    np.save(buf, np.arange(3.0))
    path = tmp_path / "a.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, buf.getvalue())
    with pytest.raises(FormatError, match="unsafe|escapes"):
        read(str(path))


def test_damaged_deflate_stream_in_an_archive_is_a_format_error(tmp_path):
    """Found by fuzzing the adapters: zlib's own error escaped from a compressed member."""
    import io
    import zipfile

    from jckpt.adapters import read

    buf = io.BytesIO()
    np.save(buf, np.arange(100.0))
    path = tmp_path / "z.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("w.npy", buf.getvalue())
    with zipfile.ZipFile(path) as zf:
        info = zf.infolist()[0]
    data = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    data[start:start + 8] = b"\xff" * 8  # an invalid deflate block type
    path.write_bytes(data)
    with pytest.raises(FormatError, match="cannot be read"):
        read(str(path))


@pytest.mark.parametrize("old, new", [("(global_dims (10))", "(global_dims (\u00b2))"),
                                      ("(path ((k w)))", "(path ((i \u00b2)))")])
def test_non_ascii_digits_in_a_directory_index(tmp_path, old, new):
    """Found by fuzzing: '²' passes str.isdigit() but not int()."""
    ck = _directory_checkpoint(tmp_path)
    _rewrite_index(ck / "index.jckpt", old, new)
    with pytest.raises(FormatError):
        jckpt.load(jckpt.Context(host=True), ck)


@pytest.mark.parametrize("descr", [",f2", "<02", "f8,(", "(99999999999999999999,)f8"])
def test_damaged_npy_descr_is_a_format_error(tmp_path, descr):
    """Found by fuzzing the adapters: numpy parses some dtype strings with ast (SyntaxError)."""
    import io
    import zipfile

    from jckpt.adapters import read

    buf = io.BytesIO()
    np.save(buf, np.arange(4, dtype=np.float64))
    raw = buf.getvalue()
    good = "'<f8'"
    assert good.encode() in raw
    bad = raw.replace(good.encode(), repr(descr).encode().ljust(len(good), b" "), 1) \
        if len(repr(descr)) <= len(good) else raw.replace(good.encode(), repr(descr).encode(), 1)
    path = tmp_path / "d.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("w.npy", bad)
    with pytest.raises(jckpt.CheckpointError):
        read(str(path))
