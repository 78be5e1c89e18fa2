"""Header, layout and payload codec: pure functions, no files, no JAX."""

import dataclasses
import re
import struct
import sys
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jckpt.errors import FormatError
from jckpt.format import (
    Entry,
    Header,
    Padding,
    decode_header,
    decode_payload,
    encode_header,
    encode_payload,
    iter_payload_chunks,
    lay_out,
    plan_layout,
    precs,
)
from jckpt.format.header import header_from_sexp
from jckpt.format.sexp import parse


def test_codec_does_not_import_jax():
    import subprocess

    code = "import sys, jckpt.format, jckpt.errors; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_reading_a_header_does_not_import_ml_dtypes():
    """Importing ml_dtypes is most of `import jckpt`'s time; a header's precs are read by name
    and size (`jckpt inspect`, a manager listing its steps), its dtypes made only when used."""
    import subprocess

    raw = encode_header(lay_out(Header(tensors=(entry(prec="Bfloat16_prec", byte_length=4),))))
    code = ("import sys, jckpt, jckpt.format as f; h = f.decode_header(bytes.fromhex(sys.argv[1]));"
            "e = h.tensors[0]; print(f.precs.dtype_name(e.prec), f.precs.item_size(e.prec),"
            "'ml_dtypes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, raw.hex()], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["bfloat16", "2", "False"]


def entry(**kw):
    base = dict(id=0, namespace="jckpt", prec="Single_prec", dims=(2,), offset=0, byte_length=8,
                label=("w",), path=(("k", "w"),), checksum=("xxh3_64", "00112233445566aa"))
    base.update(kw)
    return Entry(**base)


def test_plan_layout_ocannl_cases():
    assert plan_layout([12, 5, 4], 32) == (0, 32, 64)
    assert plan_layout([12, 5, 4], 1) == (0, 12, 17)
    assert plan_layout([], 32) == ()


def test_written_header_lays_out_and_names_this_writer():
    from jckpt.format.layout import written_header
    from jckpt.version import __version__
    entries = [entry(offset=999), entry(id=1, label=("v",), path=(("k", "v"),), offset=999)]
    header = written_header(entries, 64, metadata=[("k", "v")], extra=(("x", "1"),))
    assert [e.offset for e in header.tensors] == [0, 64]
    assert header.writer == f"jckpt {__version__}" and header.alignment == 64
    assert header.metadata == (("k", "v"),) and header.extra == (("x", "1"),)
    assert decode_header(encode_header(header)).writer == header.writer


@pytest.mark.parametrize("alignment", [1, 8, 32, 4096])
def test_header_padding_aligns_data(alignment):
    raw = encode_header(Header(tensors=(entry(),), alignment=alignment))
    (hlen,) = struct.unpack(">I", raw[:4])
    assert len(raw) == 4 + hlen
    assert len(raw) % alignment == 0
    assert raw.rstrip(b" ").endswith(b")")


def test_header_roundtrip_all_fields():
    e = entry(padding=Padding(((1, 2),), 0.5), dims=(5,), byte_length=8, key_impl="rbg",
              slice=None, extra=(("future", ("x", "y")),))
    h = Header(tensors=(e, entry(id=1, path=(("i", 3), ("a", "mu"), ("ki", -4), ("f", 0)),
                                 namespace="opt", label=("weird label", "é"))),
               alignment=64, writer='jckpt "0.1"', metadata=(("step", "100"), ("json", '{"a": 1}')),
               extra=(("unknown_top", ("1", ("2",))),))
    assert decode_header(encode_header(h)) == h


def test_sharded_fields_roundtrip():
    e = entry(dims=(2, 3), byte_length=24, slice=((2, 4), (0, 3)), global_dims=(8, 3))
    assert decode_header(encode_header(Header(tensors=(e,)))).tensors[0] == e


def test_unknown_fields_are_kept_verbatim():
    text = ('((version 1) (alignment 1) (tensors (((id 0) (namespace a) (label ()) '
            '(prec Byte_prec) (dims (1)) (padding none) (offset 0) (byte_length 1) '
            '(zz (1 2))))) (color blue))')
    h = header_from_sexp(parse(text))
    assert h.extra == (("color", "blue"),)
    assert h.tensors[0].extra == (("zz", ("1", "2")),)
    again = decode_header(encode_header(h))
    assert again == h


def test_fast_and_general_decoders_agree():
    entries = tuple(entry(id=i, path=(("k", "layers"), ("i", i)), label=("layers", str(i)),
                          offset=8 * i) for i in range(50))
    raw = encode_header(Header(tensors=entries, writer="w"))
    fast = decode_header(raw)
    general = header_from_sexp(parse(raw[4:].decode()))
    assert fast == general


def test_large_header_decodes_quickly():
    n = 100_000
    entries = tuple(entry(id=i, path=(("k", "p"), ("i", i)), label=("p", str(i)), dims=(1000,),
                          byte_length=4000) for i in range(n))
    raw = encode_header(lay_out(Header(tensors=entries)))
    start = time.perf_counter()
    h = decode_header(raw)
    elapsed = time.perf_counter() - start
    assert len(h.tensors) == n and h.tensors[-1] == lay_out(Header(tensors=entries)).tensors[-1]
    assert elapsed < 30  # a bound for a loaded CI machine; bench/ tracks the real figure


ALL_DTYPES = [np.dtype(precs.dtype_of(p)) for p in sorted(precs.ALL_PRECS - {"Void_prec",
                                                                             "Uint4x32_prec"})]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_prec_table_roundtrip(dtype):
    prec = precs.prec_of(dtype)
    assert precs.dtype_of(prec) == dtype
    assert precs.element_size(prec) == precs.item_size(prec) == dtype.itemsize
    assert precs.dtype_name(prec) == dtype.name


def test_prec_table_matches_format():
    assert precs.prec_of(np.float32) == "Single_prec"
    assert precs.prec_of(ml_dtypes.bfloat16) == "Bfloat16_prec"
    assert precs.prec_of(ml_dtypes.float8_e5m2) == "Fp8_prec"
    assert precs.prec_of(np.dtype(">f8")) == "Double_prec"
    assert precs.element_size("Uint4x32_prec") == 16
    assert precs.element_size("Void_prec") == 0
    assert precs.item_size("Uint4x32_prec") == precs.dtype_of("Uint4x32_prec").itemsize == 4
    assert precs.dtype_name("Uint4x32_prec") == "uint32" and precs.dtype_name("Void_prec") == "void"


def test_encode_payload_no_copy_when_stored_form():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = encode_payload(x)
    assert np.shares_memory(out, x)
    assert out.tobytes() == x.tobytes()


@pytest.mark.parametrize("make", [
    lambda: np.arange(12, dtype=np.float32).reshape(3, 4).T,
    lambda: np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
    lambda: np.arange(12, dtype=">f4").reshape(3, 4),
    lambda: np.arange(24, dtype=np.float64).reshape(4, 6)[::2, 1::2],
])
def test_encode_payload_converts(make):
    x = make()
    expected = np.ascontiguousarray(x).astype(x.dtype.newbyteorder("<")).tobytes()
    assert encode_payload(x).tobytes() == expected
    assert b"".join(c.tobytes() for c in iter_payload_chunks(x, chunk_bytes=8)) == expected


def _buffer_with(payload: bytes, offset: int) -> bytes:
    return b"\0" * offset + payload


def test_decode_payload_maps_when_aligned():
    x = np.arange(6, dtype=np.float32)
    buf = bytearray(_buffer_with(x.tobytes(), 32))
    e = entry(dims=(6,), byte_length=24, offset=0)
    arr, mapped = decode_payload(buf, e, data_start=32)
    assert mapped and np.array_equal(arr, x)
    buf[32] = 0xFF  # a view, not a copy
    assert arr[0] != 0


def test_decode_payload_copies_when_misaligned():
    x = np.arange(6, dtype=np.float32)
    buf = _buffer_with(x.tobytes(), 33)
    e = entry(dims=(6,), byte_length=24, offset=0)
    arr, mapped = decode_payload(buf, e, data_start=33)
    assert not mapped and np.array_equal(arr, x) and arr.flags.aligned
    arr2, mapped2 = decode_payload(bytes(_buffer_with(x.tobytes(), 32)), e, data_start=32,
                                   mmap=False)
    assert not mapped2 and np.array_equal(arr2, x)


def test_decode_padded_entry_scatters_into_dims():
    region = np.arange(6, dtype=np.float32).reshape(2, 3)
    e = entry(dims=(4, 4), byte_length=24, padding=Padding(((1, 1), (0, 1)), -1.0))
    arr, mapped = decode_payload(region.tobytes(), e, data_start=0)
    assert not mapped and arr.shape == (4, 4)
    assert np.array_equal(arr[1:3, 0:3], region)
    assert (arr[0] == -1).all() and (arr[:, 3] == -1).all()


def test_decode_uint4x32():
    x = np.arange(8, dtype=np.uint32)
    e = entry(prec="Uint4x32_prec", dims=(2,), byte_length=32)
    arr, _ = decode_payload(x.tobytes(), e, data_start=0)
    assert arr.shape == (2, 4) and np.array_equal(arr.reshape(-1), x)


def test_decode_void_refused():
    e = entry(prec="Void_prec", dims=(3,), byte_length=0)
    with pytest.raises(FormatError, match="Void_prec"):
        decode_payload(b"", e, data_start=0)


def test_hostile_padding_allocation_refused():
    e = entry(dims=(10**9, 1), byte_length=4, padding=Padding(((10**9 - 1, 0), (0, 0)), 0.0))
    with pytest.raises(FormatError, match="far more than the file"):
        decode_payload(b"\0" * 4, e, data_start=0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=20), st.sampled_from([1, 2, 8, 32, 4096]))
