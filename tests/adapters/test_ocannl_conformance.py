"""OCANNL's own persistence conformance cases, as behaviour, plus a hand-written OCANNL file."""

import struct

import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.errors import FormatError, MismatchError, MissingEntryError
from jckpt.format.sexp import parse
from tests.helpers import raw_file, reseal


def independent_offsets(path):
    """Offsets and data start parsed from the bytes, without the library's reader."""
    with open(path, "rb") as f:
        raw = f.read()
    (hlen,) = struct.unpack(">I", raw[:4])
    tree = parse(raw[4:4 + hlen].decode())
    fields = {f[0]: f[1] for f in tree}
    offsets = [int({k: v for k, v in e}["offset"]) for e in fields["tensors"]]
    return 4 + hlen, offsets, fields


def three(_alignment=None):
    """Byte lengths 12, 5 and 4, as in OCANNL's conformance test."""
    return {"a": np.arange(12, dtype=np.uint8), "b": np.arange(5, dtype=np.uint8),
            "c": np.array([7], dtype=np.int32)}


@pytest.mark.parametrize("alignment,expected", [(32, [0, 32, 64]), (1, [0, 12, 17])])
def test_layout_offsets(tmp_path, alignment, expected):
    path = tmp_path / "t.jckpt"
    jckpt.save(jckpt.Context(alignment=alignment), three(alignment), path)
    start, offsets, fields = independent_offsets(path)
    assert offsets == expected
    assert start % alignment == 0
    assert fields["alignment"] == str(alignment)


def test_alignment_one_maps_aligned_and_decodes_misaligned(tmp_path):
    path = tmp_path / "t.jckpt"
    jckpt.save(jckpt.Context(alignment=1), three(1), path)
    start, _, _ = independent_offsets(path)
    before = jckpt.ingestion_counts()
    _, tree = jckpt.load(jckpt.Context(host=True), path)
    after = jckpt.ingestion_counts()
    # a and b are bytes (always mappable); c is an int32 at start + 17, misaligned
    assert (start + 17) % 4 != 0
    assert after["mapped"] - before["mapped"] == 2
    assert after["decoded"] - before["decoded"] == 1
    assert tree["jckpt"]["c"].tolist() == [7]


def test_file_without_alignment_field_loads(tmp_path):
    path = tmp_path / "t.jckpt"
    jckpt.save(jckpt.Context(), three(32), path)
    raw = bytearray(path.read_bytes())
    i = raw.index(b"(alignment 32)")
    raw[i:i + len(b"(alignment 32)")] = b" " * len(b"(alignment 32)")
    path.write_bytes(bytes(raw))
    reseal(path)
    _, tree = jckpt.load(jckpt.Context(host=True), path)
    assert tree["jckpt"]["b"].tolist() == [0, 1, 2, 3, 4]
    assert jckpt.describe(path).alignment == 1


def test_appending_disjoint_and_overwriting(tmp_path):
    path = tmp_path / "t.jckpt"
    ctx = jckpt.Context(host=True)
    jckpt.save(ctx, {"a": np.float32(1)}, path)
    jckpt.save(ctx, {"b": np.float32(2)}, path, appending=True)
    _, tree = jckpt.load(ctx, path)
    assert {k: float(v) for k, v in tree["jckpt"].items()} == {"a": 1.0, "b": 2.0}
    ids = {e.path[0][1]: e.id for e in jckpt.describe(path).tensors}
    jckpt.save(ctx, {"a": np.float32(3)}, path, appending=True)
    _, tree = jckpt.load(ctx, path)
    assert {k: float(v) for k, v in tree["jckpt"].items()} == {"a": 3.0, "b": 2.0}
    assert {e.path[0][1]: e.id for e in jckpt.describe(path).tensors} == ids


def test_empty_set(tmp_path):
    path = tmp_path / "t.jckpt"
    jckpt.save(jckpt.Context(), {}, path)
    _, tree = jckpt.load(jckpt.Context(), path)
    assert tree == {}
    assert jckpt.describe(path).tensors == ()


def test_restore_missing_entry_and_shape_mismatch(tmp_path):
    path = tmp_path / "t.jckpt"
    jckpt.save(jckpt.Context(), {"a": np.zeros((2, 3), np.float32)}, path)
    with pytest.raises(MissingEntryError, match="jckpt/zz"):
        jckpt.restore(jckpt.Context(), {"zz": np.zeros(1)}, path)
    with pytest.raises(MismatchError, match=r"shape mismatch: file has \(2, 3\)"):
        jckpt.restore(jckpt.Context(), {"a": np.zeros((3, 2), np.float32)}, path)


