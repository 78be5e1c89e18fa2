"""Every refusal of FORMAT.md section 4, on crafted files: the error type and message."""

import pytest

import jckpt
from jckpt.errors import FormatError
from tests.helpers import entry_text, header_text, raw_file

E = entry_text


CASES = {
    "too_short": (b"\x00\x00", "shorter than the 4-byte header length"),
    "empty": (b"", "shorter than the 4-byte header length"),
    "hlen_past_eof": (raw_file(header_text(E()), b"\0" * 4, hlen=10**6),
                      "extends past the end of the file"),
    "not_utf8": (raw_file(b"((version 1) (tensors ()) (writer \xff))"), "not UTF-8"),
    "not_sexp": (raw_file("((version 1) (tensors ("), "not a well-formed S-expression"),
    "too_deep": (raw_file("((version 1) (tensors ()) (x " + "(" * 200 + ")" * 200 + "))"),
                 "nesting deeper"),
    "no_version": (raw_file("((tensors ()))"), "missing required field version"),
    "no_tensors": (raw_file("((version 1))"), "missing required field tensors"),
    "bad_version": (raw_file("((version 2) (tensors ()))"), "unsupported checkpoint version: 2"),
    "not_pair": (raw_file("((version 1) (tensors ()) (a b c))"), r"is not a \(key value\) pair"),
    "entry_missing_field": (raw_file(header_text("((id 0) (namespace a) (prec Byte_prec))")),
                            "missing required field dims"),
    "unknown_prec": (raw_file(header_text(E(prec="Quad_prec")), b"\0" * 4), "unknown prec Quad_prec"),
    "negative_dim": (raw_file(header_text(E(dims="(-1)")), b"\0" * 4), "negative dim"),
    "overflow": (raw_file(header_text(E(dims="(4294967296 4294967296 4)", length=4)), b"\0" * 4),
                 "overflows 64 bits"),
    "byte_length_mismatch": (raw_file(header_text(E(length=8)), b"\0" * 8),
                             "disagrees with dims"),
    "payload_past_eof": (raw_file(header_text(E(dims="(4)", length=16)), b"\0" * 4),
                         "extends past the end of the file"),
    "overlap": (raw_file(header_text(E(dims="(2)", length=8), E(id=1, offset=4)), b"\0" * 8),
                "overlaps"),
    "duplicate_id": (raw_file(header_text(E(), E(offset=4)), b"\0" * 8),
                     "duplicate entry identity"),
    "duplicate_path": (raw_file(header_text(E(extra=" (path ((k a)))"),
                                            E(id=1, offset=4, extra=" (path ((k a)))")), b"\0" * 8),
                       "duplicate entry identity"),
    "bad_namespace": (raw_file(header_text(E(ns="9lives")), b"\0" * 4), "invalid namespace"),
    "bad_alignment": (raw_file(header_text(E(), alignment="(alignment 0)"), b"\0" * 4),
                      "alignment 0 is < 1"),
    "int_not_int": (raw_file(header_text(E(dims="(x)")), b"\0" * 4), "must be an integer"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_refused(tmp_path, name):
    data, message = CASES[name]
    path = tmp_path / f"{name}.jckpt"
    path.write_bytes(data)
    with pytest.raises(FormatError, match=message) as info:
        jckpt.load(jckpt.Context(), path)
    assert str(path) in str(info.value)  # every error names the file
    with pytest.raises(FormatError, match=message):
        jckpt.describe(path)


def test_errors_are_checkpoint_errors():
    assert issubclass(FormatError, jckpt.CheckpointError)


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(FormatError, match="no such checkpoint file"):
        jckpt.load(jckpt.Context(), tmp_path / "nope.jckpt")
