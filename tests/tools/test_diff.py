"""Comparing checkpoints without JAX (jckpt.tools.diff): entries matched by name, values within tolerance."""

import json
import math
import os
import warnings
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
import pytest

import jckpt
from jckpt.format.entries import entry_for
from jckpt.format.names import step_name
from jckpt.tools.diff import DiffReport, EntryDiff, diff, pair_entries
from tests.helpers import write_arrays, write_directory


def test_diff_values(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {
        'f': np.array([0.0, 1.0, np.nan, 4.0], np.float32),
        'big': np.array([2**60, 5], np.int64),
        'bf': np.array([1.0, 2.0], ml_dtypes.bfloat16),
        'flag': np.array([True, False]),
        'z': np.array([1 + 1j], np.complex64)})
    b = write_arrays(tmp_path / 'b.jckpt', {
        'f': np.array([0.0, 1.5, np.nan, 2.0], np.float32),
        'big': np.array([2**60 + 1, 5], np.int64),   # not exact in float64, still caught
        'bf': np.array([1.0, 2.0], ml_dtypes.bfloat16),
        'flag': np.array([True, True]),
        'z': np.array([1 + 2j], np.complex64)})
    r = diff(a, b)
    by = {d.name: d for d in r.entries}
    f = by['jckpt/f']
    assert (f.mismatched, f.max_abs, f.max_rel) == (2, 2.0, 1.0)  # NaN == NaN in place
    assert by['jckpt/big'].mismatched == 1 and not by['jckpt/big'].same
    assert by['jckpt/bf'].same and by['jckpt/bf'].max_abs == 0
    assert by['jckpt/flag'].mismatched == 1 and by['jckpt/flag'].max_rel == 1.0
    assert by['jckpt/z'].max_abs == 1.0
    assert by['jckpt/big'].max_abs == 1.0  # the exact integer difference
    assert not r.same
    assert diff(a, b, atol=2.0).same  # every difference is at most 2
    r = diff(a, b, atol=1.5)
    assert {d.name for d in r.differing} == {'jckpt/f'}
    json.dumps(r.to_dict())


def test_diff_nan_against_number(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.array([np.nan, 1.0])})
    b = write_arrays(tmp_path / 'b.jckpt', {'x': np.array([0.0, 1.0])})
    d = diff(a, b, atol=1e9).entries[0]
    assert d.mismatched == 1 and d.max_abs == float('inf')
    assert 'inf' in json.dumps(diff(a, b).to_dict())


def test_complex_nans_match_only_in_the_same_part(tmp_path):
    # numpy's isnan calls nan+1j and 1+nanj both NaN: they are different values all the same
    nan = float('nan')
    a = write_arrays(tmp_path / 'a.jckpt', {'z': np.array([complex(nan, 1), complex(2, nan)],
                                                          np.complex64)})
    b = write_arrays(tmp_path / 'b.jckpt', {'z': np.array([complex(1, nan), complex(2, nan)],
                                                          np.complex64)})
    d = diff(a, b).entries[0]
    assert (d.same, d.mismatched, d.max_abs) == (False, 1, float('inf'))
    same_parts = write_arrays(tmp_path / 'c.jckpt', {'z': np.array(
        [complex(-nan, 1), complex(2, nan)], np.complex64)})  # another NaN, in the same part
    assert diff(a, same_parts).same


def test_a_name_with_a_newline_cannot_forge_a_line_of_the_report(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'x\nSAME: 0 entries match': np.ones(2)})
    b = write_arrays(tmp_path / 'b.jckpt', {})
    lines = diff(a, b).render().splitlines()
    assert lines[0].endswith('jckpt/x\\nSAME: 0 entries match')
    assert lines[1].startswith('DIFFERENT:') and len(lines) == 2


