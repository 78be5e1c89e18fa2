"""The header encoder (jckpt.format.header_encoder): the C accelerator writes exactly the
bytes of the Python reference, entry for entry, and the Python path stands on its own."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jckpt.format import Entry, Header, Padding, decode_header, encode_header, fastpath, header_seal, lay_out
from jckpt.format.entries import entry_for
from jckpt.format.header import encode_header_with_slots as encode_from_header_module
from jckpt.format.header_encoder import (
    _encode_entry,
    encode_entries,
    encode_header_with_slots,
    header_text,
)
from jckpt.format.precs import ALL_PRECS
from jckpt.format.sexp import quote

ACCELERATED = getattr(fastpath.accelerator, "encode_entries", None) is not None
needs_c = pytest.mark.skipif(not ACCELERATED, reason="C accelerator not built")

# --- generated entries: the common shape, and everything unusual an Entry can hold ----------

#: Characters that change how an atom is written: quoting, escapes, block comments, UTF-8.
SPECIAL = ' ()";#|\\\n\t\r\b\x00\x7f\x01é€😀'
atoms = st.one_of(
    st.sampled_from(["", "kernel", "0", "123", "-1", "#;x", "a#|b", "a|#b", "#", "|", "a;b", "~!"]),
    st.text(alphabet=st.sampled_from("abc019_-.") | st.sampled_from(SPECIAL), max_size=8),
    st.text(max_size=6))
#: 64-bit integers (what the C encoder writes), and beyond (left to Python)
int64 = st.one_of(st.integers(0, 10**6), st.integers(-(2**63), 2**63 - 1))
big = st.one_of(int64, st.integers(-(2**70), 2**70))
#: Components a reader accepts back (integers of at most 19 digits).
valid_components = st.one_of(st.tuples(st.sampled_from(["k", "a"]), atoms),
                             st.tuples(st.sampled_from(["ki", "i", "f"]), st.integers(-(10**18), 10**18)))


@st.composite
def common_entries(draw, ints=int64):
    """An Entry of the shape the C encoder writes itself: plain str, int and tuple values."""
    int_tuple = st.lists(ints, max_size=4).map(tuple)
    components = st.one_of(st.tuples(st.sampled_from(["k", "a"]), atoms),
                           st.tuples(st.sampled_from(["ki", "i", "f"]), ints))
    return Entry(
        id=draw(ints), namespace=draw(st.one_of(st.just("jckpt"), atoms)),
        prec=draw(st.sampled_from(sorted(ALL_PRECS))),
        dims=draw(int_tuple), offset=draw(ints), byte_length=draw(ints),
        label=tuple(draw(st.lists(atoms, max_size=4))),
        path=draw(st.one_of(st.none(), st.lists(components, max_size=4).map(tuple))),
        checksum=draw(st.one_of(st.none(), st.tuples(st.just("xxh3_64"),
                                                        st.from_regex(r"[0-9a-f]{16}", fullmatch=True)),
                                st.tuples(atoms, atoms))),
        key_impl=draw(st.one_of(st.none(), atoms)),
        slice=draw(st.one_of(st.none(), st.lists(st.tuples(ints, ints), max_size=3).map(tuple))),
        global_dims=draw(st.one_of(st.none(), int_tuple)))


@st.composite
def unusual_entries(draw):
    """An Entry the C encoder leaves to Python: padding, extra fields, integers beyond 64 bits,
    a prec that is not ASCII (written unquoted)."""
    e = draw(common_entries(ints=big))
    return Entry(**{**_fields(e), **draw(st.fixed_dictionaries({}, optional={
        "padding": st.builds(Padding, st.lists(st.tuples(big, big), max_size=2).map(tuple),
                             st.floats(allow_nan=True)),
        "extra": st.just((("zz", ("a b", "1")),)),
        "prec": st.sampled_from(["a b", "é", "x"])}))})


any_entries = st.one_of(common_entries(), unusual_entries())


def _fields(e: Entry) -> dict:
    return {name: getattr(e, name) for name in e.__dataclass_fields__}


def reference_header(header: Header, *, header_checksum: bool = True) -> tuple[bytes, list]:
    """The whole header as the Python encoder wrote it before the accelerator encoded it:
    one text, encoded, length-prefixed, padded and sealed with `seal_header`."""
    head = f"((version {header.version})\n (alignment {header.alignment})\n"
    body, slots = encode_entries(header.tensors, 4 + len(head) + len(" (tensors\n  ("), accelerate=False)
    lines = [head + " (tensors\n  (" + body + "))" if header.tensors else head + " (tensors ())"]
    if header.writer is not None:
        lines.append(f" (writer {quote(header.writer)})")
    if header.metadata:
        lines.append(" (metadata (" + " ".join(f"({quote(k)} {quote(v)})" for k, v in header.metadata) + "))")
    if header_checksum:
        lines.append(header_seal.UNSEALED_FIELD)
    raw = ("\n".join(lines) + ")").encode()
    size = -(-(4 + len(raw)) // header.alignment) * header.alignment
    out = struct.pack(">I", size - 4) + raw + b" " * (size - 4 - len(raw))
    return (header_seal.seal_header(out) if header_checksum else out), slots


# --- the C encoder and the Python reference agree ----------------------------------------------

@needs_c
@settings(max_examples=400, deadline=None)
@given(st.lists(any_entries, max_size=5), st.integers(0, 10**6))
def test_c_and_python_write_the_same_text_and_slots(es, start):
    try:
        expected = encode_entries(es, start, accelerate=False)
    except (UnicodeEncodeError, TypeError) as e:
        with pytest.raises(type(e)):
            encode_entries(es, start)
        return
    assert encode_entries(es, start) == expected
    assert encode_entries(tuple(es), start) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(any_entries, max_size=4), st.sampled_from([1, 8, 32, 4096]),
       st.one_of(st.none(), atoms), st.booleans())
def test_whole_header_is_byte_identical_to_the_reference(es, alignment, writer, sealed):
    header = Header(tensors=tuple(es), alignment=alignment, writer=writer,
                    metadata=(("step", "3"), ("a b", "")))
    assert encode_header_with_slots(header, header_checksum=sealed) == reference_header(
        header, header_checksum=sealed)


def test_header_module_still_exports_the_encoder():
    header = Header(tensors=(entry_for("n", (("k", "w"),), np.dtype("float32"), (2,), id=0),))
    assert encode_from_header_module(header) == encode_header_with_slots(header)


@needs_c
@pytest.mark.parametrize("atom", ["\ud800", "a\udfffb"])
def test_an_atom_with_no_utf8_is_refused_alike(atom):
    e = Entry(id=0, namespace="n", prec="Byte_prec", dims=(1,), offset=0, byte_length=1, label=(atom,))
    for accelerate in (True, False):
        with pytest.raises(UnicodeEncodeError):
            encode_entries([e], accelerate=accelerate)


@needs_c
def test_unusual_values_are_written_as_python_writes_them():
    """Lists for tuples, bools for ints, a subclass of Entry: left to the Python reference."""
    base = entry_for("n", (("k", "w"), ("i", 3)), np.dtype("int8"), (2, 3), id=1, checksum=("x", "y z"))

    class Sub(str):
        pass

    odd = [Entry(**{**_fields(base), **change}) for change in (
        {"dims": [2, 3]}, {"id": True}, {"label": ["w", "3"]}, {"path": (["k", "w"],)},
        {"path": (("i", "3"),)}, {"namespace": Sub("n")}, {"checksum": ("x", "y", "z")},
        {"slice": ((0, 2), [0, 3])}, {"global_dims": (2, 2**64)}, {"offset": -1})]
    odd.append(type("Subentry", (Entry,), {"__slots__": ()})(**_fields(base)))
    assert encode_entries(odd, 7) == encode_entries(odd, 7, accelerate=False)


# --- slots, round trips, and which path runs -----------------------------------------------------

def many(n: int) -> Header:
    return lay_out(Header(tensors=tuple(
        entry_for("jckpt", (("k", "params"), ("a", f"layer {i}"), ("i", i), ("ki", -i), ("f", 0)),
                  np.dtype("float32"), (1000,),
                  id=i, checksum=("xxh3_64", f"{i:016x}")) for i in range(n))))


def test_slots_point_at_each_entrys_checksum_digits():
    header = many(50)
    raw, slots = encode_header_with_slots(header)
    for e, slot in zip(header.tensors, slots):
        assert raw[slot:slot + 16] == e.checksum[1].encode()
        assert raw[:slot].endswith(b"(checksum (xxh3_64 ")
    no_checksum = Header(tensors=(entry_for("n", (("k", "w"),), np.dtype("uint8"), (), id=0),))
    assert encode_header_with_slots(no_checksum)[1] == [None]


def test_many_entries_round_trip_and_match_the_reference():
    header = many(2000)
    raw, slots = encode_header_with_slots(header)
    assert (raw, slots) == reference_header(header)
    assert decode_header(raw).tensors == header.tensors
    assert raw[4:].startswith(header_text(header)[:-1].encode())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.lists(valid_components, min_size=1, max_size=3).map(tuple), st.booleans()),
                max_size=6, unique_by=lambda x: x[0]))
def test_headers_of_generated_paths_decode_to_what_was_encoded(paths):
    es = tuple(entry_for("n", path, np.dtype("float32"), (2, 1), id=i,
                         checksum=("xxh3_64", "0" * 16) if hashed else None)
               for i, (path, hashed) in enumerate(paths))
    header = lay_out(Header(tensors=es))
    assert decode_header(encode_header(header)).tensors == header.tensors


@needs_c
def test_common_entries_never_reach_python(monkeypatch):
    calls = []
    monkeypatch.setattr("jckpt.format.header_encoder._encode_entry",
                        lambda e: calls.append(e) or _encode_entry(e))
    header = many(100)
    encode_header(header)
    assert calls == []
    padded = Header(tensors=(Entry(id=0, namespace="n", prec="Byte_prec", dims=(3,), offset=0,
                                   byte_length=1, padding=Padding(((1, 1),), 0.0)),))
    encode_header(padded)
    assert len(calls) == 1  # padding is left to the Python reference


def test_without_the_accelerator_python_encodes_every_entry(monkeypatch):
    header = many(30)
    expected = encode_header_with_slots(header)
    assert expected == reference_header(header)
    calls = []
    monkeypatch.setattr(fastpath, "accelerator", None)
    monkeypatch.setattr("jckpt.format.header_encoder._encode_entry",
                        lambda e: calls.append(e) or _encode_entry(e))
    assert encode_header_with_slots(header) == expected
    assert len(calls) == 30
    assert decode_header(expected[0]).tensors == header.tensors


@needs_c
def test_non_ascii_text_written_unquoted_leaves_the_whole_list_to_python():
    """A prec is written as it is; one that is not ASCII makes character and byte offsets
    differ, so Python writes every entry with its own (character) offsets."""
    plain = entry_for("n", (("k", "w"),), np.dtype("uint8"), (1,), id=0, checksum=("xxh3_64", "0" * 16))
    odd = Entry(**{**_fields(plain), "id": 1, "prec": "Ünknown"})
    assert encode_entries([odd, plain], 3) == encode_entries([odd, plain], 3, accelerate=False)
    header = Header(tensors=(odd, plain))
    assert encode_header_with_slots(header) == reference_header(header)


def test_a_lone_surrogate_is_an_input_error_naming_the_entry_or_the_metadata_key():
    """A key `os.fsdecode` made of a bad byte (`'w\\udcff'`) failed the save with a bare
    `UnicodeEncodeError` from inside the encoder, naming nothing."""
    from jckpt.errors import InputError

    bad = entry_for('jckpt', (('k', 'a'), ('k', 'w\udcff')), np.dtype('float32'), (2,), id=0)
    with pytest.raises(InputError, match="lone surrogate") as e:
        encode_header(Header(tensors=(bad,)))
    assert e.value.entry == 'jckpt/a/w\\udcff' and 'surrogateescape' in e.value.fix
    with pytest.raises(InputError, match="metadata key 'run'"):
        encode_header(Header(metadata=(('run', 'x\ud800'),)))
