"""Property tests of the checkpoint tools: what docs/cli.md promises, over random files.

Random checkpoints hold entries of every stored dtype in any shape (0-d and size-0
included), any bits (NaNs, signed zeros), several namespaces and odd keys, laid out at
random alignments; directory checkpoints have random piece tilings. The tools are run
through the `jckpt` command's `main` in this process and through their Python functions:

- `diff(a, a)` is same; `diff(a, b)` finds exactly the entries that differ, NaN equal to
  NaN in the same place and -0.0 equal to 0.0 (`|a - b| <= atol + rtol * |b|`); `--json`
  agrees with the text; exit status 0 / 1.
- `verify` passes on every file jckpt writes and fails, naming the entry, on one flipped
  payload byte; a truncated file fails too.
- `convert` to another format and back keeps every value, or refuses before writing.
- `inspect` lists exactly the entries, dtypes, shapes and sizes; `--json` agrees with text.
- `consolidate` and `relayout` keep every value and write files `verify` passes.

Hunt with more examples: `JCKPT_PROPERTY_EXAMPLES=2000 pytest tests/system/test_tool_properties.py`.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os

import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jckpt
from jckpt.format import Entry, Header, lay_out, prec_of
from jckpt.format.entries import path_name
from jckpt.format.names import piece_name, step_name
from jckpt.storage import ArraySource, CheckpointReader, open_checkpoint, write_checkpoint
from jckpt.storage.directory import write_index
from jckpt.tools import cli
from jckpt.tools.diff import diff
from jckpt.tools.render import printable
from jckpt.tools.rewrite import relayout
from jckpt.tools.verify import verify
from tests.properties import PROPERTY, STORED_DTYPES

ALIGNMENTS = (1, 2, 4, 8, 16, 32, 64, 4096)
#: Key characters: unicode, spaces, dots, dashes, digits (no `/`, which separates keys here).
KEY_CHARS = st.sampled_from(list("abcxyz019 ._-/éλ中🙂\x1b\t\n"))
#: A path's parts: dict keys (empty, with `/` or control characters too) and list indices.
PARTS = st.one_of(st.tuples(st.just("k"), st.text(KEY_CHARS, max_size=5)),
                  st.tuples(st.just("i"), st.integers(0, 3)))
SPECIAL = (math.nan, -math.nan, 0.0, -0.0, math.inf, -math.inf, 1.0, -1.5)
W = (("k", "w"),)  # the path of a one-entry file's entry
NAMESPACES = st.sampled_from(("jckpt", "student", "opt_state", "_ns2"))


# --- strategies -----------------------------------------------------------------

@st.composite
def arrays(draw, dtypes=STORED_DTYPES, min_dims=0, shape=None):
    """A C-ordered array of any dtype and shape (or `shape`), with any bits (NaNs, -0.0
    included)."""
    dtype = draw(st.sampled_from(dtypes))
    if shape is None:
        shape = draw(hnp.array_shapes(min_dims=min_dims, max_dims=3, min_side=0, max_side=4))
    n = math.prod(shape) * dtype.itemsize
    if dtype.kind in "fc" and draw(st.booleans()):  # NaNs, infinities and signed zeros
        parts = draw(st.lists(st.sampled_from(SPECIAL), min_size=2 * math.prod(shape),
                              max_size=2 * math.prod(shape)))
        real, both = np.array(parts[::2]), np.empty(len(parts) // 2, np.complex128)
        both.real, both.imag = real, parts[1::2]  # `x + 1j * nan` would make both parts NaN
        with np.errstate(invalid="ignore", over="ignore"):
            return (both if dtype.kind == "c" else real).astype(dtype).reshape(shape)
    raw = draw(st.binary(min_size=n, max_size=n))
    array = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if dtype == np.bool_:  # numpy makes bools 0 or 1
        array = array.view(np.uint8) != 0
    return array


@st.composite
def trees(draw, min_size=1, max_size=5, namespaces=NAMESPACES, min_dims=0):
    """`{(namespace, path): array}` where no path is a node of another's, nor two read
    alike (`{'a/b': x}` and `{'a': {'b': y}}` are both `a/b`)."""
    paths = draw(st.lists(st.tuples(namespaces, st.lists(PARTS, min_size=1, max_size=2)
                                    .map(tuple)),
                          min_size=min_size, max_size=max_size,
                          unique_by=(lambda t: (t[0], t[1][0]),  # distinct first parts: no clash
                                     lambda t: name_of(t), lambda t: (t[0], str(t[1][0][1])))))
    return {key: draw(arrays(min_dims=min_dims)) for key in paths}


def write_tree(path, tree, *, alignment=32, metadata=None) -> str:
    """A checkpoint file of `{(namespace, path): array}` through the storage writer."""
    entries, sources, ids = [], [], {}
    for (ns, key), a in tree.items():
        ids[ns] = ids.get(ns, -1) + 1
        entries.append(Entry(id=ids[ns], namespace=ns, prec=prec_of(a.dtype), dims=a.shape,
                             offset=0, byte_length=a.nbytes, label=tuple(str(v) for _, v in key),
                             path=key))
        sources.append(ArraySource(a))
    header = lay_out(Header(tensors=tuple(entries), alignment=alignment, writer="jckpt test",
                            metadata=tuple((metadata or {}).items())))
    write_checkpoint(str(path), header, sources, durable=False)
    return str(path)


def write_tiled_directory(path, tree, cuts) -> str:
    """A directory checkpoint of `tree` (arrays of 1+ dims), each split along axis 0 at
    `cuts[name]` (sorted cut points) into pieces dealt round-robin to the processes."""
    os.makedirs(path)
    processes = 1 + max((len(c) for c in cuts.values()), default=0)
    pieces = {p: ([], []) for p in range(processes)}
    ids = {}
    for (ns, key), a in tree.items():
        ids[ns] = ids.get(ns, -1) + 1
        bounds = [0, *cuts[(ns, key)], a.shape[0]]
        for p, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            part = np.ascontiguousarray(a[lo:hi])
            pieces[p][0].append(Entry(
                id=ids[ns], namespace=ns, prec=prec_of(a.dtype), dims=part.shape, offset=0,
                byte_length=part.nbytes, label=tuple(str(v) for _, v in key), path=key,
                slice=((lo, hi), *((0, d) for d in a.shape[1:])), global_dims=a.shape))
            pieces[p][1].append(ArraySource(part))
    for p, (entries, sources) in pieces.items():
        write_checkpoint(os.path.join(path, piece_name(p)),
                         lay_out(Header(tensors=tuple(entries))), sources, durable=False)
    write_index(str(path), processes, 32, {}, durable=False)
    return str(path)


@st.composite
def tilings(draw, tree):
    """Cut points along axis 0 for each array of `tree`."""
    return {k: sorted(draw(st.lists(st.integers(0, a.shape[0]), max_size=3)))
            for k, a in tree.items()}


# --- oracles -----------------------------------------------------------------------

def values(path) -> dict:
    """`{(namespace, path): array}` of the jckpt file or directory at `path`."""
    reader = open_checkpoint(path)
    return {(e.namespace, e.path): np.array(reader.decode(e))
            for e in reader.header.tensors}


def _scalar_equal(x, y) -> bool:
    if isinstance(x, complex) or isinstance(y, complex):
        x, y = complex(x), complex(y)
        return _scalar_equal(x.real, y.real) and _scalar_equal(x.imag, y.imag)
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return x == y  # -0.0 == 0.0


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Elementwise equal as docs/cli.md defines it (NaN equals NaN, -0.0 equals 0.0)."""
    return a.shape == b.shape and all(
        _scalar_equal(x, y) for x, y in zip(a.reshape(-1).tolist(), b.reshape(-1).tolist()))