def test_a_signaling_nan_is_compared_without_a_numpy_warning(tmp_path):
    snan = np.array([0x7F800001, 0], np.uint32).view(np.float32)  # casting it sets 'invalid'
    a = write_arrays(tmp_path / 'a.jckpt', {'x': snan})
    b = write_arrays(tmp_path / 'b.jckpt', {'x': np.array([1, 0], np.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        d = diff(a, b).entries[0]
    assert (d.mismatched, d.max_abs) == (1, float('inf'))


@pytest.mark.parametrize('a,b', [(np.nan, 1.0), (1.0, np.inf), (-np.inf, np.inf), (np.inf, np.nan)])
def test_no_tolerance_lets_a_nan_or_an_infinity_match_another_value(tmp_path, a, b):
    pa = write_arrays(tmp_path / 'a.jckpt', {'x': np.array([a, 2.0])})
    pb = write_arrays(tmp_path / 'b.jckpt', {'x': np.array([b, 2.0])})
    for atol, rtol in ((np.inf, 0.0), (0.0, 1e-3), (1.0, 1.0)):
        assert diff(pa, pb, atol=atol, rtol=rtol).entries[0].mismatched == 1, (atol, rtol)
    assert diff(pa, pa, atol=1.0, rtol=1.0).same


def test_diff_is_chunked(tmp_path, monkeypatch):
    import jckpt.tools.diff as diff_module

    monkeypatch.setattr(diff_module, 'DIFF_CHUNK', 7)
    x = np.arange(50, dtype=np.float32)
    y = x.copy()
    y[[3, 20, 49]] += np.float32([1, 2, 3])
    d = diff(write_arrays(tmp_path / 'a.jckpt', {'x': x}),
             write_arrays(tmp_path / 'b.jckpt', {'x': y})).entries[0]
    assert (d.mismatched, d.max_abs) == (3, 3.0)


def _flip_last_payload_byte(path):
    """Damage the last float32 of a file's last payload by its lowest mantissa bit."""
    data = bytearray(open(path, 'rb').read())
    data[-4] ^= 1
    open(path, 'wb').write(data)


@pytest.mark.parametrize('kind', ['file', 'directory'])
def test_a_damaged_payload_is_a_checksum_error_not_a_small_difference(tmp_path, kind):
    """A damaged copy within --atol of its source was reported SAME, exit 0."""
    x = np.linspace(0, 1, 64, dtype=np.float32)
    source = write_arrays(tmp_path / 'a.jckpt', {'x': x})
    if kind == 'file':
        copy = write_arrays(tmp_path / 'b.jckpt', {'x': x})
        damaged = copy
    else:
        copy = write_directory(tmp_path / 'b', {'x': x}, processes=2)
        damaged = os.path.join(copy, 'process_00001.jckpt')
    _flip_last_payload_byte(damaged)
    with pytest.raises(jckpt.ChecksumError, match='checksum mismatch') as e:
        diff(source, copy, atol=1e-6)
    assert e.value.entry == 'jckpt/x' and e.value.file == damaged
    r = diff(source, copy, atol=1e-6, verify=False)    # the values as stored
    assert r.same and diff(source, copy, verify=False).entries[0].mismatched == 1


# --- tolerances --------------------------------------------------------------------------------

@pytest.fixture
def near(tmp_path):
    """``a = b + [0.5, 1, 2]`` with ``b = [10, 1, 100]``."""
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.array([10.5, 2.0, 102.0])})
    b = write_arrays(tmp_path / 'b.jckpt', {'x': np.array([10.0, 1.0, 100.0])})
    return a, b


def test_differences_are_measured_against_b(near):
    a, b = near
    d = diff(a, b).entries[0]
    assert (d.size, d.mismatched, d.max_abs, d.max_rel) == (3, 3, 2.0, 1.0)  # |a-b| / |b|
    back = diff(b, a).entries[0]
    assert back.max_rel == pytest.approx(0.5)  # the other way round: divided by a


@pytest.mark.parametrize('atol,rtol,mismatched', [
    (0.0, 0.0, 3), (0.5, 0.0, 2), (1.0, 0.0, 1), (2.0, 0.0, 0), (0.0, 0.05, 1), (0.0, 1.0, 0),
    (0.5, 0.02, 1), (0.5, 0.01, 2)])
def test_atol_plus_rtol_times_b(near, atol, rtol, mismatched):
    a, b = near
    r = diff(a, b, atol=atol, rtol=rtol)
    assert r.entries[0].mismatched == mismatched
    assert r.same is (mismatched == 0) and (r.atol, r.rtol) == (atol, rtol)
    assert r.entries[0].max_abs == 2.0  # the measures do not depend on the tolerances


def test_a_difference_from_zero_is_infinitely_relative(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.array([1e-9, 0.0])})
    b = write_arrays(tmp_path / 'b.jckpt', {'x': np.array([0.0, 0.0])})
    d = diff(a, b).entries[0]
    assert d.max_rel == math.inf and d.max_abs == 1e-9
    assert diff(a, b, atol=1e-8).same and not diff(a, b, rtol=1e6).same
    assert d.to_dict()['max_rel'] == {'$float': 'inf'}  # as `inspect --json` writes it