def test_plan_layout_properties(lengths, alignment):
    offsets = plan_layout(lengths, alignment)
    for i, (o, _n) in enumerate(zip(offsets, lengths)):
        assert o % alignment == 0
        if i:
            assert o >= offsets[i - 1] + lengths[i - 1]
            assert o - (offsets[i - 1] + lengths[i - 1]) < alignment


def test_entry_properties():
    e = entry(namespace="opt", path=(("k", "mu"), ("i", 2)))
    assert e.name == "opt/mu/2" and e.identity == ("opt", (("k", "mu"), ("i", 2)))
    assert dataclasses.replace(e, path=None).name == "opt/n0"


def test_entry_for_builds_what_the_decoder_accepts():

    path = (("k", "layers"), ("i", 3), ("ki", 7), ("a", "w"))
    e = entry_for("model", path, np.dtype(">f4"), (2, 5), id=9, key_impl="rbg")
    assert (e.prec, e.dims, e.byte_length, e.label) == ("Single_prec", (2, 5), 40,
                                                         ("layers", "3", "7", "w"))
    assert (e.offset, e.checksum, e.slice, e.global_dims, e.key_impl) == (0, None, None, None, "rbg")
    piece = entry_for("model", path[:1], ml_dtypes.bfloat16, [2, 3], id=1, slice=[(2, 4), (0, 3)],
                      global_dims=[8, 3], checksum=("xxh3_64", "0" * 16))
    assert piece.byte_length == 12 and piece.dims == (2, 3)
    assert piece.slice == ((2, 4), (0, 3)) and piece.global_dims == (8, 3)
    assert entry_for("n", None, ml_dtypes.int4, (3,), id=0).label == ()
    laid = lay_out(Header(tensors=(e, piece)))
    assert decode_header(encode_header(laid)).tensors == laid.tensors
    with pytest.raises(KeyError):
        entry_for("n", (), np.dtype(object), (1,), id=0)


