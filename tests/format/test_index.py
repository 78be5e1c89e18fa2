"""The directory-index codec (jckpt.format.index): round trips, and every refusal a FormatError."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jckpt.errors import FormatError
from jckpt.format.header import Entry, Header, decode_header, encode_header, header_from_sexp
from jckpt.format.index import IndexedArray, global_entry, index_files, index_header, parse_index
from jckpt.format.names import LAYOUT_VERSION, PIECE_RE
from jckpt.format.sexp import SexpError, parse

FILES = ["process_00000.jckpt", "process_00001.jckpt", "process_00000.1.jckpt"]


def array(ident=0, dims=(4, 2), pieces=None, **kw):
    base = dict(id=ident, namespace="jckpt", prec="Single_prec", dims=dims, offset=0,
                byte_length=4 * dims[0] * dims[1] if len(dims) == 2 else 4, label=("w",),
                path=(("k", "w"), ("i", ident)))
    base.update(kw)
    if pieces is None:
        pieces = ((0, ((0, 2), (0, 2))), (1, ((2, 4), (0, 2))))
    return IndexedArray(Entry(**base), pieces)


def header(*arrays, files=FILES, metadata=None) -> Header:
    count = len({m[1] for m in map(PIECE_RE.match, files) if m and m[2] is None})  # processes
    return index_header(files, count, list(arrays), 32, metadata or {}, writer="jckpt test")


def text_of(h: Header) -> str:
    return encode_header(h, header_checksum=False)[4:].decode().rstrip()


def reparsed(text: str) -> tuple:
    raw = text.encode()
    return parse_index(decode_header(len(raw).to_bytes(4, "big") + raw, file="i"), "i")


def test_round_trip_in_memory_and_through_bytes():
    arrays = [array(0), array(1, dims=(3,), pieces=((2, ((0, 3),)),), byte_length=12,
                            key_impl="threefry2x32", path=(("k", "rng"), ("ki", -3))),
              array(2, dims=(), pieces=((0, ()),), byte_length=4, path=None, label=()),
              array(3, namespace="opt", dims=(0, 5), pieces=((1, ((0, 0), (0, 5))),),
                    byte_length=0)]
    h = header(*arrays, metadata={"step": "7"})
    assert h.tensors == () and h.writer == "jckpt test" and h.metadata == (("step", "7"),)
    assert parse_index(h, "i") == (FILES, arrays)
    back = decode_header(encode_header(h), file="i")
    assert parse_index(back, "i") == (FILES, arrays)


def test_many_pieces_of_every_rank_round_trip_with_their_bounds():
    """Pieces read from the index's text at once are those written, and so are their bounds."""
    grid = tuple((2 * i + h, ((i, i + 1), (0, 2), (2 * h, 2 * h + 2))) for i in range(40) for h in (0, 1))
    arrays = [array(0, dims=(40, 2, 4), pieces=grid, byte_length=40 * 2 * 4 * 4),
              array(1, dims=(50,), pieces=tuple((i, ((i, i + 1),)) for i in range(50)),
                    byte_length=200),
              array(2, dims=(), pieces=((2, ()),), byte_length=4),
              array(4, dims=(0,), pieces=(), byte_length=0),
              array(3, dims=(12345678901234, 1), pieces=((0, ((0, 12345678901234), (0, 1))),),
                    prec="Byte_prec", byte_length=12345678901234)]
    files = [f"process_{p:05d}.jckpt" for p in range(80)]
    back = decode_header(encode_header(header(*arrays, files=files)), file="i")
    _files, parsed = parse_index(back, "i")
    assert parsed == arrays
    for a in parsed:
        expected = [box for _, box in a.pieces]
        assert a.bounds.tolist() == [[list(pair) for pair in box] for box in expected]
        assert all(type(fi) is int and all(type(x) is int for pair in box for x in pair)
                   for fi, box in a.pieces)


def _outcome(read):
    try:
        return "ok", read()
    except (FormatError, SexpError) as e:
        return "error", str(e)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["delete", "insert", "replace"]),
       st.sampled_from(list("() 09-x")))
def test_pieces_kept_as_text_read_as_the_general_reader_reads_them(where, change, char):
    """An index, its pieces text changed by one character: the same arrays or the same refusal
    whether its pieces are read at once (as kept by the decoder) or as parsed lists."""
    arrays = [array(0), array(1, dims=(3,), pieces=((2, ((0, 3),)),), byte_length=12),
              array(2, dims=(), pieces=((0, ()),), byte_length=4, path=None, label=())]
    text = text_of(header(*arrays))
    start = text.index("(pieces")
    pos = start + where % (len(text) - start - 1)
    text = (text[:pos] + text[pos + 1:] if change == "delete" else
            text[:pos] + char + text[pos + (change == "replace"):])
    raw = text.encode()
    kept = _outcome(lambda: parse_index(decode_header(len(raw).to_bytes(4, "big") + raw, file="i"), "i"))
    general = _outcome(lambda: parse_index(header_from_sexp(parse(text), file="i"), "i"))
    if "well-formed" not in str(kept[1]):  # else the text is refused before the index is read
        assert kept == general