def test_load_clash(tmp_path):
    path = tmp_path / "t.jckpt"
    jckpt.save(jckpt.Context(), {"a": np.zeros(2)}, path)
    ctx, _ = jckpt.load(jckpt.Context(host=True), path)
    with pytest.raises(jckpt.ClashError, match="already loaded"):
        jckpt.load(ctx, path)
    ctx2, tree = jckpt.load(ctx, path, prefix_namespace="copy")
    assert "copy__jckpt" in tree and len(ctx2.registry) == 2


def test_truncated(tmp_path):
    path = tmp_path / "t.jckpt"
    jckpt.save(jckpt.Context(), {"a": np.zeros(100, np.float32)}, path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(FormatError, match="extends past the end of the file"):
        jckpt.load(jckpt.Context(), path)


def test_mapping_survives_save_over_same_path(tmp_path):
    path = tmp_path / "t.jckpt"
    ctx = jckpt.Context(host=True)
    jckpt.save(ctx, {"a": np.full(1000, 1.0, np.float32)}, path)
    # a planted abandoned staging file of this target, and another target's
    mine = tmp_path / (f"t.jckpt.jckpt-stage.{0x7FFFFFFE:08x}.{1:08x}.{2:016x}")
    other = tmp_path / (f"u.jckpt.jckpt-stage.{0x7FFFFFFE:08x}.{1:08x}.{2:016x}")
    mine.write_bytes(b"junk")
    other.write_bytes(b"junk")
    _, tree = jckpt.load(ctx, path)
    old = tree["jckpt"]["a"]
    jckpt.save(ctx, {"a": np.full(1000, 2.0, np.float32)}, path)
    assert (old == 1.0).all()
    _, new = jckpt.load(jckpt.Context(host=True), path)
    assert (new["jckpt"]["a"] == 2.0).all()
    assert not mine.exists() and other.exists()


OCANNL_HEADER = """((version 1)
 (alignment 16)
 (tensors
  (((id 3) (namespace "") (label (w)) (prec Single_prec) (dims (2 3))
    (padding none) (offset 0) (byte_length 24))
   ((id 4) (namespace "") (label (conv k)) (prec Single_prec) (dims (4 4))
    (padding (((1 1) (1 1)) 0.)) (offset 32) (byte_length 16))
   ((id 5) (namespace model) (label (f8)) (prec Fp8_prec) (dims (4))
    (padding none) (offset 48) (byte_length 4))
   ((id 6) (namespace model) (label (h)) (prec Half_prec) (dims (2))
    (padding none) (offset 64) (byte_length 4)))))
"""


def ocannl_file(tmp_path):
    w = np.arange(6, dtype="<f4")
    k = np.array([1, 2, 3, 4], dtype="<f4")
    f8 = np.array([0.5, 1, 2, -4], dtype=ml_dtypes.float8_e5m2)
    h = np.array([1.5, -2], dtype="<f2")
    data = bytearray(68)
    data[0:24] = w.tobytes()
    data[32:48] = k.tobytes()
    data[48:52] = f8.tobytes()
    data[64:68] = h.tobytes()
    path = tmp_path / "ocannl.ckpt"
    path.write_bytes(raw_file(OCANNL_HEADER, bytes(data), align=16))
    return path, w, k, f8, h


def test_hand_written_ocannl_file(tmp_path):
    path, w, k, f8, h = ocannl_file(tmp_path)
    _, tree = jckpt.load(jckpt.Context(host=True), path)
    assert set(tree) == {"ocannl", "model"}
    assert np.array_equal(tree["ocannl"]["n3"], w.reshape(2, 3))
    conv = tree["ocannl"]["n4"]
    assert conv.shape == (4, 4)
    assert np.array_equal(conv[1:3, 1:3], k.reshape(2, 2)) and conv[0].sum() == 0
    assert tree["model"]["n5"].dtype == ml_dtypes.float8_e5m2
    assert np.array_equal(tree["model"]["n5"].astype(np.float32), f8.astype(np.float32))
    assert np.array_equal(tree["model"]["n6"], h)


def test_appending_to_ocannl_file_keeps_ids_and_unknown_fields(tmp_path):
    path, w, *_ = ocannl_file(tmp_path)
    jckpt.save(jckpt.Context(namespace="model"), {"new": np.float32(9)}, path, appending=True)
    header = jckpt.describe(path)
    by_name = {e.name: e for e in header.tensors}
    assert by_name["model/new"].id == 7  # above the namespace's maximum (6)
    assert by_name["ocannl/n3"].id == 3 and by_name["ocannl/n4"].padding is not None
    _, tree = jckpt.load(jckpt.Context(host=True), path)
    assert np.array_equal(tree["ocannl"]["n3"], w.reshape(2, 3))
    assert float(tree["model"]["new"]) == 9
    assert header.alignment == 32