# --- the three decoding paths (C accelerator, regular expression, general reader) agree ---

from jckpt.format import fastpath  # noqa: E402
from jckpt.format.entries import entry_for  # noqa: E402

atoms = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=6)
components = st.one_of(
    st.tuples(st.sampled_from(["k", "a"]), atoms),
    st.tuples(st.sampled_from(["ki", "i", "f"]), st.integers(-(10**20), 10**20)))


@st.composite
def entries(draw):
    prec = draw(st.sampled_from(sorted(precs.ALL_PRECS)))
    dims = tuple(draw(st.lists(st.integers(0, 10**7), max_size=3)))
    size = precs.element_size(prec)
    return Entry(
        id=draw(st.integers(0, 10**20)), namespace=draw(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}",
                                                                      fullmatch=True)),
        prec=prec, dims=dims, offset=draw(st.integers(0, 10**12)),
        byte_length=int(np.prod(dims, dtype=object)) * size if dims else size,
        label=tuple(draw(st.lists(atoms, max_size=3))),
        path=draw(st.one_of(st.none(), st.lists(components, max_size=4).map(tuple))),
        checksum=draw(st.one_of(st.none(), st.tuples(st.just("xxh3_64"),
                                                        st.from_regex(r"[0-9a-f]{16}", fullmatch=True)))),
        key_impl=draw(st.one_of(st.none(), st.sampled_from(["threefry2x32", "rbg", "a b"]))),
        **draw(pieces(dims)),
    )