def negated_zeros(a: np.ndarray) -> np.ndarray:
    """`a` with each zero's sign flipped (a value `diff` must still call equal)."""
    with np.errstate(invalid="ignore"):  # comparing NaNs of some ml_dtypes flags 'invalid'
        return np.where(a == 0, -a, a).astype(a.dtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def run_cli(*args) -> tuple[int, str, str]:
    """`jckpt ARGS` in this process: (exit status, stdout, stderr). A command that ran
    (status 0 or 1) prints nothing on stderr: no warning of numpy's or another library's."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(["--no-progress", *map(str, args)])
        except SystemExit as e:
            rc = e.code
    assert rc == 2 or not err.getvalue(), (args, err.getvalue())
    return rc, out.getvalue(), err.getvalue()


def name_of(key) -> str:
    """`namespace/a/b/0`, as the tools name an entry."""
    return f"{key[0]}/{path_name(key[1])}"


# --- diff ----------------------------------------------------------------------------

@PROPERTY
@given(tree=trees(), alignment=st.sampled_from(ALIGNMENTS), other=st.sampled_from(ALIGNMENTS))
def test_a_checkpoint_is_the_same_as_itself_and_as_its_copy_at_any_alignment(
        tmp_path_factory, tree, alignment, other):
    d = tmp_path_factory.mktemp("diff")
    a = write_tree(d / "a.jckpt", tree, alignment=alignment)
    b = write_tree(d / "b.jckpt", tree, alignment=other)
    for x, y in ((a, a), (a, b), (b, a)):
        report = diff(x, y)
        assert report.same, report
        assert {e.name for e in report.entries} == {name_of(k) for k in tree}
        rc, out, _ = run_cli("diff", x, y)
        assert rc == 0 and out.startswith("SAME:"), out


@st.composite
def edits(draw, tree):
    """A second tree: `tree` with entries removed, added, retyped, reshaped or rewritten."""
    other = dict(tree)
    for key in list(tree):
        how = draw(st.sampled_from(("keep", "keep", "remove", "dtype", "shape", "values",
                                    "negate_zero", "one_byte", "swap_parts")))
        a = tree[key]
        if how == "remove":
            del other[key]
        elif how == "dtype":
            other[key] = np.zeros(a.shape, draw(st.sampled_from(STORED_DTYPES)))
        elif how == "shape":
            other[key] = draw(arrays(dtypes=[a.dtype]))
        elif how == "values":
            raw = draw(st.binary(min_size=a.nbytes, max_size=a.nbytes))
            other[key] = np.frombuffer(raw, a.dtype).reshape(a.shape).copy()
            if a.dtype == np.bool_:
                other[key] = other[key].view(np.uint8) != 0
        elif how == "swap_parts" and a.dtype.kind == "c":  # nan+1j against 1+nanj
            other[key] = np.empty_like(a)
            other[key].real, other[key].imag = a.imag, a.real
        elif how == "negate_zero" and a.dtype.kind in "fc":
            other[key] = negated_zeros(a)
        elif how == "one_byte" and a.nbytes and a.dtype != np.bool_:
            raw = bytearray(a.tobytes())
            raw[draw(st.integers(0, len(raw) - 1))] ^= draw(st.integers(1, 255))
            other[key] = np.frombuffer(bytes(raw), a.dtype).reshape(a.shape).copy()
    added = draw(trees(min_size=0, max_size=2))
    other.update({k: v for k, v in added.items() if k not in other
                  and (k[0], k[1][0]) not in {(ns, p[0]) for ns, p in other}
                  and name_of(k) not in {name_of(o) for o in other}})
    return other


@PROPERTY
@given(data=st.data(), tree=trees(), alignment=st.sampled_from(ALIGNMENTS))
def test_diff_finds_exactly_the_entries_that_differ_and_json_agrees_with_text(
        tmp_path_factory, data, tree, alignment):
    other = data.draw(edits(tree))
    d = tmp_path_factory.mktemp("diff")
    a = write_tree(d / "a.jckpt", tree, alignment=alignment)
    b = write_tree(d / "b.jckpt", other)
    only_a = {name_of(k) for k in tree.keys() - other.keys()}
    only_b = {name_of(k) for k in other.keys() - tree.keys()}
    differ = {name_of(k) for k in tree.keys() & other.keys()
              if tree[k].dtype != other[k].dtype or not same_values(tree[k], other[k])}
    report = diff(a, b)
    assert set(report.only_a) == only_a and set(report.only_b) == only_b
    assert {e.name for e in report.differing} == differ
    assert report.same == (not (only_a or only_b or differ))

    rc, out, err = run_cli("diff", a, b, "--json")
    assert rc == (0 if report.same else 1), err
    doc = json.loads(out)
    assert doc["same"] == report.same
    assert set(doc["only_a"]) == only_a and set(doc["only_b"]) == only_b
    assert {e["name"] for e in doc["entries"] if not e["same"]} == differ
    rc_text, text, err = run_cli("diff", a, b)
    assert rc_text == rc
    lines = text.splitlines()
    assert lines[-1].startswith("SAME:" if report.same else "DIFFERENT:"), text
    if not report.same:
        assert lines[-1].startswith(f"DIFFERENT: {len(only_a)} only in A, {len(only_b)} only "
                                    f"in B, {len(differ)} of {len(doc['entries'])} shared")
    for name in only_a:
        assert printable(f"only in {a}: {name}") in lines
    for name in only_b:
        assert printable(f"only in {b}: {name}") in lines
    rows = [ln for ln in lines if not ln.startswith(("only in", "SAME:", "DIFFERENT:", "entry "))]
    assert len(rows) == len(differ)
    for name in differ:
        assert any(r.startswith(printable(name) + " ") for r in rows), (name, text)


#: Floating types, complex ones weighted up (a NaN in one part of two is a case of its own).
FLOATS = [d for d in STORED_DTYPES if d.kind == "f"] + 8 * [d for d in STORED_DTYPES
                                                           if d.kind == "c"]


@PROPERTY
@given(data=st.data(), a=arrays(dtypes=FLOATS, min_dims=1))
def test_diff_matches_nans_in_place_and_signed_zeros(tmp_path_factory, data, a):
    b = data.draw(arrays(dtypes=[a.dtype], shape=a.shape)
                  | st.just(negated_zeros(a)))
    d = tmp_path_factory.mktemp("nan")
    pa = write_tree(d / "a.jckpt", {("jckpt", W): a})
    pb = write_tree(d / "b.jckpt", {("jckpt", W): b})
    assert diff(pa, pb).same == same_values(a, b), (a, b)


@PROPERTY
@given(data=st.data(), a=arrays(dtypes=[d for d in STORED_DTYPES if d.kind == "f"]),
       tol=st.floats(0, 10) | st.just(math.inf), rtol=st.floats(0, 1))
def test_diff_within_tolerance_follows_the_documented_rule(tmp_path_factory, data, a, tol,
                                                           rtol):
    d = tmp_path_factory.mktemp("tol")
    near = np.nextafter(a, np.array(np.inf, a.dtype)) if a.dtype.itemsize >= 4 else a
    b = data.draw(st.just(near) | arrays(dtypes=[a.dtype], shape=a.shape))
    pa = write_tree(d / "a.jckpt", {("jckpt", W): a})
    pb = write_tree(d / "b.jckpt", {("jckpt", W): b})
    x, y = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        close = np.isfinite(x) & np.isfinite(y) & (np.abs(x - y) <= tol + rtol * np.abs(y))
        ok = (x == y) | (np.isnan(x) & np.isnan(y)) | close
    assert diff(pa, pb, atol=tol, rtol=rtol).same == bool(ok.all())


# --- verify ----------------------------------------------------------------------------

@PROPERTY
@given(data=st.data(), tree=trees(), alignment=st.sampled_from(ALIGNMENTS))
def test_verify_passes_a_written_file_and_names_the_entry_of_any_flipped_payload_byte(
        tmp_path_factory, data, tree, alignment):
    path = write_tree(tmp_path_factory.mktemp("verify") / "m.jckpt", tree, alignment=alignment)
    rc, out, _ = run_cli("verify", path, "--strict")
    assert rc == 0 and out.startswith("OK:"), out
    reader = CheckpointReader(path)
    stored = [e for e in reader.header.tensors if e.byte_length]
    assume(stored)
    entry = data.draw(st.sampled_from(stored))
    where = reader.data_start + entry.offset + data.draw(st.integers(0, entry.byte_length - 1))
    del reader
    with open(path, "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ data.draw(st.integers(1, 255))]))
    rc, out, err = run_cli("verify", path)
    assert rc == 1, (out, err)
    assert printable(f"entry {entry.name}: checksum mismatch") in out, out
    rc, out, _ = run_cli("verify", path, "--json")
    doc = json.loads(out)
    assert rc == 1 and not doc["ok"]
    assert [p["entry"] for p in doc["problems"] if p["severity"] == "error"] == [entry.name]


@PROPERTY
@given(data=st.data(), tree=trees(), alignment=st.sampled_from(ALIGNMENTS))
def test_verify_fails_a_truncated_file(tmp_path_factory, data, tree, alignment):
    path = write_tree(tmp_path_factory.mktemp("trunc") / "m.jckpt", tree, alignment=alignment)
    size, data_start = os.path.getsize(path), CheckpointReader(path).data_start
    cut = data.draw(st.integers(0, size - 1))
    with open(path, "r+b") as f:
        f.truncate(cut)
    report = verify(path)
    assert not report.ok, report
    rc, out, err = run_cli("verify", path)
    assert rc == 1 and out.splitlines()[-1].startswith(f"FAILED: {path}"), (out, err)
    if cut >= data_start:  # the header is whole: a payload is cut, and named
        assert "ERROR: " in out and ": entry " in out, out


# --- inspect -----------------------------------------------------------------------------

def rows_by_name(rows: list) -> dict:
    """`inspect --json`'s rows by `namespace/path`, the names being unique."""
    by_name = {f"{r['namespace']}/{r['path']}": r for r in rows}
    assert len(by_name) == len(rows)
    return by_name


def check_listing(summary_dict, tree, text):
    rows = rows_by_name(summary_dict["entries"])
    assert set(rows) == {name_of(k) for k in tree}
    for key, a in tree.items():
        row = rows[name_of(key)]
        assert (row["dtype"], tuple(row["shape"]), row["nbytes"]) == \
            (a.dtype.name, a.shape, a.nbytes), (row, a.dtype, a.shape)
    assert summary_dict["totals"]["entries"] == len(tree)
    assert summary_dict["totals"]["payload_bytes"] == sum(a.nbytes for a in tree.values())
    namespaces = {ns for ns, _ in tree}
    assert summary_dict["totals"]["namespaces"] == {
        ns: sum(1 for n, _ in tree if n == ns) for ns in namespaces}
    assert f" in {len(namespaces)} namespace" in text.splitlines()[0]
    for row in rows.values():
        shown = f" {printable(row['path'])} "
        assert any(ln.startswith(row["namespace"]) and shown in ln
                   for ln in text.splitlines()), (row, text)


@PROPERTY
@given(tree=trees(), alignment=st.sampled_from(ALIGNMENTS))
def test_inspect_lists_exactly_the_entries_of_a_file(tmp_path_factory, tree, alignment):
    path = write_tree(tmp_path_factory.mktemp("info") / "m.jckpt", tree, alignment=alignment)
    rc, out, _ = run_cli("inspect", path, "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc == json.loads(json.dumps(jckpt.info(path).to_dict()))
    rc, text, _ = run_cli("inspect", path)
    assert rc == 0
    check_listing(doc, tree, text)
    assert f"{len(tree)} entries" in text.splitlines()[0] or \
        (len(tree) == 1 and "1 entry" in text.splitlines()[0])


@PROPERTY
@given(data=st.data(), tree=trees(min_dims=1))
def test_a_directory_checkpoint_is_listed_consolidated_and_verified_whole(
        tmp_path_factory, data, tree):
    cuts = data.draw(tilings(tree))
    d = tmp_path_factory.mktemp("dir")
    path = write_tiled_directory(d / "ckpt", tree, cuts)
    rc, out, _ = run_cli("inspect", path, "--json")
    assert rc == 0
    doc = json.loads(out)
    rows = rows_by_name(doc["arrays"])
    assert set(rows) == {name_of(k) for k in tree}
    rc, text, _ = run_cli("inspect", path)
    for row in rows.values():
        assert any(ln.startswith(row["namespace"]) and f" {printable(row['path'])} " in ln
                   for ln in text.splitlines()), (row, text)
    for key, a in tree.items():
        row = rows[name_of(key)]
        assert (row["dtype"], tuple(row["shape"]), row["nbytes"]) == \
            (a.dtype.name, a.shape, a.nbytes)
        assert row["pieces"] == len(cuts[key]) + 1
    rc, out, _ = run_cli("verify", path)
    assert rc == 0, out
    retiled = write_tiled_directory(d / "retiled", tree, data.draw(tilings(tree)))
    assert diff(path, retiled).same
    got = values(path)
    assert set(got) == set(tree) and all(same_bits(got[k], tree[k]) for k in tree)
    whole = str(d / "whole.jckpt")
    alignment = data.draw(st.sampled_from(ALIGNMENTS))
    rc, out, err = run_cli("convert", path, whole, "--alignment", alignment)
    assert rc == 0, err
    rc, out, _ = run_cli("verify", whole, "--strict")
    assert rc == 0, out
    assert CheckpointReader(whole).header.alignment == alignment
    got = values(whole)
    assert set(got) == set(tree) and all(same_bits(got[k], tree[k]) for k in tree)
    assert diff(path, whole).same


@PROPERTY
@given(trees=st.lists(trees(max_size=3), min_size=1, max_size=3))
def test_inspect_of_a_manager_directory_lists_every_step(tmp_path_factory, trees):
    d = tmp_path_factory.mktemp("mgr") / "run"
    d.mkdir()
    for i, tree in enumerate(trees):
        write_tree(d / step_name(100 * (i + 1)), tree)
    rc, out, err = run_cli("inspect", d, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    steps = {s["step"]: s for s in doc["steps"]}
    assert sorted(steps) == [100 * (i + 1) for i in range(len(trees))]
    for i, tree in enumerate(trees):
        assert steps[100 * (i + 1)]["entries"] == len(tree)
    rc, text, _ = run_cli("inspect", d)
    assert rc == 0 and f"{len(trees)} step" in text.splitlines()[0]
    for i, tree in enumerate(trees):
        assert any(ln.split()[:1] == [str(100 * (i + 1))] and ln.split()[3] == str(len(tree))
                   for ln in text.splitlines()), text
    rc, out, _ = run_cli("verify", d)
    assert rc == 0, out


# --- convert / relayout -------------------------------------------------------------------

@PROPERTY
@given(tree=trees(), alignment=st.sampled_from(ALIGNMENTS),
       new=st.sampled_from(ALIGNMENTS))
def test_relayout_keeps_every_value_and_writes_a_file_verify_passes(
        tmp_path_factory, tree, alignment, new):
    d = tmp_path_factory.mktemp("relayout")
    src = write_tree(d / "a.jckpt", tree, alignment=alignment, metadata={"run": "x"})
    dst = str(d / "b.jckpt")
    rc, out, err = run_cli("convert", src, dst, "--alignment", new)
    assert rc == 0, err
    rc, out, _ = run_cli("verify", dst, "--strict")
    assert rc == 0, out
    got = values(dst)
    assert set(got) == set(tree) and all(same_bits(got[k], tree[k]) for k in tree)
    assert CheckpointReader(dst).header.alignment == new
    assert CheckpointReader(dst).header.metadata == CheckpointReader(src).header.metadata
    relayout(dst, dst)  # in place
    assert verify(dst).ok and diff(src, dst).same


FOREIGN = ("safetensors", "npz", "pt")


@PROPERTY
@given(tree=trees(), fmt=st.sampled_from(FOREIGN))
def test_convert_to_another_format_and_back_keeps_every_value_or_refuses_first(
        tmp_path_factory, tree, fmt):
    d = tmp_path_factory.mktemp("convert")
    src = write_tree(d / "a.jckpt", tree)
    there, back = str(d / f"m.{fmt}"), str(d / "back.jckpt")
    rc, _, err = run_cli("convert", src, there)
    if rc != 0:
        assert rc == 2 and err.startswith("jckpt: error:"), err
        assert not os.path.exists(there), err
        return
    rc, out, err = run_cli("inspect", there, "--json")
    assert rc == 0, err
    rows = rows_by_name(json.loads(out)["entries"])
    assert set(rows) == {name_of(k) for k in tree}
    for key, a in tree.items():
        row = rows[name_of(key)]
        assert (row["dtype"], tuple(row["shape"]), row["nbytes"]) == \
            (a.dtype.name, a.shape, a.nbytes), (row, a.dtype, a.shape)
    rc, _, err = run_cli("convert", there, back)
    assert rc == 0, err
    got = values(back)
    assert set(got) == set(tree), (set(got), set(tree))
    for k, a in tree.items():
        assert same_bits(got[k], a), (k, got[k], a)
    assert diff(src, there).same