def test_integer_tolerances(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.array([0, 255, 7], np.uint8)})
    b = write_arrays(tmp_path / 'b.jckpt', {'x': np.array([255, 0, 7], np.uint8)})
    d = diff(a, b).entries[0]
    assert (d.mismatched, d.max_abs) == (2, 255.0)  # no wrap-around in uint8
    assert diff(a, b, atol=255).same


@pytest.mark.parametrize('atol,rtol', [(-1.0, 0.0), (0.0, -1e-9), (math.nan, 0.0), (0.0, math.nan)])
def test_bad_tolerances_are_refused(near, atol, rtol):
    with pytest.raises(jckpt.InputError, match='tolerances must be >= 0'):
        diff(*near, atol=atol, rtol=rtol)


def test_bad_tolerances_are_a_checkpoint_error(near):
    with pytest.raises(jckpt.CheckpointError):
        diff(*near, atol=-1.0)


# --- entries -----------------------------------------------------------------------------------

def test_a_changed_key_implementation_is_named_as_the_change(tmp_path):
    ctx = jckpt.Context()
    jckpt.save(ctx, {'k': jax.random.key(0, impl='rbg')}, tmp_path / 'a.jckpt')
    jckpt.save(ctx, {'k': jax.random.key(0, impl='unsafe_rbg')}, tmp_path / 'b.jckpt')
    r = diff(tmp_path / 'a.jckpt', tmp_path / 'b.jckpt')
    (d,) = r.differing  # the same bits: only the implementation tells them apart
    assert d.changes == ['key rbg -> unsafe_rbg']
    assert (d.to_dict()['key_impl_a'], d.to_dict()['key_impl_b']) == ('rbg', 'unsafe_rbg')
    assert 'key rbg -> unsafe_rbg' in r.render()


def test_entries_only_in_one_and_changes_of_type_or_shape(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'same': np.ones(2), 'gone': np.ones(1),
                                            'dtype': np.ones(3, np.float32), 'shape': np.ones((2, 3))})
    b = write_arrays(tmp_path / 'b.jckpt', {'shape': np.ones((3, 2)), 'dtype': np.ones(3, np.float64),
                                            'same': np.ones(2), 'new': np.ones(1)})
    r = diff(a, b)
    assert (r.only_a, r.only_b) == (('jckpt/gone',), ('jckpt/new',))
    assert [d.name for d in r.entries] == ['jckpt/same', 'jckpt/dtype', 'jckpt/shape']  # a's order
    by = {d.name: d for d in r.entries}
    assert by['jckpt/same'].same and by['jckpt/same'].changes == []
    dtype = by['jckpt/dtype']
    assert not dtype.same and dtype.mismatched == 0 and dtype.changes == ['dtype float32 -> float64']
    shape = by['jckpt/shape']
    assert (shape.size, shape.same) == (0, False)  # different shapes: values not compared
    assert shape.changes == ['shape (2, 3) -> (3, 2)']
    assert [d.name for d in r.differing] == ['jckpt/dtype', 'jckpt/shape']
    text = r.render()
    assert f"only in {a}: jckpt/gone" in text and f"only in {b}: jckpt/new" in text
    assert text.endswith('DIFFERENT: 1 only in A, 1 only in B, 2 of 3 shared entries differ '
                         '(atol 0, rtol 0)')
    assert 'jckpt/same' not in text and 'jckpt/same' in r.render(show_all=True)
    assert repr(r) == text


def test_entries_are_matched_by_namespace_and_path(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'w': np.ones(2)}, namespace='model')
    b = write_arrays(tmp_path / 'b.jckpt', {'w': np.ones(2)}, namespace='other')
    r = diff(a, b)
    assert (r.only_a, r.only_b, r.entries) == (('model/w',), ('other/w',), ())
    assert not r.same


def test_the_same_file_is_the_same(tmp_path):
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.arange(5.0), 'y': np.zeros((2, 2), np.int8)})
    r = diff(a, a)
    assert isinstance(r, DiffReport) and r.same
    assert all(isinstance(d, EntryDiff) and d.same for d in r.entries)
    assert r.render() == 'SAME: 2 entries match (atol 0, rtol 0)'
    data = json.loads(json.dumps(r.to_dict()))
    assert data['same'] and data['entries'][0]['shape_a'] == [5]