def pieces(dims):
    """No slice (a whole array), or a piece of a larger array: a slice that fits its dims and
    its global_dims, or (sometimes) one that does not, which every path must refuse alike."""
    fits = st.lists(st.tuples(st.integers(0, 10**7), st.integers(0, 3)),
                    min_size=len(dims), max_size=len(dims)).map(lambda xs: {
        'slice': tuple((s, s + d) for (s, _), d in zip(xs, dims)),
        'global_dims': tuple(s + d + g for (s, g), d in zip(xs, dims))})
    broken = st.tuples(fits, st.sampled_from(["stop", "global", "ndim"])).map(lambda x: {
        'slice': (x[0]['slice'] + ((0, 1),) if x[1] == "ndim" else
                  tuple((a, b + 1) for a, b in x[0]['slice']) if x[1] == "stop" else x[0]['slice']),
        'global_dims': tuple(g - 1 for g in x[0]['global_dims']) if x[1] == "global"
        else x[0]['global_dims']})
    return st.one_of(st.just({}), fits, broken)


def _decode_all_ways(text: str):
    outcomes = []
    for mode in ("c", "regex", "general"):
        try:
            if mode == "general":
                value = header_from_sexp(parse(text))
            else:
                found = fastpath.canonical_entries(text, accelerate=(mode == "c"))
                if found is None:
                    value = header_from_sexp(parse(text))
                else:
                    entries_, lo, hi = found
                    skeleton = text[:lo] + "()" + text[hi + 1:]
                    value = header_from_sexp(parse(skeleton), entries=entries_)
            outcomes.append(("ok", value))
        except (FormatError, ValueError) as e:
            outcomes.append(("error", type(e).__name__))
    return outcomes


@pytest.mark.skipif(fastpath.accelerator is None, reason="C accelerator not built")
def test_accelerator_is_built_and_used():
    raw = encode_header(Header(tensors=(entry(),)))
    assert fastpath.canonical_entries(raw[4:].decode()) is not None


def test_pieces_of_directory_checkpoints_take_the_fast_path():
    """A piece file's entries (slice and global_dims) decode without the general reader."""
    es = (entry_for("n", (("k", "w"),), np.dtype("float32"), (2, 3), id=0, slice=((2, 4), (0, 3)),
                    global_dims=(8, 3)),
          entry_for("n", (("k", "s"),), np.dtype("int32"), (), id=1, slice=(), global_dims=()))
    text = encode_header(lay_out(Header(tensors=es)))[4:].decode()
    for accelerate in ([True, False] if fastpath.accelerator is not None else [False]):
        found = fastpath.canonical_entries(text, accelerate=accelerate)
        assert found is not None
        assert [(e.slice, e.global_dims) for e in found[0]] == [(((2, 4), (0, 3)), (8, 3)), ((), ())]


@pytest.mark.parametrize("field", ["offset", "byte_length"])
def test_every_decoding_path_refuses_a_number_past_64_bits(field):
    """19 digits the fast paths' patterns admit, past 2**63 - 1: refused alike, not taken."""
    e = entry_for("n", (("k", "w"),), np.dtype("uint8"), (2,), id=0)  # non-empty: the fast path
    text = encode_header(lay_out(Header(tensors=(e,))))[4:].decode()
    big = "9999999999999999999"
    text, n = re.subn(rf"\({field} \d+\)", f"({field} {big})", text)
    if field == "byte_length":
        text = text.replace("(dims 2)", f"(dims {big})")
    assert n == 1
    outcomes = _decode_all_ways(text)
    assert outcomes == [("error", "FormatError")] * 3