def test_tagged_piece_files_and_the_files_alone():
    """A writer replacing a directory checkpoint in an object store reads only the file names."""
    tagged = ["process_00000.s000000010000000200000003.jckpt",
              "process_00001.1.s000000010000000200000003.jckpt",
              "process_00001.s000000010000000200000003.jckpt"]
    h = header(array(0), files=tagged)
    assert parse_index(h, "i")[0] == tagged == index_files(h, "i")
    with pytest.raises(FormatError, match="no sharded field"):
        index_files(Header(), "i")
    with pytest.raises(FormatError, match=r"process_NNNNN\[.K\]\[.TAG\].jckpt"):
        index_files(header(array(0), files=["process_00000.s0.jckpt"] * 2), "i")


@pytest.mark.parametrize("count, files, message", [
    (3, FILES, "files hold the first piece file of 2 processes"),
    (1, FILES, "process_00001.jckpt is of a process beyond them"),
    (0, FILES, "process_count 0 disagrees"),
    (2, ["process_00000.jckpt", "process_00000.1.jckpt", "process_00001.1.jckpt"], "of 1 processes"),
    (2, [*FILES, "process_00000.jckpt"], "names a piece file twice"),
    (10**30, FILES, "must be an integer|more than"),
])
def test_a_process_count_the_files_disagree_with_is_refused(count, files, message):
    """Every process writes its first piece file and no other process writes any: an index
    whose process_count says otherwise was damaged or assembled from several saves."""
    h = index_header(files, count, [array(0)], 32, {}, writer="jckpt test")
    with pytest.raises(FormatError, match=message) as info:
        reparsed(text_of(h))
    assert info.value.file == "i" and info.value.fix


def test_global_entry_drops_the_slice():
    piece = Entry(id=5, namespace="jckpt", prec="Half_prec", dims=(2, 3), offset=64,
                  byte_length=12, label=("w",), path=(("k", "w"),), key_impl=None,
                  slice=((2, 4), (0, 3)), global_dims=(4, 3), checksum=("xxh3_64", "0" * 16))
    g = global_entry(piece)
    assert (g.dims, g.slice, g.global_dims, g.offset, g.byte_length, g.checksum) == (
        (4, 3), None, None, 0, 24, None)
    assert g.identity == piece.identity