def test_a_typed_key_against_its_raw_data_differs(tmp_path):
    key = jax.random.key(7)
    jckpt.save(jckpt.Context(), {'k': key}, tmp_path / 'key.jckpt')
    jckpt.save(jckpt.Context(), {'k': jax.random.key_data(key)}, tmp_path / 'raw.jckpt')
    d = diff(tmp_path / 'key.jckpt', tmp_path / 'raw.jckpt').entries[0]
    assert d.mismatched == 0 and d.dtype_a == d.dtype_b and not d.same  # the same bits
    assert d.changes == ['shape () -> (2,)', 'key threefry2x32 -> (plain array)']


def test_a_typed_keys_shape_is_the_key_arrays_as_inspect_shows_it(tmp_path):
    """A scalar key's shape was its key data's, `(2,)`, where a load returns a key of shape ()."""
    one, many = jax.random.key(1), jax.random.split(jax.random.key(2), 3)
    jckpt.save(jckpt.Context(), {'k': one, 'ks': many}, tmp_path / 'a.jckpt')
    jckpt.save(jckpt.Context(), {'k': jax.random.key(3), 'ks': many[:2]}, tmp_path / 'b.jckpt')
    r = diff(tmp_path / 'a.jckpt', tmp_path / 'b.jckpt')
    shapes = {d.name: (d.shape_a, d.shape_b) for d in r.entries}
    assert shapes == {'jckpt/k': ((), ()), 'jckpt/ks': ((3,), (2,))}
    ks = next(d for d in r.entries if d.name == 'jckpt/ks')
    assert ks.changes == ['shape (3,) -> (2,)'] and 'shape (3,) -> (2,)' in r.render()
    assert json.loads(json.dumps(r.to_dict()))['entries'][0]['shape_a'] == []


# --- what is compared --------------------------------------------------------------------------

def test_a_directory_checkpoint_against_a_file(tmp_path):
    arrays = {'w': np.arange(24, dtype=np.float32).reshape(8, 3), 'b': np.arange(4.0)}
    d = write_directory(tmp_path / 'ckpt', arrays, processes=2)
    f = write_arrays(tmp_path / 'one.jckpt', arrays)
    assert diff(d, f).same and diff(f, d).same
    changed = write_arrays(tmp_path / 'two.jckpt', {**arrays, 'b': np.array([0.0, 1, 2, 4])})
    r = diff(d, changed)
    assert [(x.name, x.mismatched) for x in r.differing] == [('jckpt/b', 1)]


def test_a_manager_directory_is_refused_naming_a_step(tmp_path):
    write_arrays(tmp_path / step_name(20), {'w': np.ones(1)})
    write_arrays(tmp_path / step_name(10), {'w': np.ones(1)})
    other = write_arrays(tmp_path / 'x.jckpt', {'w': np.ones(1)})
    with pytest.raises(jckpt.FormatError, match='holds one checkpoint per step') as info:
        diff(tmp_path, other)
    assert info.value.file == str(tmp_path) and step_name(10) in info.value.fix


def test_what_is_not_a_checkpoint_is_refused_naming_it(tmp_path):
    good = write_arrays(tmp_path / 'a.jckpt', {'w': np.ones(1)})
    with pytest.raises(jckpt.FormatError) as info:
        diff(good, tmp_path / 'missing.jckpt')
    assert info.value.file == str(tmp_path / 'missing.jckpt')
    junk = tmp_path / 'junk'
    junk.write_bytes(b'\x00\x00\x00\x05((((')
    with pytest.raises(jckpt.FormatError):
        diff(good, junk)


@pytest.mark.parametrize('ext', ['safetensors', 'npz', 'pt'])
def test_an_export_is_compared_with_its_source(tmp_path, ext):
    """Another format is compared as the converter reads it: it was refused."""
    src = tmp_path / 'm.jckpt'
    jckpt.save(jckpt.Context(), {'p': {'w': np.arange(6.0).reshape(2, 3)},
                                 'b': np.ones(2, ml_dtypes.bfloat16), 'step': np.int32(7)}, src)
    out = tmp_path / f'm.{ext}'
    jckpt.convert(src, out)
    assert diff(src, out).same and diff(out, src).same and diff(out, out).same
    jckpt.save(jckpt.Context(), {'p': {'w': np.zeros((2, 3))}, 'b': np.ones(2, ml_dtypes.bfloat16),
                                 'step': np.int32(7)}, src)
    report = diff(src, out)
    assert not report.same and [e.name for e in report.entries if not e.same] == ['jckpt/p/w']