@settings(max_examples=300, deadline=None)
@given(st.lists(entries(), max_size=4, unique_by=lambda e: e.identity))
def test_decoding_paths_agree(es):
    text = encode_header(Header(tensors=tuple(es)))[4:].decode()
    outcomes = _decode_all_ways(text)
    assert outcomes[0] == outcomes[1] == outcomes[2]
    if outcomes[2][0] == "ok":
        assert outcomes[2][1].tensors == tuple(es)


@settings(max_examples=400, deadline=None)
@given(st.lists(entries(), min_size=1, max_size=3, unique_by=lambda e: e.identity), st.data())
def test_decoding_paths_agree_on_mutated_text(es, data):
    text = encode_header(Header(tensors=tuple(es)))[4:].decode().rstrip()
    pos = data.draw(st.integers(0, len(text) - 1))
    choice = data.draw(st.sampled_from(["delete", "insert", "replace"]))
    char = data.draw(st.sampled_from(list("() \"\\;#|0a-9\n\x1c")))
    if choice == "delete":
        text = text[:pos] + text[pos + 1:]
    elif choice == "insert":
        text = text[:pos] + char + text[pos:]
    else:
        text = text[:pos] + char + text[pos + 1:]
    outcomes = _decode_all_ways(text)
    assert outcomes[0] == outcomes[1] == outcomes[2]


_FIELDS_TEXT = ("(id 0) (namespace jckpt) (label (w)) (prec Single_prec) (dims (2)) (padding none) "
                "(offset 0) (byte_length 8) (path ((k w))))")


@pytest.mark.parametrize("text", [
    # an NBSP the fast paths took for whitespace: the C decoder then read character positions
    # as byte offsets and accepted what the general reader calls unbalanced
    "((version 1)\u00a0(tensors (" + _FIELDS_TEXT + ")))",
    "((version 1)\u00a0(tensors ((" + _FIELDS_TEXT + ")))",
    "((version 1) (tensors (\u00a0(" + _FIELDS_TEXT + ")))",
    "((version 1) (tensors ((" + _FIELDS_TEXT + "\u00a0)) (writer \"\u00e9\"))",
])
def test_every_decoding_path_agrees_on_non_ascii_whitespace(text, monkeypatch):
    raw = len(text.encode()).to_bytes(4, "big") + text.encode()
    outcomes = []
    for accelerator in ([fastpath.accelerator, None] if fastpath.accelerator else [None]):
        monkeypatch.setattr(fastpath, "accelerator", accelerator)
        try:
            outcomes.append(decode_header(raw, file="x.jckpt").tensors)
        except FormatError as e:
            outcomes.append(e.message)
    assert all(o == outcomes[0] for o in outcomes), outcomes
    assert all(_decode_all_ways(text)[0] == o for o in _decode_all_ways(text)), text


def test_a_header_of_many_empty_arrays_stays_on_the_fast_path(monkeypatch):
    """Any empty entry sent the whole header to the general reader, at about 50 bytes of
    memory per header byte (300,000 empty entries: 1.7 GB); only an empty shape too large
    for any array needs it."""
    from jckpt.format import header as header_mod
    general = []
    monkeypatch.setattr(header_mod, "canonical_entries",
                        _spy(header_mod.canonical_entries, general))
    entries = tuple(entry(id=i, label=(f"w{i}",), path=(("k", f"w{i}"),), dims=(0, 3),
                          byte_length=0, checksum=None) for i in range(50))
    raw = encode_header(lay_out(Header(tensors=entries)))
    assert decode_header(raw).tensors[7].dims == (0, 3) and general == [True]
    huge = (entry(dims=(0, 2**62), byte_length=0, checksum=None),)
    with pytest.raises(FormatError, match="larger than any array"):
        decode_header(encode_header(lay_out(Header(tensors=huge))))


def _spy(fn, seen):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        seen.append(out is not None)
        return out
    return wrapped


# --- the fields around the entries: the shell's fast path and the general reader agree ---