@pytest.mark.parametrize("old, new, message", [
    ("(sharded", "(shardx", "no sharded field"),
    (f"(layout {LAYOUT_VERSION})", "(layout 99)", "unsupported directory layout 99"),
    ("(layout 1)", "(layout -1)", "layout must be a non-negative integer"),
    ("(files (process_00000.jckpt", "(files (model.jckpt", "files must be a list"),
    ("(arrays (", "(arrays x (", "(key value) pair"),
    ("(namespace jckpt)", "(namespace (a b))", "namespace missing"),
    ("(id 0)", "(id x)", "id must be an integer"),
    ("(id 0)", "(id -1)", "id must be a non-negative integer"),
    ("(prec Single_prec)", "(prec Void_prec)", "bad prec"),
    ("(prec Single_prec)", "(prec (Single_prec))", "bad prec"),
    ("(global_dims (4 2))", "(global_dims 4)", "global_dims must be a list"),
    ("(global_dims (4 2))", "(global_dims (4 -2))", "negative dim"),
    ("(global_dims (4 2))", "(global_dims (4 3))", "do not tile"),
    ("(global_dims (4 2))", "(global_dims (4611686018427387904 2))", "absurdly large"),
    ("(label (w))", "(label ((w)))", "label must be a list of atoms"),
    ("(path ((k w) (i 0)))", "(path ((q w)))", "path component"),
    ("(path ((k w) (i 0)))", "(path ((i x)))", "path index must be an integer"),
    ("(pieces ((0 ((0 2) (0 2)))", "(pieces ((0 ((0 2)))", "piece must be"),
    ("(pieces ((0 ((0 2) (0 2)))", "(pieces ((7 ((0 2) (0 2)))", "piece file number 7"),
    ("(pieces ((0 ((0 2) (0 2)))", "(pieces ((0 ((0 2) x))", "piece slice must be"),
    ("(pieces ((0 ((0 2) (0 2)))", "(pieces ((0 ((0 3) (0 2)))", "do not tile"),
    ("(pieces ((0 ((0 2) (0 2)))", "(pieces ((0 ((-1 2) (0 2)))", "slice must be a non-negative"),
])
def test_refusals(old, new, message):
    text = text_of(header(array(0)))
    assert old in text, text
    with pytest.raises(FormatError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        reparsed(text.replace(old, new, 1))
    assert info.value.file == "i"


def test_duplicate_array_is_refused():
    with pytest.raises(FormatError, match="duplicate array") as info:
        parse_index(header(array(0), array(0)), "i")
    assert info.value.entry == "jckpt/w/0"


def test_missing_piece_is_refused():
    short = array(0, pieces=((0, ((0, 2), (0, 2))),))
    with pytest.raises(FormatError, match="a piece is missing or duplicated"):
        parse_index(header(short), "i")


def test_overlapping_pieces_are_refused():
    overlap = array(0, dims=(4,), byte_length=16,
                    pieces=((0, ((0, 3),)), (1, ((1, 2),))))
    with pytest.raises(FormatError, match="overlap|missing or duplicated"):
        parse_index(header(overlap), "i")


def test_a_field_twice_is_refused():
    text = text_of(header(array(0))).replace("(id 0)", "(id 0) (id 1)", 1)
    with pytest.raises(FormatError, match="appears twice"):
        reparsed(text)


def test_index_codec_imports_without_jax():
    code = "import sys, jckpt.format.index; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _one_array_index(pieces: str, n: int, name: str = "pieces") -> bytes:
    """The bytes of an index of one 1-D array of `n` elements whose pieces field is given."""
    text = ('((version 1) (alignment 32) (tensors ()) (writer "jckpt test") (sharded ((layout 1) '
            '(process_count 1) (files (process_00000.jckpt)) (arrays (((id 0) (namespace jckpt) '
            f'(label (w)) (prec Single_prec) (global_dims ({n})) (path ((k w))) ({name} {pieces})'
            '))))))')
    return len(text).to_bytes(4, "big") + text.encode()


def test_pieces_broken_over_lines_are_read_at_once_as_written():
    """The docs' example, broken for reading: blanks of any kind between tokens."""
    arrays = [array(0), array(1, dims=(3,), pieces=((2, ((0, 3),)),), byte_length=12),
              array(2, dims=(), pieces=((0, ()),), byte_length=4, path=None, label=())]
    text = text_of(header(*arrays))
    spread = text.replace(" (", "\n\t (").replace("((", "( \r\n(").replace("))", ")\n )")
    raw = spread.encode()
    assert spread.count("\n") > 20
    assert parse_index(decode_header(len(raw).to_bytes(4, "big") + raw, file="i"), "i") == (FILES, arrays)


@pytest.mark.parametrize("mutate", [
    lambda ps: ["; a comment ) ((\n" + ps[0], *ps[1:]],          # comments: the general reader
    lambda ps: [*ps[:-1], f'("0" (({len(ps) - 1} {len(ps)})))'],  # a quoted number
    lambda ps: [*ps[:-1], f"(0 (({len(ps) - 1} {len(ps)}) (0 1)))"],  # a box of 2 dims
    lambda ps: [*ps[:-1], f"(7 (({len(ps) - 1} {len(ps)})))"],  # a file not in files
])
def test_a_crafted_index_of_many_pieces_off_the_layout_is_refused_before_it_is_parsed(mutate):
    """Pieces the general reader would build one list at a time (700 bytes and 13 us each:
    a 20 MB index cost 13 s and 700 MB) are refused past a bound, before they are built."""
    n = 100_000
    pieces = "(" + " ".join(mutate([f"(0 (({i} {i + 1})))" for i in range(n)])) + ")"
    with pytest.raises(FormatError, match="more than the general reader takes") as info:
        parse_index(decode_header(_one_array_index(pieces, n), file="i"), "i")
    assert info.value.file == "i" and info.value.fix


def test_a_quoted_or_escaped_pieces_field_name_counts_too():
    n = 100_000
    pieces = "(" + " ".join(f"(0 (({i} {i + 1})))" for i in range(n)) + ")"
    for name in ['"pieces"', '"pie\\099es"']:
        with pytest.raises(FormatError, match="more than the general reader takes"):
            decode_header(_one_array_index(pieces, n, name), file="i")


def test_many_pieces_in_one_file_are_refused_before_they_are_built():
    """A file holds one piece of an array: an index listing a million pieces of one array in
    one file (or one piece many times) is refused at numpy's speed."""
    n = 200_000
    pieces = "(" + " ".join(f"(0 (({i} {i + 1})))" for i in range(n)) + ")"
    with pytest.raises(FormatError, match="two pieces are in piece file number 0") as info:
        parse_index(decode_header(_one_array_index(pieces, n), file="i"), "i")
    assert info.value.entry == "jckpt/w"
    text = text_of(header(array(1, dims=(2,), pieces=((0, ((0, 1),)), (1, ((1, 2),))),
                                byte_length=8)))
    with pytest.raises(FormatError, match="two pieces are in piece file number 0"):
        reparsed(text.replace("(1 ((1 2)))", '("0" ((1 2)))'))  # the general reader says the same
