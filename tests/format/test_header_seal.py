"""The header checksum (jckpt.format.header_seal): written last, checked whenever present,
absent in older files, and computed exactly as the format says."""

import struct

import pytest
import xxhash

from jckpt.errors import FormatError
from jckpt.format import Entry, Header, decode_header, encode_header
from jckpt.format.header_seal import check_header_checksum, seal_header, unsealed_digest
from jckpt.format.sexp import parse


def entry(name="w", ident=0, offset=0):
    return Entry(id=ident, namespace="jckpt", prec="Single_prec", dims=(2,), offset=offset,
                 byte_length=8, label=(name,), path=(("k", name),),
                 checksum=("xxh3_64", "00112233445566aa"))


HEADER = Header(tensors=(entry("w"), entry("v", 1, 32)), writer="jckpt test",
                metadata=(("step", "3"),), extra=(("zz_unknown", ("a", "b")),))


def text_of(raw: bytes) -> bytes:
    (hlen,) = struct.unpack(">I", raw[:4])
    return raw[4:4 + hlen]


def test_written_as_the_last_top_level_field_by_default():
    raw = encode_header(HEADER)
    tree = parse(text_of(raw).decode())
    assert tree[-1][0] == "header_checksum" and tree[-1][1][0] == "xxh3_64"
    assert len(tree[-1][1][1]) == 16
    assert [f[0] for f in tree] == ["version", "alignment", "tensors", "writer", "metadata",
                                    "zz_unknown", "header_checksum"]
    assert decode_header(raw) == HEADER  # the field is not kept as an unknown one


def test_digits_are_the_hash_of_the_header_bytes_with_the_digits_read_as_zeros():
    raw = encode_header(HEADER)
    digits = parse(text_of(raw).decode())[-1][1][1]
    i = raw.index(digits.encode())
    zeroed = raw[:i] + b"0" * 16 + raw[i + 16:]
    assert digits == f"{xxhash.xxh3_64_intdigest(zeroed):016x}"
    assert seal_header(zeroed) == raw


def test_a_header_without_it_still_decodes():
    old = encode_header(HEADER, header_checksum=False)
    assert b"header_checksum" not in old
    assert decode_header(old) == HEADER
    assert not check_header_checksum(old, parse(text_of(old).decode()))


def test_rewriting_a_decoded_header_gives_the_same_bytes():
    raw = encode_header(HEADER)
    assert encode_header(decode_header(raw)) == raw


@pytest.mark.parametrize("old,new", [
    (b"(label (w))", b"(label (x))"),           # still parses: a relabelled entry
    (b"(path ((k w)))", b"(path ((k x)))"),     # still parses: a renamed entry
    (b"(offset 32)", b"(offset 64)"),          # still parses: a moved payload
    (b"(step 3)", b"(step 4)"),                # metadata
    (b"(alignment 32)", b"(alignment 16)"),
])
def test_a_change_that_still_parses_is_refused(old, new):
    raw = encode_header(HEADER)
    assert old in raw
    bad = raw.replace(old, new, 1)
    with pytest.raises(FormatError, match="header checksum mismatch") as info:
        decode_header(bad, file="f.jckpt")
    assert "f.jckpt" in str(info.value) and "fix:" in str(info.value)


def test_a_change_in_the_length_prefix_or_the_padding_is_refused():
    raw = encode_header(Header(tensors=(entry(),)))
    assert raw.endswith(b" ")
    with pytest.raises(FormatError, match="header checksum mismatch"):
        decode_header(raw[:-1] + b"\t")


def test_upper_case_digits_are_accepted():
    raw = encode_header(HEADER)
    digits = parse(text_of(raw).decode())[-1][1][1]
    assert any(c.isalpha() for c in digits)
    assert decode_header(raw.replace(digits.encode(), digits.upper().encode())) == HEADER


@pytest.mark.parametrize("field", [
    b"(header_checksum (xxh3_128 0000000000000000))",  # an algorithm this reader does not know
    b"(header_checksum (xxh3_64 00000000))",           # too few digits
    b"(header_checksum (xxh3_64 000000000000000g))",
    b"(header_checksum xxh3_64)",
])
def test_a_malformed_field_is_refused(field):
    text = b"((version 1) (tensors ()) " + field + b")"
    with pytest.raises(FormatError, match="header_checksum must be"):
        decode_header(seal_header(struct.pack(">I", len(text)) + text))


def test_the_field_must_come_last():
    text = (b"((version 1) (header_checksum (xxh3_64 0000000000000000)) (tensors ()) "
            b"(x \"(header_checksum (xxh3_64 0000000000000000)))\"))")
    with pytest.raises(FormatError, match="last field"):
        decode_header(seal_header(struct.pack(">I", len(text)) + text))


def test_a_second_field_of_the_name_is_refused():
    field = b"(header_checksum (xxh3_64 0000000000000000))"
    text = b"((version 1) (tensors ()) " + field + b" " + field + b")"
    with pytest.raises(FormatError):
        decode_header(seal_header(struct.pack(">I", len(text)) + text))


def test_an_extra_field_of_the_name_is_not_written_twice():
    h = Header(extra=(("header_checksum", ("xxh3_64", "0123456789abcdef")),))
    raw = encode_header(h)
    assert raw.count(b"header_checksum") == 1
    assert decode_header(raw) == Header()


@pytest.mark.parametrize("alignment", [1, 4096, 8192, 1 << 20])
def test_sealed_and_checked_whatever_the_padding(alignment):
    """Padding to a large alignment can be longer than the window the seal is looked for in."""
    header = Header(tensors=HEADER.tensors, alignment=alignment)
    raw = encode_header(header)
    assert len(raw) % alignment == 0
    assert check_header_checksum(raw) and decode_header(raw) == header
    zeroed = raw.replace(parse(text_of(raw).decode())[-1][1][1].encode(), b"0" * 16)
    assert seal_header(zeroed) == raw
    assert unsealed_digest([zeroed[:5], zeroed[5:]]).encode() in raw