from hypothesis import HealthCheck  # noqa: E402

from jckpt.format import header as header_mod  # noqa: E402
from jckpt.format import prescan  # noqa: E402

metadata_atoms = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"),
                         max_size=8)


def _decode_both_ways(raw: bytes, monkeypatch) -> list:
    """`decode_header(raw)` with the shell's fast path, then with the general reader alone:
    the header, or the error's message and entry."""
    outcomes = []
    for shell in (fastpath.canonical_shell, lambda text, cut=None: None):
        monkeypatch.setattr(header_mod, "canonical_shell", shell)
        try:
            outcomes.append(("ok", decode_header(raw, file="x.jckpt")))
        except FormatError as e:
            outcomes.append(("error", e.message, e.entry))
    return outcomes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(metadata_atoms, metadata_atoms), max_size=4),
       st.one_of(st.none(), metadata_atoms), st.sampled_from([1, 8, 64]), st.booleans(),
       st.booleans())
def test_the_shell_fast_path_and_the_general_reader_agree(monkeypatch, pairs, writer, alignment,
                                                          sealed, empty):
    tensors = () if empty else (entry(),)
    header = Header(tensors=tensors, alignment=alignment, writer=writer, metadata=tuple(pairs))
    raw = encode_header(lay_out(header) if tensors else header, header_checksum=sealed)
    fast, general = _decode_both_ways(raw, monkeypatch)
    assert fast == general
    assert fast[0] == "ok" and fast[1].metadata == tuple(pairs) and fast[1].writer == writer


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(metadata_atoms, metadata_atoms), min_size=1, max_size=3), st.data())
def test_the_shell_paths_agree_on_mutated_text(monkeypatch, pairs, data):
    """A mutation anywhere after the entries (quotes, escapes, parentheses, a pair repeated,
    the checksum's digits): both paths accept the same header or give the same error."""
    raw = encode_header(lay_out(Header(tensors=(entry(),), metadata=tuple(pairs))),
                        header_checksum=data.draw(st.booleans()))
    text = raw[4:].decode().rstrip()
    start = text.index("(writer") if "(writer" in text else text.index("(metadata")
    pos = data.draw(st.integers(start, len(text) - 1))
    choice = data.draw(st.sampled_from(["delete", "insert", "replace", "repeat"]))
    char = data.draw(st.sampled_from(list("() \"\\;#|0a-9\n\x1c\u00a0")))
    if choice == "repeat":
        first = re.search(r"\(metadata \((\([^()]*\))", text)
        text = text.replace(first[1], f"{first[1]} {first[1]}", 1) if first else text
    elif choice == "delete":
        text = text[:pos] + text[pos + 1:]
    else:
        text = text[:pos] + char + text[pos + (choice == "replace"):]
    body = text.encode()
    fast, general = _decode_both_ways(len(body).to_bytes(4, "big") + body, monkeypatch)
    assert fast == general


def test_a_pair_repeated_past_the_scans_bound_is_refused_by_both_paths(monkeypatch):
    pairs = (("a", "1"),) * (prescan.MAX_METADATA_REPEATS + 2)
    raw = encode_header(Header(tensors=(), metadata=pairs))
    fast, general = _decode_both_ways(raw, monkeypatch)
    assert fast == general and fast[0] == "error" and "repeated" in fast[1]


def test_a_step_header_is_read_without_the_general_reader(monkeypatch):
    """A manager's step header (entries, writer, metadata with quoted JSON, checksum) is
    decoded without the general reader's scan and parse: a tenth of what they cost."""
    seen = []
    monkeypatch.setattr(prescan, "check_header", lambda text: seen.append(text))
    metadata = (("jckpt.step", "7"), ("jckpt.metrics", '{"loss": 0.5}'),
                ("jckpt.trainer_state", '{"user": {"note": "a \\"b\\"\\n"}}'))
    raw = encode_header(lay_out(Header(tensors=(entry(),), writer="jckpt 0.1.0",
                                       metadata=metadata)))
    assert decode_header(raw).metadata == metadata and seen == []
    damaged = raw.replace(b'0.5', b'0.6')
    with pytest.raises(FormatError, match="header checksum mismatch"):
        decode_header(damaged)
