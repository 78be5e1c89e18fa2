"""The reader as a security boundary: fuzzing, checksums, and the bugs fuzzing found.

The fuzz cases run in a subprocess (``tests/fuzz_reader.py``) under an
address-space limit and a per-case watchdog; see that module for the
mutations and oracles. Four seeds of 5,000 cases each: 20,000 per run.
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
from tests.fuzz_reader import record
from tests.helpers import header_text, raw_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = (101, 202, 303, 404)
CASES_PER_SEED = 5000


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_reader(tmp_path, seed):
    """Only a correct load or a CheckpointError, within a time and memory bound, per case."""
    out = tmp_path / "summary.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fuzz_reader", "--cases", str(CASES_PER_SEED),
         "--seed", str(seed), "--json", str(out), "--keep", str(tmp_path / "failing"),
         "--soft-limit", "5", "--hard-limit", "60"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert out.exists(), f"the fuzz worker died (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    summary = json.loads(out.read_text())
    run = summary["runs"][0]
    assert run["failures"] == [], json.dumps(run["failures"][:5], indent=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert run["cases"] == CASES_PER_SEED
    # The corpus and mutations are not degenerate: every outcome and every mutation occurs.
    assert run["loaded"] > 0 and run["refused"] > 0 and run["checksum"] > 0
    assert set(run["kinds"]) >= {"bitflip", "payload_flip", "header_flip", "truncate", "hlen",
                                 "header_bytes", "structural", "random", "random_sexp"}
    record("fuzz", seed=seed, cases=run["cases"], loaded=run["loaded"], refused=run["refused"],
           checksum=run["checksum"], failures=len(run["failures"]),
           slowest_case_s=run["slowest_case_s"], seconds=run["seconds"])


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