class _Moments(NamedTuple):
    mu: np.ndarray
    count: np.ndarray


@pytest.mark.parametrize('fmt', ['safetensors', 'npz', 'torch', 'orbax'])
def test_an_export_of_attributes_and_integer_keys_is_compared_with_its_source(tmp_path, fmt):
    """Exports hold an attribute (a NamedTuple's field, an nnx.State's `value`) as a dict key,
    and orbax an integer key as a string: every entry was listed as only in one of them."""
    if fmt == 'orbax':
        pytest.importorskip('orbax.checkpoint')
    src = tmp_path / 'opt.jckpt'
    state = {'opt_state': {0: _Moments(np.arange(3.0), np.int32(2))}}
    jckpt.save(jckpt.Context(), state, src)
    out = tmp_path / f'opt.{fmt}'
    jckpt.convert(src, out, format=fmt)
    report = diff(src, out)
    assert report.same and (report.only_a, report.only_b) == ((), ())
    assert sorted(e.name for e in report.entries) == ['jckpt/opt_state/0/count', 'jckpt/opt_state/0/mu']
    assert diff(out, src).same


def test_entries_that_differ_only_in_key_kinds_pair_only_one_to_one():
    def entry(*path):
        return entry_for('jckpt', path, 'float32', (1,), id=0)

    a = [entry(('a', 'mu')), entry(('i', 0))]
    b = [entry(('k', 'mu')), entry(('k', '0')), entry(('ki', 0))]  # two for ('i', 0): ambiguous
    pairs, only_a, only_b = pair_entries(a, b)
    assert [(x.path, y.path) for x, y in pairs] == [((('a', 'mu'),), (('k', 'mu'),))]
    assert only_a == ('jckpt/0',) and only_b == ('jckpt/0', 'jckpt/0')
    assert pair_entries(b, b)[1:] == ((), ())  # exact paths first: each pairs with itself


def test_a_damaged_foreign_file_is_refused_naming_it(tmp_path):
    good = write_arrays(tmp_path / 'a.jckpt', {'w': np.ones(1)})
    bad = tmp_path / 'w.safetensors'
    bad.write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"w": {"dtype": ')
    with pytest.raises(jckpt.FormatError) as info:
        diff(good, bad)
    assert info.value.file == str(bad)


def test_a_manager_in_a_bucket_is_named_as_a_local_one_is():
    """diff of a manager's prefix URL raised a bare FileNotFoundError (it listed it locally)."""
    url = "memory://diffs/run"
    with jckpt.CheckpointManager(url) as mgr:
        mgr.save(1, {"w": np.ones(2)})
    jckpt.save(jckpt.Context(), {"w": np.ones(2)}, "memory://diffs/one.jckpt")
    with pytest.raises(jckpt.FormatError, match="holds one checkpoint per step") as e:
        jckpt.diff(url, "memory://diffs/one.jckpt")
    assert f"{url}/step_00000001.jckpt" in e.value.fix


def test_an_infinity_against_another_value_is_infinitely_relative(tmp_path):
    # inf / inf is NaN, which max() passed over: three differing values reported a 0 relative diff
    a = write_arrays(tmp_path / 'a.jckpt', {'x': np.array([np.nan, 1.0, np.inf, 0.0])})
    b = write_arrays(tmp_path / 'b.jckpt', {'x': np.array([1.0, np.inf, -np.inf, 0.0])})
    d = diff(a, b).entries[0]
    assert (d.mismatched, d.max_abs, d.max_rel) == (3, math.inf, math.inf)


def test_strided_views_of_a_foreign_file_are_compared(tmp_path):
    """A .pt file's views (a column, a transpose, as torch saves them) read as strided arrays;
    comparing their bytes raised an unexpected ValueError."""
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    tree = {'w': w, 'col': w[:, 2], 'T': w.T, 'every_other': w[::2, ::3]}
    jckpt.adapters.write({'jckpt': tree}, tmp_path / 'views.pt')
    src = write_arrays(tmp_path / 'm.jckpt', {k: np.ascontiguousarray(v) for k, v in tree.items()})
    assert diff(tmp_path / 'views.pt', src).same and diff(src, tmp_path / 'views.pt').same
    changed = write_arrays(tmp_path / 'c.jckpt', {**tree, 'col': w[:, 2] + 1})
    assert [e.name for e in diff(tmp_path / 'views.pt', changed).differing] == ['jckpt/col']
